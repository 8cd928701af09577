"""Opaque cursors for paginated lists, and the headers that carry the next one.

A list answers a JSON array (as before cursors existed) and, when more items follow, the
cursor of the next page in `X-Next-Cursor` and a `Link: <...>; rel="next"` header.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError

NEXT_CURSOR_HEADER = "X-Next-Cursor"

PAGE_HEADERS: dict[str, Any] = {
    NEXT_CURSOR_HEADER: {
        "description": "the `cursor` of the next page; absent on the last page",
        "schema": {"type": "string"},
    },
    "Link": {"description": 'the next page\'s URL, `<...>; rel="next"`',
             "schema": {"type": "string"}},
}


def encode_cursor(kind: str, *position: Any) -> str:
    raw = json.dumps([kind, *position], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, kind: str, arity: int) -> list[Any]:
    """The position a cursor names; a 422 for the `cursor` field if it is not one of ours."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value = json.loads(raw)
        if not (isinstance(value, list) and len(value) == arity + 1 and value[0] == kind):
            raise ValueError(cursor)
        return value[1:]
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise RequestValidationError([{
            "loc": ("query", "cursor"), "type": "value_error",
            "msg": "not a cursor of this list; pass the X-Next-Cursor of a previous page",
        }]) from None


def goal_position(cursor: str) -> tuple[datetime, str]:
    created, goal_id = decode_cursor(cursor, "g", 2)
    try:
        return datetime.fromisoformat(created), str(goal_id)
    except (TypeError, ValueError):
        return decode_cursor("", "g", 2)  # type: ignore[return-value]  # raises the 422


def candidate_position(cursor: str) -> tuple[int, int]:
    iteration, ordinal = decode_cursor(cursor, "c", 2)
    if not (isinstance(iteration, int) and isinstance(ordinal, int)):
        decode_cursor("", "c", 2)
    return iteration, ordinal


def set_next(response: Response, request: Request, cursor: str | None) -> None:
    """Write the next page's cursor and link on `response` (nothing on the last page)."""
    if cursor is None:
        return
    response.headers[NEXT_CURSOR_HEADER] = cursor
    url = request.url.include_query_params(cursor=cursor)
    response.headers["Link"] = f'<{url}>; rel="next"'
