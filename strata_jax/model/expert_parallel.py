"""Expert parallelism: the routed experts of every MoE layer split over the devices of a mesh.

The mesh has two axes, `DATA_AXIS` x `EXPERT_AXIS` (either may have size 1). Each device holds E / n_expert of every
layer's routed experts (or of its device pool, with a host tier): device i of the expert axis holds experts
i * E_local .. (i + 1) * E_local - 1. Dense weights are replicated. A step runs inside one `shard_map` over the
whole mesh (`sharded`): every device runs the unchanged model, and its kernels, on its own rows; only the MoE's
routed experts talk to the other devices. How they do depends on how the rows lie (`ExpertParallel.tokens`):

- "sharded" (decode, verify: each device its own slots): the expert group's tokens are exchanged -- all-gathered
  and reduce-scattered back (`exchange="gather"`), or sent to every expert device and back with all-to-all
  (`exchange="all_to_all"`) -- each device computing its own experts' pairs of all of them;
- "owner" (a prefill call: every device runs the same P rows, but only the slot's owner has the real state): the
  owner's tokens and routing are summed in (the others contribute zeros), then as "replicated";
- "replicated" (every device the same rows): each device computes its own experts' pairs and a psum combines.

Pairs routed to another device's experts weigh 0 here, so every device computes exactly the all-on-one-device
function's share and the sum is the same function. Without an active `ExpertParallel` (no mesh) the MoE runs
exactly as before: `run_experts` is then a plain call.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"
EXPERT_AXIS = "expert"
MESH_AXES = (DATA_AXIS, EXPERT_AXIS)
TOKEN_LAYOUTS = ("sharded", "owner", "replicated")
EXCHANGES = ("gather", "all_to_all")
# Arrays whose leading axis is the expert (or device-pool slot) axis: split over EXPERT_AXIS.
EXPERT_ARRAYS = ("gate_up_proj", "down_proj", "gate_up_bits", "gate_up_scales", "down_bits", "down_scales")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How the MoE layers traced inside the current `shard_map` exchange tokens (see the module docstring).
    `row_order` ("owner" only; traced, int32 [B]): this device holds the call's B rows permuted, its row r being
    the call's row row_order[r] (each device writes the rows it does not own back first); the MoE puts its tokens
    in the call's order before summing the owners' in."""

    tokens: str
    exchange: str = "gather"
    row_order: jax.Array | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.tokens not in TOKEN_LAYOUTS:
            raise ValueError(f"tokens must be one of {TOKEN_LAYOUTS}, got {self.tokens!r}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {self.exchange!r}")


_CURRENT: contextvars.ContextVar[ExpertParallel | None] = contextvars.ContextVar("expert_parallel", default=None)


@contextlib.contextmanager
def active(ep: ExpertParallel | None) -> Iterator[None]:
    """Traces the MoE layers called inside the block with `ep` (None: plain, single-device)."""
    token = _CURRENT.set(ep)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> ExpertParallel | None:
    """The `ExpertParallel` being traced, or None."""
    return _CURRENT.get()


