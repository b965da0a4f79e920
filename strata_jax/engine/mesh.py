"""Several devices through JAX's own sharding: the mesh spec (`--devices N`, `--mesh data=D,expert=E`), several
hosts (`jax.distributed`), and the engine's steps as `shard_map`s over the mesh.

Layout (docs/ARCHITECTURE.md, "Several devices"): a mesh `data` x `expert`; routed experts (or the device pools of a
host tier) split over `expert`, dense weights replicated (strata_jax/model/expert_parallel.py places them); slot
caches split by slot over the whole mesh when the slot count divides, else replicated. Each step stays one jitted,
fixed-shape function: a `shard_map` in which every device runs the unchanged model and kernels on its own slots,
the MoE exchanging tokens over `expert`. A prefill call (P prompts on arbitrary slots) runs on every device: each
computes the rows whose slot it holds (the others masked, n_valid 0), the MoE takes the owner's tokens, and the
owner's results are summed out. Slot reads, writes and resets touch only the owning device's rows.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from strata_jax.engine.steps import reset_slot, take_slot, take_slot_prefix
from strata_jax.model.expert_parallel import (
    DATA_AXIS, EXCHANGES, EXPERT_AXIS, MESH_AXES, ExpertParallel, active, param_specs, sharded, slot_axes,
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A `data` x `expert` mesh over the first data * expert devices (all processes' devices with several hosts).
    `exchange`: how decode and verify steps move tokens to the experts ("gather": all-gather + reduce-scatter,
    "all_to_all")."""

    data: int = 1
    expert: int = 1
    exchange: str = "gather"

    def __post_init__(self):
        if self.data < 1 or self.expert < 1:
            raise ValueError(f"mesh axes must be >= 1, got data={self.data}, expert={self.expert}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")

    @property
    def devices(self) -> int:
        return self.data * self.expert

    def make(self, devices: list | None = None) -> Mesh:
        """The jax Mesh over `devices` (default `jax.devices()`, every process's); ValueError if too few."""
        devices = list(jax.devices() if devices is None else devices)
        if len(devices) < self.devices:
            raise ValueError(f"the mesh needs {self.devices} devices, {len(devices)} are visible "
                             f"({jax.default_backend()}; on a CPU set XLA_FLAGS=--xla_force_host_platform_device_count"
                             f"={self.devices} before JAX starts)")
        grid = np.asarray(devices[: self.devices], dtype=object).reshape(self.data, self.expert)
        return Mesh(grid, MESH_AXES)

    def describe(self) -> str:
        return (f"{self.devices} device(s): mesh {DATA_AXIS}={self.data} x {EXPERT_AXIS}={self.expert}, experts split "
                f"{self.expert} ways, dense weights replicated, slots split over all devices, exchange {self.exchange}")


