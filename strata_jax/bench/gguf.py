"""Loading a llama.cpp GGUF at real shapes (`python -m strata_jax.bench --mode gguf`).

Writes a random-weight GGUF of a preset's shapes (default flash-next-125b, strata_jax/bench/synthetic.py) with the
`gguf` package: arch `qwen4exp` with the metadata keys llama.cpp's qwen4exp loader reads, a synthetic byte-level
BPE vocabulary, routed experts in Q1_0 (llama.cpp's 1-bit type, our one-plane format), the other matrices BF16 and
norms / router / conv kernels F32. Tensors are generated and written one at a time (memory: the largest tensor,
the BF16 embedding, ~1.3 GB at Flash-Next shapes). Then it times `load_model` of the file, optionally converts it
to our own format (`quantize --from-gguf`) and times loading that directory, and measures decode tok/s through the
engine on the GGUF-loaded model (the users scenario's request loop, strata_jax/bench/users.py).
"""

from __future__ import annotations

import gc
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from strata_jax.bench.synthetic import preset_config
from strata_jax.model.config import ModelConfig

ARCH = "qwen4exp"
Q1_0_BLOCK, Q1_0_BYTES = 128, 18
# ChatML, as real Qwen GGUFs carry (without tools or thinking): the users scenario formats its prompts with it.
CHAT_TEMPLATE = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                 "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIALS = ("<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: name, numpy-order shape, storage type name (F32, BF16, Q1_0, Q8_0) and role
    (`strata_jax.weights.gguf_convert.gguf_layout`)."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    role: str

    @property
    def nbytes(self) -> int:
        n = math.prod(self.shape)
        if self.type_name == "F32":
            return 4 * n
        if self.type_name == "BF16":
            return 2 * n
        if self.type_name == "Q1_0":
            return n // Q1_0_BLOCK * Q1_0_BYTES
        if self.type_name == "Q8_0":
            return n // 32 * 34
        raise ValueError(self.type_name)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor a GGUF of `cfg` holds (the model's parameters mapped to llama.cpp's names and shapes), in the
    order of the model's parameters. Routed experts Q1_0 (Q8_0 where rows are not a multiple of 128, BF16 where
    not of 32), matrices BF16, routers / conv kernels / 1-D tensors F32."""
    from strata_jax.model.decoder import CausalLM
    from strata_jax.weights.gguf_convert import gguf_layout

    if cfg.family != "qwen4_exp":
        raise ValueError(f"the gguf bench writes qwen4exp files; preset family {cfg.family!r} is not supported")
    if cfg.ple_layers:
        raise ValueError("the gguf bench does not write PLE tables (no preset has one)")
    model = nnx.eval_shape(lambda: CausalLM(cfg, jnp.bfloat16, with_mtp=False))
    specs = []
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Param):
            continue
        ours = ".".join(str(p) for p in path)
        for name, shape, role in gguf_layout(cfg, ours, tuple(node.shape)):
            if role == "experts":
                k = shape[-1]
                kind = "Q1_0" if k % Q1_0_BLOCK == 0 else "Q8_0" if k % 32 == 0 else "BF16"
            elif role == "weight":
                kind = "BF16"
            else:
                kind = "F32"
            specs.append(TensorSpec(name, shape, kind, role))
    return specs


def _bf16_random(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """n bf16 weights (uint16 bits) straight from random bits, no float math: random sign and mantissa in the one
    octave [2^e, 2^(e+1)) with 2^e ~ std / 1.5 (rms ~ std; never NaN, Inf or subnormal)."""
    exponent = 127 + int(math.floor(math.log2(std / 1.5) + 0.5))
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16)
    bits &= np.uint16(0x807F)  # sign and mantissa
    bits |= np.uint16(exponent << 7)
    return bits


def _q1_0_random(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """n Q1_0 weights as raw blocks: random sign bits, fp16 scales std * U(0.75, 1.25) (|w| = d)."""
    blocks = rng.integers(0, 256, size=(n // Q1_0_BLOCK, Q1_0_BYTES), dtype=np.uint8)
    d = (std * rng.uniform(0.75, 1.25, size=blocks.shape[0])).astype(np.float16)
    blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def _q8_0_random(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n // 32, 34), dtype=np.uint8)
    blocks[:, :2] = np.full(n // 32, std * math.sqrt(3) / 127, np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def tensor_data(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """The bytes of one tensor (uint8 for block types, uint16 for BF16, float32): random weights of std
    1/sqrt(fan-in); gammas 1; ssm_a in [-16, -1]; other vectors small."""
    n = math.prod(spec.shape)
    std = 1.0 / math.sqrt(spec.shape[-1])
    if spec.type_name == "Q1_0":
        return _q1_0_random(rng, n, std)
    if spec.type_name == "Q8_0":
        return _q8_0_random(rng, n, std)
    if spec.type_name == "BF16":
        return _bf16_random(rng, n, std)
    if spec.role == "norm":
        x = np.ones(n, np.float32)
    elif spec.role == "ssm_a":
        x = -rng.uniform(1.0, 16.0, n).astype(np.float32)
    elif spec.role == "vector":
        x = rng.uniform(-4.0, -1.0, n).astype(np.float32)  # dt_bias: softplus of it is a small step
    elif spec.role == "conv":
        x = (rng.standard_normal(n, dtype=np.float32) * 0.5).astype(np.float32)
    else:
        x = rng.standard_normal(n, dtype=np.float32) * np.float32(std)
    return x.reshape(spec.shape)


def synthetic_vocab(size: int) -> tuple[list[str], list[int], list[str], int]:
    """A byte-level BPE vocabulary of `size` tokens (gpt2 byte-to-unicode alphabet, then merges one byte longer) ending
    with `SPECIALS` (control tokens). Returns (tokens, token types, merges, eos id = the `<|im_end|>` id)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    alphabet = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
    normal = size - len(SPECIALS)
    if normal < 256:
        raise ValueError(f"vocabulary of {size} is too small for 256 byte tokens and {len(SPECIALS)} specials")
    tokens, merges, level = list(alphabet), [], list(alphabet)
    while len(tokens) < normal:  # each level: the previous level's tokens, one byte longer
        longer = []
        for left in level:
            for right in alphabet:
                if len(tokens) == normal:
                    break
                tokens.append(left + right)
                merges.append(f"{left} {right}")
                longer.append(left + right)
        level = longer
    types = [1] * len(tokens) + [3] * len(SPECIALS)
    return tokens + list(SPECIALS), types, merges, normal


