"""Inputs of the gated delta rule shared by its kernel tests: what the model feeds it after the conv."""

import numpy as np


def rule_inputs(b: int, t: int, h: int, dk: int, dv: int, seed: int) -> list[np.ndarray]:
    """q, k [B, T, H, Dk] (L2-normalised, q scaled by Dk^-0.5), v [B, T, H, Dv], g [B, T, H] (log-decays in
    (-0.5, 0]), beta [B, T, H] in [0, 1) and a starting state [B, H, Dk, Dv], all float32."""
    rng = np.random.default_rng(seed)
    norm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = norm(rng.normal(size=(b, t, h, dk))) * dk**-0.5
    k = norm(rng.normal(size=(b, t, h, dk)))
    v = rng.normal(size=(b, t, h, dv))
    g = -rng.uniform(0.0, 0.5, size=(b, t, h))
    beta = rng.uniform(0, 1, size=(b, t, h))
    state = rng.normal(size=(b, h, dk, dv))
    return [x.astype(np.float32) for x in (q, k, v, g, beta, state)]
