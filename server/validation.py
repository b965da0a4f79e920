"""Reading request bodies and their fields with clear 4xx messages.

Validation is deliberately loose about what it does not use (unknown fields and block types are ignored: clients
keep adding them) and strict about the types of what it does use.
"""

from __future__ import annotations

import json
import math
from typing import Any

from aiohttp import web

from server.errors import ApiError, invalid_request

_MISSING = object()


async def read_json_object(request: web.Request, max_bytes: int) -> dict[str, Any]:
    """The request body parsed as a JSON object; 413 when over `max_bytes`, 400 when not a JSON object."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise ApiError(413, f"request body is too large: {request.content_length} bytes > {max_bytes} maximum")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, f"request body is too large (maximum {max_bytes} bytes)") from exc
    if not raw.strip():
        raise invalid_request("the request body is empty: expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise invalid_request(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _type_name(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def get_int(body: dict[str, Any], key: str, default: Any = _MISSING, *, minimum: int | None = None,
            path: str = "") -> Any:
    """An integer field (JSON numbers with an integral value are accepted; booleans are not)."""
    value = body.get(key, _MISSING)
    name = path + key
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise invalid_request(f"{name}: field required", name)
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"{name}: expected an integer, got {_type_name(value)} {json.dumps(value)[:40]}", name)
    if minimum is not None and value < minimum:
        raise invalid_request(f"{name}: must be >= {minimum}, got {value}", name)
    return value


def get_number(body: dict[str, Any], key: str, default: Any, *, minimum: float | None = None,
               maximum: float | None = None, path: str = "") -> Any:
    """A finite number field within [minimum, maximum]; `default` when absent or null."""
    value = body.get(key)
    name = path + key
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_request(f"{name}: expected a number, got {_type_name(value)} {json.dumps(value)[:40]}", name)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise invalid_request(f"{name}: must be between {minimum} and {maximum}, got {value}", name)
    return float(value)


def _get_typed(body: dict[str, Any], key: str, default: Any, path: str, kind: type, label: str) -> Any:
    """A field of JSON type `label` (Python `kind`); `default` when absent or null, required when `_MISSING`."""
    value = body.get(key)
    name = path + key
    if value is None:
        if default is _MISSING:
            raise invalid_request(f"{name}: field required", name)
        return default
    if not isinstance(value, kind):
        raise invalid_request(f"{name}: expected {label}, got {_type_name(value)}", name)
    return value


def get_bool(body: dict[str, Any], key: str, default: bool, *, path: str = "") -> bool:
    """A boolean field; `default` when absent or null."""
    return _get_typed(body, key, default, path, bool, "a boolean")


def get_str(body: dict[str, Any], key: str, default: Any = _MISSING, *, path: str = "") -> Any:
    """A string field; `default` when absent or null (required when no default)."""
    return _get_typed(body, key, default, path, str, "a string")


def get_list(body: dict[str, Any], key: str, default: Any = _MISSING, *, path: str = "") -> Any:
    """A list field; `default` when absent or null (required when no default)."""
    return _get_typed(body, key, default, path, list, "an array")


def get_dict(body: dict[str, Any], key: str, default: Any = None, *, path: str = "") -> Any:
    """An object field; `default` when absent or null."""
    return _get_typed(body, key, default, path, dict, "an object")


def get_stop_strings(body: dict[str, Any], key: str) -> tuple[str, ...]:
    """A stop-sequence field: a string or a list of strings (empty strings dropped)."""
    value = body.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid_request(f"{key}: expected a list of strings", key)
    return tuple(dict.fromkeys(s for s in value if s))


def expect_dict(value: Any, name: str) -> dict[str, Any]:
    """`value` if it is an object, else a 400 naming `name`."""
    if not isinstance(value, dict):
        raise invalid_request(f"{name}: expected an object, got {_type_name(value)}", name)
    return value
