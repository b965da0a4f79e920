"""OpenAI legacy completions: POST /v1/completions (streaming or not).

The prompt is tokenized raw (no chat template) and the text comes back as the model wrote it: no reasoning or
tool-call parsing. `echo` puts the prompt in front of the text; `logprobs: k` returns each token's log-probability
and its k most likely alternatives (`server.logprobs`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web

from strata_jax.engine.protocol import GenerationRequest, SamplingParams, TokenEvent
from strata_jax.tokenizer import Tokenizer, TooManyTokens

from server.anthropic_stream import random_id
from server.body import read_request_json
from server.completions_request import CompletionRequest, parse_completion_request
from server.errors import ApiError, invalid_request
from server.generation import ClientGone, EngineRun, generation_failed
from server.logprobs import CompletionLogprobs, token_text
from server.openai_api import end_stream_with_error, openai_usage
from server.prompt import clamp_max_tokens, engine_top_k
from server.sse import sse_frame, start_sse
from server.state import REQUEST_ID, STATE

log = logging.getLogger("strata.server")


def tokenize_prompt(tokenizer: Tokenizer, req: CompletionRequest, max_prompt_tokens: int | None) -> tuple[
        list[int], str]:
    """(prompt ids, prompt text): the text tokenized raw (special-token strings become their ids), or the ids
    decoded (for `echo`); a prompt longer than the context is a 400 like the chat endpoints'."""
    if req.prompt_ids is not None:
        ids = list(req.prompt_ids)
        text = tokenizer.decode(ids) if req.echo else ""
    else:
        text = req.prompt_text or ""
        try:
            ids = tokenizer.encode_in_pieces(text, stop_after=None if max_prompt_tokens is None
                                             else 2 * max_prompt_tokens)
        except TooManyTokens as exc:
            count = f"{exc.count}" if exc.exact else f"more than {exc.count}"
            raise invalid_request(f"prompt is too long: {count} tokens > {max_prompt_tokens} maximum") from exc
        if not ids:
            raise invalid_request("prompt: has no tokens", "prompt")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise invalid_request(f"prompt is too long: {len(ids)} tokens > {max_prompt_tokens} maximum")
    return ids, text


def _finish_reason(event: TokenEvent, run: EngineRun) -> str:
    run.stop_reason = "length" if event.finish_reason == "length" else "stop"
    return run.stop_reason


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions."""
    state = request.app[STATE]
    engine, tokenizer = state.require_ready()
    req = parse_completion_request(await read_request_json(request, state), tokenizer.vocab_size)
    ids, prompt_text = await asyncio.to_thread(tokenize_prompt, tokenizer, req, state.max_prompt_tokens)
    sampling = SamplingParams(
        max_tokens=clamp_max_tokens(req.max_tokens, len(ids), state.context_length),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=engine_top_k(req.top_k, tokenizer.vocab_size),
        seed=req.seed,
        stop_strings=req.stop,
        logprobs=req.logprobs,
    )
    gen = GenerationRequest(prompt_ids=tuple(ids), sampling=sampling, request_id=request[REQUEST_ID])
    eos_ids = tokenizer.eos_token_ids
    echoed = prompt_text if req.echo else ""
    logprobs = None if req.logprobs is None else CompletionLogprobs(token_text(tokenizer), req.logprobs,
                                                                    text_offset=len(echoed))
    head = {"id": random_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": req.model or state.served_name}

    def piece(event: TokenEvent) -> tuple[str, dict[str, Any] | None]:
        """The event's text and its tokens' logprobs (an end-of-text token shows neither)."""
        if event.finish_reason is not None and event.token_id in eos_ids:
            return "", (logprobs.add((), "") if logprobs else None)
        return event.text, (logprobs.add(event.logprobs, event.text) if logprobs else None)

    def choice(text: str, lp: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}

    async with EngineRun(engine, gen, request, state.metrics, heartbeat_s=state.heartbeat_s, api="completions",
                         monitor=state.monitor) as run:
        if not req.stream:
            parts = [echoed]
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    if event is None:
                        continue
                    if event.finish_reason == "error":
                        raise generation_failed(event)
                    parts.append(piece(event)[0])
                    if event.finish_reason is not None:
                        return web.json_response({
                            **head,
                            "choices": [choice("".join(parts), logprobs.total if logprobs else None,
                                               _finish_reason(event, run))],
                            "usage": openai_usage(event.prompt_tokens or len(ids), run.cached_tokens,
                                                  run.completion_tokens),
                        })
            raise ApiError(500, "the engine ended the stream without a finish reason")
        response = await start_sse(request)
        try:
            if echoed:
                await response.write(sse_frame({**head, "choices": [choice(echoed, None, None)]}))
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    if event is None:
                        await response.write(b": ping\n\n")
                        continue
                    if event.finish_reason == "error":
                        raise generation_failed(event)
                    text, lp = piece(event)
                    finish = None if event.finish_reason is None else _finish_reason(event, run)
                    frames = []
                    if text or (lp and lp["tokens"]) or finish:
                        frames.append(sse_frame({**head, "choices": [choice(text, lp, finish)]}))
                    if finish and req.include_usage:
                        usage = openai_usage(event.prompt_tokens or len(ids), run.cached_tokens,
                                             run.completion_tokens)
                        frames.append(sse_frame({**head, "choices": [], "usage": usage}))
                    if finish:
                        frames.append(b"data: [DONE]\n\n")
                    if frames:
                        await response.write(b"".join(frames))
            await response.write_eof()
        except (ClientGone, ConnectionError):
            return response
        except Exception as exc:  # noqa: BLE001 - after the 200 an error can only be a data frame
            await end_stream_with_error(response, exc, gen.request_id)
        return response