def run_experts(experts, x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array | None) -> jax.Array:
    """`experts(x, ids, weights, valid)` (x [N, H], ids/weights [N, k]), split over the expert axis when an
    `ExpertParallel` is active (inside `sharded`); a plain call otherwise."""
    ep = current()
    if ep is None:
        return experts(x, ids, weights, valid)
    if jax.lax.axis_size(MESH_AXES) == 1:  # one device: nothing to exchange (XLA keeps no-op collectives)
        return experts(x, ids, weights, valid)
    valid = jnp.ones((x.shape[0],), bool) if valid is None else valid
    n = jax.lax.axis_size(EXPERT_AXIS)
    if ep.tokens == "owner":  # only the owner's rows are real: sum them in (the others add zeros)
        order = ep.row_order
        if order is not None:  # to the call's row order, the same on every device
            x, ids, weights, valid = (_rows_permuted(a, jnp.argsort(order)) for a in (x, ids, weights, valid))
        keep = valid[:, None]
        x = jax.lax.psum(jnp.where(keep, x, 0).astype(jnp.float32), MESH_AXES).astype(x.dtype)
        ids = jax.lax.psum(jnp.where(keep, ids, 0), MESH_AXES)
        weights = jax.lax.psum(jnp.where(keep, weights, 0.0), MESH_AXES)
        valid = jax.lax.psum(valid.astype(jnp.int32), MESH_AXES) > 0
        out = jax.lax.psum(_local_experts(experts, x, ids, weights, valid, False), EXPERT_AXIS).astype(x.dtype)
        return out if order is None else _rows_permuted(out, order)
    if ep.tokens != "sharded":
        return jax.lax.psum(_local_experts(experts, x, ids, weights, valid, False), EXPERT_AXIS).astype(x.dtype)
    rows = x.shape[0]
    if ep.exchange == "gather":
        x_all, ids_all, w_all, valid_all = (jax.lax.all_gather(a, EXPERT_AXIS, tiled=True)
                                            for a in (x, ids, weights, valid))
        part = _local_experts(experts, x_all, ids_all, w_all, valid_all, True)
        return jax.lax.psum_scatter(part, EXPERT_AXIS, scatter_dimension=0, tiled=True).astype(x.dtype)
    # all_to_all: every row to every expert device (fixed shapes: a row may need any of them), partials back.
    send = [jnp.concatenate([a] * n, axis=0) for a in (x, ids, weights, valid)]
    x_all, ids_all, w_all, valid_all = (jax.lax.all_to_all(a, EXPERT_AXIS, 0, 0, tiled=True) for a in send)
    part = _local_experts(experts, x_all, ids_all, w_all, valid_all, True)
    back = jax.lax.all_to_all(part, EXPERT_AXIS, 0, 0, tiled=True)
    return back.reshape(n, rows, -1).sum(axis=0).astype(x.dtype)


