"""The aiohttp application: routes, request ids, error shapes, auth, health and metrics.

Routes:
    HEAD/GET /                      always 200 (Claude Code sends `HEAD /` first; never a 5xx): the web page (chat and
                                    live monitor) for browsers (`Accept: text/html`), else a JSON status line
    GET  /ui/{file}                 the web page's scripts and styles (server/web/, no auth: the page asks for the key)
    GET  /health                    503 while the model loads or the engine is stuck / stopping, else 200 (no auth)
    GET  /metrics                   Prometheus text (with `metrics_public`, no key needed from this machine)
    GET  /v1/monitor                the live monitor's JSON: slots, queue, tok/s, requests in flight, TTFT, hit rates
    POST /v1/messages               Anthropic Messages API (streaming and not; query string ignored)
    POST /v1/messages/count_tokens
    GET  /v1/models[/{id}]          Anthropic shape if the request has an `anthropic-version` header, else OpenAI's
    POST /v1/chat/completions       OpenAI chat completions
    POST /v1/completions            OpenAI legacy completions (raw prompt, no chat template)
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from strata_jax.engine.protocol import EngineProtocol
from strata_jax.tokenizer import Tokenizer

from server import anthropic_api, completions_api, openai_api
from server.auth import auth_middleware
from server.errors import ApiError, error_response, is_openai_request
from server.generation import ClientGone
from server.state import REQUEST_ID, STATE, ServerState
from server.body import BODY_IDLE_TIMEOUT_S, BODY_TOTAL_TIMEOUT_S

log = logging.getLogger("strata.server")

DEFAULT_MAX_BODY_BYTES = 32 * 2**20
WEB_DIR = Path(__file__).parent / "web"  # the web page: plain HTML, CSS and JS, no build step (package data)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_ERROR_MESSAGES = {
    404: "not found: {method} {path}",
    405: "method not allowed: {method} {path}",
    413: "request body is too large",
}


def create_app(engine: EngineProtocol | None, tokenizer: Tokenizer | None, *, served_name: str,
               api_key: str | None, context_length: int, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               ping_interval_s: float = 10.0, body_idle_timeout_s: float = BODY_IDLE_TIMEOUT_S,
               body_total_timeout_s: float = BODY_TOTAL_TIMEOUT_S, about: Mapping[str, Any] | None = None,
               metrics_public: bool = False, constrain_tools: bool = True) -> web.Application:
    """The server application. `engine`/`tokenizer` may be None while the model loads (then /health is 503 and API
    calls get 529 overloaded errors); install them with `install_engine` when loading finishes. `about` describes
    the set-up for the monitor (model, dtype, slots, context, drafter, `plan`: [label, value] rows);
    `metrics_public` opens /metrics to clients on this machine without the key; `constrain_tools` makes offered
    tools the answer's grammar (calls name only them, arguments follow their schemas)."""
    state = ServerState(
        served_name=served_name,
        api_key=api_key or None,
        context_length=context_length,
        max_body_bytes=max_body_bytes,
        heartbeat_s=ping_interval_s,
        body_idle_timeout_s=body_idle_timeout_s,
        body_total_timeout_s=body_total_timeout_s,
        engine=engine,
        tokenizer=tokenizer,
        about=dict(about or {}),
        constrain_tools=constrain_tools,
    )
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[_request_context, auth_middleware(api_key, metrics_public=metrics_public)])
    app[STATE] = state
    app.on_response_prepare.append(_add_request_id)
    app.router.add_route("*", "/", _root)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/monitor", _monitor)
    app.router.add_get("/ui/{name}", _web_file)
    app.router.add_post("/v1/messages", anthropic_api.create_message)
    app.router.add_post("/v1/messages/count_tokens", anthropic_api.count_tokens)
    app.router.add_get("/v1/models", _list_models)
    app.router.add_get("/v1/models/{model_id:.+}", _get_model)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/completions", completions_api.completions)
    return app


def install_engine(app: web.Application, engine: EngineProtocol, tokenizer: Tokenizer, context_length: int) -> None:
    """Make a loaded engine live: from now on /health is 200 and API calls are served."""
    state = app[STATE]
    state.tokenizer = tokenizer
    state.context_length = context_length
    state.engine = engine


