"""The prefix cache's radix tree and asynchronous snapshots, and the prefill policy, without a model: lookups
against a brute-force longest-prefix search, where a prompt parts from cached conversations, LRU eviction and
pruning, in-flight copies that land or are dropped, and the policy's order, pacing and mixed shape."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import FIXTURES
from strata_jax.engine.config import EngineConfig
from strata_jax.engine.job import Job
from strata_jax.engine.prefill_policy import PrefillPolicy, choose_mixed_shape
from strata_jax.engine.prefix_cache import PrefixCache, shared_length
from strata_jax.engine.protocol import GenerationRequest, SamplingParams
from strata_jax.model.cache import AttentionCache, init_cache, kv_position_lengths, map_kv_positions
from strata_jax.model.config import load_config

CFG = load_config(FIXTURES / "ckpt" / "qwen4_exp_causal")
CTX = 64


def _state(fill: float, device: bool = False):
    """A one-slot cache whose every entry is `fill` (host arrays unless `device`)."""
    cache = jax.tree_util.tree_map(lambda x: jnp.full_like(x, fill), init_cache(CFG, 1, CTX, jnp.float32))
    return cache if device else jax.tree_util.tree_map(np.asarray, cache)


def _brute_force(snapshots: list[tuple[int, ...]], prompt: tuple[int, ...]) -> tuple[int, ...] | None:
    best = None
    for tokens in snapshots:
        if len(tokens) < len(prompt) and prompt[: len(tokens)] == tokens and (best is None or len(tokens) > len(best)):
            best = tokens
    return best


def test_lookup_is_the_longest_cached_prefix_over_random_conversations():
    rng = np.random.default_rng(0)
    cache = PrefixCache(1 << 40)
    system = tuple(int(t) for t in rng.integers(0, 5, 12))
    stored: list[tuple[int, ...]] = []
    for i in range(60):  # prompts that share the system prompt, each other's turns, or nothing
        base = stored[int(rng.integers(len(stored)))] if stored and rng.random() < 0.5 else system
        tokens = base[: int(rng.integers(1, len(base) + 1))] + tuple(int(t) for t in rng.integers(0, 5, 6))
        if tokens not in stored:
            cache.insert(tokens, _state(i))
            stored.append(tokens)
    for _ in range(200):
        base = stored[int(rng.integers(len(stored)))]
        prompt = base[: int(rng.integers(1, len(base) + 1))] + tuple(int(t) for t in rng.integers(0, 5, 3))
        want = _brute_force(stored, prompt)
        got = cache.lookup(prompt)
        assert (got.tokens if got is not None else None) == want
    assert len(cache) == len(stored)


def test_shared_length_is_a_token_by_token_scan():
    rng = np.random.default_rng(1)

    def scan(a, b, at):
        n = 0
        while at + n < len(a) and n < len(b) and a[at + n] == b[n]:
            n += 1
        return n

    for _ in range(3000):
        a = tuple(int(t) for t in rng.integers(0, 3, int(rng.integers(0, 60))))
        at = int(rng.integers(0, len(a) + 1))
        b = a[at : at + int(rng.integers(0, 60))] if rng.random() < 0.7 else ()
        b += tuple(int(t) for t in rng.integers(0, 3, int(rng.integers(0, 5))))
        assert shared_length(a, b, at) == scan(a, b, at), (a, b, at)


def test_long_conversations_part_deep_inside_edges():
    """Prompts of thousands of tokens that part from each other and from the cached paths at arbitrary points:
    the radix tree splits edges where they part (compared by slices, not token by token)."""
    rng = np.random.default_rng(2)
    cache = PrefixCache(1 << 40)
    base = tuple(int(t) for t in rng.integers(0, 1000, 5000))
    stored = []
    for i in range(12):
        cut = int(rng.integers(1, len(base)))
        tokens = base[:cut] + tuple(int(t) for t in rng.integers(1000, 2000, int(rng.integers(1, 3000))))
        cache.insert(tokens, _state(i))
        stored.append(tokens)
        base = tokens if rng.random() < 0.5 else base
    for tokens in stored:
        for cut in rng.integers(1, len(tokens), 5):
            prompt = tokens[: int(cut)] + (5000,)
            got = cache.lookup(prompt)
            assert (got.tokens if got is not None else None) == _brute_force(stored, prompt)
            held = max(shared_length(prompt, s) for s in stored)
            assert cache.match(prompt)[1] == held


def test_kv_lengths_are_read_from_shapes_and_a_pool_restore_maps_no_device_array(monkeypatch):
    """`kv_position_lengths` equals what `map_kv_positions` hands its fn (QSA block keys, quantized scales, the MTP
    layer's cache); restoring a device-pool snapshot reads only shapes: mapping the device arrays ran eager
    reshapes, each compiled on first use of its length (tens of ms of a later turn's restore on an H100)."""
    assert CFG.qsa
    for kv_dtype in (None, jnp.int8):
        full = init_cache(CFG, 1, CTX, jnp.float32, with_mtp=True, kv_dtype=kv_dtype)
        for length in (CTX, 48, 40):
            cut = map_kv_positions(full, lambda x, axis, n=length: x[(slice(None),) * axis + (slice(0, n),)])
            mapped = []
            map_kv_positions(cut, lambda x, axis: mapped.append(x.shape[axis]) or x)
            assert kv_position_lengths(cut) == set(mapped)
    cache = PrefixCache(1 << 40, device_budget_bytes=1 << 40)
    cache.insert_async((3, 4), _state(1.0, device=True))
    snap = cache.lookup((3, 4, 5))
    assert snap.on_device

    def refuse(self, fn):
        raise AssertionError("a device-pool restore mapped the snapshot's arrays")

    monkeypatch.setattr(AttentionCache, "map_positions", refuse)
    assert cache.restore(snap, CTX) is snap.state


def test_match_says_where_a_prompt_parts_from_the_cached_paths():
    cache = PrefixCache(1 << 40)
    shared = tuple(range(100, 140))
    cache.insert(shared[:16], _state(1))
    cache.insert(shared + (1, 2, 3), _state(2))  # a whole first turn: its path runs past the last snapshot
    snap, parted = cache.match(shared + (7, 8))
    assert snap.tokens == shared[:16] and parted == len(shared)
    cache.insert(shared, _state(3))  # the parting point's snapshot: the next prompt like it resumes there
    assert cache.lookup(shared + (9,)).tokens == shared
    assert cache.match((5, 6))[1] == 0 and cache.lookup((5, 6)) is None
    assert cache.counters["hits"] == 1 and cache.counters["misses"] == 1


def test_lru_eviction_prunes_the_tree_and_keeps_the_byte_count():
    one = sum(x.nbytes for x in jax.tree_util.tree_leaves(_state(0)))
    cache = PrefixCache(3 * one)  # KV is cut to the prefix: each snapshot here takes less than `one`
    prompts = [tuple(range(10)) + (i,) * 20 for i in range(8)]
    for i, p in enumerate(prompts):
        cache.insert(p, _state(i))
        assert cache.bytes <= cache.budget
        assert cache.bytes == sum(cache.lookup(q + (0,)).nbytes for q in prompts if q in cache)
    assert prompts[-1] in cache and prompts[0] not in cache and cache.counters["evictions"] > 0
    for p in prompts:  # every eviction pruned its branch: what is left leads to snapshots only
        if p not in cache:
            assert cache.match(p)[1] == 10
    restored = cache.restore(cache.lookup(prompts[-1] + (0,)), CTX)
    kv = []
    map_kv_positions(restored, lambda x, axis: kv.append(x.shape[axis]) or x)
    assert set(kv) == {CTX}


def test_async_snapshots_land_and_a_dropped_one_frees_its_device_copy():
    cache = PrefixCache(1 << 40)
    kept, dropped = _state(5.0, device=True), _state(6.0, device=True)
    cache.insert_async((1, 2, 3), kept, owner="a")
    cache.insert_async((1, 2, 4), dropped, owner="b")
    assert cache.stats()["prefix_cache_pending_snapshots"] == 2 and cache.pending_bytes > 0
    assert cache.drop_pending("b") == 1 and (1, 2, 4) not in cache
    assert all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(dropped))
    _land_all(cache)
    assert cache.pending_bytes == 0
    snap = cache.lookup((1, 2, 3, 9))
    assert not snap.pending and all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(snap.state))
    assert float(snap.state.lengths[0]) == 5.0
    assert cache.drop_pending("a") == 0  # landed snapshots stay: they are valid prefixes


