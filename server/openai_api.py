"""OpenAI-compatible endpoints: POST /v1/chat/completions (streaming or not) and the OpenAI model listing.

GET /v1/models is shared with the Anthropic API: app.py answers in Anthropic's shape when the request carries an
`anthropic-version` header (every Anthropic SDK and Claude Code send it) and in OpenAI's shape otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from aiohttp import web

from strata_jax.engine.protocol import GenerationRequest, SamplingParams, TokenEvent

from server.anthropic_stream import random_id
from server.errors import ApiError, openai_error_body
from server.generation import ClientGone, EngineRun, generation_failed
from server.openai_request import parse_chat_request
from server.openai_stream import ChatLogprobs, ChoiceBuilder
from server.prompt import clamp_max_tokens, engine_top_k, output_constraint, render_prompt
from server.sse import sse_frame, start_sse
from server.state import REQUEST_ID, STATE
from server.toolcalls import OutputParser
from server.body import read_request_json

log = logging.getLogger("strata.server")


def _finish_reason(event: TokenEvent, choice: ChoiceBuilder, run: EngineRun) -> str:
    if event.finish_reason == "length":
        reason = "length"
    else:
        reason = "tool_calls" if choice.tool_calls and event.finish_reason == "stop" else "stop"
    run.stop_reason = reason
    return reason


def openai_usage(prompt_tokens: int, cached: int, completion: int) -> dict[str, Any]:
    """OpenAI's `usage`, with prefix-cache hits as `prompt_tokens_details.cached_tokens`."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state = request.app[STATE]
    engine, tokenizer = state.require_ready()
    req = parse_chat_request(await read_request_json(request, state))
    rendered = await asyncio.to_thread(render_prompt, tokenizer, req.prompt, state.max_prompt_tokens)
    n_prompt = len(rendered.ids)
    sampling = SamplingParams(
        max_tokens=clamp_max_tokens(req.max_tokens, n_prompt, state.context_length),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=engine_top_k(req.top_k, tokenizer.vocab_size),
        seed=req.seed,
        stop_strings=req.stop,
        logprobs=req.logprobs,
        constraint=output_constraint(req.prompt, rendered, constrain_tools=state.constrain_tools),
    )
    gen = GenerationRequest(prompt_ids=tuple(rendered.ids), sampling=sampling, request_id=request[REQUEST_ID])
    parser = OutputParser(req.prompt.tool_schemas, parse_tools=req.prompt.parse_tools,
                          start_in_thinking=rendered.start_in_thinking,
                          constrained=bool(sampling.constraint and sampling.constraint.tools))
    choice = ChoiceBuilder()
    eos_ids = tokenizer.eos_token_ids
    head = {"id": random_id("chatcmpl-"), "created": int(time.time()), "model": req.model or state.served_name}

    logprobs = ChatLogprobs(tokenizer, req.logprobs, eos_ids)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse_frame({**head, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs.take()}]})

    async with EngineRun(engine, gen, request, state.metrics, heartbeat_s=state.heartbeat_s, api="openai",
                         monitor=state.monitor) as run:
        if not req.stream:
            final = await _run_to_end(run, parser, choice, eos_ids, logprobs)
            return web.json_response({
                **head,
                "object": "chat.completion",
                "choices": [{"index": 0, "message": choice.message(),
                             "finish_reason": _finish_reason(final, choice, run),
                             "logprobs": logprobs.take(always=True)}],
                "usage": openai_usage(final.prompt_tokens or n_prompt, run.cached_tokens, run.completion_tokens),
            })
        response = await start_sse(request)
        try:
            await response.write(chunk({"role": "assistant", "content": ""}))
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    if event is None:
                        await response.write(b": ping\n\n")
                        continue
                    text = "" if event.token_id in eos_ids and event.finish_reason else event.text
                    deltas = choice.apply(parser.feed(text))
                    if event.finish_reason == "error":
                        raise generation_failed(event)
                    logprobs.add(event)
                    frames = [chunk(d) for d in deltas]
                    if event.finish_reason is not None:
                        frames += [chunk(d) for d in choice.apply(parser.finish())]
                        frames.append(chunk({}, _finish_reason(event, choice, run)))
                        if req.include_usage:
                            usage = openai_usage(event.prompt_tokens or n_prompt, run.cached_tokens,
                                                 run.completion_tokens)
                            frames.append(sse_frame({**head, "object": "chat.completion.chunk", "choices": [],
                                                     "usage": usage}))
                        frames.append(b"data: [DONE]\n\n")
                    if frames:
                        await response.write(b"".join(frames))
            await response.write_eof()
        except (ClientGone, ConnectionError):
            return response
        except Exception as exc:  # noqa: BLE001 - after the 200 an error can only be a data frame
            await end_stream_with_error(response, exc, gen.request_id)
        return response


async def end_stream_with_error(response: web.StreamResponse, exc: Exception, request_id: str) -> None:
    """Ends an OpenAI event stream that already sent its 200 with an error chunk and `[DONE]` (logged unless it is
    the client's own error); a connection that is gone by then is left alone."""
    status, text = (exc.status, exc.message) if isinstance(exc, ApiError) else (500, "internal error")
    if not isinstance(exc, ApiError):
        log.exception("request %s failed mid-stream", request_id)
    with contextlib.suppress(Exception):
        await response.write(sse_frame(openai_error_body(status, text)) + b"data: [DONE]\n\n")
        await response.write_eof()


async def _run_to_end(run: EngineRun, parser: OutputParser, choice: ChoiceBuilder,
                      eos_ids: frozenset[int], logprobs: ChatLogprobs) -> TokenEvent:
    async with contextlib.aclosing(run.events()) as events:
        async for event in events:
            if event is None:
                continue
            text = "" if event.token_id in eos_ids and event.finish_reason else event.text
            choice.apply(parser.feed(text))
            logprobs.add(event)
            if event.finish_reason is not None:
                if event.finish_reason == "error":
                    raise generation_failed(event)
                choice.apply(parser.finish())
                return event
    raise ApiError(500, "the engine ended the stream without a finish reason")


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models (OpenAI shape)."""
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model(state)]})


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (OpenAI shape)."""
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    if model_id != state.served_name:
        raise ApiError(404, f"model not found: {model_id!r} (this server serves {state.served_name!r})")
    return web.json_response(_model(state))


def _model(state: Any) -> dict[str, Any]:
    return {"id": state.served_name, "object": "model", "created": int(state.created), "owned_by": "strata_jax"}
