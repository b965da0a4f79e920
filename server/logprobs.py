"""Log-probabilities in OpenAI's two wire shapes, from the engine's `TokenEvent.logprobs`.

Chat completions: `choices[].logprobs.content[]` = `{token, logprob, bytes, top_logprobs: [{token, logprob,
bytes}]}`. Legacy completions: `choices[].logprobs` = `{tokens, token_logprobs, top_logprobs: [{token: logprob}],
text_offset}`. A token's string is its text when its bytes are valid UTF-8 on their own, else `bytes:\\xNN...`
(a piece of a multi-byte character); `bytes` always carries the exact bytes, as OpenAI's API does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import Any

import tokenizers

from strata_jax.engine.protocol import TokenLogprob
from strata_jax.tokenizer import Tokenizer

# OpenAI reports tokens too unlikely for a float as -9999.0; JSON has no -Infinity.
FLOOR_LOGPROB = -9999.0


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode), inverted: vocabulary character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """A tokenizer's tokens as bytes and display strings (cached per token id)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        """Read the tokenizer's decoder kind and its added (special) tokens."""
        self._tokenizer = tokenizer
        backend = tokenizer.backend
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._byte_level = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        """The exact bytes token `token_id` stands for."""
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._compute_bytes(token_id)
        return cached

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return bytes(alphabet[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self._tokenizer.decode([token_id]).encode()

    def text(self, token_id: int) -> str:
        """The token as a string: its text, or `bytes:\\xNN...` when its bytes are not valid UTF-8 alone."""
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@functools.lru_cache(maxsize=4)
def token_text(tokenizer: Tokenizer) -> TokenText:
    """The (shared) `TokenText` of `tokenizer`."""
    return TokenText(tokenizer)


def finite(logprob: float) -> float:
    """`logprob` as JSON can carry it: -inf and NaN become FLOOR_LOGPROB."""
    return float(logprob) if math.isfinite(logprob) else FLOOR_LOGPROB


def chat_entry(entry: TokenLogprob, texts: TokenText, top: int) -> dict[str, Any]:
    """One generated token in chat completions' `logprobs.content[]` shape, with its `top` alternatives."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token_id), "logprob": finite(logprob), "bytes": list(texts.bytes(token_id))}

    return {**item(entry.token_id, entry.logprob),
            "top_logprobs": [item(t, lp) for t, lp in entry.top[:top]]}


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built event by event: `add` returns the object for the tokens of
    one event (a stream chunk's), and `total` holds all of them (the non-streaming answer)."""

    def __init__(self, texts: TokenText, top: int, text_offset: int = 0) -> None:
        """`top`: alternatives per token (the request's `logprobs`); `text_offset`: characters before the first
        generated one in the returned text (the echoed prompt)."""
        self._texts = texts
        self._top = top
        self.offset = text_offset
        self.total: dict[str, list[Any]] = self.empty()

    @staticmethod
    def empty() -> dict[str, list[Any]]:
        """An object with no tokens."""
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(self, entries: Iterable[TokenLogprob], text: str) -> dict[str, list[Any]]:
        """The tokens behind `text` (one event's text): each at the offset where its text starts (within `text`;
        a token that only completes a character starts where that character's text does)."""
        out = self.empty()
        within = 0
        for entry in entries:
            token = self._texts.text(entry.token_id)
            top: dict[str, float] = {}
            for token_id, logprob in entry.top[: self._top]:
                top.setdefault(self._texts.text(token_id), finite(logprob))
            top.setdefault(token, finite(entry.logprob))  # the sampled token is always listed, as OpenAI does
            out["tokens"].append(token)
            out["token_logprobs"].append(finite(entry.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset + min(within, len(text)))
            within += len(self._texts.bytes(entry.token_id).decode("utf-8", errors="ignore"))
        self.offset += len(text)
        for key, values in out.items():
            self.total[key].extend(values)
        return out