def _land_all(cache: PrefixCache, timeout: float = 30.0) -> None:
    """Polls until the worker thread has landed every copy in flight."""
    deadline = time.monotonic() + timeout
    while cache.poll() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cache.poll() == 0


def test_the_device_pool_keeps_recent_snapshots_and_moves_older_ones_to_the_host():
    one = sum(x.nbytes for x in jax.tree_util.tree_leaves(_state(0.0, device=True)))
    cache = PrefixCache(1 << 40, device_budget_bytes=2 * one)
    states = [_state(float(i), device=True) for i in range(3)]
    for i, state in enumerate(states):
        cache.insert_async((7, i), state)
    stats = cache.stats()
    assert stats["prefix_cache_device_snapshots"] == 2 and stats["prefix_cache_device_bytes"] == 2 * one
    oldest = cache.lookup((7, 0, 1))  # moved to the host: landed by the lookup, KV cut to the prefix
    assert not oldest.on_device and not oldest.pending and float(oldest.state.lengths[0]) == 0.0
    newest = cache.lookup((7, 2, 1))
    assert newest.on_device and cache.restore(newest, CTX) is newest.state  # restored device to device
    padded = cache.restore(oldest, CTX)
    assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(padded))
    assert not all(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(states[2]))


def test_clear_drops_landed_in_flight_and_device_pool_snapshots():
    one = sum(x.nbytes for x in jax.tree_util.tree_leaves(_state(0.0, device=True)))
    cache = PrefixCache(1 << 40, device_budget_bytes=one)
    cache.insert((1, 2), _state(1.0))
    in_flight = _state(2.0, device=True)
    cache.insert_async((3, 4), _state(3.0, device=True))  # the device pool
    cache.insert_async((3, 5), in_flight)  # pool full: (3, 4) moves to the host, (3, 5) takes the pool
    assert len(cache) == 3
    assert cache.clear() == 3
    assert len(cache) == 0 and cache.bytes == 0 and cache.device_bytes == 0
    assert cache.lookup((1, 2, 9)) is None and cache.lookup((3, 5, 9)) is None
    assert cache.match((3, 4, 9)) == (None, 0)  # the tree is pruned to its root
    cache.insert((1, 2), _state(1.0))  # and works on
    assert float(cache.lookup((1, 2, 9)).state.lengths[0]) == 1.0


