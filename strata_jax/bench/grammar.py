"""Grammar engines for constrained decoding, measured: time to compile a grammar and to compute one token mask,
at the demo tokenizer's vocabulary and at a synthetic vocabulary of Flash-Next's size (248,320 tokens).

`python -m strata_jax.bench.grammar [--vocab 248320] [--engines llguidance,xgrammar,outlines_core]` measures
every engine that imports (llguidance is a dependency; xgrammar needs torch and transformers, outlines-core is
regex-only) on two constraints: a JSON schema (OpenAI `json_schema`) and the tool-call grammar the engine builds
for two tools in the demo template's Qwen XML format (`strata_jax.engine.constraints.lark_grammar`). Each walks a
valid answer token by token: compute the mask (timed), check the answer's token is allowed, consume it.

The synthetic vocabulary: the demo tokenizer's tokens (its special tokens included), then the most frequent
pre-tokenizer pieces of the Python standard library's sources (words with and without a leading space, numbers,
punctuation runs, indentation), then CJK characters and pairs, up to the size asked. Tokenization is greedy
longest match (the engines only need token bytes; which split of the answer is walked does not matter much).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from strata_jax.engine.constraints import lark_grammar
from strata_jax.engine.protocol import Constraint, ToolSchema

DEMO = Path(__file__).resolve().parents[1] / "demo"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                  "zip": {"type": "string"}}, "required": ["street", "city"]},
    "active": {"type": "boolean"}}, "required": ["name", "age", "address"]}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
                     "tags": ["math", "engines", "poetry"], "address": {"street": "12 St James's Square",
                                                                      "city": "London", "zip": "SW1Y 4JH"},
                     "active": True})
TOOLS = (
    ToolSchema("write_file", json.dumps({"type": "object", "properties": {
        "file_path": {"type": "string"}, "content": {"type": "string"}}, "required": ["file_path", "content"]})),
    ToolSchema("run_command", json.dumps({"type": "object", "properties": {
        "command": {"type": "string"}, "timeout": {"type": "integer"}}, "required": ["command"]})),
)
TOOL_ANSWER = ("I will write the file.\n\n<tool_call>\n<function=write_file>\n<parameter=file_path>\n/tmp/hello.py\n"
               "</parameter>\n<parameter=content>\ndef main():\n    print(\"hello, world\")\n\n\nmain()\n"
               "</parameter>\n</function>\n</tool_call>")


def _demo_tokens() -> tuple[list[bytes], dict[str, int]]:
    data = json.loads((DEMO / "tokenizer.json").read_text())
    byte_of = _byte_decoder()
    tokens: dict[int, bytes] = {i: bytes(byte_of[c] for c in s) for s, i in data["model"]["vocab"].items()}
    special = {}
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"].encode()
        special[added["content"]] = added["id"]
    return [tokens[i] for i in range(len(tokens))], special


def _byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_PIECE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+""")


