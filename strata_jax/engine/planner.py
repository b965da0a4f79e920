"""The memory planner: from a checkpoint's shapes, the serving shape and the device budget, decide what lives on the
GPU (dense weights, every slot's caches, a workspace for the step functions, as many routed experts per MoE layer as
fit) and what stays in host RAM (the other experts), keeping `vram_reserve_mib` free for the CUDA context, library
workspaces and the driver, so that nothing pages. Refuses, naming the shortfall, when even the minimum cannot fit.

Sizes are never re-derived by hand: weights come from the model's own parameter shapes (`CausalLM` under
`nnx.eval_shape`) and caches from `init_cache` under `jax.eval_shape`, so they cannot drift from the model code.
Only the transient workspace is an estimate (see `_workspace`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from strata_jax.model.config import ExpertQuantization, ModelConfig
from strata_jax.engine.config import AGENT_CONTEXT, CPU_CONTEXT, MAX_DEFAULT_CONTEXT, EngineConfig
from pallas_kernels.decode_attention import MAX_TOKENS as DECODE_MAX_TOKENS
from pallas_kernels.prefill_attention import BLOCK_K as PREFILL_BLOCK_K
from strata_jax.model.cache import cache_len_for, init_cache, kv_dtype_of
from strata_jax.model.decoder import CausalLM

MIB = 1 << 20
GIB = 1 << 30
DEFAULT_RESERVE_MIB = 1536
CONTEXT_STEP = 1024  # a chosen context is a multiple of this (and so of the attention kernel's key block)

# Environment for a process that only asks JAX how big the device is: no up-front grab, and a limit of the whole
# card, so that memory_stats' bytes_limit is the device's total memory rather than JAX's default 75% of it.
PROBE_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "1.0"}

_DENSE_PARTS = (
    "embeddings",
    "LM head",
    "attention + QSA indexer",
    "Gated DeltaNet",
    "router + shared expert / dense MLP",
    "hyper-connections + norms",
    "PLE projections",
    "MTP (dense part)",
)
_CACHE_PARTS = ("KV", "KV scales (int8/fp8)", "QSA index keys", "QSA block keys", "GDN conv state",
                "GDN recurrent state (fp32)", "PLE conv state", "MTP KV", "slot lengths")


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What JAX's allocator on one device offers: `limit` (bytes_limit: total x the memory fraction), `in_use`."""

    limit: int
    in_use: int
    source: str

    @property
    def free(self) -> int:
        return max(0, self.limit - self.in_use)


def device_memory(device=None) -> DeviceMemory | None:
    """`bytes_limit - bytes_in_use` of `device` (default: the first) from `memory_stats()`, or None where the
    backend keeps no statistics (CPU).

    This initialises JAX's backend, whose allocator settings are then fixed for the process: call it in a process
    whose environment has `PROBE_ENV` (the `plan` command does) to see the whole card. JAX's statistics do not see
    other processes' allocations: on a shared card, pass a budget."""
    dev = device if device is not None else jax.devices()[0]
    try:
        stats = dev.memory_stats()
    except (RuntimeError, NotImplementedError, AttributeError):  # some backends raise instead of returning None
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    return DeviceMemory(limit, used, f"{dev.device_kind} memory_stats: limit {limit / GIB:.2f} GiB, "
                                     f"in use {used / GIB:.2f} GiB")


_PROBE = (
    "import json, jax\n"
    "d = jax.devices()[0]\n"
    "s = d.memory_stats() or {}\n"
    "print(json.dumps([s.get('bytes_limit'), s.get('bytes_in_use', 0), d.device_kind, jax.default_backend()]))\n"
)


@dataclasses.dataclass(frozen=True)
class DeviceProbe:
    """What a probe process saw: `backend` (`jax.default_backend()`: "gpu", "cpu", ...; None when the probe
    failed) and the first device's `memory` (None on CPU or when the probe failed)."""

    backend: str | None
    memory: DeviceMemory | None