def parse_mesh(devices: int | None = None, spec: str | None = None, exchange: str = "gather") -> MeshConfig | None:
    """`--devices N` (a 1 x N mesh: experts split N ways) or `--mesh SPEC` ("data=2,expert=2", "expert=4", or
    "2x2" = data x expert) -> MeshConfig; None when neither is given. ValueError on a malformed spec."""
    if devices is not None and spec is not None:
        raise ValueError("give --devices or --mesh, not both")
    if devices is not None:
        if devices < 1:
            raise ValueError(f"--devices must be >= 1, got {devices}")
        return MeshConfig(1, devices, exchange)
    if spec is None:
        return None
    sizes = {DATA_AXIS: 1, EXPERT_AXIS: 1}
    try:
        if "=" in spec:
            for part in spec.split(","):
                name, _, value = part.partition("=")
                name = name.strip()
                if name not in sizes:
                    raise ValueError(f"unknown axis {name!r}")
                sizes[name] = int(value)
        else:
            data, expert = spec.lower().split("x")
            sizes = {DATA_AXIS: int(data), EXPERT_AXIS: int(expert)}
    except ValueError as e:
        raise ValueError(f"--mesh {spec!r}: expected data=D,expert=E or DxE ({e})") from None
    return MeshConfig(sizes[DATA_AXIS], sizes[EXPERT_AXIS], exchange)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """Joins a multi-host run (one process per host) through `jax.distributed.initialize`, from the flags or else
    the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster JAX detects: SLURM,
    Open MPI, ...). Call it before anything else touches JAX. Returns whether it did (False: single host)."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and os.environ.get("JAX_NUM_PROCESSES"):
        num_processes = int(os.environ["JAX_NUM_PROCESSES"])
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator is None and num_processes is None and process_id is None:
        return False
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True


# -- the engine's steps over a mesh --------------------------------------------------------------------------------
def _row_spec(axes: tuple[str, ...], rows: int):
    """Spec of an input leaf: split like the slots when it is per slot ([rows, ...]), else replicated."""
    return lambda a: P(axes) if axes and a.ndim >= 1 and a.shape[0] == rows else P()


def _owned(slot: jax.Array, held: int, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """(this device's index of global `slot` (clipped into range), whether it holds it)."""
    if not axes:
        return slot, jnp.ones(slot.shape, bool)
    local = slot - jax.lax.axis_index(axes) * held
    return jnp.clip(local, 0, held - 1), (local >= 0) & (local < held)


def _owners_value(tree, owned: jax.Array, axes: tuple[str, ...]):
    """Leaves [P, ...] whose rows are real only on their owner's device -> the owners' rows on every device."""
    if not axes:
        return tree

    def pick(a):
        keep = owned.reshape(owned.shape + (1,) * (a.ndim - owned.ndim))
        summed = jax.lax.psum(jnp.where(keep, a, jnp.zeros_like(a)).astype(
            jnp.int32 if a.dtype == bool else a.dtype), axes)
        return summed.astype(a.dtype)

    return jax.tree_util.tree_map(pick, tree)


def _put_owned(cache, slot: jax.Array, sub, owned: jax.Array):
    """`put_slot` where this device holds the slot; elsewhere the (clipped) row is written back unchanged. `sub`
    may cover only the first positions of each array (a prefix read: `put_slot_prefix`)."""
    def put(x, y):
        start = (slot,) + (0,) * (x.ndim - 1)
        row = jax.lax.dynamic_slice(x, start, y.shape)
        return jax.lax.dynamic_update_slice(x, jnp.where(owned, y.astype(x.dtype), row), start)

    return jax.tree_util.tree_map(put, cache, sub)


class MeshSteps:
    """The runner's step and slot functions over `mesh` for a cache of `slots` slots: `jit_step` (as
    `steps.jit_step`), `place_cache`, and jitted `reset` / `read` / `read_prefix` / `write` (as
    `steps.reset_slot` / `take_slot` / `take_slot_prefix` / `put_slot`)."""

    def __init__(self, mesh: Mesh, slots: int, exchange: str = "gather"):
        self.mesh = mesh
        self.slots = slots
        self.exchange = exchange
        self.axes = slot_axes(mesh, slots)
        self.held = slots // mesh.size if self.axes else slots  # slots per device
        self.cache_spec = P(self.axes) if self.axes else P()

    def place_cache(self, cache):
        """`cache` split by slot over the mesh (or replicated)."""
        return jax.device_put(cache, NamedSharding(self.mesh, self.cache_spec))

    # -- model steps -----------------------------------------------------------------------------------------------
    def jit_step(self, name: str, step: Callable, graphdef, state, mtp_k: int = 0):
        """`step` (one of `steps.STEPS`) over the mesh, jitted with the cache donated: a function of (flat weights,
        cache, *inputs) like `steps.jit_step`'s. Outputs other than the cache and the routing counts are per slot
        (decode, verify) or per prompt row (prefill)."""
        treedef = jax.tree_util.tree_structure(state)
        wspecs = param_specs(state, self.mesh)
        if name == "prefill":
            return jax.jit(self._prefill(step, graphdef, treedef, wspecs, mtp_k), donate_argnums=(1,))
        ep = ExpertParallel("sharded" if self.axes else "replicated", self.exchange)
        axes, mesh, cache_spec = self.axes, self.mesh, self.cache_spec

        def body(weights, cache, *inputs):
            *outs, cache, counts = step(mtp_k, graphdef, jax.tree_util.tree_unflatten(treedef, weights), cache,
                                        *inputs)
            return tuple(outs), cache, counts

        def run(weights, cache, *inputs):
            specs = jax.tree_util.tree_map(_row_spec(axes, self.slots), inputs)
            outs, cache, counts = sharded(body, mesh, (wspecs, cache_spec, *specs),
                                          (P(axes) if axes else P(), cache_spec, P()), ep)(weights, cache, *inputs)
            return (*outs, cache, counts)

        return jax.jit(run, donate_argnums=(1,))

    def _prefill(self, step: Callable, graphdef, treedef, wspecs, mtp_k: int):
        """The prefill step: every device runs the call's P rows; rows of slots it does not hold get n_valid 0 and
        are written back unchanged, before its own rows are written (so a clipped duplicate cannot overwrite one)."""
        names = list(inspect.signature(step).parameters)[4:]  # after mtp_k, graphdef, state, cache
        i_slots, i_valid = names.index("slots"), names.index("n_valid")
        axes, held, mesh, cache_spec = self.axes, self.held, self.mesh, self.cache_spec
        ep = ExpertParallel("owner" if axes else "replicated", self.exchange)

        def body(weights, cache, *inputs):
            slots = inputs[i_slots]
            rows = slots.shape[0]
            local, owned = _owned(slots, held, axes)
            order = jnp.argsort(owned, stable=True)  # rows this device does not hold first
            inverse = jnp.argsort(order)

            def permute(a, idx):
                return a[idx] if a.ndim >= 1 and a.shape[0] == rows else a

            inputs = list(inputs)
            inputs[i_slots] = local
            inputs[i_valid] = jnp.where(owned, inputs[i_valid], 0)
            inputs = jax.tree_util.tree_map(lambda a: permute(a, order), inputs)
            with active(dataclasses.replace(ep, row_order=order)):
                *outs, cache, counts = step(mtp_k, graphdef, jax.tree_util.tree_unflatten(treedef, weights), cache,
                                            *inputs)
            outs = jax.tree_util.tree_map(lambda a: permute(a, inverse), tuple(outs))
            return _owners_value(outs, owned, axes), cache, counts

        def run(weights, cache, *inputs):
            outs, cache, counts = sharded(body, mesh, (wspecs, cache_spec, *(P() for _ in inputs)),
                                          (P(), cache_spec, P()), ep)(weights, cache, *inputs)
            return (*outs, cache, counts)

        return run

    # -- slots -----------------------------------------------------------------------------------------------------
    def _slot_fn(self, fn: Callable, in_specs, out_specs):
        return sharded(fn, self.mesh, in_specs, out_specs, None)

    def reset_fn(self):
        """jitted (cache, slot) -> cache with `slot` emptied (`reset_slot`), cache donated."""
        axes, held = self.axes, self.held

        def body(cache, slot):
            idx, owned = _owned(slot, held, axes)
            sub = reset_slot(take_slot(cache, idx), jnp.int32(0))
            return _put_owned(cache, idx, sub, owned)

        return jax.jit(self._slot_fn(body, (self.cache_spec, P()), self.cache_spec), donate_argnums=(0,))

    def read_fn(self, length: int | None = None):
        """jitted (cache, slot) -> that slot's state (batch 1, replicated); KV cut to `length` positions if given."""
        axes, held = self.axes, self.held

        def body(cache, slot):
            idx, owned = _owned(slot, held, axes)
            sub = take_slot(cache, idx) if length is None else take_slot_prefix(cache, idx, length)
            return _owners_value(sub, owned, axes)

        return jax.jit(self._slot_fn(body, (self.cache_spec, P()), P()))

    def read_prefix_fn(self) -> Callable:
        """(cache, slot, length) -> `read_fn(length)(cache, slot)`, one compiled function per length."""
        fns: dict[int, Callable] = {}

        def read(cache, slot, length: int):
            if length not in fns:
                fns[length] = self.read_fn(length)
            return fns[length](cache, slot)

        return read

    def write_fn(self):
        """jitted (cache, slot, sub) -> cache with `slot` replaced by `sub` (batch 1; its KV may be a prefix, as
        `put_slot_prefix` takes it), cache donated."""
        axes, held = self.axes, self.held

        def body(cache, slot, sub):
            idx, owned = _owned(slot, held, axes)
            return _put_owned(cache, idx, sub, owned)

        return jax.jit(self._slot_fn(body, (self.cache_spec, P(), P()), self.cache_spec), donate_argnums=(0,))


def describe_placement(mesh: Mesh, slots: int) -> str:
    """One line for start-up logs: the devices, what each holds."""
    axes = slot_axes(mesh, slots)
    per = (f"{slots // mesh.size} slot(s) per device" if axes else
           f"all {slots} slot(s) on every device (the slot count does not divide over {mesh.size} devices)")
    return (f"mesh: {mesh.size} device(s) {dict(mesh.shape)}; experts split over {EXPERT_AXIS}="
            f"{mesh.shape[EXPERT_AXIS]}, dense weights replicated, {per}")

