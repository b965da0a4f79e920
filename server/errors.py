"""API errors and their two wire shapes (Anthropic's and OpenAI's).

Handlers raise `ApiError`; the app's error middleware turns it (and aiohttp's own HTTP exceptions) into a JSON body
in the shape the calling client understands.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

# Anthropic's error type for each status code it documents.
ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}

# OpenAI's `error.type` values for the same situations.
OPENAI_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    529: "server_error",
}


class ApiError(Exception):
    """An error answered to the client: HTTP `status`, a `message`, optionally the offending `param`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    @property
    def anthropic_type(self) -> str:
        """The Anthropic `error.type` for this status."""
        return anthropic_error_type(self.status)


def invalid_request(message: str, param: str | None = None) -> ApiError:
    """A 400 invalid_request_error."""
    return ApiError(400, message, param=param)


def anthropic_error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status (api_error for unknown 5xx, invalid_request_error for 4xx)."""
    return ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """`{"type": "error", "error": {"type": ..., "message": ...}}`."""
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def openai_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """`{"error": {"message", "type", "param", "code"}}` as OpenAI's API returns it."""
    err_type = OPENAI_ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": None}}


def generic_error_body(status: int, message: str) -> dict[str, Any]:
    """An error body both SDKs read, for errors raised before the API is known (malformed HTTP): Anthropic's shape
    whose `error` object also carries OpenAI's `param`/`code` (both SDKs read `error.type` and `error.message`)."""
    body = anthropic_error_body(status, message)
    body["error"].update(param=None, code=None)
    return body


def error_response(status: int, message: str, *, openai: bool, param: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    """A JSON error response in the Anthropic or OpenAI shape."""
    body = openai_error_body(status, message, param) if openai else anthropic_error_body(status, message)
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=headers,
    )


# Paths only OpenAI-style clients use; /v1/models is shared and decided by the anthropic-version header.
OPENAI_PATH_PREFIXES = ("/v1/chat/", "/v1/completions", "/v1/embeddings", "/v1/responses")


def is_openai_request(request: web.Request) -> bool:
    """Whether errors for `request` should use OpenAI's shape: OpenAI-only paths, and the shared /v1/models when
    the client sent no `anthropic-version` header (Anthropic SDKs and Claude Code always send it)."""
    path = request.path
    if path.startswith(OPENAI_PATH_PREFIXES):
        return True
    return path.startswith("/v1/models") and "anthropic-version" not in request.headers
