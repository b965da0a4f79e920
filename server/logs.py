"""What `serve` logs: one line per generation request at its end, a start-up summary, and aiohttp's access lines for
the other requests; as text or as one JSON object per line (`serve --log-format json`)."""

from __future__ import annotations

import datetime
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger

from server.monitor import Finished

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

# Set on a request whose generation logged its own line: its access line would only repeat it.
LOGGED: Any = web.RequestKey("strata_logged", bool) if hasattr(web, "RequestKey") else "strata_logged"

# Successful requests to these paths are polled (the web page's monitor, probes) or are the page's own files: their
# access lines would drown the requests that matter.
QUIET_PATHS = ("/", "/health", "/v1/monitor", "/favicon.ico")
QUIET_PREFIXES = ("/ui/",)

request_log = logging.getLogger("strata.requests")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, and the record's `fields` (structured data)."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a single JSON line."""
        out: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, Mapping):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(log_format: str = "text", stream: Any = None) -> None:
    """Set up the root handler (stderr) in `log_format` ("text" or "json") and the server's loggers' levels."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    for name in ("aiohttp.access", "strata.server", "strata.requests", "strata_jax.engine"):
        logging.getLogger(name).setLevel(logging.INFO)


def log_request(finished: Finished) -> None:
    """The request's line at its end: id, API, prompt / cached / output tokens, TTFT, tok/s, duration, stop, slot."""
    f = finished
    ttft = "-" if f.ttft_s is None else f"{f.ttft_s:.3f}s"
    speed = "-" if f.tok_s is None else f"{f.tok_s:.1f}"
    slot = "-" if f.slot is None else str(f.slot)
    request_log.info(
        "%s %s: prompt %d tokens (%d cached), output %d, TTFT %s, %s tok/s, %.2fs, stop %s, slot %s",
        f.request_id, f.api, f.prompt_tokens, f.cached_tokens, f.output_tokens, ttft, speed, f.duration_s, f.stop,
        slot,
        extra={"fields": {"event": "request", "request_id": f.request_id, "api": f.api,
                          "prompt_tokens": f.prompt_tokens, "cached_tokens": f.cached_tokens,
                          "output_tokens": f.output_tokens, "ttft_s": _round(f.ttft_s, 3),
                          "tok_s": _round(f.tok_s, 2), "duration_s": round(f.duration_s, 3), "stop": f.stop,
                          "slot": f.slot}},
    )


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


class QuietAccessLogger(AccessLogger):
    """aiohttp's access log without the lines that only repeat a request line or come from polling (see
    QUIET_PATHS); failures of those are still logged."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        """Log the access line unless the request is one of the quiet ones."""
        if request.get(LOGGED):
            return
        if response.status < 400 and (request.path in QUIET_PATHS or request.path.startswith(QUIET_PREFIXES)):
            return
        super().log(request, response, time)


def startup_lines(url: str, served_name: str, about: Mapping[str, Any], *, key_hint: str | None,
                  metrics_public: bool) -> list[str]:
    """The summary printed when the server is ready: model, plan, slots x context, the URL and its web page, and
    how to point Claude Code and OpenAI clients at it. `key_hint` stands for the API key in those commands (None:
    the server has no key)."""
    lines = ["ready:"]
    model = about.get("model")
    if model:
        detail = ", ".join(str(about[k]) for k in ("dtype", "backend") if about.get(k))
        lines.append(f"  model     {model}" + (f" ({detail})" if detail else "") + f", served as {served_name!r}")
    if about.get("slots") and about.get("context"):
        draft = about.get("draft")
        lines.append(f"  slots     {about['slots']} x {about['context']:,} tokens of context"
                     + (f", drafter {draft}" if draft and draft != "none" else ""))
    if about.get("plan_summary"):
        lines.append(f"  plan      {about['plan_summary']}")
    lines.append(f"  web UI    {url}/  (chat and live monitor)")
    lines.append(f"  metrics   {url}/metrics" + ("  (no key needed from this machine)" if metrics_public and key_hint
                                                   else ""))
    token = key_hint or "local"
    lines.append(f"  Claude Code:  ANTHROPIC_BASE_URL={url} ANTHROPIC_AUTH_TOKEN={token} "
                 f"ANTHROPIC_MODEL={served_name} claude")
    lines.append(f"  OpenAI SDKs:  base_url={url}/v1 api_key={token}")
    return lines


def log_startup(url: str, served_name: str, about: Mapping[str, Any]) -> None:
    """The start-up summary as one structured record (for `--log-format json`)."""
    logging.getLogger("strata.server").info(
        "ready: %s on %s", served_name, url,
        extra={"fields": {"event": "ready", "url": url, "served_name": served_name, **dict(about)}})
