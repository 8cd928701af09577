"""SDK fixtures: the real app in-process, reached by `Client` and `AsyncClient` through httpx.

`client` and `aclient` reach it over a real socket (uvicorn in a thread, `tests/live.py`):
`wait()` follows the event stream, and httpx's `ASGITransport` hands a response over only once
the app has sent all of it, so a stream that stays open (a goal waiting for prompts) would
never arrive through it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi import FastAPI

from agentloop.api.app import create_app
from agentloop.sdk import AsyncClient, Client
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher
from tests.live import serve_in_thread


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
def live_url(app: FastAPI) -> Iterator[str]:
    """The app served by uvicorn in a thread, lifespan included; its base URL."""
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture
def client(live_url: str) -> Iterator[Client]:
    """The blocking client against the app in this process."""
    with Client(live_url) as c:
        yield c


@pytest.fixture
async def aclient(live_url: str, anyio_backend: str) -> AsyncIterator[AsyncClient]:
    """The asyncio client against the app in this process."""
    async with AsyncClient(live_url) as c:
        yield c


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
