"""Hot-expert placement: which experts of each MoE layer occupy the device pool (the others run on the host).

The step functions count routed (real token, expert) pairs per layer and expert on the device (`RoutingCounts`,
returned with every step: no extra host sync). Every `every` steps the engine thread reads and clears them (one
small device-to-host copy), folds them into a decaying usage score, and swaps the hottest host experts with the
coldest pool residents: at most `max_swaps` per layer per round, and only when the newcomer is `margin` times
hotter (hysteresis, so that near-ties do not ping-pong). A swap copies the expert's packed bytes from host RAM into
the freed slot with one jitted, donated scatter per layer (fixed shapes: compiled once, at warm-up) and rewrites
the layer's expert->slot map. Outputs do not change: a pair computes the same function on either side.

Streaming layers (`ExpertQuantization.host_path = "stream"`) are placed the same way: a promotion copies the
expert's row from pinned host memory inside the jitted pool update (as the step does), and each round also folds the
layers' streaming counters (experts staged, rows copied over PCIe, rounds) into the totals `stats` exports.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.host_gather import gather_rows
from strata_jax.host.pool import HostPool
from strata_jax.host.tier import HostTier
from strata_jax.model.expert_stream import RowLayout
from strata_jax.model.moe import QuantizedExperts

_KINDS = ("gate_up_bits", "gate_up_scales", "down_bits", "down_scales")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """every: steps between rounds (0: never move experts, only count). max_swaps: experts promoted per layer per
    round (bounds the bytes copied, hence the pause). decay: weight of the previous score in each round's update.
    margin: a host expert is promoted only when its score exceeds margin x the evicted resident's."""

    every: int = 32
    max_swaps: int = 8
    decay: float = 0.5
    margin: float = 1.25

    def __post_init__(self):
        if self.every < 0 or self.max_swaps < 1 or not 0.0 <= self.decay < 1.0 or self.margin < 1.0:
            raise ValueError(f"invalid placement config {self}")


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_pool(pool: tuple[jax.Array, ...], slots: jax.Array, rows: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """pool[i][slots[m]] = rows[i][m]; slots past the pool's end are padding and dropped."""
    return tuple(a.at[slots].set(r, mode="drop") for a, r in zip(pool, rows))


@functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(4,))
def _write_pool_streamed(pool: tuple[jax.Array, ...], host_rows: jax.Array, experts: jax.Array, slots: jax.Array,
                         layout: RowLayout) -> tuple[jax.Array, ...]:
    """`_write_pool` with the experts' rows copied from host memory [E, words] inside the call."""
    return _write_pool(pool, slots, layout.unpack(gather_rows(host_rows, experts)))


def _commit(variables) -> None:
    """Pins each variable's array to the device it is on (no copy). jit compiles again for a committed argument
    where it compiled for an uncommitted one: a pool update's outputs are committed, the loader's arrays are not,
    and the first round's update then compiled on the engine thread (0.33 s on the CPU, stalling every slot),
    not at warm-up."""
    for var in variables:
        value = var.get_value()
        if isinstance(value, jax.Array) and not value.committed:
            var.set_value(jax.device_put(value, value.sharding))


@dataclasses.dataclass
class _Layer:
    path: tuple
    module: QuantizedExperts
    leaves: dict  # name -> the nnx Variable in the model's state (shared with every step's input)
    slot_of: np.ndarray  # int32 [E]
    expert_in: np.ndarray  # int64 [pool]
    score: np.ndarray  # float64 [E]


