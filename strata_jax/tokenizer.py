"""Tokenizer and chat-template rendering for Hugging Face style tokenizer directories.

Wraps the `tokenizers` library (no torch/transformers) and renders chat templates the same way
`transformers` 5.x does (`PreTrainedTokenizerBase.apply_chat_template` + `render_jinja_template`),
so prompts and token ids match the reference implementation exactly.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["IncrementalDecoder", "TemplateError", "Tokenizer", "TooManyTokens", "load_tokenizer"]

# Named special-token attributes transformers exposes to templates (its SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may be passed under; the first is what templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Tokens that end a turn/document in Qwen-family models even when the config names only one eos.
_QWEN_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


class TooManyTokens(ValueError):
    """`Tokenizer.encode_in_pieces` found more tokens than its caller allows: `count` so far (all of them when
    `exact`)."""

    def __init__(self, count: int, exact: bool):
        super().__init__(f"{count}{'' if exact else '+'} tokens")
        self.count = count
        self.exact = exact


def _pieces(text: str, size: int) -> Iterable[str]:
    """`text` cut into pieces of about `size` characters, each ending after a newline followed by a non-space
    character (or at the end): pre-tokenizer boundaries of byte-level BPE. A text without such a place is one
    piece."""
    start, n = 0, len(text)
    while n - start > size:
        cut = start + size
        while True:
            cut = text.find("\n", cut)
            if cut == -1 or cut + 1 >= n:
                yield text[start:]
                return
            if not text[cut + 1].isspace():
                break
            cut += 1
        yield text[start : cut + 1]
        start = cut + 1
    if start < n:
        yield text[start:]


class TemplateError(jinja2.exceptions.TemplateError):
    """Raised for invalid chat templates and by a template's `raise_exception(...)`."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's builtin tojson HTML-escapes `<>&'`; transformers replaces it with plain json.dumps.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - name fixed by the template API
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` global that cannot be used to reach the real `dict` type from a template."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` global that rejects underscore attributes (sandbox hardening, as transformers)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _compile_template(source: str, origin: Path) -> jinja2.Template:
    try:
        return _make_environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TemplateError(f"invalid chat template in {origin} (line {exc.lineno}): {exc.message}") from exc


