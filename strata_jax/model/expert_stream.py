"""Experts streamed from pinned host memory inside the step (`ExpertQuantization.host_path = "stream"`).

Experts outside a layer's device pool stay in host memory (the `pinned_host` memory kind, where the device has
one) as one packed row of uint32 words per expert: the expert's gate_up bits, gate_up scales, down bits and down
scales back to back (`RowLayout`; bf16 scales two to a word). After routing, a layer lists the experts its real
tokens need that are not in the pool, copies them into `S` staging rows (`pallas_kernels.host_gather`: one
`lax.dynamic_slice_in_dim` + `jax.device_put(..., jax.memory.Space.Device)` per row, or one Pallas kernel reading
the host rows; all inside the jitted step: no host round trip; a gather over a host array is refused, one slice per
row is not) and runs the same expert kernel over them:

* small calls (decode, verify: tokens x top_k < experts): the pool's pairs through the kernel as before, then the
  staged pairs through a second kernel call over the `S` staging rows; when more experts are missing than `S`, a
  `lax.fori_loop` runs further rounds of `S` (exact; the loop exists only when overflow is possible at all). When
  every pair has its own staging row (`S` = the call's pairs: up to `SMALL_CALL_PAIRS`), row j holds pair j's expert
  if it is the first missed pair of that expert, and no list of missing experts is built (fewer small kernels per
  layer; a decode step runs this once per layer);
* large calls (prompt chunks, which touch most experts): every expert outside the pool is staged, the staging rows
  are concatenated behind the pool and one kernel call serves every pair (the prefill kernel's grouped schedule).

Shapes are fixed, so with the "slices" copy every staging row is copied whether or not a missing expert fills it
(dead rows copy expert 0); the "pallas" copy (the GPU's default) skips dead rows' bytes
(`ExpertQuantization.stream_copy`). `S` trades bytes over PCIe (or dead rows) against overflow rounds.
`stream_copy_slots` sizes it per call from the call's pairs and the pool's share unless
`ExpertQuantization.copy_slots` fixes it. On the CPU backend the host array is the CPU
device's `pinned_host` memory and the copies are plain copies: tests run the same code.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import PackedExperts, moe_experts_1bit
from pallas_kernels.host_gather import gather_rows, resolve_impl
from strata_jax.model.config import HOST_MEMORIES
from strata_jax.model.host_mapped import mapped_host_array

PARTS = ("gate_up_bits", "gate_up_scales", "down_bits", "down_scales")

# Hot-expert placement under skewed routing serves about half of the pairs the pool's share alone would miss
# (measured at 24 GiB, 1 slot: 67% of pairs on the device with uniform routing, 83% with Zipf(0.6)).
ASSUMED_MISS_SHARE = 0.5

# A call of at most this many pairs stages all of them (no overflow loop): on the H200 (2026-12-02, 48 chained layers
# at Flash-Next shapes, 1 token, 340 experts in the pool) staging every pair took 1.65-1.88 ms per step against 0.95
# all-resident, 2 rows per round 2.84 ms (the loop's predicate costs ~20 us a layer) and 5.72 ms with overflow rounds.
SMALL_CALL_PAIRS = 16

# Counters a streaming layer adds up per call (`StreamCounts`): distinct experts staged, rows copied (the bytes over
# PCIe: staged and dead rows with the "slices" copy, staged ones only with "pallas"), rounds run.
STAT_NAMES = ("staged_experts", "copied_rows", "rounds")

# host_memory="auto" -> "mapped" on a GPU: whether a step reading mapped rows (XLA sees device memory) beats one
# reading jax's pinned_host kind (False until measured on the H200).
AUTO_MAPPED = False


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where each of an expert's four packed arrays sits in its row of uint32 words. `shapes`: per part in
    `PARTS`, one expert's shape ([planes, in/32 | groups, out]); bits are uint32 words, scales bfloat16."""

    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, hidden: int, inter: int, planes: int, group: int) -> RowLayout:
        """The layout of `QuantizedExperts`' arrays: gate_up [2I outputs, H inputs], down [H outputs, I inputs]."""
        return cls(((planes, hidden // 32, 2 * inter), (planes, -(-hidden // group), 2 * inter),
                    (planes, inter // 32, hidden), (planes, -(-inter // group), hidden)))

    def part_words(self, part: int) -> int:
        n = math.prod(self.shapes[part])
        return n if PARTS[part].endswith("_bits") else -(-n // 2)

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(sum(self.part_words(j) for j in range(i)) for i in range(len(PARTS)))

    @property
    def words(self) -> int:
        """uint32 words per expert row."""
        return sum(self.part_words(i) for i in range(len(PARTS)))

    @property
    def row_bytes(self) -> int:
        return 4 * self.words

    def pack_part(self, out: np.ndarray, name: str, array: np.ndarray) -> None:
        """Writes all E experts' `name` array (bits uint32, scales bfloat16, the pool's layout) into rows `out`
        [E, words] uint32."""
        i = PARTS.index(name)
        e = out.shape[0]
        if tuple(array.shape) != (e, *self.shapes[i]):
            raise ValueError(f"{name} has shape {tuple(array.shape)}, expected {(e, *self.shapes[i])}")
        flat = np.ascontiguousarray(array).reshape(e, -1)
        if name.endswith("_scales"):
            flat = flat.astype(ml_dtypes.bfloat16, copy=False).view(np.uint16)
            if flat.shape[1] % 2:
                flat = np.concatenate([flat, np.zeros((e, 1), np.uint16)], axis=1)
            flat = flat.view(np.uint32)
        out[:, self.offsets[i]:self.offsets[i] + flat.shape[1]] = flat.astype(np.uint32, copy=False)

    def unpack(self, rows: jax.Array) -> tuple[jax.Array, ...]:
        """Rows [S, words] uint32 -> the four arrays [S, *shape] (bits uint32, scales bfloat16), in `PARTS`
        order."""
        s = rows.shape[0]
        out = []
        for i, name in enumerate(PARTS):
            words = jax.lax.slice_in_dim(rows, self.offsets[i], self.offsets[i] + self.part_words(i), axis=1)
            n = math.prod(self.shapes[i])
            if name.endswith("_scales"):  # little-endian: a word's low half is the earlier bfloat16
                words = jax.lax.bitcast_convert_type(words, jnp.bfloat16).reshape(s, -1)[:, :n]
            out.append(words.reshape(s, *self.shapes[i]))
        return tuple(out)


def host_memory_kind(device=None) -> str | None:
    """The memory kind experts are streamed from on `device` (default: the first): "pinned_host" where the device
    offers it, else None (then only the host-compute path keeps experts off the device)."""
    device = device if device is not None else jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return "pinned_host" if "pinned_host" in kinds else None


def resolve_host_memory(memory: str) -> str:
    """"auto" -> where rows live on this backend ("mapped" only once measured faster: `AUTO_MAPPED`)."""
    if memory not in HOST_MEMORIES:
        raise ValueError(f"host_memory must be one of {', '.join(HOST_MEMORIES)}, got {memory!r}")
    if memory == "auto":
        return "mapped" if AUTO_MAPPED and jax.default_backend() == "gpu" else "pinned"
    return memory


def to_host_memory(rows: np.ndarray, device=None, memory: str = "auto") -> jax.Array:
    """`rows` [E, W] uint32 in host memory the step copies from: `device`'s pinned host memory kind ("pinned"), or
    pinned memory the GPU reads in place, imported as a device array ("mapped": `host_mapped`); RuntimeError naming
    the device where it has neither."""
    device = device if device is not None else jax.devices()[0]
    if resolve_host_memory(memory) == "mapped":
        return mapped_host_array(np.asarray(rows, np.uint32), device)
    kind = host_memory_kind(device)
    if kind is None:
        raise RuntimeError(f"host_path='stream' needs pinned host memory, which {device.device_kind} does not offer; "
                           "use host_path='compute' (the planner chooses it there)")
    if not vmm_allocator():
        return jax.device_put(rows, jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
    # Under XLA's VMM allocator a direct device_put into pinned host memory crashes the process (H200, jax 0.11.2,
    # 2026-12-04: a segfault), while the same rows put on the device and moved there by a jitted copy arrive exact.
    # One layer's table passes through device memory at a time (354 MB at Flash-Next shapes: within the reserve).
    on_device = jax.device_put(rows, jax.sharding.SingleDeviceSharding(device))
    return _moved_to(device, kind)(on_device)


def vmm_allocator(environ: Mapping[str, str] | None = None) -> bool:
    """Whether XLA will run with its VMM allocator: `--command-buffers stable-scratch`
    (strata_jax.engine.command_buffers) sets the flag that turns it on."""
    flags = (os.environ if environ is None else environ).get("XLA_FLAGS", "")
    return "--xla_gpu_command_buffer_update_mode=SKIP_TEMP" in flags


@functools.lru_cache(maxsize=None)
def _moved_to(device, kind: str):
    return jax.jit(lambda x: x, out_shardings=jax.sharding.SingleDeviceSharding(device, memory_kind=kind))


def stream_copy_slots(tokens: int, top_k: int, num_experts: int, pool: int, copy_slots: int | None = None,
                      prefill_copy_slots: int | None = None) -> int:
    """Staging rows per round for a call of `tokens` tokens: at most the experts outside the pool and the call's
    pairs. Small calls (pairs < experts): `copy_slots`, or, when None, every pair up to `SMALL_CALL_PAIRS` (no
    overflow rounds), else the distinct experts the call's pairs are expected to miss with placement serving
    `ASSUMED_MISS_SHARE` of what the pool's share misses. Large calls: `prefill_copy_slots`, or every expert outside
    the pool when None."""
    outside, pairs = num_experts - pool, tokens * top_k
    if outside <= 0:
        return 0
    if pairs >= num_experts:
        cap = outside if prefill_copy_slots is None else prefill_copy_slots
    elif copy_slots is not None:
        cap = copy_slots
    elif pairs <= SMALL_CALL_PAIRS:
        cap = pairs
    else:
        missed = pairs * (outside / num_experts) * ASSUMED_MISS_SHARE
        cap = math.ceil(outside * -math.expm1(missed * math.log1p(-1.0 / outside)) if outside > 1 else missed)
    return max(1, min(outside, pairs, cap))


def streamed_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array, slot_of: jax.Array,
                     pool_gate_up: PackedExperts, pool_down: PackedExperts, host_rows: jax.Array, layout: RowLayout,
                     *, copy_slots: int | None = None, prefill_copy_slots: int | None = None,
                     impl: str = "auto", copy_impl: str = "auto") -> tuple[jax.Array, jax.Array]:
    """Routed experts with the pool on the device and every expert's row in `host_rows` [E, W].

    x [N, H], ids/weights [N, k], valid bool [N] (only real tokens' experts are staged; padding rows' pairs on
    experts outside the pool contribute nothing), slot_of int32 [E] (-1: not in the pool); `impl`: the expert
    kernel's, `copy_impl`: the copy's (`pallas_kernels.host_gather.gather_rows`). Returns (out [N, H] x.dtype, int32
    [3] counters in `STAT_NAMES` order)."""
    n, k = ids.shape
    e = slot_of.shape[0]
    pool = pool_gate_up.bits.shape[0]
    group = pool_gate_up.group
    outside = e - pool
    s = stream_copy_slots(n, k, e, pool, copy_slots, prefill_copy_slots)
    slot = slot_of[ids]
    on_device = slot >= 0
    miss = ~on_device & valid[:, None]
    skips_dead = resolve_impl(copy_impl) == "pallas"  # dead staging rows cost no bytes: only live rows are counted

    def packed(parts):
        return PackedExperts(parts[0], parts[1], group), PackedExperts(parts[2], parts[3], group)

    def pool_call():
        return moe_experts_1bit(x, jnp.where(on_device, slot, 0), jnp.where(on_device, weights, 0.0), pool_gate_up,
                                pool_down, impl=impl).astype(jnp.float32)

    def staged_call(parts, staged):  # the pairs whose expert sits in staging row `staged` (-1: not staged)
        hit = staged >= 0
        return moe_experts_1bit(x, jnp.where(hit, staged, 0), jnp.where(hit, weights, 0.0), *packed(parts),
                                impl=impl).astype(jnp.float32)

    def counters(n_missing, rounds):  # STAT_NAMES; rows copied: live ones only with the kernel, else every row
        return jnp.stack([n_missing, n_missing if skips_dead else rounds * s, rounds]).astype(jnp.int32)

    if s == n * k < e:  # a staging row per pair (decode, verify): no list of missing experts to build
        flat, missed = ids.reshape(-1), miss.reshape(-1)
        order = jnp.arange(n * k)
        # The first missed pair of each expert is staged; later pairs of the same expert read its row.
        same = (flat[:, None] == flat[None, :]) & missed[None, :] & (order[None, :] <= order[:, None])
        first_of = jnp.argmax(same, axis=1)
        first = missed & (first_of == order)
        parts = layout.unpack(gather_rows(host_rows, jnp.where(first, flat, -1), impl=copy_impl))
        out = pool_call() + staged_call(parts, jnp.where(missed, first_of, -1).reshape(n, k))
        return out.astype(x.dtype), counters(jnp.sum(first), jnp.int32(1))

    needed = jnp.zeros((e,), jnp.int32).at[ids].max(miss.astype(jnp.int32))
    n_missing = jnp.sum(needed)
    rounds_total = -(-outside // s)
    missing = jnp.nonzero(needed, size=rounds_total * s, fill_value=e)[0].astype(jnp.int32)  # ascending, then e

    def stage(r):
        chosen = jax.lax.dynamic_slice_in_dim(missing, r * s, s)
        live = chosen < e
        parts = layout.unpack(gather_rows(host_rows, jnp.where(live, chosen, -1), impl=copy_impl))
        stage_of = jnp.full((e,), -1, jnp.int32).at[chosen].set(jnp.arange(s, dtype=jnp.int32), mode="drop")
        return parts, stage_of[ids]

    if n * k >= e and s == outside:  # one round stages every expert outside the pool: one kernel call over both
        parts, staged = stage(0)
        both = [jnp.concatenate([pool_part, part]) for pool_part, part in
                zip((pool_gate_up.bits, pool_gate_up.scales, pool_down.bits, pool_down.scales), parts)]
        served = on_device | (staged >= 0)
        where = jnp.where(on_device, slot, pool + staged)
        out = moe_experts_1bit(x, jnp.where(served, where, 0), jnp.where(served, weights, 0.0), *packed(both),
                               impl=impl)
        return out, counters(n_missing, jnp.int32(1))

    def staged_round(r, acc):
        return acc + staged_call(*stage(r))

    out = staged_round(0, pool_call())
    rounds = jnp.int32(1)
    if s < min(outside, n * k):  # more experts may be missing than one round stages: the overflow rounds
        rounds = jnp.maximum(1, (n_missing + s - 1) // s).astype(jnp.int32)
        out = jax.lax.fori_loop(1, rounds, staged_round, out)
    return out.astype(x.dtype), counters(n_missing, rounds)
