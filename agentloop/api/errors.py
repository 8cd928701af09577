"""Error answers and the body limit: what the API says when input is refused, instead of a
500 or a dropped connection. Every 422 keeps FastAPI's `{"detail": [{"loc", "msg", "type"}]}`
shape."""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
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
            response = JSONResponse({"detail": too_large_message(self.max_bytes)}, status_code=413)
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

    @app.exception_handler(OperationalError)
    async def database_unavailable(_request: Request, _exc: OperationalError) -> JSONResponse:
        """The database went away (restart, failover): 503, retry later; never a hang or 500."""
        return JSONResponse(
            {"detail": "the database is unavailable; retry shortly"}, status_code=503,
            headers={"Retry-After": "5"},
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """FastAPI's 422, with each refused input made safe to send back (FastAPI's own
        handler fails on `NaN` or a lone surrogate, answering 500)."""
        return JSONResponse({"detail": jsonable_encoder(echo_safe(exc.errors()))},
                            status_code=422)

    @app.exception_handler(DataError)
    async def data_error(request: Request, exc: DataError) -> JSONResponse:
        """A value the database refused (too long, out of range, unstorable) is the caller's
        input: 422, never 500. Validation should catch it first; this is the backstop."""
        reason = str(exc.orig).splitlines()[0][:ECHO_CHARS] if exc.orig is not None else "invalid"
        return JSONResponse(
            {"detail": [{"loc": ["body"], "msg": f"the database refused a value: {reason}",
                         "type": "value_error"}]},
            status_code=422,
        )

    @app.exception_handler(413)
    async def body_too_large(request: Request, exc: HTTPException) -> JSONResponse:
        """Say what the limit is (checked on Content-Length and on the bytes streamed)."""
        return JSONResponse({"detail": too_large_message(settings.max_body_bytes)},
                            status_code=413)

    @app.exception_handler(405)
    async def method_not_allowed(request: Request, exc: HTTPException) -> JSONResponse:
        """List every method of the path in `Allow`: the router names only the first route's
        (GET and POST /v1/goals are two routes)."""
        path = request.scope["path"]
        methods = sorted({
            m for r in app.routes if isinstance(r, Route) and r.path_regex.match(path)
            for m in r.methods or ()
        })
        return JSONResponse({"detail": "Method Not Allowed"}, status_code=405,
                            headers={"Allow": ", ".join(methods)})
