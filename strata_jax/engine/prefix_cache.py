"""Prefix cache: snapshots of one slot's state after a known token prefix, in a radix tree over the token
sequences, LRU under a byte budget of host memory.

Attention KV could simply be truncated, but Gated DeltaNet / conv / PLE state cannot be rewound, so a reusable
prefix needs the whole state as it was right after that prefix: a snapshot is only useful where a later request
can resume (a block boundary of a long prompt, the end of a turn, the point where two conversations part). The
tree holds the token paths of every snapshot, shared between conversations: a prompt that follows a cached path
past its last snapshot tells the scheduler exactly where it parts from it (`match`), so that the common system
prompt and tools of every agent session are computed once, snapshotted at the parting point, and restored for the
others.

Snapshots are taken without stalling the step loop: the slot's state is copied on the device (a jitted read, queued
behind the step that wrote it). With a device pool (`device_budget_bytes`, where the card has memory to spare)
the copy stays there and is restored device to device; snapshots beyond the pool (its least recently used) go to
host memory: a worker thread copies them there (the host buffers are allocated off the engine thread) and cuts the
KV to the prefix; the snapshot is taken as landed between steps (`poll`) or when a lookup needs it. Host RAM is
the larger pool; KV is stored only up to the prefix length there.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import time
from collections.abc import Sequence

import jax
import numpy as np

from strata_jax.model.cache import ModelCache, kv_position_lengths, map_kv_positions

MAX_PENDING = 4  # snapshots whose host copy may be in flight at once (each holds a device copy of a slot prefix)


def _host_available_bytes() -> int | None:
    """Host memory available now: MemAvailable, within what the cgroup (v2) still allows; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(available, 0)