def test_a_lookup_lands_a_snapshot_still_in_flight():
    cache = PrefixCache(1 << 40, max_pending=1)
    cache.insert_async((1, 2), _state(1.0, device=True))
    cache.insert_async((3, 4), _state(2.0, device=True))  # over max_pending: the older one lands first
    assert not cache.lookup((1, 2, 0)).pending
    snap = cache.lookup((3, 4, 0))
    assert not snap.pending and float(snap.state.lengths[0]) == 2.0


def _job(n: int, submitted: float, pos: int = 0) -> Job:
    return Job(GenerationRequest(tuple(range(n)), SamplingParams()), stream=None, seed=0, submitted=submitted,
               pos=pos)


def test_order_is_shortest_remaining_first_and_ages():
    policy = PrefillPolicy(EngineConfig(prefill_aging_s=5.0))
    fresh_first_turn, later_turn = _job(27000, submitted=100.0), _job(30000, submitted=100.0, pos=27500)
    assert policy.order([fresh_first_turn, later_turn], now=100.0) == [later_turn, fresh_first_turn]
    old = _job(27000, submitted=0.0)  # waited 100 s: 27,000 / 21 ~ 1,286 < 2,500
    assert policy.order([later_turn, old], now=100.0) == [old, later_turn]


def test_a_prompt_waiting_three_agings_goes_before_every_shorter_one():
    """The aged key alone would keep a 9,000-token tail behind fresh 300-token turns for ~145 s; after 3 agings
    (15 s) it goes first, and among such prompts the longest waiting goes first."""
    policy = PrefillPolicy(EngineConfig(prefill_aging_s=5.0))
    tail = _job(25000, submitted=0.0, pos=16000)
    short = _job(300, submitted=14.0)
    assert policy.order([short, tail], now=14.9) == [short, tail]  # 14.9 s: 9,000 / 3.98 > 300
    assert policy.order([short, tail], now=15.0) == [tail, short]
    older = _job(30000, submitted=-1.0, pos=1000)
    assert policy.order([short, tail, older], now=15.0) == [older, tail, short]


def test_pacing_keeps_the_decoders_share():
    policy = PrefillPolicy(EngineConfig(decode_share=0.75, mixed_step_ms=1000))
    assert policy.may_prefill(decoding=False)
    decode_s, prefill_s, spent = 0.01, 0.02, {"decode": 0.0, "prefill": 0.0}
    for _ in range(1000):
        if policy.may_prefill(decoding=True):
            policy.prefilled(prefill_s, decoding=True)
            spent["prefill"] += prefill_s
        policy.decoded(decode_s, prefilling=True)
        spent["decode"] += decode_s
    share = spent["decode"] / (spent["decode"] + spent["prefill"])
    assert 0.74 <= share <= 0.78 and spent["prefill"] > 0


@pytest.mark.parametrize("by_requests", [False, True])
def test_by_requests_the_decoders_keep_at_most_their_part_of_the_slots(by_requests):
    """`share_by_requests`: D decoding and W prefilling requests give the decoders min(decode_share, D / (D + W)) of
    the time (off: decode_share whatever waits); the pacing holds that split over many iterations."""
    policy = PrefillPolicy(EngineConfig(decode_share=0.7, mixed_step_ms=1000, share_by_requests=by_requests))
    for (d, w), want in {(4, 4): 0.5, (3, 1): 0.7, (1, 3): 0.25, (6, 2): 0.7, (2, 0): 0.7}.items():
        assert policy.share(d, w) == pytest.approx(want if by_requests else 0.7)
    decode_s, prefill_s, spent = 0.01, 0.005, {"decode": 0.0, "prefill": 0.0}
    for _ in range(3000):
        while policy.may_prefill(decoding=True):
            policy.prefilled(prefill_s, decoding=True)
            spent["prefill"] += prefill_s
        policy.decoded(decode_s, 4, decoders=2)
        spent["decode"] += decode_s
    share = spent["decode"] / (spent["decode"] + spent["prefill"])
    want = 2 / 6 if by_requests else 0.7
    assert want - 0.02 <= share <= want + 0.02


