"""Opaque cursors for paginated lists, and the headers that carry the next one.

A list answers a JSON array (as before cursors existed) and, when more items follow, the
cursor of the next page in `X-Next-Cursor` and a `Link: <...>; rel="next"` header.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from fastapi import Request, Response

NEXT_CURSOR_HEADER = "X-Next-Cursor"

PAGE_HEADERS: dict[str, Any] = {
    NEXT_CURSOR_HEADER: {
        "description": "the `cursor` of the next page; absent on the last page",
        "schema": {"type": "string"},
    },
    "Link": {"description": 'the next page\'s URL, `<...>; rel="next"`',
             "schema": {"type": "string"}},
}


GOAL_CURSOR = r"^[0-9]{1,17}-[0-9a-f]{32}$"
"""A goal page's cursor: the last goal's creation time (microseconds since 1970, UTC) and id.
Clients treat it as opaque; the pattern only makes every schema-valid cursor a position."""
CANDIDATE_CURSOR = r"^[0-9]{1,9}-[0-9]{1,9}$"
"""A candidate page's cursor: the last candidate's iteration and ordinal (opaque likewise)."""

_EPOCH = datetime(1970, 1, 1)


def goal_cursor(created_at: datetime, goal_id: str) -> str:
    micros = (created_at.replace(tzinfo=None) - _EPOCH) // timedelta(microseconds=1)
    return f"{micros}-{goal_id}"


def goal_position(cursor: str) -> tuple[datetime, str]:
    """The (created_at, id) a goal cursor names (the route's pattern has checked its form)."""
    micros, goal_id = cursor.split("-", 1)
    return _EPOCH + timedelta(microseconds=int(micros)), goal_id


def candidate_cursor(iteration: int, ordinal: int) -> str:
    return f"{iteration}-{ordinal}"


def candidate_position(cursor: str) -> tuple[int, int]:
    iteration, ordinal = cursor.split("-", 1)
    return int(iteration), int(ordinal)


def set_next(response: Response, request: Request, cursor: str | None) -> None:
    """Write the next page's cursor and link on `response` (nothing on the last page)."""
    if cursor is None:
        return
    response.headers[NEXT_CURSOR_HEADER] = cursor
    url = request.url.include_query_params(cursor=cursor)
    response.headers["Link"] = f'<{url}>; rel="next"'
