"""GGUF metadata -> `ModelConfig`, for llama.cpp's `qwen4exp` (Flash-Next) and `qwen3next` architectures.

The metadata is translated into the Hugging Face `config.json` fields that `ModelConfig.from_hf_dict` reads, so one
set of validation rules serves both sources. Facts llama.cpp fixes in code rather than in the file are stated here:
both architectures normalise the top-k router weights, qwen4exp's Gated DeltaNet output gate is a sigmoid and
qwen3next's a SiLU, and llama.cpp stores no MTP head for either (its qwen3next converter may: `nextn` tensors are
reported and ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata_jax.model.config import ConfigError, ModelConfig
from strata_jax.weights.gguf_reader import GGUFError, GGUFFile

ARCHITECTURES = {"qwen4exp": "qwen4_exp_text", "qwen3next": "qwen3_next"}


@dataclass(frozen=True)
class PleHash:
    """The PLE n-gram hash constants a GGUF stores explicitly (llama.cpp's `ple.*` keys)."""

    multipliers: tuple[int, ...]
    head_offsets: tuple[int, ...]
    head_vocab_sizes: tuple[int, ...]
    eos_token_id: int


def _opt(g: GGUFFile, arch: str, key: str, default: Any = None) -> Any:
    return g.get(f"{arch}.{key}", default)


def _need(g: GGUFFile, arch: str, key: str) -> Any:
    return g.need(f"{arch}.{key}")


def _layer_types(g: GGUFFile, arch: str, n_layers: int) -> list[str]:
    recurrent = _opt(g, arch, "attention.recurrent_layers")
    if recurrent is not None:
        if isinstance(recurrent, (int, bool)):
            recurrent = [bool(recurrent)] * n_layers
        if len(recurrent) < n_layers:
            raise GGUFError(f"{arch}.attention.recurrent_layers has {len(recurrent)} entries for {n_layers} layers")
        return ["linear_attention" if r else "full_attention" for r in recurrent[:n_layers]]
    interval = int(_opt(g, arch, "full_attention_interval", 4))
    if interval <= 0:
        raise GGUFError(f"{arch}.full_attention_interval must be positive, got {interval}")
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]