def test_the_mixed_shape_is_the_most_tokens_under_the_target():
    config = EngineConfig(prefill_chunks=(32, 256, 2048), prefill_batch=4, slots=4, mixed_step_ms=50)
    seconds = {("prefill", 32, 1): 0.005, ("prefill", 256, 1): 0.02, ("prefill", 256, 2): 0.04,
               ("prefill", 256, 4): 0.08, ("prefill", 2048, 1): 0.2, ("decode", 1, 4): 0.01}
    assert choose_mixed_shape(config, seconds) == (256, 2)
    assert choose_mixed_shape(config, seconds, waiting=1) == (256, 1)  # one prompt: no empty rows
    wide = {**seconds, ("prefill", 2048, 1): 0.045}
    assert choose_mixed_shape(config, wide, waiting=1) == (2048, 1)  # one prompt alone gets the widest piece
    assert choose_mixed_shape(config, {("prefill", 32, 1): 0.5}) == (32, 1)  # none fits: the smallest
    given = EngineConfig(prefill_chunks=(8, 32), prefill_batch=2, slots=2, mixed_prefill=(8, 2))
    assert choose_mixed_shape(given, seconds) == (8, 2)
    with pytest.raises(ValueError, match="mixed_prefill"):
        EngineConfig(prefill_chunks=(8, 32), mixed_prefill=(16, 1))


def test_a_prompt_that_fits_the_burst_prefills_at_once_and_long_ones_stay_paced():
    """`prefill_burst_ms`: a prompt whose remaining pieces at full width take at most that long (by warm-up's
    one-prompt calls) runs beside decoders whatever the share says, piece after piece until its prefill ends; a
    longer one stays paced; no burst starts while the share's debt is a burst or more, or with the burst off."""
    config = EngineConfig(prefill_chunks=(256, 1024), slots=4, decode_share=0.7, prefill_burst_ms=300)
    policy = PrefillPolicy(config)
    policy.warmed_up({("prefill", 256, 1): 0.05, ("prefill", 1024, 1): 0.1, ("prefill", 1024, 2): 0.19})
    later = _job(9000, submitted=0.0, pos=7000)  # pieces 7000-8024, 8024-9000 (both 1,024 wide): 0.2 s
    first = _job(20000, submitted=0.0, pos=4000)  # 16 pieces (the last 640 tokens, 1,024 wide)
    assert policy.estimate(later) == pytest.approx(0.2) and policy.estimate(first) == pytest.approx(1.6)
    assert policy.burst([first, later], decoding=False, now=1.0) == []  # nobody decodes: all calls full width
    policy.prefilled(0.2, decoding=True)  # in debt, under one burst: may_prefill says no, a burst may start
    assert not policy.may_prefill(decoding=True)
    assert policy.burst([first, later], decoding=True, now=1.0) == [later] and policy.bursts == 1
    policy.prefilled(0.25, decoding=True)  # deeper in debt than a burst: the burst going on still goes on
    assert policy.burst([first, later], decoding=True, now=1.0) == [later] and policy.bursts == 1
    other = _job(500, submitted=0.0)
    assert policy.burst([first, other], decoding=True, now=1.0) == []  # `later` ended; none while in debt
    for _ in range(200):
        policy.decoded(0.01, prefilling=True)
    assert policy.burst([first, other], decoding=True, now=1.0) == [other] and policy.bursts == 2
    assert policy.burst([first, other], decoding=False, now=1.0) == []  # the decoders ended: full width
    # A starved prompt (waited 3 agings: 15 s) at the head of the order: no burst overtakes it; it may burst itself.
    assert policy.burst([first, other], decoding=True, now=16.0) == []
    assert policy.burst([later, other], decoding=True, now=16.0) == [later]
    off = PrefillPolicy(dataclasses.replace(config, prefill_burst_ms=0))
    off.warmed_up({("prefill", 256, 1): 0.05, ("prefill", 1024, 1): 0.1})
    assert off.burst([later], decoding=True, now=1.0) == []
    untimed = PrefillPolicy(config)  # no warm-up times (a width never timed): never a burst
    assert untimed.burst([later], decoding=True, now=1.0) == []
    with pytest.raises(ValueError, match="prefill_burst_ms"):
        EngineConfig(prefill_burst_ms=-1)
