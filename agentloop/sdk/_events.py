"""Events: the model of one event of a goal's log, and what the two clients share (no I/O)
to follow `GET /v1/goals/{id}/events` (Server-Sent Events, read with httpx-sse).

Standalone on purpose: pydantic and httpx only, nothing of the server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator, Mapping
from datetime import datetime
from typing import Any

import httpx
from httpx_sse import ServerSentEvent, SSEError
from pydantic import BaseModel, Field

from agentloop.sdk._errors import AgentloopError

GOAL_FINISHED = "goal.finished"
"""A goal's last event: the server ends its stream after sending it."""
SETTLED_STATUSES = frozenset({"done", "failed", "cancelled", "waiting"})
"""Statuses `wait` returns at (terminal, or waiting for the caller's prompts)."""
RECONNECTS = 5
"""Connection failures in a row (no event in between) before `events()` gives up."""


class Event(BaseModel):
    """One event of a goal's log. `id` only grows; pass the last one you saw as `after` to
    resume. `type` is one of goal.created, goal.status (data: from, to, stop_reason),
    goal.best (candidate_id, score), goal.finished (status, stop_reason, error,
    best_candidate_id, best_score), iteration.opened (index, candidate_ids),
    iteration.closed (index, best_score), iteration.withdrawn (index, candidate_ids),
    candidate.started (candidate_id, iteration, attempt, worker), candidate.succeeded
    (candidate_id, iteration, attempt, clip_score, part_scores, image_url), candidate.failed
    (candidate_id, iteration, attempt, error, retry), candidate.cancelled (candidate_id,
    iteration, reason), candidate.pruned (candidate_id, iteration, attempt, pruned_at_step,
    preview_score, generation_cost, image_url: cut mid-denoise by its prune group). Scores are CLIPScore = 2.5 * max(cos, 0), from 0 to 2.5."""

    id: int
    goal_id: str
    type: str
    data: dict[str, Any] = Field(default_factory=dict)
    created_at: datetime


def event_of(sse: ServerSentEvent) -> Event:
    """The event an SSE message carries (its `data:` is the event as JSON)."""
    return Event.model_validate_json(sse.data)


def settles(event: Event) -> bool:
    """Whether this event may be the one `wait` returns at: the goal ended (its last event,
    `goal.finished`, which follows its terminal `goal.status`), or now waits for prompts."""
    return event.type == GOAL_FINISHED or (
        event.type == "goal.status" and event.data.get("to") == "waiting"
    )


def stream_headers(headers: Mapping[str, str], last_id: int | None) -> dict[str, str]:
    """The client's headers, plus where to resume (`Last-Event-ID`)."""
    out = dict(headers)
    if last_id is not None:
        out["Last-Event-ID"] = str(last_id)
    return out


def stream_unavailable(exc: BaseException) -> bool:
    """Whether `wait` should poll instead: the server has no event stream (an older server or
    a proxy: 404/405/406/501, or not `text/event-stream`), or the connection keeps failing."""
    if isinstance(exc, AgentloopError):
        return exc.status_code in (404, 405, 406, 501)
    return isinstance(exc, SSEError | httpx.TransportError)


def reconnect_delay(failures: int) -> float:
    """Seconds before reconnecting after `failures` failures in a row: 0.25, 0.5, 1, 2, 4."""
    return min(0.25 * 2 ** (failures - 1), 4.0)


def past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


class Deadline:
    """A streaming response whose reading stops at a deadline, keep-alives included: httpx-sse
    hides the server's pings, and a read timeout never fires while they arrive."""

    def __init__(self, response: httpx.Response, deadline: float | None):
        self.response = response
        self.headers = response.headers
        self.deadline = deadline

    def iter_text(self) -> Iterator[str]:
        for text in self.response.iter_text():
            if past(self.deadline):
                raise TimeoutError("deadline passed")
            yield text

    async def aiter_text(self) -> AsyncIterator[str]:
        async for text in self.response.aiter_text():
            if past(self.deadline):
                raise TimeoutError("deadline passed")
            yield text


def stream_timeout(timeout: float, deadline: float | None) -> httpx.Timeout:
    """The client's timeout, with reads cut at the deadline (a silent stream then times out
    when the caller's wait does)."""
    if deadline is None:
        return httpx.Timeout(timeout)
    return httpx.Timeout(timeout, read=min(timeout, max(deadline - time.monotonic(), 0.05)))
