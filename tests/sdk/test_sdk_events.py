"""The SDK on the event stream, both twins, against the real app over a socket: `wait()` with
a progress callback, `events()` resuming after a dropped connection, and polling where the
server has no stream."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from agentloop.api.app import create_app
from agentloop.sdk import AsyncClient, Client, Event
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import threaded_loop
from tests.live import serve_in_thread


@pytest.fixture
def looping_url(sqlite_url: str, settings: Settings) -> Iterator[tuple[str, Store]]:
    """The orchestrator for real in background threads, a fake worker in place of the GPU."""
    store = Store(sqlite_url)
    loop = threaded_loop(store, settings, score=lambda c: 0.2 + 0.1 * c.iteration + 0.01 * c.ordinal)
    app = create_app(settings.model_copy(update={"events_poll_seconds": 0.02}), store, loop)
    try:
        with serve_in_thread(app) as url:
            yield url, store
    finally:
        loop.close(wait=True)
        store.dispose()
    assert loop.errors == []


def _check_progress(seen: list[Event], store: Store, goal_id: str) -> None:
    assert [e.id for e in seen] == [e.id for e in store.events_after(goal_id)]
    assert seen[0].type == "goal.created" and seen[-1].type == "goal.finished"
    succeeded = [e for e in seen if e.type == "candidate.succeeded"]
    assert len(succeeded) == 5 and all(e.data["image_url"].startswith("/v1/") for e in succeeded)


def test_sync_wait_reports_every_event(looping_url: tuple[str, Store]) -> None:
    url, store = looping_url
    seen: list[Event] = []
    with Client(url) as client:
        goal = client.create_goal("a red circle", budget=5, fanout=2)
        goal = client.wait(goal, timeout=30, progress=seen.append)
        assert goal.status == "done" and goal.generations_done == 5
        _check_progress(seen, store, goal.id)
        assert [e.id for e in client.events(goal)] == [e.id for e in seen]  # replayed, then ends
        assert [e.id for e in client.events(goal, after=seen[-3].id)] == [e.id for e in seen[-2:]]


@pytest.mark.anyio
async def test_async_wait_reports_every_event(looping_url: tuple[str, Store]) -> None:
    url, store = looping_url
    seen: list[Event] = []

    async def progress(event: Event) -> None:  # a coroutine function is awaited
        seen.append(event)

    async with AsyncClient(url) as client:
        goal = await client.create_goal("a red circle", budget=5, fanout=2)
        goal = await client.wait(goal, timeout=30, progress=progress)
        assert goal.status == "done" and goal.generations_done == 5
        _check_progress(seen, store, goal.id)
        assert [e.id async for e in client.events(goal)] == [e.id for e in seen]


class DropOnce(httpx.BaseTransport):
    """A real connection that breaks an event stream after its second chunk, once; records
    the Last-Event-ID each events request resumed from."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.dropped = False
        self.resumed_from: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if not request.url.path.endswith("/events"):
            return response
        self.resumed_from.append(request.headers.get("last-event-id"))
        if self.dropped:
            return response
        self.dropped = True

        def broken() -> Iterator[bytes]:
            for n, chunk in enumerate(response.stream):  # type: ignore[union-attr]
                if n == 2:
                    response.close()
                    raise httpx.ReadError("connection reset by peer")
                yield chunk

        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_Stream(broken()))


class _Stream(httpx.SyncByteStream):
    def __init__(self, chunks: Iterator[bytes]):
        self.chunks = chunks

    def __iter__(self) -> Iterator[bytes]:
        return self.chunks


class AsyncDropOnce(httpx.AsyncBaseTransport):
    """`DropOnce` for the async client."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.dropped = False
        self.resumed_from: list[str | None] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/events"):
            return response
        self.resumed_from.append(request.headers.get("last-event-id"))
        if self.dropped:
            return response
        self.dropped = True

        async def broken() -> AsyncIterator[bytes]:
            n = 0
            async for chunk in response.stream:  # type: ignore[union-attr]
                if n == 2:
                    await response.aclose()
                    raise httpx.ReadError("connection reset by peer")
                n += 1
                yield chunk

        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_AsyncStream(broken()))


class _AsyncStream(httpx.AsyncByteStream):
    def __init__(self, chunks: AsyncIterator[bytes]):
        self.chunks = chunks

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self.chunks


def test_sync_events_resume_after_a_dropped_connection(looping_url: tuple[str, Store]) -> None:
    url, store = looping_url
    transport = DropOnce()
    with Client(url, transport=transport) as client:
        goal = client.create_goal("a red circle", budget=5, fanout=2)
        ids = [e.id for e in client.events(goal)]  # live, until goal.finished
    assert ids == [e.id for e in store.events_after(goal.id)]  # nothing missed, nothing twice
    assert transport.resumed_from[0] is None and int(transport.resumed_from[1]) in ids[:-1]


@pytest.mark.anyio
async def test_async_events_resume_after_a_dropped_connection(
    looping_url: tuple[str, Store]
) -> None:
    url, store = looping_url
    transport = AsyncDropOnce()
    async with AsyncClient(url, transport=transport) as client:
        goal = await client.create_goal("a red circle", budget=5)
        ids = [e.id async for e in client.events(goal)]
    assert ids == [e.id for e in store.events_after(goal.id)]
    assert transport.resumed_from[0] is None and int(transport.resumed_from[1]) in ids[:-1]


def _without_events(inner: httpx.BaseTransport) -> httpx.MockTransport:
    """A server that predates the event stream: its events route answers 404."""
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return inner.handle_request(request)

    return httpx.MockTransport(handle)


def test_sync_wait_polls_where_there_is_no_stream(looping_url: tuple[str, Store]) -> None:
    url, _ = looping_url
    seen: list[Event] = []
    with Client(url, transport=_without_events(httpx.HTTPTransport())) as client:
        goal = client.create_goal("a red circle", budget=3, fanout=3)
        assert client.wait(goal, timeout=30, poll=0.02, progress=seen.append).status == "done"
    assert seen == []


@pytest.mark.anyio
async def test_async_wait_polls_where_there_is_no_stream(looping_url: tuple[str, Store]) -> None:
    url, _ = looping_url

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/events"):
            return httpx.Response(405, json={"detail": "Method Not Allowed"})
        async with httpx.AsyncClient() as http:
            answer = await http.send(request)
            return httpx.Response(answer.status_code, headers=answer.headers,
                                  content=answer.content)

    async with AsyncClient(url, transport=httpx.MockTransport(handle)) as client:
        goal = await client.create_goal("a red circle", budget=3, fanout=3)
        assert (await client.wait(goal, timeout=30, poll=0.02)).status == "done"
