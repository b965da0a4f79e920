"""GGUF tensors -> our parameters: the inverse of llama.cpp's converter (convert_hf_to_gguf.py, conversion/qwen*.py).

Our modules use the Hugging Face names, so each parameter is rebuilt as the HF tensor it was converted from:

* names: `token_embd` <- `model.embed_tokens`, `blk.{i}.attn_qkv` <- `...linear_attn.in_proj_qkv`, ... (`_DIRECT`);
* RMSNorm gammas stored as ``1 + w`` (every ``*norm.weight`` except the Gated DeltaNet's ``linear_attn.norm``, and
  the indexer / PLE norms) get the 1 taken off again;
* ``ssm_a = -exp(A_log)`` -> ``A_log = log(-ssm_a)``; conv kernels get their middle axis back;
* qwen4exp (Qwen3.5-style GDN) stores the value heads "tiled" (``[G0v0, G1v0, ..., G0v1, ...]``) where HF groups
  them by key head (``[G0v0, G0v1, ..., G1v0, ...]``): undone on ``in_proj_qkv`` (v rows), ``in_proj_z``,
  ``in_proj_a/b``, ``A_log``, ``dt_bias``, the conv's v channels and ``out_proj``'s columns;
* qwen3next splits the interleaved ``in_proj_qkvz`` into ``attn_qkv`` + ``attn_gate``: re-interleaved here;
* the QSA indexer's ``index_qk_proj`` is split into ``indexer.q_proj`` / ``indexer.k_proj``: concatenated back;
* routed experts are stacked ``ffn_{gate,up,down}_exps`` ``[E, out, in]``: gate and up are concatenated into our
  ``gate_up_proj``.

Routed experts in a sign-plane type are not dequantized (`expert_planes`): ``Q1_0`` is our one-plane format with the
bits in the same order (only the layout differs: Q1_0 is row-major blocks, we keep outputs fastest), and a ternary
weight ``t * d`` (``TQ1_0``, ``TQ2_0``) is exactly two sign planes at scale ``d / 2`` (``t = (s1 + s2) / 2``). The
only rounding is of the fp16 block scale to our bf16 scales (relative error <= 2^-8 per group).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from pallas_kernels.onebit_format import BF16, PackedExperts
from strata_jax.model.config import ModelConfig
from strata_jax.weights.gguf_reader import GGUFError, GGUFFile, QType, TensorInfo, dequantize_tensor, q1_0_blocks

# Our parameter path (after "model." / "model.language_model."; {i} = layer) -> GGUF name, for plain copies.
_DIRECT = {
    "embed_tokens.weight": "token_embd.weight",
    "hyper_connection_mixer.input_mix_weight_down.weight": "output_hc_down.weight",
    "hyper_connection_mixer.input_mix_weight_up.weight": "output_hc_up.weight",
    "layers.{i}.attn_hyper_connection.input_mix_weight_down.weight": "blk.{i}.hc_attn_down.weight",
    "layers.{i}.attn_hyper_connection.input_mix_weight_up.weight": "blk.{i}.hc_attn_up.weight",
    "layers.{i}.attn_hyper_connection.block_inject_weight.weight": "blk.{i}.hc_attn_inject.weight",
    "layers.{i}.mlp_hyper_connection.input_mix_weight_down.weight": "blk.{i}.hc_ffn_down.weight",
    "layers.{i}.mlp_hyper_connection.input_mix_weight_up.weight": "blk.{i}.hc_ffn_up.weight",
    "layers.{i}.mlp_hyper_connection.block_inject_weight.weight": "blk.{i}.hc_ffn_inject.weight",
    "layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.linear_attn.norm.weight": "blk.{i}.ssm_norm.weight",
    "layers.{i}.linear_attn.in_proj_ba.weight": "blk.{i}.ssm_ba.weight",
    "layers.{i}.mlp.gate.weight": "blk.{i}.ffn_gate_inp.weight",
    "layers.{i}.mlp.shared_expert.gate_proj.weight": "blk.{i}.ffn_gate_shexp.weight",
    "layers.{i}.mlp.shared_expert.up_proj.weight": "blk.{i}.ffn_up_shexp.weight",
    "layers.{i}.mlp.shared_expert.down_proj.weight": "blk.{i}.ffn_down_shexp.weight",
    "layers.{i}.mlp.shared_expert_gate.weight": "blk.{i}.ffn_gate_inp_shexp.weight",
    "layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
    "layers.{i}.ple.key_proj.weight": "blk.{i}.ple_key.weight",
    "layers.{i}.ple.value_proj.weight": "blk.{i}.ple_value.weight",
    "layers.{i}.ple.conv1d.weight": "blk.{i}.ple_conv1d.weight",
}
# Gammas the converter stored as 1 + w.
_PLUS_ONE = {
    "norm.weight": "output_norm.weight",
    "hyper_connection_mixer.hc_norm.weight": "output_hc_norm.weight",
    "layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "layers.{i}.attn_hyper_connection.hc_norm.weight": "blk.{i}.hc_attn_norm.weight",
    "layers.{i}.mlp_hyper_connection.hc_norm.weight": "blk.{i}.hc_ffn_norm.weight",
    "layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.self_attn.indexer.q_layernorm.weight": "blk.{i}.indexer.q_norm.weight",
    "layers.{i}.self_attn.indexer.k_layernorm.weight": "blk.{i}.indexer.k_norm.weight",
    "layers.{i}.ple.norm_key.weight": "blk.{i}.ple_norm_key.weight",
    "layers.{i}.ple.norm_query.weight": "blk.{i}.ple_norm_query.weight",
    "layers.{i}.ple.norm_conv.weight": "blk.{i}.ple_norm_conv.weight",
}
# Gated DeltaNet tensors whose value heads qwen4exp stores tiled: (GGUF name, axis, which part of the axis).
_V_TILED = {
    "layers.{i}.linear_attn.in_proj_qkv.weight": ("blk.{i}.attn_qkv.weight", 0, "v_after_qk"),
    "layers.{i}.linear_attn.in_proj_z.weight": ("blk.{i}.attn_gate.weight", 0, "v"),
    "layers.{i}.linear_attn.in_proj_b.weight": ("blk.{i}.ssm_beta.weight", 0, "head"),
    "layers.{i}.linear_attn.in_proj_a.weight": ("blk.{i}.ssm_alpha.weight", 0, "head"),
    "layers.{i}.linear_attn.dt_bias": ("blk.{i}.ssm_dt.bias", 0, "head"),
    "layers.{i}.linear_attn.A_log": ("blk.{i}.ssm_a", 0, "head"),
    "layers.{i}.linear_attn.conv1d.weight": ("blk.{i}.ssm_conv1d.weight", 0, "v_after_qk"),
    "layers.{i}.linear_attn.out_proj.weight": ("blk.{i}.ssm_out.weight", 1, "v"),
}
_LAYER = re.compile(r"^layers\.(\d+)\.")


def _template(rel: str) -> tuple[str, int | None]:
    m = _LAYER.match(rel)
    if not m:
        return rel, None
    return "layers.{i}." + rel[m.end():], int(m.group(1))


def _strip_prefix(cfg: ModelConfig, ours: str) -> str:
    if ours.startswith("model."):
        return ours[len("model."):]
    return ours


def _untile_v(x: np.ndarray, axis: int, cfg: ModelConfig, part: str) -> np.ndarray:
    """Undo the converter's grouped -> tiled reordering of value heads along `axis`."""
    nk, nv = cfg.linear_num_k_heads, cfg.linear_num_v_heads
    if nk == nv or nk == 0:
        return x
    r = nv // nk
    x = np.moveaxis(x, axis, 0)
    if part == "v_after_qk":
        qk = 2 * nk * cfg.linear_k_dim
        head, v = x[:qk], x[qk:]
    else:
        head, v = x[:0], x
    hd = v.shape[0] // nv
    rest = v.shape[1:]
    v = v.reshape(r, nk, hd, *rest).swapaxes(0, 1).reshape(nv * hd, *rest)  # tiled [r, nk] -> grouped [nk, r]
    return np.moveaxis(np.concatenate([head, v], axis=0), 0, axis)