def planned_budget_mib(available_bytes: int | None = None, floor_mib: int = 2048, cap_mib: int = 65536) -> int:
    """`serve`'s prefix-cache budget: a quarter of the host memory available at start (`available_bytes`, default
    read from /proc and the cgroup), at least `floor_mib` where that leaves half the memory free, at most `cap_mib`.
    Agents need room: a 27K-token snapshot of Flash-Next takes ~0.85 GB, and every session keeps one per turn."""
    available = _host_available_bytes() if available_bytes is None else available_bytes
    if available is None:
        return floor_mib
    quarter = available // 4 >> 20
    return int(min(cap_mib, max(quarter, min(floor_mib, available // 2 >> 20))))


def _positions(axis: int, stop: int) -> tuple:
    return (slice(None),) * axis + (slice(0, stop),)


def shared_length(tokens: tuple[int, ...], edge: tuple[int, ...], at: int = 0) -> int:
    """How many leading tokens of `edge` `tokens` holds from `at` on. Slices are compared in C, halving the span
    where they part: a per-token Python loop took ~5 ms of the engine thread per 24K-token snapshot (2-core CPU)."""
    lo, hi = 0, min(len(edge), len(tokens) - at)
    if tokens[at : at + hi] == edge[:hi]:
        return hi
    while hi - lo > 1:  # tokens[at : at + lo] == edge[:lo] and the first hi differ
        mid = (lo + hi) // 2
        if tokens[at + lo : at + mid] == edge[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclasses.dataclass(eq=False)
class Snapshot:
    tokens: tuple[int, ...]
    state: ModelCache  # batch 1: host arrays with KV cut to the prefix once landed; else the device read
    nbytes: int
    last_used: int
    owner: str | None = None  # the request it was taken from (its copy in flight is dropped if it is cancelled)
    pending: bool = False  # its device-to-host copy is in flight (`future` lands it)
    on_device: bool = False  # kept in the device pool: restored device to device
    future: concurrent.futures.Future | None = None


@dataclasses.dataclass(eq=False)
class _Node:
    """A radix-tree node: the tokens from its parent's end to its own (`edge`), `depth` tokens from the root."""

    edge: tuple[int, ...]
    depth: int
    parent: _Node | None
    children: dict[int, _Node] = dataclasses.field(default_factory=dict)
    snapshot: Snapshot | None = None


class PrefixCache:
    """Longest-prefix lookup over snapshots in a radix tree of token sequences. Snapshots live in host memory
    (`budget_bytes`, least recently used evicted) and, with `device_budget_bytes`, first in a device pool (least
    recently used moved to the host)."""

    def __init__(self, budget_bytes: int, kv_block: int = 1, max_pending: int = MAX_PENDING,
                 device_budget_bytes: int = 0):
        self.budget = budget_bytes
        self.device_budget = device_budget_bytes
        self.kv_block = kv_block
        self.max_pending = max_pending
        self._root = _Node((), 0, None)
        self._by_tokens: dict[tuple[int, ...], _Node] = {}
        self._clock = itertools.count()
        self.bytes = 0  # host snapshots, landed and in flight (those land in host memory)
        self.device_bytes = 0  # snapshots in the device pool
        self._lander: concurrent.futures.ThreadPoolExecutor | None = None
        self.counters = {"hits": 0, "misses": 0, "evictions": 0, "taken": 0, "landed": 0, "dropped": 0,
                         "wait_seconds": 0.0}

    def __len__(self) -> int:
        return len(self._by_tokens)

    # -- lookup --------------------------------------------------------------------------------------------------
    def _walk(self, prompt: tuple[int, ...]) -> tuple[list[_Node], int]:
        """The nodes on the path `prompt` follows (root excluded) and how many of its tokens the tree holds."""
        node, at, path = self._root, 0, []
        while at < len(prompt):
            child = node.children.get(prompt[at])
            if child is None:
                return path, at
            edge = child.edge
            n = shared_length(prompt, edge, at)
            if n < len(edge):  # the edge parts from the prompt inside it
                return path, at + n
            path.append(child)
            node, at = child, at + n
        return path, at

    def match(self, prompt: Sequence[int]) -> tuple[Snapshot | None, int]:
        """(the snapshot `lookup` would restore, or None; how many leading tokens of `prompt` the tree's paths hold).
        The second is where `prompt` parts from every cached conversation: a snapshot there would serve the next
        prompt that parts at the same point."""
        prompt = tuple(prompt)
        path, matched = self._walk(prompt)
        best = next((n.snapshot for n in reversed(path) if n.snapshot is not None and n.depth < len(prompt)), None)
        return best, matched

    def lookup(self, prompt: Sequence[int]) -> Snapshot | None:
        """The snapshot with the longest token prefix of `prompt` that leaves at least one token to prefill (landed
        first if its host copy was in flight). Counts a hit or a miss."""
        best, _ = self.match(prompt)
        if best is None:
            self.counters["misses"] += 1
            return None
        self.counters["hits"] += 1
        best.last_used = next(self._clock)
        if best.pending and not self._land(best, wait=True):
            return None
        return best

    def would_keep(self, n_tokens: int, nbytes: int) -> bool:
        """Whether a snapshot of `n_tokens` tokens taking about `nbytes` would be stored: reading a slot is not free
        (hundreds of MB at long contexts), so callers ask first."""
        return n_tokens > 0 and 0 < nbytes <= max(self.budget, self.device_budget)

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._by_tokens

    # -- insertion -----------------------------------------------------------------------------------------------
    def _cut(self, tokens: tuple[int, ...], state: ModelCache) -> ModelCache:
        """Host arrays of `state` with KV cut to whole `kv_block`s past the prefix (waits for device arrays)."""
        keep = -(-len(tokens) // self.kv_block) * self.kv_block
        state = jax.tree_util.tree_map(np.asarray, state)
        return map_kv_positions(state, lambda x, axis: np.array(x[_positions(axis, keep)]))

    def insert(self, tokens: Sequence[int], state: ModelCache, owner: str | None = None) -> None:
        """Stores a host copy of a slot's state after `tokens` (state as read from the device, batch 1; its KV may
        hold more positions than the tokens: they are cut to whole `kv_block`s past the prefix)."""
        tokens = tuple(tokens)
        if not self._skip(tokens):
            self._store(tokens, self._cut(tokens, state), owner, "host")

    def insert_async(self, tokens: Sequence[int], state: ModelCache, owner: str | None = None) -> float:
        """Stores a snapshot whose state is still on the device (`state`: device arrays, batch 1, the output of a
        jitted read queued behind the step that filled the slot) and returns at once: into the device pool if it
        has room for it (making room by moving its least recently used snapshots to the host), else its copy to
        the host is started and a worker thread lands it. Returns the seconds the engine thread spent (waiting
        for the oldest copy in flight when `max_pending` are in flight already)."""
        tokens = tuple(tokens)
        if self._skip(tokens):
            return 0.0
        t0 = time.perf_counter()
        nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
        if nbytes <= self.device_budget:
            self._store(tokens, state, owner, "device")
        else:
            self._store(tokens, state, owner, "flight")
        return time.perf_counter() - t0

    def _skip(self, tokens: tuple[int, ...]) -> bool:
        if not tokens or (self.budget <= 0 and self.device_budget <= 0):
            return True
        node = self._by_tokens.get(tokens)
        if node is not None:
            node.snapshot.last_used = next(self._clock)
            return True
        return False

    def _store(self, tokens: tuple[int, ...], state: ModelCache, owner: str | None, where: str) -> None:
        """Stores a snapshot "host" (landed), "flight" (its copy to the host starts now) or "device" (pool)."""
        nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
        if where == "flight":
            pending = self._pending()
            if len(pending) >= self.max_pending:
                self._land(min(pending, key=lambda s: s.last_used), wait=True)
        if not self._make_room(nbytes, device=where == "device"):
            return
        node = self._node_for(tokens)
        snap = Snapshot(tokens, state, nbytes, next(self._clock), owner, on_device=where == "device")
        node.snapshot = snap
        self._by_tokens[tokens] = node
        if snap.on_device:
            self.device_bytes += nbytes
        else:
            self.bytes += nbytes
        if where == "flight":
            self._start_landing(snap)
        self.counters["taken"] += 1

    def _make_room(self, nbytes: int, device: bool) -> bool:
        """Evicts least recently used snapshots of the host (or moves those of the device pool to the host) until
        `nbytes` more fit; False if they never would."""
        budget = self.device_budget if device else self.budget
        if nbytes > budget:
            return False
        while (self.device_bytes if device else self.bytes) + nbytes > budget:
            victim = min((s for s in self._snapshots() if s.on_device == device), key=lambda s: s.last_used)
            if device:
                self._to_host(victim)
            else:
                self._remove(victim.tokens)
                self.counters["evictions"] += 1
        return True

    def _to_host(self, snap: Snapshot) -> None:
        """Moves a device-pool snapshot to the host (its copy starts now), or drops it if the host has no room."""
        self.device_bytes -= snap.nbytes
        snap.on_device = False
        if not self._make_room(snap.nbytes, device=False):
            self._forget(snap.tokens)
            self.counters["evictions"] += 1
            return
        self.bytes += snap.nbytes
        self._start_landing(snap)

    def _start_landing(self, snap: Snapshot) -> None:
        # The worker starts the copy itself (`_cut`'s np.asarray): a device-to-host copy begun here would allocate
        # its host buffer on the engine thread (hundreds of MB per snapshot at agent-sized prompts).
        if self._lander is None:
            self._lander = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-snapshots")
        snap.pending = True
        snap.future = self._lander.submit(self._cut, snap.tokens, snap.state)

    def _node_for(self, tokens: tuple[int, ...]) -> _Node:
        """The node ending exactly after `tokens`, splitting an edge or adding a leaf as needed."""
        node, at = self._root, 0
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:
                leaf = _Node(tokens[at:], len(tokens), node)
                node.children[tokens[at]] = leaf
                return leaf
            edge = child.edge
            n = shared_length(tokens, edge, at)
            if n == len(edge):
                node, at = child, at + n
                continue
            middle = _Node(edge[:n], at + n, node, {edge[n]: child})  # split the edge where `tokens` parts
            node.children[tokens[at]] = middle
            child.edge, child.parent = edge[n:], middle
            node, at = middle, at + n
        return node

    def _remove(self, tokens: tuple[int, ...]) -> None:
        snap = self._by_tokens[tokens].snapshot
        if snap.on_device:
            self.device_bytes -= snap.nbytes
        else:
            self.bytes -= snap.nbytes
        # A copy in flight is ours alone (a fresh read): freed now, not at collection - unless the worker is
        # reading it this moment (then it goes when the worker lets go of it).
        if snap.pending and (snap.future.cancel() or snap.future.done()):
            for leaf in jax.tree_util.tree_leaves(snap.state):
                leaf.delete()
        self._forget(tokens)

    def _forget(self, tokens: tuple[int, ...]) -> None:
        node = self._by_tokens.pop(tokens)
        node.snapshot = None
        # Prune what no longer leads to a snapshot; merge a node left with one child into it.
        while node is not self._root and node.snapshot is None and len(node.children) <= 1:
            parent = node.parent
            if node.children:
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, parent
                parent.children[node.edge[0]] = child
            else:
                del parent.children[node.edge[0]]
            node = parent

    # -- in-flight copies ----------------------------------------------------------------------------------------
    def _land(self, snap: Snapshot, wait: bool) -> bool:
        """Takes a snapshot in flight as landed if its worker is done (or waiting for it)."""
        if not wait and not snap.future.done():
            return False
        t0 = time.perf_counter()
        try:
            state = snap.future.result()
        except Exception:  # noqa: BLE001 - a copy that failed is a snapshot lost, not an engine error
            self._remove(snap.tokens)
            return False
        nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
        self.bytes += nbytes - snap.nbytes
        snap.state, snap.nbytes, snap.pending, snap.future = state, nbytes, False, None
        self.counters["landed"] += 1
        if wait:
            self.counters["wait_seconds"] += time.perf_counter() - t0
        return True

    def poll(self) -> int:
        """Takes every snapshot whose copy has landed (no waiting); returns how many are still in flight."""
        return sum(not self._land(s, wait=False) for s in self._pending())

    def clear(self) -> int:
        """Drops every snapshot, landed, in flight or in the device pool (their memory is freed; a copy the
        worker is reading this moment goes when it lets go of it). Returns how many were dropped."""
        every = list(self._by_tokens)
        for tokens in every:
            self._remove(tokens)
        self.counters["dropped"] += len(every)
        return len(every)

    def drop_pending(self, owner: str) -> int:
        """Drops the snapshots in flight taken from request `owner` (cancelled: their device copies are freed now
        instead of landing); landed ones and the device pool's stay, they are valid prefixes. Returns how many
        were dropped."""
        mine = [s.tokens for s in self._pending() if s.owner == owner]
        for tokens in mine:
            self._remove(tokens)
        self.counters["dropped"] += len(mine)
        return len(mine)

    def _snapshots(self) -> list[Snapshot]:
        # list() of a dict view runs without releasing the GIL: safe while the engine thread changes the dict.
        return [s for s in (n.snapshot for n in list(self._by_tokens.values())) if s is not None]

    def _pending(self) -> list[Snapshot]:
        return [s for s in self._snapshots() if s.pending]

    @property
    def pending_bytes(self) -> int:
        return sum(s.nbytes for s in self._pending())

    def stats(self) -> dict[str, float]:
        """For the engine's stats() (any thread): snapshots, bytes, in-flight copies, hits / misses / evictions."""
        c = self.counters
        snaps = self._snapshots()
        pending = [s for s in snaps if s.pending]
        return {
            "prefix_cache_snapshots": len(snaps), "prefix_cache_bytes": self.bytes,
            "prefix_cache_budget_bytes": self.budget, "prefix_cache_pending_snapshots": len(pending),
            "prefix_cache_pending_bytes": sum(s.nbytes for s in pending),
            "prefix_cache_device_snapshots": sum(s.on_device for s in snaps),
            "prefix_cache_device_bytes": self.device_bytes, "prefix_cache_device_budget_bytes": self.device_budget,
            "prefix_cache_hits_total": c["hits"], "prefix_cache_misses_total": c["misses"],
            "prefix_cache_evictions_total": c["evictions"], "prefix_cache_snapshots_taken_total": c["taken"],
            "prefix_cache_snapshots_dropped_total": c["dropped"],
            "prefix_cache_land_wait_seconds_total": c["wait_seconds"],
        }

    @staticmethod
    def restore(snap: Snapshot, kv_len: int) -> ModelCache:
        """The snapshot's state with KV padded to `kv_len` positions: host arrays, or the device pool's arrays as
        they are when their KV already has that length."""
        # From the shapes: mapping the device arrays to read them (the QSA block keys' reshapes) ran eager ops,
        # compiled per length on first use, likely most of a later turn's 58 ms restore on an H100.
        if snap.on_device and kv_position_lengths(snap.state) <= {kv_len}:
            return snap.state

        def pad(x, axis):
            x = np.asarray(x)
            out = np.zeros(x.shape[:axis] + (kv_len,) + x.shape[axis + 1 :], x.dtype)
            out[_positions(axis, min(x.shape[axis], kv_len))] = x[_positions(axis, kv_len)]
            return out

        return map_kv_positions(snap.state, pad)
