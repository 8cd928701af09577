"""The synchronous client. Only the sending path lives here; `_async.py` repeats it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx
from httpx_sse import EventSource, connect_sse

from agentloop.sdk import _events
from agentloop.sdk._base import BaseClient, Call, GoalRef, Page, PromptLike, error_for
from agentloop.sdk._errors import AgentloopError
from agentloop.sdk._events import Event
from agentloop.sdk._models import Candidate, Goal, IterationAccepted, Models, WebhookDelivery

T = TypeVar("T")


class Client(BaseClient):
    """agentloop over HTTP, blocking.

    `transport` (an `httpx.BaseTransport`) and `timeout` configure the httpx client this
    makes; or pass your own `http_client` (anything with httpx's `request()`, e.g. Starlette's
    `TestClient`), which is then yours to close.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        max_retries: int = 3,
        retry_backoff: float = 0.5,
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
    ):
        super().__init__(
            base_url, token=token, headers=headers, timeout=timeout, max_retries=max_retries,
            retry_backoff=retry_backoff,
        )
        if http_client is not None and transport is not None:
            raise ValueError("pass either transport or http_client, not both")
        self._owns_http = http_client is None
        self._http = http_client or httpx.Client(transport=transport, timeout=timeout)

    def _request(self, call: Call[T]) -> T:
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    call.method, call.url, params=call.params, json=call.json,
                    headers=self._headers_for(call),
                )
            except httpx.TransportError:
                delay = self._retry_delay(call, attempt, None)
                if delay is None:
                    raise
            else:
                delay = self._retry_delay(call, attempt, response)
                if delay is None:
                    return self._answer(call, response)
            attempt += 1
            time.sleep(delay)

    def create_goal(
        self, goal: str, *, idempotency_key: str | None = None, **options: Any
    ) -> Goal:
        """Create a goal (options: budget, fanout, model, scorer, steps, size, reviser, ...;
        `init_image`: PNG or JPEG bytes, a `pathlib.Path` or base64 text, or
        `init_candidate_id`, with `init_strength`, to start from an image).
        Sent with an Idempotency-Key (`idempotency_key`, or a fresh one), so retries are safe."""
        return self._request(self._create_goal(goal, options, idempotency_key))

    def get_goal(self, goal: GoalRef) -> Goal:
        """A goal with its iterations and best candidate."""
        return self._request(self._get_goal(goal))

    def list_goals(
        self, limit: int = 50, tenant: str | None = None, *,
        status: str | Iterable[str] | None = None, cursor: str | None = None,
    ) -> Page[Goal]:
        """One page of goals, newest first, each with its summary; `.next_cursor` names the
        next page (None on the last)."""
        return self._request(self._list_goals(limit, tenant, status, cursor))

    def iter_goals(
        self, tenant: str | None = None, *, status: str | Iterable[str] | None = None,
        page_size: int = 100,
    ) -> Iterator[Goal]:
        """Every goal, newest first, page after page."""
        cursor = None
        while True:
            page = self.list_goals(page_size, tenant, status=status, cursor=cursor)
            for goal in page:  # noqa: UP028 - written as the async twin must be
                yield goal
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    def candidates(
        self, goal: GoalRef, *, iteration: int | None = None,
        status: str | Iterable[str] | None = None,
    ) -> list[Candidate]:
        """Every candidate of a goal (or of one iteration, or in some statuses), in
        iteration order, page after page."""
        found: list[Candidate] = []
        cursor = None
        while True:
            page = self._request(self._candidates(goal, iteration, status, cursor))
            found.extend(page)
            if page.next_cursor is None:
                return found
            cursor = page.next_cursor

    def wait(
        self, goal: GoalRef, timeout: float = 600, poll: float = 0.5,
        progress: Callable[[Event], Any] | None = None,
    ) -> Goal:
        """Wait until the goal is done, failed, cancelled or waiting for prompts; TimeoutError
        otherwise. Follows the goal's event stream, calling `progress(event)` for each event
        from its first; polls `get_goal` every `poll` s where the server has no stream."""
        self._check_wait(timeout, poll)
        deadline = time.monotonic() + timeout
        current = self.get_goal(goal)
        if self._settled(current) and progress is None:  # else its events are replayed
            return current
        try:
            for event in self._follow(current.id, None, deadline):
                if progress is not None:
                    progress(event)
                if _events.settles(event) and self._settled(current := self.get_goal(goal)):
                    return current
        except TimeoutError:
            raise self._timed_out(self.get_goal(goal), timeout) from None
        except (AgentloopError, _events.SSEError, httpx.TransportError) as exc:
            if not _events.stream_unavailable(exc):
                raise
        while True:
            current = self.get_goal(goal)
            left = deadline - time.monotonic()
            if self._settled(current):
                return current
            if left <= 0:
                raise self._timed_out(current, timeout)
            time.sleep(min(poll, left))

    def events(self, goal: GoalRef, after: int | None = None) -> Iterator[Event]:
        """The goal's events, oldest first (those after the id `after`), live until its
        `goal.finished`; reconnects with `Last-Event-ID` when the connection drops."""
        goal_id = goal.id if isinstance(goal, Goal) else goal
        yield from self._follow(goal_id, after, None)

    def _follow(self, goal_id: str, after: int | None, deadline: float | None) -> Iterator[Event]:
        last, failures = after, 0
        while True:
            try:
                with connect_sse(
                    self._http, "GET", self._goal_url(goal_id, "/events"),
                    headers=_events.stream_headers(self.headers, last),
                    timeout=_events.stream_timeout(self.timeout, deadline),
                ) as source:
                    if source.response.status_code >= 400:
                        source.response.read()
                        raise error_for(source.response)
                    for sse in EventSource(_events.Deadline(source.response, deadline)).iter_sse():  # type: ignore[arg-type]
                        if not sse.data:  # a keep-alive: httpx-sse dispatches comments
                            continue
                        event = _events.event_of(sse)
                        last, failures = event.id, 0
                        yield event
                        if event.type == _events.GOAL_FINISHED:
                            return
                if self.get_goal(goal_id).status in _events.SETTLED_STATUSES - {"waiting"}:
                    return  # ended, and the stream had nothing more: the end was seen
            except httpx.TransportError:
                if _events.past(deadline):
                    raise TimeoutError("deadline passed") from None
                if failures >= _events.RECONNECTS:
                    raise
            failures += 1
            time.sleep(_events.reconnect_delay(failures))

    def add_iteration(
        self, goal: GoalRef, prompts: Sequence[PromptLike], *,
        idempotency_key: str | None = None,
    ) -> IterationAccepted:
        """Supply the next iteration's prompts to a goal with reviser 'external'. Sent with
        an Idempotency-Key (`idempotency_key`, or a fresh one), so retries are safe."""
        return self._request(self._add_iteration(goal, prompts, idempotency_key))

    def close_goal(self, goal: GoalRef) -> Goal:
        """End a goal that is waiting for prompts."""
        return self._request(self._close_goal(goal))

    def cancel_goal(self, goal: GoalRef) -> Goal:
        """Cancel an unfinished goal: nothing more of it is generated. Idempotent."""
        return self._request(self._cancel_goal(goal))

    def artifact(self, ref: str | Candidate) -> bytes:
        """A candidate's image (PNG bytes), by candidate or by its `artifact_url`."""
        return self._request(self._artifact(ref))

    def health(self) -> dict[str, str]:
        """The server's liveness, database and sweep check: `status` "ok" or "degraded" (the
        sweep that recovers lost work is not running: `sweep` "stale" or "never"); a database
        that does not answer raises `ServerError` (503)."""
        return self._request(self._health())

    def list_models(self) -> Models:
        """The models and scorers the server knows, and its defaults."""
        return self._request(self._list_models())

    def webhook_deliveries(self, goal: GoalRef) -> list[WebhookDelivery]:
        """The events sent (or to be sent) to the goal's webhook, with attempts and outcome."""
        return self._request(self._webhook_deliveries(goal))

    def close(self) -> None:
        """Close the HTTP connections (only those of a client this made)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        self.close()
