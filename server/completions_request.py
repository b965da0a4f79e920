"""OpenAI legacy completions request bodies (`POST /v1/completions`) -> a validated `CompletionRequest`.

The prompt is raw text or token ids: no chat template. One prompt and one choice per request; fields this server
cannot honour (`suffix`, `n`/`best_of` above 1, `echo` with `logprobs`) are refused with a 400 naming them rather
than ignored. Unknown fields are ignored, as on the other endpoints.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from strata_jax.engine.protocol import MAX_TOP_LOGPROBS

from server.errors import invalid_request
from server.validation import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    get_bool,
    get_dict,
    get_int,
    get_number,
    get_stop_strings,
    get_str,
)

# OpenAI's default for this endpoint (the chat endpoint's default is "as many as fit").
DEFAULT_MAX_TOKENS = 16


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """A validated /v1/completions request: `prompt` is text or token ids (never both)."""

    model: str
    prompt_text: str | None
    prompt_ids: tuple[int, ...] | None
    max_tokens: int
    stream: bool
    include_usage: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    echo: bool
    logprobs: int | None


def parse_completion_request(body: dict[str, Any], vocab_size: int) -> CompletionRequest:
    """Validate and convert a completions body; token ids must lie in [0, vocab_size)."""
    prompt_text, prompt_ids = _prompt(body.get("prompt"), vocab_size)
    if get_str(body, "suffix", "") != "":
        raise invalid_request("suffix: not supported (this server does no fill-in-the-middle); leave it out",
                              "suffix")
    if get_int(body, "n", 1, minimum=1, maximum=INT32_MAX) != 1:
        raise invalid_request("n: only n=1 is supported (send several requests for several completions)", "n")
    if get_int(body, "best_of", 1, minimum=1, maximum=INT32_MAX) != 1:
        raise invalid_request("best_of: only best_of=1 is supported", "best_of")
    echo = get_bool(body, "echo", False)
    logprobs = get_int(body, "logprobs", None, minimum=0, maximum=MAX_TOP_LOGPROBS)
    if echo and logprobs is not None:
        raise invalid_request("echo with logprobs is not supported: the prompt's log-probabilities are not computed",
                              "echo")
    stream_options = get_dict(body, "stream_options") or {}
    return CompletionRequest(
        model=get_str(body, "model", ""),
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        max_tokens=get_int(body, "max_tokens", DEFAULT_MAX_TOKENS, minimum=1, maximum=INT32_MAX),
        stream=get_bool(body, "stream", False),
        include_usage=get_bool(stream_options, "include_usage", False, path="stream_options."),
        temperature=get_number(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
        top_p=get_number(body, "top_p", 1.0, minimum=0.0, maximum=1.0),
        top_k=max(get_int(body, "top_k", 0, minimum=-1, maximum=INT32_MAX), 0),  # vLLM's -1 = off, like 0
        seed=get_int(body, "seed", None, minimum=INT64_MIN, maximum=INT64_MAX),
        stop=get_stop_strings(body, "stop"),
        echo=echo,
        logprobs=logprobs,
    )


def _prompt(value: Any, vocab_size: int) -> tuple[str | None, tuple[int, ...] | None]:
    """(text, None) or (None, ids) from a string, a list of token ids, or a list holding one of those."""
    expected = "expected a string, an array of token ids, or an array holding one of those"
    if value is None:
        raise invalid_request(f"prompt: field required ({expected})", "prompt")
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) != 1:
            raise invalid_request(f"prompt: only one prompt per request is supported, got {len(value)}", "prompt")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise invalid_request("prompt: must not be empty", "prompt")
        return value, None
    if not isinstance(value, list):
        raise invalid_request(f"prompt: {expected}", "prompt")
    if not value:
        raise invalid_request("prompt: must not be empty", "prompt")
    for i, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise invalid_request(f"prompt.{i}: expected a token id in 0..{vocab_size - 1}, got {token!r}"[:300],
                                  f"prompt.{i}")
    return None, tuple(value)
