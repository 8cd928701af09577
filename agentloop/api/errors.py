"""Error answers and the body limit: what the API says when input is refused, instead of a
500 or a dropped connection.

Every error answers one body (see docs/api.md, "Errors"):

    {"error": {"code": "iteration_open", "message": "...", "field": null, "errors": [...]},
     "detail": ...}

`error.code` is stable and machine-readable; `error.errors` lists each refused field of a 422.
`detail` is FastAPI's former body (a string, or the `[{"loc", "msg", "type"}]` list of a 422),
kept so that clients written against it keep working."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentloop.settings import Settings

ECHO_CHARS = 200
"""Longest refused input echoed back in a 422 (never a whole megabyte prompt)."""


def echo_safe(value: Any) -> Any:
    """A refused input as it may be sent back in JSON: NaN and infinity spelled as strings,
    lone surrogates replaced (they have no UTF-8 form), long text cut."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        text = value if len(value) <= ECHO_CHARS else value[:ECHO_CHARS] + "…"
        return text.encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {echo_safe(k): echo_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [echo_safe(v) for v in value]
    return value


REDACTED = "[redacted]"


def redact_secrets(errors: Any) -> Any:
    """Refused inputs with every webhook secret blanked: a 422 never echoes a secret (the
    input of an error about a `secret`, and any `secret` key inside an echoed object)."""
    def blank(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: REDACTED if k == "secret" else blank(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [blank(v) for v in value]
        return value

    out = []
    for e in errors:
        e = dict(e)
        if "input" in e:
            e["input"] = REDACTED if "secret" in map(str, e.get("loc", ())) else blank(e["input"])
        out.append(e)
    return out


ERROR_CODES: dict[str, str] = {
    "not_found": "no such goal, route or artifact (404)",
    "validation_error": "the request was refused; `errors` names each field (422)",
    "invalid_body": "the body is not JSON or not UTF-8 (422)",
    "not_external": "the goal's reviser is not 'external' (409)",
    "goal_not_waiting": "the goal does not wait for prompts now (409)",
    "iteration_open": "the previous iteration is still running (409)",
    "budget_exceeded": "more prompts than generations left (409)",
    "goal_finished": "the goal has finished (409)",
    "idempotency_key_reused": "the Idempotency-Key was used with another body (422)",
    "idempotency_in_progress": "a request with this Idempotency-Key is still running (409)",
    "method_not_allowed": "the path does not take this method (405)",
    "body_too_large": "the body is over the size limit (413)",
    "invalid_image": "a goal's init_image is not base64 of one readable PNG or JPEG (422)",
    "image_too_large": "a goal's init_image is over the server's max_init_image_bytes (413)",
    "invalid_init_candidate": "a goal's init_candidate_id names no succeeded candidate of "
    "the tenant with an image (422)",
    "broker_unavailable": "the task broker is unavailable; retry (503)",
    "database_unavailable": "the database is unavailable; retry (503)",
}
"""Every stable `error.code` the API answers, with what it means (the table in docs/api.md)."""

_CODE_OF_STATUS = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed",
                   409: "conflict", 413: "body_too_large", 422: "validation_error",
                   503: "service_unavailable"}


class ApiError(Exception):
    """An error a route answers: HTTP status, stable code, message, optionally the field."""

    def __init__(
        self, status_code: int, code: str, message: str, *, field: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers


def error_body(
    code: str, message: str, *, field: str | None = None,
    errors: list[dict[str, Any]] | None = None, detail: Any = None,
) -> dict[str, Any]:
    """The one error body: `{"error": {...}, "detail": ...}` (detail defaults to message)."""
    error: dict[str, Any] = {"code": code, "message": message}
    if field is not None:
        error["field"] = field
    if errors is not None:
        error["errors"] = errors
    return {"error": error, "detail": message if detail is None else detail}


def error_response(
    status_code: int, code: str, message: str, *, headers: dict[str, str] | None = None,
    **rest: Any,
) -> JSONResponse:
    return JSONResponse(error_body(code, message, **rest), status_code=status_code,
                        headers=headers)


def _field_of(loc: Any) -> str:
    parts = [str(p) for p in loc or ()]
    if len(parts) > 1 and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or "body"


def validation_response(detail: list[dict[str, Any]]) -> JSONResponse:
    """A 422 naming every refused field, from FastAPI-style `[{"loc", "msg", "type"}]`."""
    errors = [{"field": _field_of(d.get("loc")), "message": str(d.get("msg", "")),
               "type": str(d.get("type", "value_error"))} for d in detail]
    body_broken = any(d.get("type") in ("json_invalid", "json_type") for d in detail)
    code = "invalid_body" if body_broken else "validation_error"
    message = "; ".join(f"{e['field']}: {e['message']}" for e in errors) or "invalid request"
    field = errors[0]["field"] if len(errors) == 1 else None
    return error_response(422, code, message, field=field, errors=errors, detail=detail)


def too_large_message(max_bytes: int) -> str:
    return f"request body larger than {max_bytes} bytes"


class BodyLimit:
    """Refuse a request body over `max_bytes` with 413: at once when its Content-Length says
    so, else when the bytes streamed so far pass the limit (a chunked upload has no length).

    Pure ASGI, outermost, so nothing reads an oversized body into memory first."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            response = error_response(413, "body_too_large", too_large_message(self.max_bytes))
            await response(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # An HTTPException passes through FastAPI's body parsing to the 413 handler.
                    raise HTTPException(413, too_large_message(self.max_bytes))
            return message

        await self.app(scope, counted, send)


def install_error_handlers(app: FastAPI, settings: Settings) -> None:
    """Register the handlers for refused input, and for a database that went away, on `app`."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        """A route's refusal, with its stable code."""
        return error_response(exc.status_code, exc.code, exc.message, field=exc.field,
                              headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Any other HTTP error (an unknown route's 404, ...) in the one error body."""
        code = _CODE_OF_STATUS.get(exc.status_code, f"http_{exc.status_code}")
        return error_response(exc.status_code, code, str(exc.detail),
                              headers=dict(exc.headers or {}) or None)

    @app.exception_handler(OperationalError)
    async def database_unavailable(_request: Request, _exc: OperationalError) -> JSONResponse:
        """The database went away (restart, failover): 503, retry later; never a hang or 500."""
        return error_response(503, "database_unavailable",
                              "the database is unavailable; retry shortly",
                              headers={"Retry-After": "5"})

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422, with each refused input made safe to send back (FastAPI's own
        handler fails on `NaN` or a lone surrogate, answering 500)."""
        return validation_response(jsonable_encoder(echo_safe(redact_secrets(exc.errors()))))

    @app.exception_handler(DataError)
    async def data_error(request: Request, exc: DataError) -> JSONResponse:
        """A value the database refused (too long, out of range, unstorable) is the caller's
        input: 422, never 500. Validation should catch it first; this is the backstop."""
        reason = str(exc.orig).splitlines()[0][:ECHO_CHARS] if exc.orig is not None else "invalid"
        return validation_response([{"loc": ["body"], "type": "value_error",
                                     "msg": f"the database refused a value: {reason}"}])

    @app.exception_handler(413)
    async def body_too_large(request: Request, exc: HTTPException) -> JSONResponse:
        """Say what the limit is (checked on Content-Length and on the bytes streamed)."""
        return error_response(413, "body_too_large", too_large_message(settings.max_body_bytes))

    @app.exception_handler(405)
    async def method_not_allowed(request: Request, exc: HTTPException) -> JSONResponse:
        """List every method of the path in `Allow`: the router names only the first route's
        (GET and POST /v1/goals are two routes)."""
        path = request.scope["path"]
        methods = sorted({
            m for r in app.routes if isinstance(r, Route) and r.path_regex.match(path)
            for m in r.methods or ()
        })
        return error_response(405, "method_not_allowed", "Method Not Allowed",
                              headers={"Allow": ", ".join(methods)})
