"""Reading a request body: size and time limits, Content-Encoding, strict UTF-8, bounded JSON nesting, no lone
surrogates; every failure is a 4xx `ApiError` in the API's shape."""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError
from aiohttp.web_protocol import RequestPayloadError

from server.errors import ApiError, invalid_request

# Limits on what a body may contain (far above anything a real client sends).
MAX_JSON_DEPTH = 128  # nesting of arrays/objects in a request body

# Bodies may be sent compressed with these Content-Encodings (decoded here, under the body size limit).
SUPPORTED_ENCODINGS = ("gzip", "deflate", "identity")

# Waiting for the request body: at most this long without a byte arriving, and this long in all.
BODY_IDLE_TIMEOUT_S = 30.0
BODY_TOTAL_TIMEOUT_S = 300.0
_PARSE_INLINE_BYTES = 256 * 1024  # bodies from this size are decoded and parsed in a worker thread

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


async def read_json_object(request: web.Request, max_bytes: int, *, idle_timeout_s: float = BODY_IDLE_TIMEOUT_S,
                           total_timeout_s: float = BODY_TOTAL_TIMEOUT_S) -> dict[str, Any]:
    """The request body parsed as a JSON object.

    413 when over `max_bytes` (before or after decompression), 415 for an unsupported Content-Encoding, 408 when the
    client stalls, 400 for a corrupt compressed body, invalid UTF-8, lone surrogates, nesting deeper than
    MAX_JSON_DEPTH or anything else that is not a JSON object.
    """
    codings = _content_codings(request)  # 415 before reading a body nobody can decode
    raw = await _read_raw(request, max_bytes, idle_timeout_s, total_timeout_s)
    decode = codings and getattr(request.content, "total_compressed_bytes", None) is None
    if not decode and len(raw) < _PARSE_INLINE_BYTES:
        return parse_json_object(raw)

    def decode_and_parse() -> dict[str, Any]:
        return parse_json_object(decode_content(raw, codings, max_bytes) if decode else raw)

    # Megabytes of JSON (or a body to inflate) take long enough to stall every other client: a worker thread.
    return await asyncio.to_thread(decode_and_parse)


async def read_request_json(request: web.Request, state: Any) -> dict[str, Any]:
    """`read_json_object` under the server's limits (`state`: a ServerState)."""
    return await read_json_object(request, state.max_body_bytes, idle_timeout_s=state.body_idle_timeout_s,
                                  total_timeout_s=state.body_total_timeout_s)


def _content_codings(request: web.Request) -> list[str]:
    header = ",".join(request.headers.getall("Content-Encoding", []))
    codings = [c.strip().lower() for c in header.split(",") if c.strip()]
    for coding in codings:
        if coding not in SUPPORTED_ENCODINGS and coding != "x-gzip":
            raise ApiError(415, f"unsupported Content-Encoding {coding[:40]!r}: send the body uncompressed or "
                                f"as {', '.join(SUPPORTED_ENCODINGS[:2])}")
    return [c for c in codings if c != "identity"]


async def _read_raw(request: web.Request, max_bytes: int, idle_timeout_s: float, total_timeout_s: float) -> bytes:
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"request body is too large: {request.content_length} bytes > {max_bytes} maximum")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + total_timeout_s
    chunks: list[bytes] = []
    size = 0
    while True:
        wait = min(idle_timeout_s, deadline - loop.time())
        try:
            if wait <= 0:
                raise TimeoutError
            async with asyncio.timeout(wait):
                chunk = await request.content.readany()
        except TimeoutError:
            raise ApiError(408, f"timed out reading the request body (no data for {idle_timeout_s:g} s, or over "
                                f"{total_timeout_s:g} s in all)") from None
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"request body is too large (maximum {max_bytes} bytes)") from exc
        except RequestPayloadError as exc:
            cause = exc.__cause__ or exc
            if isinstance(cause, ContentEncodingError):
                raise ApiError(400, "the request body could not be decompressed: it does not match its "
                                    "Content-Encoding") from exc
            raise ApiError(400, f"the request body could not be read: {short(str(cause), 120)}") from exc
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"request body is too large (maximum {max_bytes} bytes)")
        chunks.append(chunk)


