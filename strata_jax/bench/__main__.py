"""`python -m strata_jax.bench`: see `strata_jax.bench.main`."""

import sys

from strata_jax.bench.main import main

sys.exit(main())