def synthetic_vocab(size: int) -> tuple[list[bytes], dict[str, int]]:
    """`size` distinct token byte strings (see the module doc) and the special tokens' ids."""
    tokens, special = _demo_tokens()
    seen = set(tokens)
    counts: collections.Counter[str] = collections.Counter()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            counts.update(_PIECE.findall(path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
        if len(counts) > 4 * size:
            break
    extra = (p.encode() for p, _ in counts.most_common())
    cjk = (chr(a).encode() for a in range(0x4E00, 0x9FFF))
    pairs = ((chr(a) + chr(b)).encode() for a in range(0x4E00, 0x9FFF) for b in range(0x4E00, 0x4E00 + 64))
    for source in (extra, cjk, pairs):
        for t in source:
            if len(tokens) >= size:
                return tokens, special
            if t not in seen and len(t) <= 32:
                seen.add(t)
                tokens.append(t)
    return tokens, special


class GreedyTokenizer:
    """Longest-match tokenization over a list of token bytes (special tokens matched by their text)."""

    def __init__(self, tokens: list[bytes], special: dict[str, int]):
        self.ids = {t: i for i, t in enumerate(tokens) if i not in special.values()}
        self.special = {name.encode(): i for name, i in special.items()}
        self.longest = max(len(t) for t in tokens)

    def __call__(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, i = [], 0
        while i < len(data):
            hit = next(((n, t) for n, t in self.special.items() if data.startswith(n, i)), None)
            if hit is not None:
                out.append(hit[1])
                i += len(hit[0])
                continue
            for j in range(min(len(data), i + self.longest), i, -1):
                if data[i:j] in self.ids:
                    out.append(self.ids[data[i:j]])
                    i = j
                    break
            else:
                raise ValueError(f"byte {data[i]} has no token")
        return out


def _walk(fill, consume, ids: list[int], allowed) -> list[float]:
    times = []
    for t in ids:
        t0 = time.perf_counter()
        mask = fill()
        times.append(time.perf_counter() - t0)
        if not allowed(mask, t):
            raise AssertionError(f"token {t} not allowed after {len(times) - 1} tokens")
        consume(t)
    return times


def _bit(mask: np.ndarray, t: int) -> bool:
    return bool((int(mask.reshape(-1)[t // 32]) >> (t % 32)) & 1)


def run_llguidance(tokens, special, tok, eos) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    class Wrapped:
        eos_token_id, bos_token_id = eos, None

        def __init__(self):
            self.tokens = tokens
            self.special_token_ids = list(special.values())

        def __call__(self, data):
            return tok(data)

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapped()))
    out = {}
    cases = {"json_schema": (Constraint(json_schema=json.dumps(SCHEMA), thinking=False), ANSWER),
             "tool_calls": (Constraint(tools=TOOLS, thinking=False), TOOL_ANSWER)}
    for name, (constraint, answer) in cases.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_lark(lark_grammar(constraint, SPECIAL))
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        mask = lnp.allocate_token_bitmask(1, len(tokens))
        lnp.fill_next_token_bitmask(matcher, mask)
        compile_s = time.perf_counter() - t0
        matcher.reset()

        def fill():
            lnp.fill_next_token_bitmask(matcher, mask)
            return mask
        times = _walk(fill, matcher.consume_token, tok(answer), _bit)
        out[name] = _summary(compile_s, times)
    return out


def run_xgrammar(tokens, special, tok, eos) -> dict:
    import torch
    import xgrammar as xgr

    # RAW vocabularies have no special tokens: "<tool_call>" is the text of its token, which is what the structural
    # tag's trigger matches.
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    tool_tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [
            {"begin": f"<tool_call>\n<function={t.name}>\n", "end": "</function>\n</tool_call>",
             "content": {"type": "json_schema", "json_schema": json.loads(t.parameters), "style": "qwen_xml"}}
            for t in TOOLS]}}
    cases = {"json_schema": (lambda: compiler.compile_json_schema(json.dumps(SCHEMA)), ANSWER),
             "tool_calls": (lambda: compiler.compile_structural_tag(json.dumps(tool_tag)), TOOL_ANSWER)}
    out = {}
    for name, (build, answer) in cases.items():
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(build())
        mask = xgr.allocate_token_bitmask(1, len(tokens))
        matcher.fill_next_token_bitmask(mask)
        compile_s = time.perf_counter() - t0
        ids = tok(answer)

        def fill():
            matcher.fill_next_token_bitmask(mask)
            return mask.numpy()
        times = _walk(fill, matcher.accept_token, ids, _bit)
        out[name] = _summary(compile_s, times)
    del torch
    return out


def run_outlines_core(tokens, special, tok, eos) -> dict:
    import outlines_core as oc

    vocab: dict[bytes, list[int]] = collections.defaultdict(list)
    for i, t in enumerate(tokens):
        if i != eos and i not in special.values():
            vocab[t].append(i)
    t0 = time.perf_counter()
    vocabulary = oc.Vocabulary(eos, dict(vocab))
    regex = oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = oc.Index(regex, vocabulary)
    guide = oc.Guide(index)
    words = (len(tokens) + 31) // 32
    mask = np.zeros(words, np.int32)
    guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
    compile_s = time.perf_counter() - t0

    def fill():
        guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
        return mask
    times = _walk(fill, guide.advance, tok(ANSWER), _bit)
    return {"json_schema": _summary(compile_s, times), "tool_calls": "no context-free grammars (regex only)"}


def _summary(compile_s: float, times: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {"compile_s": round(compile_s, 3), "tokens": len(us), "mask_us_mean": round(statistics.fmean(us), 1),
            "mask_us_p50": round(us[len(us) // 2], 1), "mask_us_max": round(us[-1], 1)}


ENGINES = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines_core": run_outlines_core}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=248_320, help="synthetic vocabulary size (default 248320; "
                        "0: the demo tokenizer's own vocabulary)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated (default: all three)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    tokens, special = synthetic_vocab(args.vocab) if args.vocab else _demo_tokens()
    tok = GreedyTokenizer(tokens, special)
    eos = special["<|im_end|>"]
    results = {"vocab": len(tokens)}
    for name in args.engines.split(","):
        try:
            results[name] = ENGINES[name](tokens, special, tok, eos)
        except ImportError as e:
            results[name] = f"not installed ({e.name})"
        print(name, json.dumps(results[name]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
