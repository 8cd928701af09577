"""API fixtures: the real app over a real database (SQLite and PostgreSQL), a recording dispatcher."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from agentloop.api.app import create_app
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    yield s
    s.dispose()


@pytest.fixture
def dispatcher() -> RecordingDispatcher:
    return RecordingDispatcher()


@pytest.fixture
def app(settings: Settings, store: Store, dispatcher: RecordingDispatcher) -> FastAPI:
    return create_app(settings, store, dispatcher)


@pytest.fixture
def api(app: FastAPI) -> Iterator[TestClient]:
    """The app in-process, lifespan included."""
    with TestClient(app) as client:
        yield client