def decode_content(raw: bytes, codings: list[str], max_bytes: int) -> bytes:
    """`raw` with its Content-Encodings (gzip/x-gzip/deflate, applied in `codings` order) undone; 413 when the result
    exceeds `max_bytes` (a decompression bomb stops there), 400 when the data is corrupt or truncated."""
    for coding in reversed(codings):
        if not raw:
            continue
        if coding in ("gzip", "x-gzip"):
            wbits = 16 + zlib.MAX_WBITS
        else:  # deflate: zlib-wrapped per the RFC; some clients send a raw deflate stream
            wbits = zlib.MAX_WBITS if raw[0] & 0x0F == 8 else -zlib.MAX_WBITS
        raw = _inflate(raw, wbits, max_bytes, coding)
    return raw


def _inflate(data: bytes, wbits: int, max_bytes: int, coding: str) -> bytes:
    out: list[bytes] = []
    size = 0
    try:
        while data:
            d = zlib.decompressobj(wbits)
            chunk = d.decompress(data, max_bytes + 1 - size)
            size += len(chunk)
            out.append(chunk)
            if size > max_bytes or d.unconsumed_tail:
                raise ApiError(413, f"request body is too large once decompressed (maximum {max_bytes} bytes)")
            if not d.eof:
                raise ApiError(400, f"the request body is truncated {coding} data")
            data = d.unused_data if wbits > 0 and coding != "deflate" else b""  # concatenated gzip members
            if data and not data.strip(b"\0"):
                data = b""
    except zlib.error as exc:
        raise ApiError(400, f"the request body is not valid {coding} data: {exc}") from exc
    return b"".join(out)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A body parsed as a JSON object: strict UTF-8, nesting <= MAX_JSON_DEPTH, no NaN/Infinity, no lone surrogates
    (neither raw nor \\u-escaped) anywhere; 400 for anything else."""
    if not raw.strip():
        raise invalid_request("the request body is empty: expected a JSON object")
    try:
        text = raw.decode("utf-8")  # strict: also refuses UTF-8-encoded surrogates (ED A0 80..ED BF BF)
    except UnicodeDecodeError as exc:
        raise invalid_request(f"the request body is not valid UTF-8 (byte {exc.start}: {exc.reason})") from exc
    text = text.removeprefix("\ufeff")
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise invalid_request(f"the request body nests arrays/objects too deeply; at most {MAX_JSON_DEPTH} levels "
                              "are accepted") from exc
    except ValueError as exc:  # NaN/Infinity, integers over Python's digit limit
        reason = "a number has too many digits" if "digits" in str(exc) else short(str(exc), 120)
        raise invalid_request(f"the request body is not valid JSON: {reason}") from exc
    depth = json_nesting_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise invalid_request(f"the request body nests arrays/objects {depth} deep; at most {MAX_JSON_DEPTH} "
                              "levels are accepted")
    if not isinstance(body, dict):
        raise invalid_request(f"the request body must be a JSON object, got {type_name(body)}")
    if _SURROGATE_ESCAPE.search(text):
        where = find_lone_surrogate(body)
        if where is not None:
            raise invalid_request(f"{short(where, 80)}: contains a lone UTF-16 surrogate (\\ud800-\\udfff), which "
                                  "is not valid Unicode", where)
    return body


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def json_nesting_depth(value: Any) -> int:
    """The deepest array/object nesting of a parsed JSON value (0 for a scalar), walked without recursion.

    Measured on the parsed value rather than by scanning the text: json.loads refuses what would exhaust Python's
    recursion itself, and a regular expression over a megabytes-long body holds the interpreter lock for a tenth of
    a second or more, stalling the event loop."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        depth += 1
        deepest = max(deepest, depth)
        stack.extend((sub, depth) for sub in item if isinstance(sub, (dict, list)))
    return deepest


def find_lone_surrogate(value: Any) -> str | None:
    """The dotted path of the first string (value or key) holding a surrogate code point, or None. Iterative."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, sub in item.items():
                where = f"{path}.{key}" if path else key
                if _SURROGATE.search(key):
                    return where.encode("utf-8", "backslashreplace").decode()
                stack.append((sub, where))
        elif isinstance(item, list):
            stack.extend((sub, f"{path}.{i}" if path else str(i)) for i, sub in enumerate(item))
    return None


def short(text: str, limit: int = 40) -> str:
    """`text`, cut to `limit` characters with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_name(value: Any) -> str:
    """The JSON type name of a parsed value (for error messages)."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)