def probe_device(timeout: float = 120.0) -> DeviceProbe:
    """The backend and `device_memory()`, measured in a fresh Python process started with `PROBE_ENV`, so this
    process's JAX backend stays uninitialised and `allocator_env(plan)` can still be applied before it starts
    (`serve`'s order: probe, plan, apply_env, then load)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, **PROBE_ENV}
    env.pop("XLA_CLIENT_MEM_FRACTION", None)  # would conflict with PROBE_ENV's fraction
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout, check=True)
        limit, used, kind, *rest = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError, TypeError):
        return DeviceProbe(None, None)
    backend = str(rest[0]) if rest else None
    if limit is None:
        return DeviceProbe(backend, None)
    source = f"{kind} memory_stats (probe): limit {int(limit) / GIB:.2f} GiB, in use {int(used) / GIB:.2f} GiB"
    return DeviceProbe(backend, DeviceMemory(int(limit), int(used), source))


def probe_device_memory(timeout: float = 120.0) -> DeviceMemory | None:
    """`probe_device(timeout).memory`: None on CPU, or when the probe fails."""
    return probe_device(timeout).memory


def default_dtype(backend: str | None) -> str:
    """Weights' dtype when --dtype is not given: bfloat16 on a GPU (half the memory of float32 and the dtype the
    kernels are tuned for), float32 elsewhere (XLA:CPU computes bfloat16 slowly, and the CPU is for checking)."""
    return "bfloat16" if backend == "gpu" else "float32"


@dataclasses.dataclass(frozen=True)
class Workspace:
    """Transient device memory of the largest step (an estimate): `phase` says which step binds, `terms` what it
    holds at its peak."""

    phase: str
    terms: tuple[tuple[str, int], ...]

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.terms)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Every component's device bytes and the decision. `gpu_experts` is per MoE layer (the same count in every
    layer); the other `num_experts - gpu_experts` of each layer stay in host RAM."""

    model: str
    expert_format: str
    weights_dtype: str
    cache_dtype: str
    slots: int
    max_context: int
    dense: tuple[tuple[str, int], ...]
    cache: tuple[tuple[str, int], ...]
    workspace: Workspace
    reserve: int
    budget: int
    budget_source: str
    device_total: int | None  # the card's memory as JAX sees it; None when unknown (explicit budget on CPU)
    moe_layers: int
    num_experts: int
    top_k: int
    expert_bytes: int  # one expert of one layer
    gpu_experts: int
    fits: bool
    message: str

    @property
    def dense_bytes(self) -> int:
        return sum(b for _, b in self.dense)

    @property
    def cache_bytes(self) -> int:
        return sum(b for _, b in self.cache)

    @property
    def fixed_bytes(self) -> int:
        """Everything on the device except the expert pool and the reserve."""
        return self.dense_bytes + self.cache_bytes + self.workspace.bytes

    @property
    def all_expert_bytes(self) -> int:
        return self.expert_bytes * self.num_experts * self.moe_layers

    @property
    def gpu_expert_bytes(self) -> int:
        return self.expert_bytes * self.gpu_experts * self.moe_layers

    @property
    def host_expert_bytes(self) -> int:
        """Host RAM the overflow experts need (0 when every expert is on the GPU)."""
        return self.all_expert_bytes - self.gpu_expert_bytes

    @property
    def min_expert_bytes(self) -> int:
        return self.expert_bytes * min(self.top_k, self.num_experts) * self.moe_layers

    @property
    def device_bytes(self) -> int:
        """Planned device use, the reserve included."""
        return self.fixed_bytes + self.gpu_expert_bytes + self.reserve

    @property
    def arena_bytes(self) -> int:
        """What JAX's allocator may hold: the budget less the reserve."""
        return self.budget - self.reserve


@dataclasses.dataclass(frozen=True)
class _Weights:
    dense: tuple[tuple[str, int], ...]
    moe_layers: int
    expert_bytes: int


def _dense_part(path: tuple) -> str:
    names = [p for p in path if isinstance(p, str)]
    if names[0] == "mtp":
        return "MTP (dense part)"
    if "embed_tokens" in names:
        return "embeddings"
    if "lm_head" in names:
        return "LM head"
    for key, part in (("self_attn", "attention + QSA indexer"), ("linear_attn", "Gated DeltaNet"),
                      ("mlp", "router + shared expert / dense MLP"), ("ple", "PLE projections")):
        if key in names:
            return part
    return "hyper-connections + norms"


@functools.lru_cache(maxsize=16)
def _weights(cfg: ModelConfig, quant: ExpertQuantization | None, dtype_name: str, with_mtp: bool) -> _Weights:
    """Parameter bytes by component, from the model's own abstract parameters (nothing is allocated)."""
    model = nnx.eval_shape(lambda: CausalLM(cfg, jnp.dtype(dtype_name), with_mtp=with_mtp, quant=quant))
    dense = dict.fromkeys(_DENSE_PARTS, 0)
    expert_total = 0
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param):
            continue
        nbytes = math.prod(node.shape) * jnp.dtype(node.dtype).itemsize
        if "experts" in path:
            expert_total += nbytes
        else:
            dense[_dense_part(path)] += nbytes
    moe_layers = cfg.num_layers - len(cfg.dense_mlp_layers) + (1 if with_mtp else 0)
    per_expert = expert_total // max(1, moe_layers * cfg.num_experts)
    if per_expert * moe_layers * cfg.num_experts != expert_total:
        raise AssertionError("routed expert bytes are not uniform across experts and layers")
    return _Weights(tuple((k, v) for k, v in dense.items() if v), moe_layers, per_expert)


def _cache_parts(cfg: ModelConfig, slots: int, max_context: int, dtype, with_mtp: bool,
                 kv_dtype=None) -> tuple[tuple[str, int], ...]:
    """Cache bytes by component, from `init_cache`'s own shapes (`kv_dtype`: K and V stored quantized)."""
    shapes = jax.eval_shape(lambda: init_cache(cfg, slots, max_context, dtype, with_mtp=with_mtp, kv_dtype=kv_dtype))
    parts = dict.fromkeys(_CACHE_PARTS, 0)
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        names = [getattr(k, "name", None) for k in path]
        nbytes = math.prod(leaf.shape) * leaf.dtype.itemsize
        last = names[-1]
        if names[0] == "mtp":
            part = "MTP KV"
        elif last in ("k", "v"):
            part = "KV"
        elif last in ("k_scale", "v_scale"):
            part = "KV scales (int8/fp8)"
        elif last == "index_k":
            part = "QSA index keys"
        elif last == "block_keys":
            part = "QSA block keys"
        elif "ple" in names:
            part = "PLE conv state"
        elif last == "conv":
            part = "GDN conv state"
        elif last == "state":
            part = "GDN recurrent state (fp32)"
        else:
            part = "slot lengths"
        parts[part] += nbytes
    return tuple((k, v) for k, v in parts.items() if v)


def _largest_layer_bytes(cfg: ModelConfig, max_context: int, dtype, with_mtp: bool, kv_dtype=None) -> int:
    """One slot's cache bytes of its largest layer (an attention layer's KV, scales and QSA keys; or the MTP
    layer's), from `init_cache`'s own shapes: what a prefill call copies per prompt at a time."""
    one = jax.eval_shape(lambda: init_cache(cfg, 1, max_context, dtype, with_mtp=with_mtp, kv_dtype=kv_dtype))
    layers = list(one.layers) + ([one.mtp] if one.mtp is not None else [])
    return max(sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(layer))
               for layer in layers)


