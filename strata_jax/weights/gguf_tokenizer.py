"""Our `Tokenizer` from a GGUF's own tokenizer metadata (`tokenizer.ggml.*` + `tokenizer.chat_template`).

llama.cpp stores a byte-level BPE ("gpt2" model) as its token strings, merges and token types, and names the
pre-tokenizer (`tokenizer.ggml.pre`). That is turned back into the `tokenizer.json` + `tokenizer_config.json` pair
Hugging Face would have shipped (control tokens as special added tokens, user-defined ones as plain added tokens,
the pre-tokenizer's split regex as in llama.cpp's llama-vocab.cpp), written to a temporary directory and loaded by
`strata_jax.tokenizer.Tokenizer`. No tokenizer.json is needed beside the GGUF.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from strata_jax.tokenizer import Tokenizer
from strata_jax.weights.gguf_reader import GGUFError, GGUFFile

# tokenizer.ggml.pre -> the split regex of the original tokenizer.json (llama-vocab.cpp quotes them).
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "kormo": _QWEN2, "f2llmv2": _QWEN2, "qwen35": _QWEN35}
# llama_token_type (llama.h)
CONTROL, USER_DEFINED = 3, 4


def tokenizer_files(g: GGUFFile) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) contents equivalent to the GGUF's tokenizer metadata."""
    model = g.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"{g.path}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = g.get("tokenizer.ggml.pre", "qwen2")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{g.path}: pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    tokens = g.need("tokenizer.ggml.tokens")
    types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = g.get("tokenizer.ggml.merges") or []
    added, vocab = [], {}
    for i, (tok, kind) in enumerate(zip(tokens, types)):
        if kind in (CONTROL, USER_DEFINED):
            added.append({"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": kind == CONTROL})
        else:
            vocab[tok] = i
    tok_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PRE_TOKENIZERS[pre]}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [m.split(" ", 1) for m in merges]},
    }

    def token(key: str) -> str | None:
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config: dict[str, Any] = {
        "add_bos_token": bool(g.get("tokenizer.ggml.add_bos_token", False)),
        "bos_token": token("bos") if g.get("tokenizer.ggml.add_bos_token", False) else None,
        "eos_token": token("eos"),
        "pad_token": token("padding"),
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }
    template = g.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tok_json, config


def tokenizer_from_gguf(g: GGUFFile) -> Tokenizer:
    """Our `Tokenizer` for the GGUF, built from its metadata alone."""
    tok_json, config = tokenizer_files(g)
    with tempfile.TemporaryDirectory(prefix="strata-gguf-tok-") as tmp:
        d = Path(tmp)
        (d / "tokenizer.json").write_text(json.dumps(tok_json, ensure_ascii=False))
        (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
        tok = Tokenizer(d)
    tok._path = g.path  # the files were only a vehicle: the GGUF is where this tokenizer came from
    return tok