def _write_metadata(w, cfg: ModelConfig, specs: list[TensorSpec]) -> None:
    import gguf

    arr = gguf.GGUFValueType.ARRAY
    w.add_string("general.name", "strata-jax random qwen4exp")
    w.add_uint32("general.quantization_version", 2)
    u32 = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
           "block_count": cfg.num_layers, "feed_forward_length": cfg.shared_expert_intermediate_size,
           "expert_feed_forward_length": cfg.moe_intermediate_size,
           "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
           "expert_count": cfg.num_experts, "expert_used_count": cfg.num_experts_per_tok,
           "attention.head_count": cfg.num_heads, "attention.head_count_kv": cfg.num_kv_heads,
           "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
           "rope.dimension_count": cfg.rotary_dim, "ssm.conv_kernel": cfg.linear_conv_kernel,
           "ssm.state_size": cfg.linear_k_dim, "ssm.group_count": cfg.linear_num_k_heads,
           "ssm.time_step_rank": cfg.linear_num_v_heads, "ssm.inner_size": cfg.linear_v_dim * cfg.linear_num_v_heads,
           "full_attention_interval": _interval(cfg), "hyper_connection.count": cfg.hc_count,
           "hyper_connection.low_rank": cfg.hc_lowrank, "attention.indexer.head_count": cfg.indexer_n_heads,
           "attention.indexer.key_length": cfg.indexer_head_dim, "attention.indexer.top_k": cfg.indexer_budget}
    for key, value in u32.items():
        w.add_uint32(f"{ARCH}.{key}", int(value))
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(f"{ARCH}.rope.freq_base", cfg.rope_theta)
    pairs = cfg.rotary_dim // 2  # Qwen3.5-style multimodal rope sections, all text positions here
    first = round(pairs * 11 / 32)
    w.add_key_value(f"{ARCH}.rope.dimension_sections", [first, first, pairs - 2 * first, 0], arr,
                    sub_type=gguf.GGUFValueType.INT32)
    w.add_key_value(f"{ARCH}.attention.recurrent_layers", [t == "linear_attention" for t in cfg.layer_types], arr,
                    sub_type=gguf.GGUFValueType.BOOL)
    ratio = cfg.indexer_compress_ratio if cfg.indexer_n_heads else 0
    w.add_key_value(f"{ARCH}.attention.compress_ratios",
                    [ratio if t == "full_attention" else 0 for t in cfg.layer_types], arr,
                    sub_type=gguf.GGUFValueType.UINT32)
    tokens, types, merges, eos = synthetic_vocab(cfg.vocab_size)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_key_value("tokenizer.ggml.tokens", tokens, arr, sub_type=gguf.GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", types, arr, sub_type=gguf.GGUFValueType.INT32)
    w.add_key_value("tokenizer.ggml.merges", merges, arr, sub_type=gguf.GGUFValueType.STRING)
    w.add_string("tokenizer.chat_template", CHAT_TEMPLATE)
    w.add_uint32("tokenizer.ggml.eos_token_id", eos)
    w.add_uint32("tokenizer.ggml.padding_token_id", eos)


def _interval(cfg: ModelConfig) -> int:
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    return full[0] + 1 if full else cfg.num_layers + 1


def write_random_gguf(path: str | Path, cfg: ModelConfig, seed: int = 0, progress: bool = True) -> int:
    """Writes a random-weight qwen4exp GGUF of `cfg`'s shapes to `path`, one tensor at a time; returns its bytes."""
    import gguf

    path = Path(path)
    specs = tensor_specs(cfg)
    w = gguf.GGUFWriter(str(path), ARCH)
    _write_metadata(w, cfg, specs)
    for s in specs:
        qtype = gguf.GGMLQuantizationType[s.type_name]
        if s.type_name in ("Q1_0", "Q8_0"):
            byte_shape = (*s.shape[:-1], s.shape[-1] // (Q1_0_BLOCK if s.type_name == "Q1_0" else 32)
                          * (Q1_0_BYTES if s.type_name == "Q1_0" else 34))
            w.add_tensor_info(s.name, byte_shape, np.dtype(np.uint8), s.nbytes, raw_dtype=qtype)
        else:
            dtype = np.dtype(np.float32 if s.type_name == "F32" else np.uint16)
            w.add_tensor_info(s.name, s.shape, dtype, s.nbytes, raw_dtype=qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    started, written = time.monotonic(), 0
    for i, s in enumerate(specs):
        w.write_tensor_data(tensor_data(s, rng))
        written += s.nbytes
        if progress and (i % 50 == 49 or i == len(specs) - 1):
            print(f"gguf bench: wrote {i + 1}/{len(specs)} tensors, {written / 2**30:.1f} GiB "
                  f"({time.monotonic() - started:.0f}s)", flush=True)
    w.close()
    return path.stat().st_size


def _timed_load(path: Path, dtype: str):
    from strata_jax.loaded_model import load_model

    started = time.perf_counter()
    model = load_model(path, dtype=dtype)
    jax.block_until_ready(model.state)
    return model, time.perf_counter() - started


def _decode_rows(model, args, source: str) -> list[dict]:
    """Decode through the engine as the users mode does: per user count, per-user and aggregate tok/s."""
    from strata_jax.bench.users import run_all_users, user_prompts
    from strata_jax.engine import Engine, EngineConfig

    rows = []
    ctx = args.prompt_tokens + args.gen_tokens + 16
    for users in args.users:
        engine = Engine(model, EngineConfig(slots=users, max_context=ctx, prefill_chunks=args.prefill_chunks,
                                            prefix_cache_mib=0, draft="none"))
        engine.start()
        try:
            results, wall = run_all_users(engine, user_prompts(model, users, args.prompt_tokens), args.gen_tokens)
        finally:
            engine.shutdown()
        rows.append({"source": source, "users": users,
                     "per_user_tok_s": statistics.mean(r["decode_tok_s"] for r in results),
                     "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
                     "ttft_p50_s": sorted(r["ttft"] for r in results)[len(results) // 2]})
        print(f"decode ({source}), {users} user(s): {rows[-1]['per_user_tok_s']:.1f} tok/s per user, "
              f"{rows[-1]['aggregate_tok_s']:.1f} aggregate", flush=True)
    return rows


def run_gguf(args) -> list[dict]:
    """Write (or reuse) the GGUF, time its load, optionally convert + time our format's load, decode from it."""
    from strata_jax.weights.convert import convert_from_gguf

    cfg = preset_config(args.preset)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    workdir = Path(args.gguf_dir) if args.gguf_dir else Path(tempfile.mkdtemp(prefix="strata-gguf-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{args.preset}-q1_0.gguf"
    row: dict = {"preset": args.preset, "file": str(path), "dtype": args.dtype}
    try:
        if path.is_file() and args.gguf_reuse:
            print(f"gguf bench: reusing {path}", flush=True)
            row["write_s"] = None
        else:
            started = time.perf_counter()
            write_random_gguf(path, cfg, seed=0)
            row["write_s"] = time.perf_counter() - started
        row["file_gb"] = path.stat().st_size / 1e9
        model, row["load_gguf_s"] = _timed_load(path, args.dtype)
        row["gguf_report"] = model.gguf_report.lines() if model.gguf_report else []
        print(f"load_model({path.name}): {row['load_gguf_s']:.1f}s ({row['file_gb']:.1f} GB)", flush=True)
        decode = _decode_rows(model, args, "gguf") if not args.gguf_no_decode else []
        del model
        gc.collect()
        if not args.gguf_no_convert:
            out = workdir / f"{args.preset}-converted"
            started = time.perf_counter()
            convert_from_gguf(path, out, dtype=args.dtype)
            row["convert_s"] = time.perf_counter() - started
            row["converted_gb"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file()) / 1e9
            model, row["load_converted_s"] = _timed_load(out, args.dtype)
            print(f"load_model(converted directory): {row['load_converted_s']:.1f}s "
                  f"({row['converted_gb']:.1f} GB; convert {row['convert_s']:.0f}s)", flush=True)
            del model
            gc.collect()
            if not args.gguf_keep:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.gguf_keep and not args.gguf_reuse:
            path.unlink(missing_ok=True)
            if not args.gguf_dir:
                shutil.rmtree(workdir, ignore_errors=True)
    return [row, *decode]


def print_gguf_table(rows: list[dict]) -> None:
    head, decode = rows[0], rows[1:]
    print(f"\n{head['preset']}: random-weight GGUF (Q1_0 experts, BF16 dense), {head['file_gb']:.1f} GB, "
          f"{jax.devices()[0].device_kind}")
    print("\n| step | seconds | size GB |")
    print("|---|---|---|")
    if head.get("write_s") is not None:
        print(f"| write the GGUF (gguf package) | {head['write_s']:.1f} | {head['file_gb']:.1f} |")
    print(f"| load_model(GGUF) | {head['load_gguf_s']:.1f} | {head['file_gb']:.1f} |")
    if "load_converted_s" in head:
        print(f"| quantize --from-gguf (our format) | {head['convert_s']:.1f} | {head['converted_gb']:.1f} |")
        print(f"| load_model(converted directory) | {head['load_converted_s']:.1f} | {head['converted_gb']:.1f} |")
    if decode:
        print("\n| loaded from | users | tok/s per user | aggregate tok/s | TTFT p50 s |")
        print("|---|---|---|---|---|")
        for r in decode:
            print(f"| {r['source']} | {r['users']} | {r['per_user_tok_s']:.1f} | {r['aggregate_tok_s']:.1f} "
                  f"| {r['ttft_p50_s']:.2f} |")


def gguf_args(p) -> None:
    """The gguf mode's flags (it also reads --preset, --dtype, --users, --prompt-tokens, --gen-tokens,
    --prefill-chunks)."""
    g = p.add_argument_group("gguf mode")
    g.add_argument("--gguf-dir", default=None,
                   help="folder for the GGUF and the converted directory (default: a temporary folder, removed); "
                        "the full-size file is ~25 GB and the converted directory about as much")
    g.add_argument("--gguf-keep", action="store_true", help="keep the written files (default: removed at the end)")
    g.add_argument("--gguf-reuse", action="store_true",
                   help="reuse the GGUF already in --gguf-dir instead of writing it (and keep it)")
    g.add_argument("--gguf-no-convert", action="store_true",
                   help="skip converting to our format and timing its load")
    g.add_argument("--gguf-no-decode", action="store_true", help="skip the decode measurement")