def _workspace(cfg: ModelConfig, engine: EngineConfig, act_bytes: int, layer_slot_bytes: int,
               recurrent_bytes: int) -> Workspace:
    """Peak transient bytes of the largest step, assuming XLA reuses buffers across layers (one layer's
    intermediates live at a time) and the current model code: decode and verify attention materialise float32
    scores and activation-dtype probabilities over the whole cache length for every query head (QSA only masks
    them), a prefill chunk's attention only over one key block at a time (pallas_kernels.prefill_attention); logits
    are computed for every position of a decode or verify step and for each prompt's last position in a prefill
    (activation dtype, then float32); a prefill call updates its slots' rows of the cache in place, copying one
    layer's rows at a time (`layer_slot_bytes` per prompt: `TextModel`'s `cache_rows`); a verify
    step (drafting) keeps the pre-step recurrent and conv state for the rollback plus the replay inputs of every
    GDN layer.

    Prefill: `engine.prefill_batch` prompts (its largest compiled count) of `engine.chunk` tokens. Decode: every
    slot, 1 token (draft_k + 1 with a drafter). Terms
    below a few MiB (norms, hyper-connection mixing) are covered by the float32 stream copies term. Packed experts
    run in the Pallas kernel (or the GPU XLA fallback's single fusion), so no unpacked weights are held; the CPU
    XLA fallback does materialise them (tokens x k x in x out float32 per projection) and is not planned for.
    Checked against XLA's memory_analysis() of the compiled prefill step on CPU (tiny preset, dense experts,
    4 slots x 4096: 38 MiB measured, 44 MiB estimated)."""
    s = cache_len_for(cfg, engine.max_context)
    n_attn = sum(not cfg.layer_is_linear(i) for i in range(cfg.num_layers))
    n_gdn = cfg.num_layers - n_attn
    width = cfg.hidden_size * max(cfg.hc_count, 1)
    hv, dk, dv = cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim

    def step_terms(batch: int, t: int, prefill: bool = False) -> list[tuple[str, int]]:
        tokens = batch * t
        keys = min(s, PREFILL_BLOCK_K) if prefill and t > DECODE_MAX_TOKENS else s  # keys scored at a time
        terms = []
        if n_attn:
            terms.append(("attention scores + probs", cfg.num_heads * tokens * keys * (4 + act_bytes)))
            if cfg.qsa:
                blocks = s // cfg.indexer_compress_ratio
                terms.append(("QSA masks + block scores",
                              tokens * keys * 2 + tokens * blocks * (cfg.indexer_n_heads * 4 + 1)))
        terms.append(("logits", (batch if prefill else tokens) * cfg.vocab_size * (act_bytes + 4)))
        if n_gdn:  # chunked delta rule: ~8 float32 [T, Hv, Dk|Dv] tensors and the [T, Hv, 64] decay/intra blocks
            terms.append(("GDN chunk intermediates", tokens * hv * (8 * (dk + dv) + 4 * 64) * 4))
        moe = tokens * cfg.num_experts_per_tok * (3 * cfg.moe_intermediate_size + cfg.hidden_size) * 4
        terms.append(("MoE intermediates", moe + tokens * cfg.num_experts * 4))
        terms.append(("float32 stream copies", 16 * tokens * width * 4))
        return terms

    chunk, prompts = engine.chunk, max(engine.prefill_batches)
    prefill = step_terms(prompts, chunk, prefill=True) + [("one layer's slot rows", prompts * layer_slot_bytes)]
    draft = getattr(engine, "draft", "none")  # drafting arrives with the speculation issue
    t = getattr(engine, "draft_k", 0) + 1 if draft != "none" else 1
    decode = step_terms(engine.slots, t)
    if t > 1:
        replay = engine.slots * t * (2 * cfg.linear_num_k_heads * dk * act_bytes + hv * dv * act_bytes
                                     + hv * (dk + dv + 2) * 4)
        decode += [("rollback state copy", recurrent_bytes), ("GDN replay inputs", n_gdn * replay)]
    p_total, d_total = sum(b for _, b in prefill), sum(b for _, b in decode)
    if p_total >= d_total:
        what = f"{prompts} prefill chunks" if prompts > 1 else "prefill chunk"
        return Workspace(f"{what} of {chunk} tokens at {engine.max_context} ctx", tuple(prefill))
    what = f"verify of {t} tokens" if t > 1 else "decode"
    return Workspace(f"{what} x {_slots(engine.slots)} at {engine.max_context} ctx", tuple(decode))


SNAPSHOT_POOL_MARGIN = 1 << 30  # left beside the largest step's workspace: the drafter, cuBLAS, fragmentation


def snapshot_pool_bytes(requested: int, memory: DeviceMemory | None, workspace: int | None,
                        margin: int = SNAPSHOT_POOL_MARGIN) -> tuple[int, str | None]:
    """The prefix cache's device pool that fits beside the compiled steps, measured after warm-up: at most the
    allocator's free bytes less the largest step's temporary allocation (`workspace`) and `margin`. Returns (bytes,
    why it was cut, or None). A pool sized from a plan, or given by hand, can be too large for the process's
    allocator: under XLA's VMM allocator (stable-scratch command buffers) the limit is 75% of the card whatever the
    plan assumed, and a pool grown into a step's workspace fails that step for every user. Unknown memory (CPU, no
    statistics) or workspace: the request stands."""
    if requested <= 0 or memory is None or workspace is None:
        return requested, None
    fits = max(0, memory.free - workspace - margin)
    if requested <= fits:
        return requested, None
    return fits, (f"prefix cache device pool cut from {requested / MIB:,.0f} to {fits / MIB:,.0f} MiB: the allocator "
                  f"has {memory.free / MIB:,.0f} MiB free after warm-up, the largest step needs "
                  f"{workspace / MIB:,.0f} MiB of workspace and {margin / MIB:,.0f} MiB stay spare")


