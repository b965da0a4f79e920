"""Helpers shared by the engine tests: random prompts, collecting a request's events, the tokens among them, plain
greedy decoding to compare them with."""

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


def greedy(model, prompt, n: int, max_len: int = 160) -> list[int]:
    """`model.generate(prompt, n, stop_at_eos=False)` through the same plain API (the whole prompt in one step,
    then one token per step, argmax of each step's last logits), on a cache of `max_len` positions whatever the
    prompt, the prompt padded to a power-of-two width of at least 32 (its real length given as `n_valid`):
    generate sizes its cache to prompt + n and its prompt step to the prompt, so each prompt length compiled two
    steps; here a module's model compiles one decode step and a prompt step per width."""
    if len(prompt) + n > max_len:
        raise ValueError(f"a prompt of {len(prompt)} tokens and {n} more do not fit a cache of {max_len}")
    seqs = model.start(1, max_len)
    width = min(max(32, 1 << (len(prompt) - 1).bit_length()), max_len)
    padded = np.zeros((1, width), np.int32)
    padded[0, : len(prompt)] = prompt
    logits, _, seqs = model.step(seqs, padded, np.asarray([len(prompt)], np.int32))
    out = [int(np.argmax(logits[0, len(prompt) - 1]))]
    while len(out) < n:
        logits, _, seqs = model.step(seqs, np.asarray([[out[-1]]], np.int32))
        out.append(int(np.argmax(logits[0, -1])))
    return out