def _rows_permuted(a: jax.Array, index: jax.Array) -> jax.Array:
    """a [B * T, ...] (B rows of T tokens, flattened) with its rows taken in `index` [B] order."""
    rows = index.shape[0]
    return a.reshape(rows, a.shape[0] // rows, *a.shape[1:])[index].reshape(a.shape)


def _local_experts(experts, x, ids, weights, valid, per_group: bool) -> jax.Array:
    """This device's share (float32 [N, H]): the pairs routed to the experts it holds. `per_group`: the tokens are
    the expert group's own (sharded rows), so routing counts are summed over the data axis."""
    from strata_jax.model.moe import QuantizedExperts  # the MoE module imports this one

    me = jax.lax.axis_index(EXPERT_AXIS)
    if isinstance(experts, QuantizedExperts) and experts.host is not None:
        return _local_with_host(experts, x, ids, weights, valid, per_group)
    held = experts.gate_up_bits.shape[0] if isinstance(experts, QuantizedExperts) else experts.gate_up_proj.shape[0]
    local = ids - me * held
    mine = (local >= 0) & (local < held)
    out = experts(x, jnp.where(mine, local, 0), jnp.where(mine, weights, 0.0), valid)
    return out.astype(jnp.float32)


def _local_with_host(experts, x, ids, weights, valid, per_group: bool) -> jax.Array:
    """`QuantizedExperts.__call__` with a host tier, for this device's part of the pool: the pool's slots are split
    over the expert axis like experts are; the host pairs are computed once per expert group (by its device 0)."""
    from pallas_kernels import PackedExperts, moe_experts_1bit

    me = jax.lax.axis_index(EXPERT_AXIS)
    g = experts.quant.group
    gate_up = PackedExperts(experts.gate_up_bits[...], experts.gate_up_scales[...], g)
    down = PackedExperts(experts.down_bits[...], experts.down_scales[...], g)
    counted = jnp.zeros((experts.num_experts,), jnp.int32).at[ids].add(
        jnp.broadcast_to(valid[:, None], ids.shape).astype(jnp.int32))
    if per_group:
        counted = jax.lax.psum(counted, DATA_AXIS)
    experts.counts[...] = experts.counts[...] + counted
    held = gate_up.bits.shape[0]
    slot = experts.slot_of[...][ids]
    local = slot - me * held
    on_me = (slot >= 0) & (local >= 0) & (local < held)
    device = moe_experts_1bit(x, jnp.where(on_me, local, 0), jnp.where(on_me, weights, 0.0), gate_up, down,
                              impl=experts.quant.impl)
    on_host = (slot < 0) & valid[:, None]
    shape = jax.ShapeDtypeStruct(x.shape, jnp.float32)

    def host_pairs():
        return jax.pure_callback(experts.host.compute, shape, x.astype(jnp.float32), ids,
                                 weights.astype(jnp.float32), on_host, vmap_method="sequential")

    host = jax.lax.cond(jnp.any(on_host) & (me == 0), host_pairs, lambda: jnp.zeros(x.shape, jnp.float32))
    return device.astype(jnp.float32) + host


# -- where parameters and caches live ------------------------------------------------------------------------------
def _names(path) -> list[str]:
    out = []
    for key in path:
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        out.append(str(name))
    return [n for n in out if n != "value"]


def param_spec(path, shape: tuple[int, ...], mesh: Mesh) -> P:
    """A parameter's PartitionSpec: routed experts' (and device pools') leading axis over the expert axis; the rest
    replicated. ValueError when the experts do not split evenly."""
    names = _names(path)
    if len(names) >= 2 and names[-2] == "experts" and names[-1] in EXPERT_ARRAYS:
        n = mesh.shape[EXPERT_AXIS]
        if shape[0] % n:
            raise ValueError(f"{'/'.join(names)}: {shape[0]} experts (or pool slots) per layer do not split over "
                             f"{n} devices of the expert axis")
        return P(EXPERT_AXIS)
    return P()


def param_specs(state, mesh: Mesh) -> list[P]:
    """PartitionSpecs of `jax.tree_util.tree_leaves(state)`, in that order (the step functions' flat weights)."""
    return [param_spec(path, leaf.shape, mesh) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]]


def shard_state(state, mesh: Mesh) -> None:
    """Places every array of the nnx `state` on `mesh` (experts split, the rest replicated), in place: the
    Variables stay the same objects, so holders of `state` (expert placement, the runner) see the placed arrays."""
    from flax import nnx

    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        var.set_value(jax.device_put(value, NamedSharding(mesh, param_spec(path, value.shape, mesh))))


def slot_axes(mesh: Mesh, slots: int) -> tuple[str, ...]:
    """The mesh axes a cache's slots are split over: all of them when the slot count divides, else none (every
    device then holds every slot and the steps run replicated)."""
    return MESH_AXES if slots % mesh.size == 0 else ()


def sharded(fn, mesh: Mesh, in_specs, out_specs, ep: ExpertParallel | None):
    """`fn` as a `shard_map` over `mesh`, its MoE layers traced with `ep`. Replication is not checked: outputs
    declared replicated are made so by the callers (psums)."""

    def body(*args):
        with active(ep):
            return fn(*args)

    if hasattr(jax, "shard_map"):
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # jax < 0.7

    return shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def replicated_call(fn, graphdef, mesh: Mesh, exchange: str, state, *args):
    """`fn(graphdef, state, *args)` with `state` placed by `shard_state`, every other argument and every output
    replicated: each device runs the whole batch, its own experts' pairs summed over the expert axis (what
    `LoadedModel`'s explicit-state steps use over a mesh). Call it under `jax.jit`."""
    leaves, treedef = jax.tree_util.tree_flatten(state)

    def body(leaves, *args):
        return fn(graphdef, jax.tree_util.tree_unflatten(treedef, leaves), *args)

    specs = (param_specs(state, mesh), *(P() for _ in args))
    return sharded(body, mesh, specs, P(), ExpertParallel("replicated", exchange))(leaves, *args)
