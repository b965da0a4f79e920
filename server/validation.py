"""Reading the fields of a request body with clear 4xx messages (the body itself: `server.body`).

Validation is deliberately loose about what it does not use (unknown fields and block types are ignored: clients
keep adding them) and strict about the types of what it does use.
"""

from __future__ import annotations

import json
import math
from typing import Any

from server.body import short as _short
from server.body import type_name as _type_name
from server.errors import invalid_request

_MISSING = object()


# Limits on what a body may contain (far above anything a real client sends).
MAX_SCHEMA_DEPTH = 64  # nesting of arrays/objects inside one tool's JSON schema
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def get_int(body: dict[str, Any], key: str, default: Any = _MISSING, *, minimum: int, maximum: int = INT32_MAX,
            path: str = "") -> Any:
    """An integer field in [minimum, maximum] (JSON numbers with an integral value are accepted; booleans are
    not); `default` when absent or null, required when no default. 400s name the field and the allowed range."""
    value = body.get(key, _MISSING)
    name = path + key
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise invalid_request(f"{name}: field required (an integer in {minimum}..{maximum})", name)
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid_request(f"{name}: expected an integer in {minimum}..{maximum}, got {_type_name(value)} "
                              f"{_short(json.dumps(value))}", name)
    if not minimum <= value <= maximum:
        raise invalid_request(f"{name}: must be an integer in {minimum}..{maximum}, got {_short_int(value)}", name)
    return value


def get_number(body: dict[str, Any], key: str, default: Any, *, minimum: float, maximum: float,
               path: str = "") -> Any:
    """A finite number field within [minimum, maximum]; `default` when absent or null. Integers of any size are
    range-checked before any conversion to float."""
    value = body.get(key)
    name = path + key
    allowed = f"a finite number between {minimum:g} and {maximum:g}"
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid_request(f"{name}: expected {allowed}, got {_type_name(value)} {_short(json.dumps(value))}",
                              name)
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid_request(f"{name}: expected {allowed}, got {value}", name)
    if not minimum <= value <= maximum:  # exact for ints of any size (no float overflow)
        shown = _short_int(value) if isinstance(value, int) else repr(value)
        raise invalid_request(f"{name}: must be {allowed}, got {shown}", name)
    return float(value)


def _short_int(value: int) -> str:
    if value.bit_length() <= 64:
        return str(value)
    return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"


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


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else")


def check_tool_schema(schema: dict[str, Any], path: str) -> None:
    """400 unless `schema` (a tool's input schema) is something the chat template and the tool-call parser can
    use: nesting at most MAX_SCHEMA_DEPTH deep, `properties` (and the like) objects of schemas, `required` a list
    of strings, `type` a string or list of strings, `enum` a list. Unknown keywords are left alone. Iterative."""
    depth = _container_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise invalid_request(f"{path}: the schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are "
                              "accepted", path)
    # (node, where, strict): a node under `properties` must be a schema; elsewhere odd values are left alone.
    stack: list[tuple[Any, str, bool]] = [(schema, path, True)]
    while stack:
        node, where, strict = stack.pop()
        if not isinstance(node, dict):
            if strict and not isinstance(node, bool):  # `true`/`false` are valid JSON schemas
                raise invalid_request(f"{where}: expected a JSON schema object, got {_type_name(node)}", where)
            continue
        kind = node.get("type")
        if kind is not None and not isinstance(kind, str) and not (
                isinstance(kind, list) and all(isinstance(k, str) for k in kind)):
            raise invalid_request(f"{where}.type: expected a string or a list of strings, got {_type_name(kind)}",
                                  f"{where}.type")
        required = node.get("required")
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise invalid_request(f"{where}.required: expected a list of strings", f"{where}.required")
        if node.get("enum") is not None and not isinstance(node["enum"], list):
            raise invalid_request(f"{where}.enum: expected an array, got {_type_name(node['enum'])}", f"{where}.enum")
        props = node.get("properties", {})
        if not isinstance(props, dict):  # `null` too: the chat template lists the properties
            raise invalid_request(f"{where}.properties: expected an object mapping parameter names to schemas, got "
                                  f"{_type_name(props)}", f"{where}.properties")
        for key in _SUBSCHEMA_MAPS:
            sub = node.get(key)
            if isinstance(sub, dict):
                stack.extend((v, f"{where}.{key}.{k}", key == "properties") for k, v in sub.items())
        for key in (*_SUBSCHEMA_LISTS, *_SUBSCHEMA_ONE):
            sub = node.get(key)
            if isinstance(sub, list):
                stack.extend((v, f"{where}.{key}.{i}", False) for i, v in enumerate(sub))
            elif isinstance(sub, dict):
                stack.append((sub, f"{where}.{key}", False))


def _container_depth(value: Any) -> int:
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
    return deepest
