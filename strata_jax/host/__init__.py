"""The host tier: routed experts that do not fit the device's expert pool, computed in numpy from the packed bytes."""