def _format_name(quant: ExpertQuantization | None, dtype_name: str) -> str:
    if quant is None:
        return f"dense {dtype_name}"
    return f"1-bit, {quant.planes} plane{'s' if quant.planes > 1 else ''}, group {quant.group}"


def make_plan(
    cfg: ModelConfig,
    quant: ExpertQuantization | None,
    engine: EngineConfig,
    *,
    weights_dtype: str = "bfloat16",
    with_mtp: bool = False,
    vram_reserve_mib: int = DEFAULT_RESERVE_MIB,
    vram_budget_mib: int | None = None,
    device: DeviceMemory | None = None,
    suggest: bool = True,
) -> MemoryPlan:
    """Plans device memory for `cfg` served as `engine` (slots, max_context, cache_dtype, prefill chunks).

    quant: packed expert format (None: dense experts in `weights_dtype`). with_mtp: the checkpoint has an MTP
    module (its weights and KV cache are counted). The budget is `device.free` (see `device_memory`),
    `vram_budget_mib` (act as a smaller card), or the smaller of both; with neither, raises ValueError. When the
    minimum (dense weights + caches + workspace + reserve + top_k experts per MoE layer) does not fit, the plan
    has `fits=False` and `message` names the shortfall (with `suggest`, also a context or slot count that fits).
    """
    if vram_reserve_mib < 0:
        raise ValueError("--vram-reserve-mib must be >= 0")
    if vram_budget_mib is not None and vram_budget_mib <= 0:
        raise ValueError("--vram-budget-mib must be > 0")
    if weights_dtype not in ("bfloat16", "float32"):
        raise ValueError(f"weights dtype must be bfloat16 or float32, got {weights_dtype!r}")
    if device is None and vram_budget_mib is None:
        raise ValueError("this backend reports no device memory (CPU?): pass --vram-budget-mib")
    if vram_budget_mib is not None and (device is None or vram_budget_mib * MIB <= device.free):
        budget, budget_source = vram_budget_mib * MIB, f"--vram-budget-mib {vram_budget_mib}"
        if device is not None:
            budget_source += f" (device free {device.free / GIB:.2f} GiB)"
    else:
        budget, budget_source = device.free, f"device free memory ({device.source})"
        if vram_budget_mib is not None:
            budget_source += f"; --vram-budget-mib {vram_budget_mib} is more than that"
    reserve = vram_reserve_mib * MIB

    cache_dtype = engine.cache_dtype or weights_dtype
    kv_dtype = kv_dtype_of(cache_dtype)  # int8 / fp8: K and V quantized, the other caches in the weights' dtype
    w = _weights(cfg, quant, weights_dtype, with_mtp)
    cache = _cache_parts(cfg, engine.slots, engine.max_context,
                         jnp.dtype(weights_dtype if kv_dtype is not None else cache_dtype), with_mtp, kv_dtype)
    recurrent = sum(b for k, b in cache if k in ("GDN conv state", "GDN recurrent state (fp32)", "PLE conv state"))
    layer_slot = _largest_layer_bytes(cfg, engine.max_context,
                                      jnp.dtype(weights_dtype if kv_dtype is not None else cache_dtype), with_mtp,
                                      kv_dtype)
    workspace = _workspace(cfg, engine, jnp.dtype(weights_dtype).itemsize, layer_slot, recurrent)
    fixed = sum(b for _, b in w.dense) + sum(b for _, b in cache) + workspace.bytes
    top_k = min(cfg.num_experts_per_tok, cfg.num_experts)
    layer_bytes = w.expert_bytes * w.moe_layers  # one expert slot in every MoE layer
    room = budget - reserve - fixed
    gpu_experts = cfg.num_experts if layer_bytes == 0 else max(0, min(cfg.num_experts, room // layer_bytes))
    fits = room >= 0 and gpu_experts >= (top_k if layer_bytes else 0)
    plan = MemoryPlan(
        model=f"{cfg.family}, {cfg.num_layers} layers, {cfg.num_experts} experts/layer (top-{cfg.num_experts_per_tok})",
        expert_format=_format_name(quant, weights_dtype),
        weights_dtype=weights_dtype,
        cache_dtype=cache_dtype,
        slots=engine.slots,
        max_context=engine.max_context,
        dense=w.dense,
        cache=cache,
        workspace=workspace,
        reserve=reserve,
        budget=budget,
        budget_source=budget_source,
        device_total=device.limit if device is not None else None,
        moe_layers=w.moe_layers,
        num_experts=cfg.num_experts,
        top_k=top_k,
        expert_bytes=w.expert_bytes,
        gpu_experts=gpu_experts if fits else 0,
        fits=fits,
        message="",
    )
    message = _decision(plan) if fits else _refusal(plan)
    if not fits and suggest:
        message += _suggestion(cfg, quant, engine, plan, weights_dtype=weights_dtype, with_mtp=with_mtp,
                               vram_reserve_mib=vram_reserve_mib, vram_budget_mib=vram_budget_mib, device=device)
    return dataclasses.replace(plan, message=message)


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.1f} MiB"


def _slots(n: int) -> str:
    return f"{n} slot{'s' if n != 1 else ''}"


def _decision(p: MemoryPlan) -> str:
    spare = p.budget - p.device_bytes
    if p.moe_layers == 0:
        return f"fits: no routed experts; {_gib(spare)} of the budget unused"
    if p.gpu_experts == p.num_experts:
        return (f"fits: all {p.num_experts} experts of every MoE layer on the GPU ({_gib(p.gpu_expert_bytes)}); "
                f"{_gib(spare)} of the budget unused")
    share = 100.0 * p.gpu_experts / p.num_experts
    return (f"fits: {p.gpu_experts} of {p.num_experts} experts per MoE layer on the GPU ({share:.0f}%, "
            f"{_gib(p.gpu_expert_bytes)}); the other {p.num_experts - p.gpu_experts} per layer "
            f"({_gib(p.host_expert_bytes)}) stay in host RAM")


def _refusal(p: MemoryPlan) -> str:
    usable = p.budget - p.reserve
    need = p.fixed_bytes + p.min_expert_bytes
    parts = [f"dense weights {_gib(p.dense_bytes)}",
             f"caches {_gib(p.cache_bytes)} ({_slots(p.slots)} x {p.max_context} tokens)",
             f"workspace {_gib(p.workspace.bytes)} ({p.workspace.phase})"]
    if p.moe_layers:
        parts.append(f"minimum expert pool {_gib(p.min_expert_bytes)} ({p.top_k} of {p.num_experts} experts x "
                     f"{p.moe_layers} layers)")
    text = (f"does not fit: the budget {_gib(p.budget)} less the {_gib(p.reserve)} reserve leaves {_gib(usable)}, "
            f"but the minimum needs {_gib(need)}: {', '.join(parts)}; {_gib(need - usable)} short.")
    if p.dense_bytes + p.min_expert_bytes > usable:
        text += (f" The dense weights alone{' and the minimum expert pool' if p.moe_layers else ''} exceed it: "
                 "this model needs a larger card (or a smaller --vram-reserve-mib).")
    return text


def _suggestion(cfg, quant, engine: EngineConfig, p: MemoryPlan, **kw) -> str:
    """A shorter context (same slots), fewer slots (same context), or else one slot at a shorter context, that
    fits; empty when the dense weights alone do not."""
    if p.dense_bytes + p.min_expert_bytes > p.budget - p.reserve:
        return ""

    def fits(slots: int, ctx: int) -> bool:
        shape = dataclasses.replace(engine, slots=slots, max_context=ctx)
        return make_plan(cfg, quant, shape, suggest=False, **kw).fits

    def longest(slots: int) -> int | None:
        ctx = engine.max_context // 2
        while ctx >= 1024 and not fits(slots, ctx):
            ctx //= 2
        return ctx if ctx >= 1024 else None

    found = []
    ctx = longest(engine.slots)
    if ctx:
        found.append(f"--ctx {ctx} (at {_slots(engine.slots)})")
    slots = next((n for n in range(engine.slots - 1, 0, -1) if fits(n, engine.max_context)), None)
    if slots:
        found.append(f"--slots {slots} (at {engine.max_context} tokens)")
    if not found and engine.slots > 1 and (ctx := longest(1)):
        found.append(f"--slots 1 --ctx {ctx}")
    return f" Would fit: {' or '.join(found)}." if found else ""


@dataclasses.dataclass(frozen=True)
class ContextChoice:
    """The context per slot a server runs with: `tokens`; `source` "flag" (--ctx), "plan" (the largest the memory
    plan allows) or "default" (no device memory to plan with); `reason` says why, in words for the start-up log."""

    tokens: int
    source: str
    reason: str


def choose_context(
    requested: int | None,
    cfg: ModelConfig,
    quant: ExpertQuantization | None,
    engine: EngineConfig,
    *,
    weights_dtype: str = "bfloat16",
    with_mtp: bool = False,
    vram_reserve_mib: int = DEFAULT_RESERVE_MIB,
    vram_budget_mib: int | None = None,
    device: DeviceMemory | None = None,
) -> ContextChoice:
    """`serve`'s context per slot: `requested` (an explicit --ctx) as given; else, with no device memory and no
    budget (a CPU), CPU_CONTEXT; else the largest multiple of CONTEXT_STEP, from AGENT_CONTEXT up to the cap, that
    fits `engine.slots` slots without taking routed experts off the device (the device pool keeps the size it has
    at AGENT_CONTEXT: on a card that holds only part of the experts, more context would slow every decode step).
    The cap is the model's max_position_embeddings, at most MAX_DEFAULT_CONTEXT and at least AGENT_CONTEXT (an
    agent's first request must fit, even on a model trained on shorter text). When AGENT_CONTEXT does not fit, the
    largest context below it that does; when nothing fits, AGENT_CONTEXT (the plan then refuses, naming why)."""
    if requested is not None:
        return ContextChoice(requested, "flag", "--ctx")
    cap = min(MAX_DEFAULT_CONTEXT, max(cfg.max_position_embeddings, AGENT_CONTEXT)) // CONTEXT_STEP * CONTEXT_STEP
    if device is None and vram_budget_mib is None:
        return ContextChoice(min(CPU_CONTEXT, cap), "default",
                             "default without device memory statistics (CPU); --vram-budget-mib plans one")

    def plan(ctx: int) -> MemoryPlan:
        return make_plan(cfg, quant, dataclasses.replace(engine, max_context=ctx), weights_dtype=weights_dtype,
                         with_mtp=with_mtp, vram_reserve_mib=vram_reserve_mib, vram_budget_mib=vram_budget_mib,
                         device=device, suggest=False)

    def largest(lo: int, hi: int, ok) -> int:
        """The largest step count in [lo, hi] passing `ok` (monotonic), `ok(lo)` being known true."""
        if ok(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    floor = min(AGENT_CONTEXT, cap)
    base = plan(floor)
    step = CONTEXT_STEP
    if base.fits:
        keep = base.gpu_experts
        n = largest(floor // step, cap // step, lambda k: (p := plan(k * step)).fits and p.gpu_experts >= keep)
        pool = (f"all {keep} experts per MoE layer" if keep == base.num_experts else
                f"the device pool at {keep} of {base.num_experts} experts per MoE layer")
        bound = ("the cap: the model's max_position_embeddings" if cap == cfg.max_position_embeddings else
                 f"the cap of {cap}")
        why = f"{bound} (fits with {pool})" if n * step == cap else f"the largest that keeps {pool} on the device"
        return ContextChoice(n * step, "plan", f"plan: {why}")
    if not plan(step).fits:
        return ContextChoice(floor, "plan", "plan: nothing fits (see the refusal)")
    n = largest(1, floor // step - 1, lambda k: plan(k * step).fits)
    return ContextChoice(n * step, "plan", f"plan: the largest that fits; {floor} does not (fewer --slots leave "
                                           "room for more: coding agents send tens of thousands of tokens)")


# serve's prefill shapes when not given (the largest chunk, prompts per call), best first. H200, 20,000-token prompt
# (docs/PERF.md, "Prefill at agent-sized prompts", 2026-12-01): 4,096-token chunks 4.14 s against 6.07 s for 2,048;
# 4 users' 20,000-token prompts prefilled 4 at a time: TTFT p95 9.66 s against 12.71 one at a time.
GPU_PREFILL_CHOICES = ((4096, 4), (2048, 4), (2048, 1))
CPU_PREFILL = ((32, 256), 1)  # 2,048-token chunks hung XLA:CPU now and then (README, "Reliability")
SMALL_CHUNKS = (32, 256)  # short prompts and a long prompt's remainder


@dataclasses.dataclass(frozen=True)
class PrefillChoice:
    """serve's prefill shapes: chunk sizes, the most prompts per prefill call, and why (for the start-up log)."""

    chunks: tuple[int, ...]
    batch: int
    reason: str


def choose_prefill(
    requested_chunks: tuple[int, ...] | None,
    requested_batch: int | None,
    cfg: ModelConfig,
    quant: ExpertQuantization | None,
    engine: EngineConfig,
    *,
    weights_dtype: str = "bfloat16",
    with_mtp: bool = False,
    vram_reserve_mib: int = DEFAULT_RESERVE_MIB,
    vram_budget_mib: int | None = None,
    device: DeviceMemory | None = None,
) -> PrefillChoice:
    """`serve`'s prefill chunks and prompts per call where the flags do not give them: without device memory to plan
    with (a CPU), CPU_PREFILL; else the first of GPU_PREFILL_CHOICES whose workspace leaves the device expert pool
    as large as the smallest choice leaves it (a bigger chunk must not move experts to the host, which would slow
    every decode step) at `engine`'s slots and context."""
    if requested_chunks is not None and requested_batch is not None:
        return PrefillChoice(tuple(requested_chunks), requested_batch, "flags")
    if device is None and vram_budget_mib is None:
        chunks, batch = CPU_PREFILL
        return PrefillChoice(tuple(requested_chunks or chunks), requested_batch or batch,
                             "default without device memory statistics (CPU)")

    def plan(chunk: int, batch: int) -> MemoryPlan:
        chunks = requested_chunks or SMALL_CHUNKS + (chunk,)
        shaped = dataclasses.replace(engine, prefill_chunks=chunks, prefill_batch=requested_batch or batch)
        return make_plan(cfg, quant, shaped, weights_dtype=weights_dtype, with_mtp=with_mtp,
                         vram_reserve_mib=vram_reserve_mib, vram_budget_mib=vram_budget_mib, device=device,
                         suggest=False)

    base = plan(*GPU_PREFILL_CHOICES[-1])
    for chunk, batch in GPU_PREFILL_CHOICES:
        p = plan(chunk, batch)
        if p.fits and p.gpu_experts >= base.gpu_experts:
            chosen = requested_chunks or SMALL_CHUNKS + (chunk,)
            return PrefillChoice(tuple(chosen), requested_batch or batch,
                                 f"plan: the largest whose workspace ({_gib(p.workspace.bytes)}) keeps the device "
                                 "expert pool")
    chunk, batch = GPU_PREFILL_CHOICES[-1]
    return PrefillChoice(tuple(requested_chunks or SMALL_CHUNKS + (chunk,)), requested_batch or batch,
                         "plan: the smallest (nothing fits; see the plan)")


def allocator_env(plan: MemoryPlan) -> dict[str, str]:
    """Environment for JAX's GPU allocator that agrees with `plan`; set it before JAX initialises its backend.

    With the card's size known (`plan.device_total`): preallocate, with XLA_PYTHON_CLIENT_MEM_FRACTION = the
    plan's arena (budget less reserve) / the card. XLA caps its BFC pool at total x fraction whether or not it
    preallocates, so the default (0.75) would both waste a quarter of a 24 GB card and ignore the reserve. Taking
    the arena up front as one region keeps the plan's arithmetic true (the peak is the persistent arrays plus the
    largest workspace; a growing pool fragments into regions that never merge), stops other processes taking
    memory the plan counted on, and leaves exactly the reserve outside JAX for the CUDA context, cuBLAS/Triton
    workspaces and the driver. Rounded down, so the pool is never larger than planned.

    Without it (an explicit budget on a machine whose card we did not see): only XLA_PYTHON_CLIENT_PREALLOCATE=false,
    so JAX does not grab 75% of an unknown card; the planned sizes then bound what the engine allocates."""
    if plan.device_total:
        fraction = math.floor(plan.arena_bytes / plan.device_total * 1e6) / 1e6
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{fraction:.6f}"}
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def apply_env(env: dict[str, str], environ=os.environ) -> None:
    """Sets `env` (from `allocator_env` or PROBE_ENV). jax raises if both the current XLA_CLIENT_MEM_FRACTION and
    the deprecated XLA_PYTHON_CLIENT_MEM_FRACTION are set, so a fraction goes to whichever name is already in use."""
    for key, value in env.items():
        if key == "XLA_PYTHON_CLIENT_MEM_FRACTION" and "XLA_CLIENT_MEM_FRACTION" in environ:
            key = "XLA_CLIENT_MEM_FRACTION"
        environ[key] = value


def format_plan(plan: MemoryPlan) -> str:
    """The plan as a table: every component's bytes (MiB and GiB), where it lives, and the decision."""
    rows: list[tuple[str, str, int]] = []
    rows += [(f"dense: {name}", "GPU", b) for name, b in plan.dense]
    rows.append(("dense weights total", "GPU", plan.dense_bytes))
    rows += [(f"cache: {name}", "GPU", b) for name, b in plan.cache]
    rows.append((f"caches total ({_slots(plan.slots)} x {plan.max_context} tokens)", "GPU", plan.cache_bytes))
    rows += [(f"workspace: {name}", "GPU", b) for name, b in plan.workspace.terms]
    rows.append((f"workspace total ({plan.workspace.phase})", "GPU", plan.workspace.bytes))
    if plan.moe_layers:
        rows.append((f"routed experts: {plan.gpu_experts} of {plan.num_experts} x {plan.moe_layers} layers", "GPU",
                     plan.gpu_expert_bytes))
    rows.append(("reserve (kept free)", "GPU", plan.reserve))
    rows.append(("total planned on the GPU", "GPU", plan.device_bytes))
    rows.append(("budget", "GPU", plan.budget))
    if plan.moe_layers:
        host = plan.num_experts - plan.gpu_experts
        overflow = f"routed experts: {host} of {plan.num_experts} x {plan.moe_layers} layers"
        rows.append((overflow, "host", plan.host_expert_bytes))
    width = max(len(r[0]) for r in rows)
    head = [
        f"memory plan: {plan.model}",
        (f"  weights {plan.weights_dtype}, experts {plan.expert_format} ({plan.expert_bytes:,} B per expert, "
         f"{_gib(plan.all_expert_bytes)} in all), caches {plan.cache_dtype}"),
        f"  budget {_gib(plan.budget)} from {plan.budget_source}",
        "",
        f"  {'component':<{width}}  {'where':<5}  {'MiB':>10}  {'GiB':>7}",
    ]
    body = [f"  {name:<{width}}  {where:<5}  {b / MIB:>10.1f}  {b / GIB:>7.2f}" for name, where, b in rows]
    tail = ["", ("" if plan.fits else "REFUSED: ") + plan.message]
    if plan.fits:
        tail.append("allocator: " + " ".join(f"{k}={v}" for k, v in allocator_env(plan).items()))
    return "\n".join(head + body + tail)


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """How the experts a plan leaves off the device are served (`ExpertQuantization.host_path`), and why.

    host_path: "stream" (pinned host memory, copied into the step: `strata_jax.model.expert_stream`), "compute"
    (the host CPU computes them) or "none" (every expert fits). gpu_experts: the device pool per MoE layer, smaller
    than the plan's by the staging rows' room when streaming. copy_slots / prefill_copy_slots: staging rows per
    round of a decode (or verify) call and of a prompt chunk. staging_bytes: the largest call's transient staging
    on the device (one layer at a time). pinned_host_bytes: host memory the packed rows take (every expert of every
    MoE layer: placement promotes from them)."""

    host_path: str
    gpu_experts: int
    copy_slots: int
    prefill_copy_slots: int
    staging_bytes: int
    pinned_host_bytes: int
    reason: str


def _staging_bytes(row: int, num_experts: int, outside: int, decode_slots: int, prefill_slots: int,
                   merged: bool) -> int:
    """A layer's transient staging: the copied rows and their unpacked arrays; a merged prompt chunk also
    concatenates the pool and the staged experts into one stack."""
    return max(2 * decode_slots * row, (2 * prefill_slots + (num_experts if merged else 0)) * row)


def stream_plan(plan: MemoryPlan, engine: EngineConfig, backend: str | None, requested: str = "auto",
                copy_slots: int | None = None) -> StreamPlan:
    """Chooses streaming or host compute for the experts `plan` leaves in host RAM. `backend`: the device's
    (`jax.default_backend()`, from the probe); streaming needs a GPU (pinned host memory behind PCIe; on a CPU the
    "device" is host memory already, and the host kernel serves better). `requested`: "auto", "stream" or
    "compute" (--host-path). Streaming takes its staging rows' room out of the device pool."""
    if requested not in ("auto", "stream", "compute"):
        raise ValueError(f"host path must be auto, stream or compute, got {requested!r}")
    from strata_jax.model.expert_stream import stream_copy_slots

    e, pool, row = plan.num_experts, plan.gpu_experts, plan.expert_bytes
    pinned = e * row * plan.moe_layers
    if not plan.moe_layers or pool >= e or not plan.fits:
        return StreamPlan("none", pool, 0, 0, 0, 0, "every expert fits on the device: nothing to stream"
                          if plan.fits else "the plan does not fit")
    if requested == "compute":
        return StreamPlan("compute", pool, 0, 0, 0, 0, "--host-path compute")
    if requested == "auto" and backend != "gpu":
        return StreamPlan("compute", pool, 0, 0, 0, 0, f"the {backend or 'unknown'} backend has no PCIe between host "
                          "and device memory to stream over: the host CPU computes the experts outside the pool")
    window = engine.slots * (engine.draft_k + 1 if getattr(engine, "draft", "none") != "none" else 1)
    chunk_tokens = engine.chunk * max(engine.prefill_batches)
    layer_bytes = row * plan.moe_layers
    spare = plan.budget - plan.device_bytes

    def settle(chunk_cap: int | None) -> tuple[int, int, int, int]:
        """(pool, decode rows, chunk rows, staging bytes) once the staging's room is out of the pool."""
        streamed_pool = pool
        for _ in range(4):  # the staging grows as the pool shrinks
            slots = stream_copy_slots(window, plan.top_k, e, streamed_pool, copy_slots)
            chunk = stream_copy_slots(chunk_tokens, plan.top_k, e, streamed_pool, prefill_copy_slots=chunk_cap)
            merged = chunk_tokens * plan.top_k >= e and chunk == e - streamed_pool
            staging = _staging_bytes(row, e, e - streamed_pool, slots, chunk, merged)
            streamed_pool = pool - max(0, -(-(staging - spare) // layer_bytes))
        return streamed_pool, slots, chunk, staging

    # A prompt chunk stages every expert outside the pool in one round where that costs at most a quarter of the
    # pool; else fewer rows per round (more rounds per chunk: slower prompts, a larger pool for decode).
    for cap in (None, 256, 128, 64, 32, 16):
        streamed_pool, slots, chunk, staging = settle(cap)
        if streamed_pool >= max(1, pool - pool // 4):
            break
    if streamed_pool < 1:
        return StreamPlan("compute", pool, 0, 0, 0, 0, f"streaming's staging ({_gib(staging)} for a prompt chunk) "
                          "leaves no device pool: the host CPU computes the experts outside the pool")
    reason = (f"stream: {e - streamed_pool} of {e} experts per layer from pinned host memory ({_gib(pinned)} of host "
              f"RAM) over PCIe inside the step; staging {_gib(staging)} (decode: {slots} rows per round for "
              f"{window} tokens, prompt chunk: {chunk}) takes {pool - streamed_pool} experts per layer from the pool")
    return StreamPlan("stream", streamed_pool, slots, chunk, staging, pinned, reason)


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """The plan of each device of a mesh (strata_jax/engine/mesh.py): `plan` is one device's, every device the same
    (dense weights replicated, `slots / slot_shards` slots' caches, up to num_experts / expert_shards experts per
    MoE layer in its part of the pool, the reserve kept free on each). `gpu_experts` is the whole pool per layer
    (every device's part), what `load_model(gpu_experts=...)` takes."""

    plan: MemoryPlan
    devices: int
    expert_shards: int
    slot_shards: int

    @property
    def gpu_experts(self) -> int:
        return self.plan.gpu_experts * self.expert_shards

    @property
    def fits(self) -> bool:
        return self.plan.fits


def make_device_plan(cfg: ModelConfig, quant: ExpertQuantization | None, engine: EngineConfig, *, devices: int,
                     expert_shards: int, **kw) -> DevicePlan:
    """Plans one device of a `devices`-device mesh whose expert axis has `expert_shards` devices: `make_plan`'s
    arguments (`kw`: weights_dtype, with_mtp, vram_reserve_mib, vram_budget_mib, device), each device's budget and
    reserve being its own. Slots split over every device when they divide (else each device holds all of them);
    a prefill call runs on every device, so its workspace is the whole call's."""
    if devices < 1 or expert_shards < 1 or devices % expert_shards:
        raise ValueError(f"a mesh of {devices} devices cannot have {expert_shards} on its expert axis")
    if cfg.num_experts % expert_shards:
        raise ValueError(f"{cfg.num_experts} experts per layer do not split over {expert_shards} devices")
    slot_shards = devices if engine.slots % devices == 0 else 1
    local = dataclasses.replace(engine, slots=engine.slots // slot_shards,
                                prefill_batch=min(engine.prefill_batch, engine.slots // slot_shards))
    base = make_plan(cfg, quant, local, suggest=False, **kw)
    held = cfg.num_experts // expert_shards
    top_k = -(-min(cfg.num_experts_per_tok, cfg.num_experts) // expert_shards)
    layer_bytes = base.expert_bytes * base.moe_layers
    room = base.budget - base.reserve - base.fixed_bytes
    per_device = held if layer_bytes == 0 else max(0, min(held, room // layer_bytes))
    fits = room >= 0 and per_device >= (top_k if layer_bytes else 0)
    plan = dataclasses.replace(base, num_experts=held, top_k=top_k, gpu_experts=per_device if fits else 0,
                               fits=fits, model=f"{base.model}; one of {devices} devices")
    message = _decision(plan) if fits else _refusal(plan)
    return DevicePlan(dataclasses.replace(plan, message=f"per device: {message}"), devices, expert_shards, slot_shards)


def format_device_plan(dp: DevicePlan) -> str:
    """A mesh plan: what every device holds (`format_plan` of one device) and the totals."""
    p = dp.plan
    slots = (f"{p.slots} of the {p.slots * dp.slot_shards} slots" if dp.slot_shards > 1 else
             f"all {p.slots} slots (they do not split over {dp.devices} devices)")
    head = (f"mesh plan: {dp.devices} devices, experts split over {dp.expert_shards}; each device holds the dense "
            f"weights, {slots}, {p.gpu_experts} of its {p.num_experts} experts per MoE layer; "
            f"{dp.gpu_experts} of {p.num_experts * dp.expert_shards} per layer on the GPUs in all, "
            f"{_gib(p.device_bytes * dp.devices)} planned on {dp.devices} x {_gib(p.budget)}")
    return head + "\n" + format_plan(p)
