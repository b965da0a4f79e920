"""The benchmark wing: serving, step and per-kernel benchmarks, the device floors they are measured against, and
the synthetic presets (random models at real shapes). Nothing in the engine imports it; run it with
`python -m strata_jax.bench` (see `strata_jax.bench.main`)."""
