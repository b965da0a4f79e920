"""Helpers shared by the engine tests: random prompts, collecting a request's events, the tokens among them."""

from __future__ import annotations

import asyncio

import numpy as np

from strata_jax.engine import GenerationRequest, SamplingParams


def random_prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(x) for x in np.random.default_rng(seed).integers(0, 500, n))


async def collect(engine, prompt, delay: float = 0.0, max_tokens: int = 8, **sampling) -> list:
    """Submits `prompt` after `delay` seconds (greedy, EOS ignored unless `sampling` says otherwise) and returns
    every event of its stream."""
    await asyncio.sleep(delay)
    params = SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, **sampling})
    stream = await engine.submit(GenerationRequest(prompt, params))
    return [ev async for ev in stream]


def tokens(events) -> list[int]:
    return [ev.token_id for ev in events if ev.token_id is not None]
