"""Running the server: bind first (so /health answers 503 during model load and warm-up), load the engine in a
worker thread, install it, print a start-up summary and then `listening on http://HOST:PORT`, and shut down
gracefully on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any


from strata_jax.engine.protocol import EngineProtocol
from strata_jax.tokenizer import Tokenizer

from server.app import DEFAULT_MAX_BODY_BYTES, create_app, install_engine, server_state
from server.listener import listen, make_runner
from server.logs import QuietAccessLogger, configure_logging, log_startup, startup_lines

log = logging.getLogger("strata.server")

LoadEngine = Callable[[], tuple[EngineProtocol, Tokenizer, int]]

ACCESS_LOG_FORMAT = '%a "%r" %s %bB %Tfs "%{User-Agent}i"'

# On shutdown the engine ends every stream at once with a retryable error; handlers then get this long to write
# their error events before their connections are closed.
SHUTDOWN_GRACE_S = 1.5
# An engine that stays unhealthy this long (its watchdog found a step stuck and it did not come back) makes the
# server exit with EXIT_STUCK, so that a supervisor restarts it: a hung device call cannot be undone in-process.
STUCK_EXIT_S = 30.0
EXIT_STUCK = 70

def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except OSError:
            return False


def serve(load_engine: LoadEngine, *, host: str, port: int, api_key: str | None, served_name: str,
          allow_insecure_public: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          stuck_exit_s: float = STUCK_EXIT_S, log_format: str = "text", metrics_public: bool = False,
          about: Mapping[str, Any] | None = None, constrain_tools: bool = True) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0), or until the engine stays unhealthy for `stuck_exit_s`
    (EXIT_STUCK: the caller should end the process at once, e.g. `os._exit`, since an engine thread may be stuck
    in a device call); returns the process exit code.

    `load_engine()` runs in a worker thread and returns (engine, tokenizer, context_length); it prints its own
    progress. `api_key` defaults to $STRATA_API_KEY. A non-loopback `host` needs a key unless
    `allow_insecure_public`. `log_format` is "text" or "json" (one object per line, on stderr); `metrics_public`
    opens /metrics to clients on this machine without the key; `about` describes the set-up for the start-up
    summary and the monitor (see `server.app.create_app`); `constrain_tools` (default on) makes offered tools the
    answer's grammar.
    """
    key_hint = None
    if api_key:
        key_hint = "<your --api-key>"
    elif os.environ.get("STRATA_API_KEY"):
        key_hint = "$STRATA_API_KEY"
    api_key = api_key or os.environ.get("STRATA_API_KEY") or None
    if not is_loopback(host) and not api_key and not allow_insecure_public:
        print(f"error: refusing to serve on {host} (reachable from other machines) without an API key; set "
              "--api-key or STRATA_API_KEY, or pass --allow-insecure-public", file=sys.stderr)
        return 2
    # Request lines (strata.requests), access lines for other requests, long prompts' prefill progress.
    configure_logging(log_format)
    options = _Options(api_key, served_name, max_body_bytes, stuck_exit_s, log_format, metrics_public,
                       dict(about or {}), key_hint, constrain_tools)
    try:
        return asyncio.run(_serve(load_engine, host, port, options))
    except KeyboardInterrupt:
        return 130