def _qkvz(g: GGUFFile, cfg: ModelConfig, i: int) -> np.ndarray:
    """qwen3next: re-interleave attn_qkv [q*nk | k*nk | v*nk] + attn_gate [z*nk] into in_proj_qkvz's per-key-head
    [q k v z] rows."""
    qkv = dequantize_tensor(g.info(f"blk.{i}.attn_qkv.weight"))
    z = dequantize_tensor(g.info(f"blk.{i}.attn_gate.weight"))
    nk, dk = cfg.linear_num_k_heads, cfg.linear_k_dim
    vh = cfg.linear_num_v_heads // nk * cfg.linear_v_dim
    h = qkv.shape[1]
    q = qkv[: nk * dk].reshape(nk, dk, h)
    k = qkv[nk * dk : 2 * nk * dk].reshape(nk, dk, h)
    v = qkv[2 * nk * dk :].reshape(nk, vh, h)
    return np.concatenate([q, k, v, z.reshape(nk, vh, h)], axis=1).reshape(-1, h)


def read_dense(g: GGUFFile, cfg: ModelConfig, ours: str, shape: tuple[int, ...]) -> np.ndarray:
    """One non-expert parameter (our path, e.g. ``model.layers.0.linear_attn.A_log``) as float32 of `shape`."""
    rel = _strip_prefix(cfg, ours)
    tmpl, i = _template(rel)

    def name(t: str) -> str:
        return t.format(i=i)

    if ours == "lm_head.weight":
        arr = dequantize_tensor(g.info("output.weight" if "output.weight" in g else "token_embd.weight"))
    elif tmpl in _DIRECT:
        arr = dequantize_tensor(g.info(name(_DIRECT[tmpl])))
    elif tmpl in _PLUS_ONE:
        arr = dequantize_tensor(g.info(name(_PLUS_ONE[tmpl]))) - np.float32(1.0)
    elif tmpl == "layers.{i}.linear_attn.in_proj_qkvz.weight":
        arr = _qkvz(g, cfg, i)
    elif tmpl in _V_TILED:
        src, axis, part = _V_TILED[tmpl]
        arr = dequantize_tensor(g.info(name(src)))
        if tmpl.endswith("A_log"):
            with np.errstate(divide="ignore", invalid="ignore"):
                arr = np.log(-arr.astype(np.float64)).astype(np.float32)
        if tmpl.endswith("conv1d.weight"):
            arr = arr.reshape(arr.shape[0], -1)  # [channels, kernel]
        if cfg.family == "qwen4_exp":
            arr = _untile_v(arr, axis, cfg, part)
    elif tmpl == "layers.{i}.self_attn.indexer.index_qk_proj.weight":
        q = dequantize_tensor(g.info(name("blk.{i}.indexer.q_proj.weight")))
        k = dequantize_tensor(g.info(name("blk.{i}.indexer.k_proj.weight")))
        arr = np.concatenate([q, k], axis=0)
    else:
        raise GGUFError(f"{g.path}: no GGUF tensor is known for parameter {ours!r}")
    if arr.size != int(np.prod(shape)):
        raise GGUFError(f"{g.path}: tensor for {ours!r} has shape {arr.shape}, the metadata implies {tuple(shape)}")
    return arr.reshape(shape)


