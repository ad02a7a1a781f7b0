"""The OpenAI error envelope, used for every error either service returns.

    {"error": {"message": "...", "type": "...", "code": "..."}}
"""
from __future__ import annotations

import json
import logging

from flask import Response
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

# HTTP status -> OpenAI error type, for callers that do not name one.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    415: "invalid_request_error",
    417: "invalid_request_error",
    421: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    501: "invalid_request_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


# HTTP status -> Anthropic's error type (its JSON and SSE error shape).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 529: "overloaded_error",
                   503: "overloaded_error"}


def anthropic_error(message: str, status: int) -> dict:
    """An error in Anthropic's shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"),
                                       "message": message}}


def error_body(message: str, status: int = 500, type_: str | None = None,
               code: str | None = None, param: str | None = None) -> dict:
    """The envelope as a dict (for SSE error events and JSON responses)."""
    err = {
        "message": message,
        "type": type_ or _TYPES.get(status, "server_error"),
        "code": code,
    }
    if param is not None:
        err["param"] = param
    return {"error": err}


def error_response(message: str, status: int = 500, type_: str | None = None,
                   code: str | None = None, param: str | None = None,
                   headers: dict | None = None) -> Response:
    """A Flask response carrying the envelope with the given HTTP status."""
    return Response(
        json.dumps(error_body(message, status, type_, code, param)),
        status=status,
        mimetype="application/json",
        headers=headers,
    )


class ApiError(Exception):
    """Raise anywhere in a request handler; the app turns it into the envelope."""

    def __init__(self, message: str, status: int = 500, type_: str | None = None,
                 code: str | None = None, headers: dict | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_
        self.code = code
        self.headers = headers or {}
        self.param = param

    def response(self) -> Response:
        return error_response(self.message, self.status, self.type, self.code,
                              param=getattr(self, "param", None), headers=self.headers)


def too_large(limit: int) -> Response:
    """413 for a request body beyond `limit` bytes (MAX_BODY_BYTES)."""
    return error_response(f"request body too large: the limit is {limit} bytes "
                          "(MAX_BODY_BYTES)", 413, code="body_too_large",
                          headers={"Connection": "close"})


def error_for(e: Exception, log: logging.Logger, body_limit: int | None = None) -> Response:
    """The envelope answering an exception a request handler raised: the one
    mapping, for every route (install_error_handlers). Anything unexpected is
    logged with its trace and answered 500, without it."""
    if isinstance(e, ApiError):
        return e.response()
    if isinstance(e, RequestEntityTooLarge) and body_limit is not None:
        return too_large(body_limit)
    if isinstance(e, HTTPException):
        # Its own fields kept (a 405's Allow), its HTML Content-Type not.
        headers = {k: v for k, v in e.get_headers() if k.lower() != "content-type"}
        return error_response(e.description or e.name, e.code or 500, headers=headers or None)
    log.error("unhandled error", exc_info=e)
    return error_response(f"internal error: {type(e).__name__}: {e}", 500)


def install_error_handlers(app) -> None:
    """Make every error of a Flask app answer in the envelope (no HTML, no traces)."""
    app.register_error_handler(
        Exception, lambda e: error_for(e, app.logger, app.config.get("MAX_CONTENT_LENGTH")))