@dataclasses.dataclass(frozen=True)
class _Options:
    """serve()'s settings, handed to the event loop's coroutine."""

    api_key: str | None
    served_name: str
    max_body_bytes: int
    stuck_exit_s: float
    log_format: str
    metrics_public: bool
    about: dict[str, Any]
    key_hint: str | None  # how the start-up summary writes the key (never the key itself)
    constrain_tools: bool = True


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _serve(load_engine: LoadEngine, host: str, port: int, opts: _Options) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    app = create_app(None, None, served_name=opts.served_name, api_key=opts.api_key, context_length=0,
                     max_body_bytes=opts.max_body_bytes, about=opts.about, metrics_public=opts.metrics_public,
                     constrain_tools=opts.constrain_tools)
    runner = make_runner(app, shutdown_timeout=SHUTDOWN_GRACE_S, access_log_format=ACCESS_LOG_FORMAT,
                         access_log_class=QuietAccessLogger)
    await runner.setup()
    try:
        listener, _ = await listen(runner, host, port)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        await runner.cleanup()
        return 1
    sockets = listener.sockets
    bound_port = sockets[0].getsockname()[1] if sockets else port
    print(f"loading the model (GET {_url(host, bound_port)}/health answers 503 until it is ready)", flush=True)

    loaded: asyncio.Future[tuple[EngineProtocol, Tokenizer, int]] = loop.create_future()
    # A daemon thread, not the default executor: Ctrl-C during a long load must not wait for it to finish.
    threading.Thread(target=_load_in_thread, args=(load_engine, loop, loaded), name="strata-load", daemon=True).start()
    stop_wait = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loaded, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    engine: Any = None
    code = 0
    if loaded.done() and loaded.exception() is None:
        engine, tokenizer, context_length = loaded.result()
        install_engine(app, engine, tokenizer, context_length)
        # What loading left alive (JAX, compiled steps, the tokenizer) goes to the permanent generation: a full
        # collection would otherwise walk it all while holding the interpreter lock, stalling every stream.
        gc.collect()
        gc.freeze()
        url = _url(host, bound_port)
        about = {**opts.about, "context": context_length}
        server_state(app).about["context"] = context_length
        for line in startup_lines(url, opts.served_name, about, key_hint=opts.key_hint,
                                  metrics_public=opts.metrics_public):
            print(line, flush=True)
        if opts.log_format == "json":
            log_startup(url, opts.served_name, about)
        print(f"listening on {url}", flush=True)
        watch = asyncio.ensure_future(_until_stuck(engine, opts.stuck_exit_s))
        await asyncio.wait({stop_wait, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done():
            code = EXIT_STUCK
        watch.cancel()
    elif loaded.done():
        exc = loaded.exception()
        print(f"error: loading the model failed: {exc}", file=sys.stderr, flush=True)
        code = 1
    stop_wait.cancel()
    print("shutting down", file=sys.stderr, flush=True)
    listener.close()  # stop accepting
    shutdown = getattr(engine, "shutdown", None) or getattr(engine, "stop", None)
    if callable(shutdown):  # every stream ends now with a retryable error event (the engine thread is not awaited)
        await loop.run_in_executor(None, shutdown)
    await runner.cleanup()  # handlers write those events within SHUTDOWN_GRACE_S
    return code


async def _until_stuck(engine: Any, stuck_exit_s: float) -> None:
    """Returns once `engine.health()` has been false for `stuck_exit_s` seconds (never if it has no health())."""
    health = getattr(engine, "health", None)
    if health is None:
        await asyncio.Event().wait()
    loop = asyncio.get_running_loop()
    since = None
    while True:
        await asyncio.sleep(min(1.0, stuck_exit_s / 4))
        healthy, why = health()
        if healthy:
            since = None
            continue
        since = loop.time() if since is None else since
        if loop.time() - since >= stuck_exit_s:
            print(f"error: the engine is unhealthy ({why}) for {stuck_exit_s:g}s; exiting with code {EXIT_STUCK} so "
                  "a supervisor can restart the server", file=sys.stderr, flush=True)
            return


def _load_in_thread(load_engine: LoadEngine, loop: asyncio.AbstractEventLoop, out: asyncio.Future) -> None:
    def settle(result: Any, exc: BaseException | None) -> None:
        if not out.done():
            out.set_exception(exc) if exc is not None else out.set_result(result)

    try:
        result = load_engine()
    except BaseException as exc:  # noqa: BLE001 - reported on the event loop
        loop.call_soon_threadsafe(settle, None, exc)
        return
    loop.call_soon_threadsafe(settle, result, None)