def gguf_layout(cfg: ModelConfig, ours: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str]]:
    """The GGUF tensors llama.cpp's converter writes for our parameter `ours` (a path as `read_dense` takes it, or
    ``...mlp.experts.gate_up_proj`` / ``down_proj``), as (name, numpy shape, role): the inverse of `read_dense`'s
    naming, for writing GGUF files (strata_jax/bench/gguf.py). role: "weight" (a matrix), "experts" (a routed
    expert stack), "router" (kept F32 by llama.cpp), "conv" (F32), "norm" (a gamma, ~1), "ssm_a" (negative: it is
    -exp(A_log)), "vector" (other 1-D tensors). The qwen3next-only fused ``in_proj_qkvz`` is not covered."""
    rel = _strip_prefix(cfg, ours)
    tmpl, i = _template(rel)
    one_d = (int(np.prod(shape)),)
    if ours == "lm_head.weight":
        return [("output.weight", tuple(shape), "weight")]
    if tmpl == "layers.{i}.mlp.experts.gate_up_proj":
        e, two_i, h = shape
        return [(f"blk.{i}.ffn_{k}_exps.weight", (e, two_i // 2, h), "experts") for k in ("gate", "up")]
    if tmpl == "layers.{i}.mlp.experts.down_proj":
        return [(f"blk.{i}.ffn_down_exps.weight", tuple(shape), "experts")]
    if tmpl == "layers.{i}.self_attn.indexer.index_qk_proj.weight":
        q = cfg.indexer_n_heads * cfg.indexer_head_dim
        return [(f"blk.{i}.indexer.q_proj.weight", (q, shape[1]), "weight"),
                (f"blk.{i}.indexer.k_proj.weight", (shape[0] - q, shape[1]), "weight")]
    if tmpl in _PLUS_ONE or tmpl == "layers.{i}.linear_attn.norm.weight":
        name = (_PLUS_ONE.get(tmpl) or _DIRECT[tmpl]).format(i=i)
        return [(name, one_d if len(shape) == 1 else tuple(shape), "norm")]
    if tmpl in _V_TILED:
        name = _V_TILED[tmpl][0].format(i=i)
        if tmpl.endswith("A_log"):
            return [(name, one_d, "ssm_a")]
        if tmpl.endswith("conv1d.weight"):
            return [(name, (shape[0], int(np.prod(shape[1:]))), "conv")]
        return [(name, tuple(shape), "vector" if len(shape) == 1 else "weight")]
    if tmpl in _DIRECT:
        name = _DIRECT[tmpl].format(i=i)
        if tmpl.endswith("shared_expert_gate.weight"):
            return [(name, one_d, "router")]
        if tmpl.endswith("mlp.gate.weight"):
            return [(name, tuple(shape), "router")]
        if tmpl.endswith("conv1d.weight"):
            return [(name, (shape[0], int(np.prod(shape[1:]))), "conv")]
        return [(name, tuple(shape), "vector" if len(shape) == 1 else "weight")]
    raise GGUFError(f"no GGUF tensor is known for parameter {ours!r}")


# -- routed experts -------------------------------------------------------------------------------------------------
# Types that are exactly sign planes: (planes, group) of their native representation.
EXACT_PLANES = {QType.Q1_0: (1, 128), QType.TQ1_0: (2, 256), QType.TQ2_0: (2, 256)}
# Low-bit types that are not sign planes (grids, offsets or 16/32-weight sub-blocks): dequantized and re-packed into
# this many planes.
REPACK_PLANES = {QType.IQ1_S: 2, QType.IQ1_M: 2, QType.Q2_K: 2, QType.IQ2_XXS: 2, QType.IQ2_XS: 2, QType.IQ2_S: 2}
_TERNARY_D_OFFSET = {QType.TQ1_0: 52, QType.TQ2_0: 64}  # byte offset of the fp16 d in the 54 / 66-byte block


@dataclass(frozen=True)
class ExpertTensors:
    """One MoE layer's routed expert tensors in the file: gate_up ([E, 2I, H]) as one or two tensors, and down."""

    gate_up: tuple[TensorInfo, ...]
    down: TensorInfo

    @property
    def all(self) -> tuple[TensorInfo, ...]:
        return (*self.gate_up, self.down)


def expert_tensors(g: GGUFFile, layer: int) -> ExpertTensors:
    fused = f"blk.{layer}.ffn_gate_up_exps.weight"
    if fused in g:
        gate_up = (g.info(fused),)
    else:
        gate_up = (g.info(f"blk.{layer}.ffn_gate_exps.weight"), g.info(f"blk.{layer}.ffn_up_exps.weight"))
    return ExpertTensors(gate_up, g.info(f"blk.{layer}.ffn_down_exps.weight"))


def check_expert_shapes(g: GGUFFile, cfg: ModelConfig, layer: int, ex: ExpertTensors) -> None:
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want_gu = [(e, 2 * i, h)] if len(ex.gate_up) == 1 else [(e, i, h), (e, i, h)]
    for t, want in [*zip(ex.gate_up, want_gu), (ex.down, (e, h, i))]:
        if tuple(t.shape) != want:
            raise GGUFError(f"{g.path}: tensor {t.name!r} has shape {t.shape}, the metadata implies {want} "
                            f"(expert_count {e}, expert_feed_forward_length {i}, embedding_length {h})")


def native_planes(t: TensorInfo) -> tuple[int, int] | None:
    """(planes, group) in which tensor `t` is exactly representable, or None if it is not a sign-plane type."""
    if t.type not in EXACT_PLANES:
        return None
    planes, group = EXACT_PLANES[t.type]
    if t.shape[-1] % group:
        return None
    return planes, group


def _blocks(t: TensorInfo, block_bytes: int) -> np.ndarray:
    raw = np.asarray(t.raw, np.uint8)
    return raw.reshape(*t.shape[:-1], -1, block_bytes)


def exact_planes(t: TensorInfo) -> PackedExperts:
    """A sign-plane tensor [E, N, K] as packed planes in its native (planes, group), bits copied, no requantization."""
    e, n, k = t.shape
    if t.type == QType.Q1_0:
        d, qs = q1_0_blocks(np.asarray(t.raw))  # d [E, N, K/128], qs [E, N, K/128, 16]
        words = np.ascontiguousarray(qs).view("<u4").reshape(e, n, k // 32)  # Q1_0 bytes are our words' bytes
        bits = np.ascontiguousarray(words.transpose(0, 2, 1))[:, None].astype(np.uint32, copy=False)
        scales = d.astype(np.float32).transpose(0, 2, 1)[:, None].astype(BF16)
        return PackedExperts(bits, np.ascontiguousarray(scales), 128)
    # Ternary: t * d = (s1 + s2) / 2 * d with s1 = +1 where t >= 0, s2 = +1 where t > 0.
    _, block_bytes = (256, 54) if t.type == QType.TQ1_0 else (256, 66)
    blocks = _blocks(t, block_bytes)
    off = _TERNARY_D_OFFSET[t.type]
    d = np.ascontiguousarray(blocks[..., off : off + 2]).view(np.float16)[..., 0].astype(np.float32)  # [E, N, K/256]
    w = dequantize_tensor(t).reshape(e, n, k // 256, 256)
    with np.errstate(divide="ignore", invalid="ignore"):
        ternary = np.where(d[..., None] != 0, np.rint(w / d[..., None]), 0.0).reshape(e, n, k)
    from pallas_kernels.onebit_format import pack_signs

    bits = np.stack([pack_signs(ternary >= 0), pack_signs(ternary > 0)], axis=1)  # [E, 2, K/32, N]
    half = (d * 0.5).transpose(0, 2, 1).astype(BF16)  # [E, K/256, N]
    return PackedExperts(bits, np.ascontiguousarray(np.stack([half, half], axis=1)), 256)


def lift(p: PackedExperts, planes: int, group: int) -> PackedExperts:
    """The same weights in more planes and/or a finer group, exactly: a plane is split into two copies at half scale
    (halving a bf16 is exact), a group's scale is repeated over its sub-groups."""
    if planes < p.planes or p.group % group:
        raise ValueError(f"cannot lift ({p.planes} planes, group {p.group}) to ({planes}, {group})")
    bits, scales = p.bits, p.scales
    while bits.shape[1] < planes:
        # split the plane with the largest scales in two halves
        peak = np.abs(scales.astype(np.float32)).reshape(scales.shape[0], scales.shape[1], -1).max(-1).max(0)
        j = int(np.argmax(peak))
        half = (scales[:, j : j + 1].astype(np.float32) * 0.5).astype(BF16)
        scales = np.concatenate([scales[:, :j], half, half, scales[:, j + 1 :]], axis=1)
        bits = np.concatenate([bits[:, :j], bits[:, j : j + 1], bits[:, j:]], axis=1)
    if group != p.group:
        k = p.in_features
        scales = np.repeat(scales, p.group // group, axis=2)[:, :, : -(-k // group)]
    return PackedExperts(np.ascontiguousarray(bits), np.ascontiguousarray(scales), group)


def concat_outputs(parts: list[PackedExperts]) -> PackedExperts:
    """Stack packed tensors along the output axis (gate rows, then up rows)."""
    if len(parts) == 1:
        return parts[0]
    return PackedExperts(np.concatenate([p.bits for p in parts], axis=-1),
                         np.concatenate([p.scales for p in parts], axis=-1), parts[0].group)


def relative_error(w: np.ndarray, approx: np.ndarray) -> float:
    w64 = np.asarray(w, np.float64)
    num = float(((w64 - np.asarray(approx, np.float64)) ** 2).sum())
    den = float((w64**2).sum())
    return float(np.sqrt(num / den)) if den > 0 else 0.0


def scale_rounding_error(t: TensorInfo, packed: PackedExperts) -> float:
    """Relative error of an exactly mapped tensor (`exact_planes`), which comes only from rounding its fp16 block
    scales to bf16. For Q1_0 every weight of a block is +-d, so the error follows from the scales alone:
    sqrt(sum (d - bf16(d))^2 / sum d^2) over the blocks, without dequantizing the tensor (a full-size expert stack
    is ~1e9 weights). Ternary types weigh each block by its non-zero count: computed from the dequantized tensor."""
    if t.type == QType.Q1_0:
        d, _ = q1_0_blocks(np.asarray(t.raw))  # [E, N, K/128]
        d = d.astype(np.float64)
        ours = packed.scales[:, 0].astype(np.float64).transpose(0, 2, 1)  # [E, K/128, N] -> [E, N, K/128]
        den = float((d * d).sum())
        return float(np.sqrt(((d - ours) ** 2).sum() / den)) if den > 0 else 0.0
    from strata_jax.weights.onebit import dequantize_experts

    return relative_error(dequantize_tensor(t), dequantize_experts(packed))

