"""Model configuration: one frozen dataclass for every supported family, built from a HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# HF model_type -> our family name. Multimodal wrappers carry the text model in `text_config`.
_FAMILIES = {
    "qwen4_exp": "qwen4_exp",
    "qwen4_exp_text": "qwen4_exp",
    "qwen3_next": "qwen3_next",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}
_WRAPPERS = {"qwen4_exp", "qwen3_5_moe"}

LINEAR = "linear_attention"
ATTENTION = "full_attention"
# How a prefill chunk's attention runs (pallas_kernels.flash_prefill.PREFILL_IMPLS; kept equal by a test): "auto"
# (on a GPU, chunks with a QSA selection through the kernel that reads only each token's selected keys; plain chunks
# through cuDNN on Hopper GPUs; else the jnp form), "jnp", "pallas" (the flash-style kernel), "cudnn", "selected"
# (QSA chunks through the selected-keys kernel).
PREFILL_ATTENTION_IMPLS = ("auto", "jnp", "pallas", "cudnn", "selected")


class ConfigError(ValueError):
    """The checkpoint's config.json describes something we cannot run."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs to know about a checkpoint's architecture.

    Built with `ModelConfig.from_hf_dict` (or `load_config(dir)`); never mutated.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    # Gated full attention.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # Gated DeltaNet.
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_k_dim: int
    linear_v_dim: int
    linear_conv_kernel: int
    gdn_split_projections: bool  # qwen4_exp / qwen3_5: in_proj_qkv/z/b/a; qwen3_next: interleaved in_proj_qkvz/ba
    gdn_gate_act: str  # activation of the gated output norm: "silu" or "sigmoid"
    # Mixture of experts.
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    dense_mlp_layers: tuple[int, ...]  # qwen3_next layers with a plain MLP instead of MoE
    intermediate_size: int
    # Hyper-connections (hc_count == 0: plain pre-norm residual stream).
    hc_count: int
    hc_lowrank: int
    # QSA block indexer on attention layers (indexer_n_heads == 0: plain full attention).
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    # Hashed n-gram per-layer embedding (PLE); zero-indexed layers.
    ple_layers: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    ngram_vocab_divisor: int
    ngram_seed: int
    # Misc.
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    weight_prefix: str  # "model." or "model.language_model." (multimodal wrapper)
    # A serving choice, not the checkpoint's: the form of a prefill chunk's attention (`PREFILL_ATTENTION_IMPLS`,
    # pallas_kernels.flash_prefill.resolve_prefill_impl), set by `load_model(prefill_attention=...)`.
    prefill_attention_impl: str = "auto"

    def __post_init__(self):
        if self.prefill_attention_impl not in PREFILL_ATTENTION_IMPLS:
            raise ConfigError(f"prefill_attention_impl must be one of {', '.join(PREFILL_ATTENTION_IMPLS)}, got "
                              f"{self.prefill_attention_impl!r}")

    @property
    def qsa(self) -> bool:
        return self.indexer_n_heads > 0

    @property
    def hyper_connections(self) -> bool:
        return self.hc_count > 1

    @property
    def pad_eos_id(self) -> int:
        """The id PLE uses to pad n-gram context (the first eos id)."""
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    @property
    def ple_ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_conv_state_len(self) -> int:
        return (self.ple_conv_kernel - 1) * self.ngram_size

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Builds a config from the parsed `config.json` of a HF checkpoint."""
        model_type = raw.get("model_type")
        if model_type not in _FAMILIES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_FAMILIES))}"
            )
        family = _FAMILIES[model_type]
        prefix = "model."
        text = raw
        if model_type in _WRAPPERS:
            if "text_config" not in raw:
                raise ConfigError(f"model_type {model_type!r} needs a text_config")
            text = dict(raw["text_config"])
            prefix = "model.language_model."
        return _build(family, text, prefix, raw)

    def layer_is_linear(self, i: int) -> bool:
        return self.layer_types[i] == LINEAR


def _rope(text: dict[str, Any]) -> tuple[float, float]:
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"unsupported rope_type {rope_type!r}")
    return float(theta), float(factor)


def _layer_types(text: dict[str, Any], n: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        interval = text.get("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % interval else ATTENTION for i in range(n)]
    out = []
    for t in types:
        if t in ("full_attention", "indexed_attention", "attention"):
            out.append(ATTENTION)
        elif t == "linear_attention":
            out.append(LINEAR)
        else:
            raise ConfigError(f"unsupported layer type {t!r}")
    if len(out) != n:
        raise ConfigError(f"layer_types has {len(out)} entries for {n} layers")
    return tuple(out)


def _build(family: str, text: dict[str, Any], prefix: str, raw: dict[str, Any]) -> ModelConfig:
    def need(key: str) -> Any:
        if key not in text:
            raise ConfigError(f"config.json lacks {key!r}")
        return text[key]

    hidden = int(need("hidden_size"))
    n_layers = int(need("num_hidden_layers"))
    heads = int(need("num_attention_heads"))
    head_dim = int(text.get("head_dim") or hidden // heads)
    theta, factor = _rope(text)
    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    qwen4 = family == "qwen4_exp"
    ple_ids = sorted(set(text.get("ple_layer_ids") or [])) if qwen4 else []
    indexer_heads = int(text.get("indexer_n_heads") or 0) if qwen4 else 0
    if indexer_heads and int(text.get("indexer_kv_heads") or 1) != 1:
        raise ConfigError("the QSA indexer needs indexer_kv_heads == 1")
    if family == "qwen3_next":
        sparse_step = int(text.get("decoder_sparse_step", 1))
        mlp_only = set(text.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(n_layers) if i in mlp_only or (i + 1) % sparse_step != 0)
    else:
        dense = ()
    cfg = ModelConfig(
        family=family,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        num_layers=n_layers,
        layer_types=_layer_types(text, n_layers),
        num_heads=heads,
        num_kv_heads=int(need("num_key_value_heads")),
        head_dim=head_dim,
        rotary_dim=int(head_dim * factor),
        rope_theta=theta,
        linear_num_k_heads=int(need("linear_num_key_heads")),
        linear_num_v_heads=int(need("linear_num_value_heads")),
        linear_k_dim=int(need("linear_key_head_dim")),
        linear_v_dim=int(need("linear_value_head_dim")),
        linear_conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        gdn_split_projections=family != "qwen3_next",
        gdn_gate_act=(text.get("output_gate_type") or text.get("hidden_act", "silu")) if qwen4 else "silu",
        num_experts=int(need("num_experts")),
        num_experts_per_tok=int(need("num_experts_per_tok")),
        moe_intermediate_size=int(need("moe_intermediate_size")),
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        norm_topk_prob=bool(text.get("norm_topk_prob", True)),
        dense_mlp_layers=dense,
        intermediate_size=int(text.get("intermediate_size") or 0),
        hc_count=int(text.get("hc_count", 4)) if qwen4 else 0,
        hc_lowrank=int(text.get("hc_lowrank", 320)) if qwen4 else 0,
        indexer_n_heads=indexer_heads,
        indexer_head_dim=int(text.get("indexer_head_dim") or 0),
        indexer_budget=int(text.get("indexer_budget") or 0),
        indexer_compress_ratio=int(text.get("indexer_compress_ratio") or 1),
        ple_layers=tuple(i - 1 for i in ple_ids),
        ple_embed_dim=int(text.get("ple_embed_dim") or hidden),
        ple_conv_kernel=int(text.get("ple_conv_kernel_size", 4)),
        ngram_size=int(text.get("ngram_size", 3)),
        heads_per_ngram=int(text.get("heads_per_ngram", 8)),
        ngram_vocab_size_base=int(text.get("ngram_vocab_size_base", 20_000_000)),
        ngram_vocab_divisor=int(text.get("make_ngram_vocab_size_divisible_by", 128)),
        ngram_seed=int(text.get("seed", 1234)),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        weight_prefix=prefix,
    )
    _validate(cfg)
    return cfg


def _validate(cfg: ModelConfig) -> None:
    if cfg.gdn_gate_act not in ("silu", "sigmoid"):
        raise ConfigError(f"unsupported output gate activation {cfg.gdn_gate_act!r}")
    if cfg.family == "qwen4_exp" and cfg.hc_count <= 1:
        raise ConfigError(f"qwen4_exp needs hc_count > 1, got {cfg.hc_count}")
    if cfg.qsa:
        if cfg.indexer_budget % cfg.indexer_compress_ratio:
            raise ConfigError("indexer_budget must be divisible by indexer_compress_ratio")
        if cfg.rotary_dim > cfg.indexer_head_dim:
            raise ConfigError("the attention rotary dims must fit the QSA index head")
    for i in cfg.ple_layers:
        if not 0 <= i < cfg.num_layers or not cfg.layer_is_linear(i):
            raise ConfigError(f"PLE layer {i + 1} must be a linear_attention layer")
    if cfg.ple_layers:
        if cfg.ple_embed_dim % cfg.ple_ngram_heads:
            raise ConfigError("ple_embed_dim must be divisible by the number of n-gram heads")
        if not cfg.eos_token_ids:
            raise ConfigError("PLE needs eos_token_id")
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ConfigError("num_experts_per_tok must be in [1, num_experts]")


HOST_PATHS = ("compute", "stream")  # ExpertQuantization.host_path
STREAM_COPIES = ("auto", "slices", "pallas")  # ExpertQuantization.stream_copy (pallas_kernels.host_gather.IMPLS)
HOST_MEMORIES = ("auto", "pinned", "mapped")  # ExpertQuantization.host_memory


@dataclasses.dataclass(frozen=True)
class ExpertQuantization:
    """Routed experts as packed sign bit-planes (docs/FORMATS.md, "Packed expert format")."""

    planes: int = 1
    group: int = 128
    impl: str = "auto"  # kernel choice: auto | pallas | xla | reference (pallas_kernels.moe_experts_1bit)
    # Experts per MoE layer in the device pool (the planner's `gpu_experts`); the others are computed on the host
    # (strata_jax/host). None, or >= num_experts: every expert on the device (no host tier at all).
    gpu_experts: int | None = None
    # How experts outside the pool are served (docs/FORMATS.md, "Host tier"): "compute" (computed on the host CPU
    # from their packed bytes) or "stream" (kept in pinned host memory and copied into the step's staging rows on
    # the device: strata_jax/model/expert_stream.py). The planner chooses per device (`planner.stream_plan`).
    host_path: str = "compute"
    # Streaming only: staging rows per round for decode/verify calls (None: sized per call from its pairs and the
    # pool's share) and for prompt chunks (None: every expert outside the pool, one round).
    copy_slots: int | None = None
    prefill_copy_slots: int | None = None
    # Streaming only: how a layer's missing experts cross from host memory (pallas_kernels.host_gather): "slices"
    # (one copy per staging row), "pallas" (one kernel reading the host rows, dead rows skipped) or "auto".
    stream_copy: str = "auto"
    # Streaming only: where the rows live (strata_jax.model.expert_stream.to_host_memory): "pinned" (jax's
    # pinned_host memory kind), "mapped" (pinned host memory the GPU reads in place, handed to XLA as a device array:
    # strata_jax/model/host_mapped.py) or "auto".
    host_memory: str = "auto"

    def __post_init__(self):
        if self.gpu_experts is not None and self.gpu_experts < 1:
            raise ValueError(f"gpu_experts must be >= 1, got {self.gpu_experts}")
        if self.host_path not in HOST_PATHS:
            raise ValueError(f"host_path must be one of {', '.join(HOST_PATHS)}, got {self.host_path!r}")
        if self.stream_copy not in STREAM_COPIES:
            raise ValueError(f"stream_copy must be one of {', '.join(STREAM_COPIES)}, got {self.stream_copy!r}")
        if self.host_memory not in HOST_MEMORIES:
            raise ValueError(f"host_memory must be one of {', '.join(HOST_MEMORIES)}, got {self.host_memory!r}")
        for name in ("copy_slots", "prefill_copy_slots"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.planes <= 4:
            raise ValueError(f"planes must be 1..4, got {self.planes}")
        if self.group not in (64, 128, 256):
            raise ValueError(f"group must be 64, 128 or 256, got {self.group}")


def load_config(path: str | Path) -> ModelConfig:
    """Reads `<path>/config.json` and returns its `ModelConfig`."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON: {e}") from e
    return ModelConfig.from_hf_dict(raw)