def hf_config_dict(g: GGUFFile) -> dict[str, Any]:
    """The Hugging Face config.json fields equivalent to the GGUF's metadata (text model only)."""
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{g.path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    n_layers = int(_need(g, arch, "block_count")) - mtp_layers(g)
    head_dim = int(_opt(g, arch, "attention.key_length") or 0)
    hidden = int(_need(g, arch, "embedding_length"))
    heads = int(_need(g, arch, "attention.head_count"))
    head_dim = head_dim or hidden // heads
    rot = int(_opt(g, arch, "rope.dimension_count", head_dim))
    v_heads = int(_need(g, arch, "ssm.time_step_rank"))
    vocab = _vocab_size(g)
    eos = g.get("tokenizer.ggml.eos_token_id")
    cfg: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(_need(g, arch, "attention.head_count_kv")),
        "head_dim": head_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(_opt(g, arch, "rope.freq_base", 10000.0)),
                            "partial_rotary_factor": rot / head_dim},
        "layer_types": _layer_types(g, arch, n_layers),
        "linear_num_key_heads": int(_need(g, arch, "ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_key_head_dim": int(_need(g, arch, "ssm.state_size")),
        "linear_value_head_dim": int(_need(g, arch, "ssm.inner_size")) // v_heads,
        "linear_conv_kernel_dim": int(_opt(g, arch, "ssm.conv_kernel", 4)),
        "num_experts": int(_need(g, arch, "expert_count")),
        "num_experts_per_tok": int(_need(g, arch, "expert_used_count")),
        "moe_intermediate_size": int(_need(g, arch, "expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(_opt(g, arch, "expert_shared_feed_forward_length", 0)),
        "intermediate_size": int(_opt(g, arch, "feed_forward_length", 0)),
        "norm_topk_prob": True,  # llama.cpp's build_moe_ffn(..., norm_w = true) for both architectures
        "rms_norm_eps": float(_opt(g, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in g,
        "max_position_embeddings": int(_opt(g, arch, "context_length", 32768)),
        "eos_token_id": int(eos) if eos is not None else None,
    }
    if arch == "qwen3next":
        cfg["mlp_only_layers"] = [i for i in range(n_layers)
                                  if f"blk.{i}.ffn_gate_inp.weight" not in g and f"blk.{i}.ffn_gate.weight" in g]
    else:
        _qwen4exp_fields(g, arch, n_layers, hidden, cfg)
    return cfg


def _qwen4exp_fields(g: GGUFFile, arch: str, n_layers: int, hidden: int, cfg: dict[str, Any]) -> None:
    ratios = _opt(g, arch, "attention.compress_ratios")
    ratios = [int(r) for r in ratios] if isinstance(ratios, list) else [int(ratios or 0)] * n_layers
    used = {r for r, t in zip(ratios, cfg["layer_types"]) if t == "full_attention" and r}
    if len(used) > 1:
        raise GGUFError(f"{g.path}: per-layer QSA compress ratios {sorted(used)} differ; strata_jax supports one")
    idx_heads = int(_opt(g, arch, "attention.indexer.head_count", 0))
    cfg.update({
        "output_gate_type": "sigmoid",  # llama.cpp qwen4exp: the GDN output gate is a sigmoid
        "hc_count": int(_need(g, arch, "hyper_connection.count")),
        "hc_lowrank": int(_need(g, arch, "hyper_connection.low_rank")),
        "indexer_n_heads": idx_heads if used else 0,
        "indexer_head_dim": int(_opt(g, arch, "attention.indexer.key_length", 0)),
        "indexer_budget": int(_opt(g, arch, "attention.indexer.top_k", 0)),
        "indexer_compress_ratio": used.pop() if used else 1,
        "indexer_kv_heads": 1,
    })
    layers = _opt(g, arch, "ple.layers")
    if layers:
        layers = [int(i) for i in (layers if isinstance(layers, list) else [layers])]
        ngram = int(_need(g, arch, "ple.ngram_size"))
        heads_per = int(_need(g, arch, "ple.heads_per_ngram"))
        row_dim = int(_need(g, arch, "embedding_length_per_layer_input"))
        cfg.update({
            "ple_layer_ids": [i + 1 for i in layers],  # HF counts PLE layers from 1
            "ngram_size": ngram,
            "heads_per_ngram": heads_per,
            "ple_conv_kernel_size": int(_need(g, arch, "ple.conv_kernel")),
            "ple_embed_dim": row_dim * (ngram - 1) * heads_per,
            # The hash constants come from the file (`ple_hash`); these only have to describe a valid config.
            "make_ngram_vocab_size_divisible_by": 1,
        })
        ple_eos = int(_need(g, arch, "ple.eos_token_id"))
        if cfg["eos_token_id"] is None or int(cfg["eos_token_id"]) != ple_eos:
            cfg["eos_token_id"] = [ple_eos] if cfg["eos_token_id"] is None else [ple_eos, int(cfg["eos_token_id"])]
    else:
        cfg["ple_layer_ids"] = []


def ple_hash(g: GGUFFile) -> PleHash | None:
    """The PLE hash constants stored in the file, or None for a model without PLE."""
    arch = g.architecture
    if not _opt(g, arch, "ple.layers"):
        return None
    return PleHash(
        multipliers=tuple(int(x) for x in _need(g, arch, "ple.layer_multipliers")),
        head_offsets=tuple(int(x) for x in _need(g, arch, "ple.head_offsets")),
        head_vocab_sizes=tuple(int(x) for x in _need(g, arch, "ple.head_vocab_sizes")),
        eos_token_id=int(_need(g, arch, "ple.eos_token_id")),
    )


def mtp_layers(g: GGUFFile) -> int:
    """MTP (`nextn`) layers the file appends after the decoder layers (llama.cpp's qwen3next converter writes them;
    strata_jax does not load them)."""
    return int(g.get(f"{g.architecture}.nextn_predict_layers", 0) or 0)


def _vocab_size(g: GGUFFile) -> int:
    tokens = g.get("tokenizer.ggml.tokens")
    if "token_embd.weight" in g:
        return int(g.info("token_embd.weight").shape[0])
    if tokens is None:
        raise GGUFError(f"{g.path} has neither token_embd.weight nor tokenizer.ggml.tokens")
    return len(tokens)


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    """The `ModelConfig` of a GGUF's text model. Raises GGUFError for unsupported or inconsistent metadata."""
    try:
        return ModelConfig.from_hf_dict(hf_config_dict(g))
    except ConfigError as e:
        raise GGUFError(f"{g.path}: {e}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{g.path}: bad metadata value: {e}") from e
