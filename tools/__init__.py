"""Tools that are not the engine: the demo model's trainer (`python -m tools.train_demo`) and its chat template.
Run from a checkout; not installed with the package."""
