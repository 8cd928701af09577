"""SDK fixtures: the real app in-process, reached by `Client` and `AsyncClient` through httpx."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import anyio.from_thread
import httpx
import pytest
from fastapi import FastAPI

from agentloop.api.app import create_app
from agentloop.sdk import AsyncClient, Client
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher

BASE_URL = "http://agentloop.test"


class PortalTransport(httpx.BaseTransport):
    """Lets a sync `httpx.Client` call an ASGI app: `httpx.ASGITransport` run in an anyio portal.

    httpx's ASGITransport is async-only, and Starlette's TestClient is built on another
    httpx (httpx2), so the sync SDK client gets this 15-line bridge in tests.
    """

    def __init__(self, app: FastAPI, portal: anyio.from_thread.BlockingPortal):
        self._asgi = httpx.ASGITransport(app)
        self._portal = portal

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._portal.call(self._send, request)

    async def _send(self, request: httpx.Request) -> httpx.Response:
        inner = httpx.Request(
            request.method, request.url, headers=request.headers, content=request.read()
        )
        response = await self._asgi.handle_async_request(inner)
        content = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, content=content)


@pytest.fixture
def store(sqlite_url: str) -> Iterator[Store]:
    s = Store(sqlite_url)
    yield s
    s.dispose()


@pytest.fixture
def dispatcher() -> RecordingDispatcher:
    """Stands in for the Celery broker: the SDK and HTTP layers are tested alone."""
    return RecordingDispatcher()


@pytest.fixture
def app(settings: Settings, store: Store, dispatcher: RecordingDispatcher) -> FastAPI:
    return create_app(settings, store, dispatcher)


@pytest.fixture
def client(app: FastAPI) -> Iterator[Client]:
    """The blocking client against the app in this process (lifespan run in the portal)."""
    with (
        anyio.from_thread.start_blocking_portal() as portal,
        portal.wrap_async_context_manager(app.router.lifespan_context(app)),
        Client(BASE_URL, transport=PortalTransport(app, portal)) as c,
    ):
        yield c


@pytest.fixture
async def aclient(app: FastAPI, anyio_backend: str) -> AsyncIterator[AsyncClient]:
    """The asyncio client against the app in this process, through `httpx.ASGITransport`."""
    async with (
        app.router.lifespan_context(app),
        AsyncClient(BASE_URL, transport=httpx.ASGITransport(app)) as c,
    ):
        yield c


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