def server_state(app: web.Application) -> ServerState:
    """The app's state (engine, settings, metrics)."""
    return app[STATE]


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["request-id"] = request.get(REQUEST_ID) or _new_request_id()


def _new_request_id() -> str:
    return "req_" + secrets.token_hex(12)


@web.middleware
async def _request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Request id, errors in the client's shape (never a traceback), and request metrics."""
    request[REQUEST_ID] = _new_request_id()
    try:
        response = await handler(request)
    except ApiError as exc:
        response = _error(request, exc.status, exc.message, exc.param, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        template = _HTTP_ERROR_MESSAGES.get(exc.status, "{reason}")
        message = template.format(method=request.method, path=request.path, reason=exc.reason)
        response = _error(request, exc.status, message, None, None)
    except ClientGone:
        response = web.Response(status=499)  # nobody is listening; only the metrics see it
    except asyncio.CancelledError:  # the client went away (handler cancellation)
        _count(request, 499)
        raise
    except Exception:  # noqa: BLE001 - one bad request must not take the server down
        log.exception("unhandled error in %s %s", request.method, request.path)
        response = _error(request, 500, "internal server error", None, None)
    _count(request, response.status)
    return response


def _count(request: web.Request, status: int) -> None:
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    request.app[STATE].metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


def _error(request: web.Request, status: int, message: str, param: str | None,
           headers: dict[str, str] | None) -> web.Response:
    openai = is_openai_request(request)
    if openai and status == 529:
        status = 503  # 529 is Anthropic's own; OpenAI clients know 503
    return error_response(status, message, openai=openai, param=param, headers=headers)


async def _root(request: web.Request) -> web.Response:
    if request.method not in ("GET", "HEAD"):
        raise ApiError(405, f"method not allowed: {request.method} /")
    if wants_html(request):
        return web.FileResponse(WEB_DIR / "index.html", headers={"Cache-Control": "no-cache"})
    state = request.app[STATE]
    return web.json_response({"name": "strata_jax", "model": state.served_name,
                              "status": "ready" if state.ready else "loading"})


async def _web_file(request: web.Request) -> web.FileResponse:
    name = request.match_info["name"]
    if name not in _web_files():  # only the page's own files: no paths, no directory listing
        raise web.HTTPNotFound()
    return web.FileResponse(WEB_DIR / name, headers={"Cache-Control": "no-cache"})


def _web_files() -> frozenset[str]:
    return frozenset(p.name for p in WEB_DIR.iterdir() if p.suffix in (".html", ".js", ".css"))


def wants_html(request: web.Request) -> bool:
    """Whether the client asks for a page (a browser's `Accept: text/html,...`) rather than JSON: HTML only when
    it names text/html and not application/json, so curl, SDKs and probes (`*/*` or nothing) keep getting JSON."""
    accept = request.headers.get("accept", "").lower()
    return "text/html" in accept and "application/json" not in accept


async def _monitor(request: web.Request) -> web.Response:
    state = request.app[STATE]
    healthy, why = state.engine_health()
    status = "loading" if not state.ready else ("ok" if healthy else "unavailable")
    body = {"model": state.served_name, "status": status, "reason": why or None,
            "context_length": state.context_length, "about": state.about,
            **state.monitor.snapshot(state.engine_stats())}
    return web.json_response(body, headers={"Cache-Control": "no-store"})


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not state.ready:
        return web.json_response({"status": "loading"}, status=503, headers={"retry-after": "5"})
    healthy, why = state.engine_health()
    if not healthy:
        return web.json_response({"status": "unavailable", "reason": why}, status=503, headers={"retry-after": "5"})
    return web.json_response({"status": "ok", "model": state.served_name, "context_length": state.context_length})


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _list_models(request: web.Request) -> web.Response:
    if is_openai_request(request):
        return await openai_api.list_models(request)
    return await anthropic_api.list_models(request)


async def _get_model(request: web.Request) -> web.Response:
    if is_openai_request(request):
        return await openai_api.get_model(request)
    return await anthropic_api.get_model(request)