class ExpertPlacement:
    """The host side of the expert tier of one loaded model: counts, hit rate, promotions. Every method but
    `stats()` (any thread: /metrics) runs on the engine thread, between steps."""

    def __init__(self, state: nnx.State, graphdef, config: PlacementConfig | None = None):
        self.config = config or PlacementConfig()
        model = nnx.merge(graphdef, state)
        flat = dict(nnx.to_flat_state(state))  # path -> the Variable objects of `state` (shared, not copies)
        self._leaves = flat
        self.layers: list[_Layer] = []
        for path, node in nnx.iter_graph(model):
            if isinstance(node, QuantizedExperts) and node.tiered:
                names = _KINDS + ("slot_of", "counts") + (("host_rows", "streamed") if node.streaming else ())
                leaves = {k: flat[path + (k,)] for k in names}
                _commit(leaves[k] for k in _KINDS)
                slot_of = np.asarray(leaves["slot_of"].get_value()).astype(np.int32)
                expert_in = np.full(node.pool_size, -1, np.int64)
                expert_in[slot_of[slot_of >= 0]] = np.flatnonzero(slot_of >= 0)
                self.layers.append(_Layer(path, node, leaves, slot_of, expert_in, np.zeros(node.num_experts)))
        # The layers' tiers compute on their model's one HostPool, whose busy counters `stats` exports (once).
        pools = [layer.module.host.pool for layer in self.layers
                 if isinstance(layer.module.host, HostTier) and not layer.module.streaming]
        self._pools = list({id(pool): pool for pool in pools}.values())
        self._steps = 0
        # Held by stats() (any thread) and by the engine's runner from a step's call until the counters it returns
        # are back in the state: a step consumes the counters it is given (`EngineConfig.donate_counts`).
        self.lock = threading.Lock()
        self.writes = 0  # rounds and moves so far: each rewrote weights the runner's flat list must re-read
        self._pairs = 0
        self._hits = 0
        self._promotions = 0
        self._rounds = 0
        self._round_seconds = 0.0
        self._streamed = np.zeros(3, np.int64)  # expert_stream.STAT_NAMES, summed over layers and rounds
        self._row_bytes = next((layer.module.layout.row_bytes for layer in self.layers if layer.module.streaming), 0)

    @property
    def active(self) -> bool:
        """Whether the model has a host tier at all."""
        return bool(self.layers)

    def store_counts(self, counts: nnx.State) -> None:
        """Takes the counters a call returned (device arrays; no sync), for callers that run the model on its state
        themselves; the engine's runner and the tier bench put them in through `steps.FlatWeights`."""
        for path, var in nnx.to_flat_state(counts):
            self._leaves[path].set_value(var.get_value() if isinstance(var, nnx.Variable) else var)

    def tick(self) -> None:
        """Called after every step: runs a round every `config.every` steps."""
        self._steps += 1
        if self.active and self.config.every and self._steps % self.config.every == 0:
            self.round()

    def round(self, place: bool = True) -> int:
        """Reads and clears the counters, updates hit statistics and scores and (with `place`) promotes hot host
        experts. Returns the number of experts moved."""
        started = time.perf_counter()
        with self.lock:  # stats() adds the pending counts: take them and fold them into the totals atomically
            counts = self._pending_counts()
            for layer, c in zip(self.layers, counts):
                layer.leaves["counts"].set_value(jnp.zeros_like(layer.leaves["counts"].get_value()))
                self._pairs += int(c.sum())
                self._hits += int(c[layer.slot_of >= 0].sum())
            self._streamed += self._pending_streamed(clear=True)
            self.writes += 1
        moved = 0
        for layer, c in zip(self.layers, counts):
            layer.score = self.config.decay * layer.score + c
            if place:
                moved += self._place(layer)
        with self.lock:
            self._promotions += moved
            self._rounds += 1
            self._round_seconds += time.perf_counter() - started
        return moved

    def _place(self, layer: _Layer) -> int:
        cfg, score = self.config, layer.score
        host = np.flatnonzero(layer.slot_of < 0)
        resident = np.flatnonzero(layer.slot_of >= 0)
        hot = host[np.argsort(-score[host], kind="stable")][: cfg.max_swaps]
        cold = resident[np.argsort(score[resident], kind="stable")][: cfg.max_swaps]
        swaps = [(h, c) for h, c in zip(hot, cold) if score[h] > 0 and score[h] > cfg.margin * score[c]]
        if not swaps:
            return 0
        self.move(layer, [int(h) for h, _ in swaps], [int(layer.slot_of[c]) for _, c in swaps])
        return len(swaps)

    def move(self, layer: _Layer, experts: list[int], slots: list[int]) -> None:
        """Copies `experts` (from host RAM) into pool `slots` of `layer`, evicting what was there."""
        m = self.config.max_swaps
        pad_slots = np.full(m, layer.module.pool_size, np.int32)  # out of range: dropped
        pad_slots[: len(slots)] = slots
        pad_experts = np.zeros(m, np.int64)
        pad_experts[: len(experts)] = experts
        pool = tuple(layer.leaves[k].get_value() for k in _KINDS)
        if layer.module.streaming:
            new = _write_pool_streamed(pool, layer.leaves["host_rows"].get_value(),
                                       jnp.asarray(pad_experts, jnp.int32), jnp.asarray(pad_slots), layer.module.layout)
        else:
            rows = tuple(jnp.asarray(layer.module.host.rows(k, pad_experts)) for k in _KINDS)
            new = _write_pool(pool, jnp.asarray(pad_slots), rows)
        for k, arr in zip(_KINDS, new):
            layer.leaves[k].set_value(arr)
        with self.lock:
            for e, s in zip(experts, slots):
                old = layer.expert_in[s]
                if old >= 0:
                    layer.slot_of[old] = -1
                layer.slot_of[e] = s
                layer.expert_in[s] = e
        layer.leaves["slot_of"].set_value(jnp.asarray(layer.slot_of))
        self.writes += 1

    def _pending_counts(self) -> list[np.ndarray]:
        """Every layer's routing counts since the last round, in one transfer (a read per layer waited on the
        device once each)."""
        return [np.asarray(c) for c in jax.device_get([layer.leaves["counts"].get_value() for layer in self.layers])]

    def _pending_streamed(self, clear: bool) -> np.ndarray:
        """The streaming layers' counters since the last round, summed (a small device read), optionally cleared.
        Call with the lock held."""
        variables = [layer.leaves["streamed"] for layer in self.layers if layer.module.streaming]
        total = np.zeros(3, np.int64)
        for value in jax.device_get([var.get_value() for var in variables]):
            total += np.asarray(value, np.int64)
        if clear:
            for var in variables:
                var.set_value(jnp.zeros_like(var.get_value()))
        return total

    def warm_up(self) -> None:
        """Compiles the pool update (a no-op write) so that the first round does not stall on compilation."""
        if self.layers:
            self.move(self.layers[0], [], [])

    def stats(self) -> dict[str, float]:
        """For /metrics: routed pairs, pairs served by the device pool, its hit rate, promotions, rounds, the host
        callbacks run and the seconds spent in them, and, streaming, the experts staged, rows and bytes copied from
        host memory and copy rounds run (all layers; per step: divide by `expert_steps_total`)."""
        if not self.active:
            return {}
        host_calls, host_seconds = _busy(self._pools)
        with self.lock:
            # Plus the counts since the last round (the expert map has not changed since): a small device read.
            pairs, hits = self._pairs, self._hits
            for layer, c in zip(self.layers, self._pending_counts()):
                pairs += int(c.sum())
                hits += int(c[layer.slot_of >= 0].sum())
            staged, rows, rounds = (int(v) for v in self._streamed + self._pending_streamed(clear=False))
            return {
                "expert_pairs_total": pairs,
                "expert_gpu_pairs_total": hits,
                "expert_gpu_hit_rate": hits / pairs if pairs else 0.0,
                "expert_promotions_total": self._promotions,
                "expert_placement_rounds_total": self._rounds,
                "expert_placement_seconds_total": self._round_seconds,
                "expert_pool_size": self.layers[0].module.pool_size,
                "experts_per_layer": self.layers[0].module.num_experts,
                "host_expert_calls_total": host_calls,
                "host_expert_seconds_total": host_seconds,
                "expert_streaming": int(any(layer.module.streaming for layer in self.layers)),
                "expert_steps_total": self._steps,
                "expert_streamed_experts_total": staged,
                "expert_streamed_rows_total": rows,
                "expert_streamed_bytes_total": rows * self._row_bytes,
                "expert_stream_rounds_total": rounds,
            }


def _busy(pools: list[HostPool]) -> tuple[int, float]:
    """(callbacks run, seconds spent in them) over `pools`."""
    readings = [pool.busy() for pool in pools]
    return sum(c for c, _ in readings), sum(s for _, s in readings)