def _plain_data(value: Any) -> Any:
    """Rebuild template inputs from plain JSON-like types (as transformers' `_plain_template_data`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(k): _plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(v) for v in value)
    if isinstance(value, np.generic):
        return _plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Plain dicts, keys with None values dropped, reasoning aliases filled in (as transformers)."""
    out = []
    for message in _plain_data(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON in {path}: {exc}") from exc


class Tokenizer:
    """A Hugging Face tokenizer directory: `tokenizer.json` + `tokenizer_config.json` (+ chat template files).

    Attributes are read-only after construction.
    """

    def __init__(self, path: str | Path) -> None:
        """Load the tokenizer from directory `path` (or from the directory holding a given tokenizer.json)."""
        path = Path(path)
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tok_file}")
        self._path = path
        self._tok = tokenizers.Tokenizer.from_file(str(tok_file))
        self._pieces_ok: bool | None = None

        config_file = path / "tokenizer_config.json"
        config: dict[str, Any] = _read_json(config_file) if config_file.is_file() else {}
        self._config = config
        self._add_missing_added_tokens(config.get("added_tokens_decoder") or {}, config_file)

        self._special_tokens_map: dict[str, str] = {}
        for attr in _SPECIAL_TOKEN_ATTRS:
            content = _token_content(config.get(attr))
            if content is not None:
                self._special_tokens_map[attr] = str(content)

        gen_eos: list[int] = []
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos = _read_json(gen_file).get("eos_token_id")
            gen_eos = [eos] if isinstance(eos, int) else list(eos or [])
        self._generation_eos_ids = tuple(int(i) for i in gen_eos)

        self._templates = self._load_templates(config, config_file)

    # ----------------------------------------------------------------------------------------- loading

    def _add_missing_added_tokens(self, decoder: Mapping[str, Any], origin: Path) -> None:
        # transformers adds tokens declared only in tokenizer_config.json; ids must line up with the vocab.
        for id_str, spec in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            content = spec["content"] if isinstance(spec, dict) else str(spec)
            if self._tok.token_to_id(content) is not None:
                continue
            special = bool(spec.get("special", True)) if isinstance(spec, dict) else True
            token = tokenizers.AddedToken(content, special=special, normalized=not special)
            if special:
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])
            if self._tok.token_to_id(content) != int(id_str):
                raise ValueError(
                    f"{origin}: added token {content!r} declared with id {id_str} "
                    f"but got id {self._tok.token_to_id(content)}"
                )

    def _load_templates(self, config: Mapping[str, Any], config_file: Path) -> dict[str, jinja2.Template]:
        """Named compiled templates; a single template is stored as "default". Precedence as transformers:
        chat_template.jinja (+ additional_chat_templates/*.jinja) > chat_template.json > tokenizer_config.json."""
        sources: dict[str, tuple[str, Path]] = {}
        jinja_file = self._path / "chat_template.jinja"
        json_file = self._path / "chat_template.json"
        extra_dir = self._path / "additional_chat_templates"
        if jinja_file.is_file():
            sources["default"] = (jinja_file.read_text(encoding="utf-8"), jinja_file)
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                sources[f.stem] = (f.read_text(encoding="utf-8"), f)
        if not sources:
            raw: Any = None
            origin = config_file
            if json_file.is_file():
                raw, origin = _read_json(json_file).get("chat_template"), json_file
            if raw is None:
                raw = config.get("chat_template")
            if isinstance(raw, str):
                sources["default"] = (raw, origin)
            elif isinstance(raw, list):
                sources = {t["name"]: (t["template"], origin) for t in raw}
            elif isinstance(raw, dict):
                sources = {name: (src, origin) for name, src in raw.items()}
            elif raw is not None:
                raise TemplateError(f"invalid chat_template in {origin}: expected str, list or dict")
        return {name: _compile_template(src, origin) for name, (src, origin) in sources.items()}

    # ----------------------------------------------------------------------------------------- properties

    @property
    def path(self) -> Path:
        """Directory the tokenizer was loaded from."""
        return self._path

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (do not mutate)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens (may be smaller than the model's embedding rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (bos_token, eos_token, ...) that are set; passed to chat templates."""
        return dict(self._special_tokens_map)

    @property
    def bos_token(self) -> str | None:
        """Beginning-of-sequence token string, or None (Qwen has none)."""
        return self._special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """End-of-sequence token string from tokenizer_config.json."""
        return self._special_tokens_map.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        """Padding token string."""
        return self._special_tokens_map.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        """Id of `bos_token`, or None."""
        return self.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        """Id of `eos_token`, falling back to the first generation_config eos id."""
        if self.eos_token is not None and (tid := self.token_to_id(self.eos_token)) is not None:
            return tid
        return self._generation_eos_ids[0] if self._generation_eos_ids else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """All ids that should stop generation: eos_token, generation_config eos ids, and the Qwen
        turn/document terminators (<|im_end|>, <|endoftext|>) when they are special tokens of this vocab."""
        ids = set(self._generation_eos_ids)
        if (eos := self.eos_token_id) is not None:
            ids.add(eos)
        special = self.special_token_ids
        for token in _QWEN_STOP_TOKENS:
            tid = self.token_to_id(token)
            if tid is not None and tid in special:
                ids.add(tid)
        return frozenset(ids)

    @property
    def pad_token_id(self) -> int | None:
        """Id of `pad_token`, or None."""
        return self.token_to_id(self.pad_token) if self.pad_token is not None else None

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of all added tokens flagged special (those `decode(skip_special_tokens=True)` drops)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @property
    def chat_template_names(self) -> tuple[str, ...]:
        """Names of the available chat templates ("default" for a single template)."""
        return tuple(self._templates)

    # ----------------------------------------------------------------------------------------- encode/decode

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None if absent."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None if out of range."""
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings inside `text` become their special ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_in_pieces(self, text: str, stop_after: int | None = None, piece_chars: int = 16384) -> list[int]:
        """`encode(text)`, one piece of about `piece_chars` characters at a time: each call into the tokenizer
        holds the interpreter lock only briefly, so a server thread encoding megabytes leaves the event loop
        responsive. Pieces end after a newline that a non-space character follows, a place where the pre-tokenizers
        of byte-level BPE vocabularies always split, so the ids equal `encode(text)`'s; tokenizers for which that
        does not hold (checked once) are given the text whole. With `stop_after`, raises `TooManyTokens` as soon
        as more than that many tokens are found (the count so far is a lower bound)."""
        if not self._pieces_exact():
            ids = self.encode(text)
            if stop_after is not None and len(ids) > stop_after:
                raise TooManyTokens(len(ids), exact=True)
            return ids
        ids: list[int] = []
        done = 0
        for piece in _pieces(text, piece_chars):
            ids += self._tok.encode(piece, add_special_tokens=False).ids
            done += len(piece)
            if stop_after is not None and len(ids) > stop_after:
                raise TooManyTokens(len(ids), exact=done == len(text))
        return ids

    def _pieces_exact(self) -> bool:
        """Whether encoding in pieces gives the ids of encoding whole, for this tokenizer (checked once)."""
        if self._pieces_ok is None:
            sample = ("def f(x):\n    return x + 1\n\n\nclass A:\n\tpass\n};\n\nword \n  \n42\n"
                      "<|im_start|>user\nHallo, Grüße 世界!\n<|im_end|>\n") * 3
            whole = self.encode(sample)
            pieced = [t for p in _pieces(sample, 8) for t in self._tok.encode(p, add_special_tokens=False).ids]
            self._pieces_ok = whole == pieced
        return self._pieces_ok

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. No tokenization-space cleanup: transformers skips it for BPE tokenizers too."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------------------- chat

    def _template_for(self, tools: Any, name: str | None) -> jinja2.Template:
        if not self._templates:
            raise ValueError(f"no chat template found in {self._path}")
        if name is not None:
            if name not in self._templates:
                raise KeyError(f"no chat template named {name!r}; available: {sorted(self._templates)}")
            return self._templates[name]
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise ValueError(f"multiple chat templates and no 'default' in {self._path}: {sorted(self._templates)}")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tokenize: bool = False,
        *,
        template_name: str | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render `messages` (OpenAI-style dicts) with the chat template, exactly as transformers does.

        `enable_thinking=None` leaves the variable undefined in the template (the template's default);
        `extra` keyword arguments become template variables and override special-token variables.
        Returns the prompt string, or its token ids when `tokenize=True`.
        """
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        template = self._template_for(tools, template_name)
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, Mapping):
                    raise TypeError(f"tools must be JSON-schema dicts, got {tool!r}")
        if documents is not None and not all(isinstance(d, Mapping) for d in documents):
            raise TypeError("documents must be a list of dicts")
        if enable_thinking is not None:
            extra["enable_thinking"] = enable_thinking
        variables = {**self._special_tokens_map, **_plain_data(extra)}
        text = template.render(
            messages=_normalize_messages(messages),
            tools=_plain_data(list(tools)) if tools is not None else None,
            documents=_plain_data(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text) if tokenize else text

    def incremental_decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        """A fresh `IncrementalDecoder` over this tokenizer."""
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self._path)!r}, vocab_size={self.vocab_size}, eos_token={self.eos_token!r})"


class IncrementalDecoder:
    """Streaming detokenizer: push ids one at a time and receive only newly completed text.

    Decodes a small window of recent ids (rather than each token alone) so merges across token
    boundaries (multi-byte UTF-8, decoder-level spacing) come out right, and holds text back while it
    ends in U+FFFD, i.e. while a character is still incomplete. `"".join(pushes) + flush()` equals
    `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        """Create a decoder over `tokenizer`."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window (context for the next delta)
        self._read = 0  # ids before this index have been emitted

    @property
    def ids(self) -> tuple[int, ...]:
        """All ids pushed so far."""
        return tuple(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def push_many(self, token_ids: Iterable[int]) -> str:
        """Push several ids; return the concatenated new text."""
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Return any held-back text (e.g. a truly invalid byte sequence as U+FFFD) and mark it emitted."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a `Tokenizer` from a Hugging Face model/tokenizer directory."""
    return Tokenizer(path)
