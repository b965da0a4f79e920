"""Anthropic Messages API: POST /v1/messages (streaming or not), /v1/messages/count_tokens, model listing.

The query string is ignored (Claude Code posts to `/v1/messages?beta=true`), as are beta/version headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from strata_jax.engine.protocol import GenerationRequest, SamplingParams, TokenEvent

from server.anthropic_request import MessagesRequest, parse_messages_request
from server.anthropic_stream import MessageBuilder, SseEvent, random_id
from server.errors import ApiError, anthropic_error_body
from server.generation import ClientGone, EngineRun, generation_failed
from server.prompt import RenderedPrompt, clamp_max_tokens, engine_top_k, output_constraint, render_prompt
from server.sse import send_events, start_sse
from server.state import REQUEST_ID, STATE, ServerState
from server.toolcalls import OutputParser
from server.body import read_request_json

log = logging.getLogger("strata.server")


async def _render(state: ServerState, req: MessagesRequest) -> RenderedPrompt:
    _, tokenizer = state.require_ready()
    # Rendering and tokenizing a 20-40K token prompt takes a while: keep it off the event loop.
    return await asyncio.to_thread(render_prompt, tokenizer, req.prompt, state.max_prompt_tokens)


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens -> {"input_tokens": N}."""
    state = request.app[STATE]
    state.require_ready()
    req = parse_messages_request(await read_request_json(request, state), count_only=True)
    rendered = await _render(state, req)
    return web.json_response({"input_tokens": len(rendered.ids)})


def _usage(prompt_tokens: int, cached: int, output: int) -> dict[str, int]:
    # input_tokens + cache_read_input_tokens + cache_creation_input_tokens = the whole prompt.
    return {
        "input_tokens": prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


class _Answer:
    """One answer being built: engine events -> parser -> content blocks (and their SSE events)."""

    def __init__(self, req: MessagesRequest, rendered: RenderedPrompt, eos_ids: frozenset[int], model: str, *,
                 constrained_calls: bool = False) -> None:
        # max_tokens 0 asks only for the prompt to be cached: one token is run and nothing is shown.
        self.warm_only = req.max_tokens == 0
        self._parser = OutputParser(req.prompt.tool_schemas, parse_tools=req.prompt.parse_tools,
                                    start_in_thinking=rendered.start_in_thinking, constrained=constrained_calls)
        self._builder = MessageBuilder(show_thinking=req.show_thinking)
        self._eos_ids = eos_ids
        self.n_prompt = len(rendered.ids)
        self.message: dict[str, Any] = {
            "id": random_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.n_prompt, 0, 0),
        }

    def feed(self, event: TokenEvent, run: EngineRun) -> list[SseEvent]:
        """The SSE events one engine event produces (the closing ones included when it is the last)."""
        if event.finish_reason == "error":
            raise generation_failed(event)
        # An end-of-turn token's text (if an engine reports it) is not part of the answer.
        hide = self.warm_only or (event.finish_reason is not None and event.token_id in self._eos_ids)
        out = self._builder.apply(self._parser.feed("" if hide else event.text))
        if event.finish_reason is None:
            return out
        out += self._builder.apply(self._parser.finish()) + self._builder.finish()
        stop_reason, stop_sequence = self._stop_reason(event)
        run.stop_reason = stop_reason
        usage = _usage(event.prompt_tokens or self.n_prompt, run.cached_tokens,
                       0 if self.warm_only else run.completion_tokens)
        self.message.update(content=self._builder.content, stop_reason=stop_reason, stop_sequence=stop_sequence,
                            usage=usage)
        out.append(("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                      "usage": usage}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out

    def _stop_reason(self, event: TokenEvent) -> tuple[str, str | None]:
        if event.finish_reason == "length" or self.warm_only:
            return "max_tokens", None
        if event.finish_reason == "stop_string":
            return "stop_sequence", event.stop_string
        return ("tool_use" if self._builder.has_tool_use else "end_turn"), None


async def create_message(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    state = request.app[STATE]
    engine, tokenizer = state.require_ready()
    req = parse_messages_request(await read_request_json(request, state))
    rendered = await _render(state, req)
    sampling = SamplingParams(
        max_tokens=clamp_max_tokens(max(req.max_tokens or 0, 1), len(rendered.ids), state.context_length),
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=engine_top_k(req.top_k, tokenizer.vocab_size),
        stop_strings=req.stop_sequences,
        constraint=output_constraint(req.prompt, rendered, constrain_tools=state.constrain_tools),
    )
    gen = GenerationRequest(prompt_ids=tuple(rendered.ids), sampling=sampling, request_id=request[REQUEST_ID])
    answer = _Answer(req, rendered, tokenizer.eos_token_ids, req.model or state.served_name,
                     constrained_calls=bool(sampling.constraint and sampling.constraint.tools))
    async with EngineRun(engine, gen, request, state.metrics, heartbeat_s=state.heartbeat_s, api="anthropic",
                         monitor=state.monitor) as run:
        if not req.stream:
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    if event is not None:
                        answer.feed(event, run)
            return web.json_response(answer.message)
        response = await start_sse(request)
        try:
            await send_events(response, [("message_start", {"type": "message_start", "message": answer.message})])
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    ping = [("ping", {"type": "ping"})]
                    await send_events(response, ping if event is None else answer.feed(event, run))
            await response.write_eof()
        except (ClientGone, ConnectionError):
            pass  # leaving the `async with` cancels the request in the engine
        except Exception as exc:  # noqa: BLE001 - after the 200 an error can only be an SSE event
            status, text = (exc.status, exc.message) if isinstance(exc, ApiError) else (500, "internal error")
            if not isinstance(exc, ApiError):
                log.exception("request %s failed mid-stream", gen.request_id)
            with contextlib.suppress(Exception):
                await send_events(response, [("error", anthropic_error_body(status, text))])
                await response.write_eof()
        return response


def model_info(state: ServerState) -> dict[str, Any]:
    """The served model in Anthropic's shape."""
    created = datetime.fromtimestamp(state.created, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": state.served_name, "display_name": state.served_name, "created_at": created}


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models (Anthropic shape)."""
    state = request.app[STATE]
    info = model_info(state)
    return web.json_response({"data": [info], "has_more": False, "first_id": info["id"], "last_id": info["id"]})


async def get_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id} (Anthropic shape); 404 for other ids."""
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    if model_id != state.served_name:
        raise ApiError(404, f"model not found: {model_id!r} (this server serves {state.served_name!r})")
    return web.json_response(model_info(state))
