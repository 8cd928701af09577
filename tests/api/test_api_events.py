"""GET /v1/goals/{id}/events over a real HTTP server (uvicorn in a thread), both backends:
the live stream, resuming with Last-Event-ID, keep-alives, the end at goal.finished, events
written through another connection pool (as a worker in another process writes them)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from httpx_sse import connect_sse

from agentloop.api.app import create_app
from agentloop.orchestrator import advance
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher, finish
from tests.live import serve_in_thread

FAST = {"events_ping_seconds": 0.2, "events_poll_seconds": 0.05}


@pytest.fixture
def fast_settings(settings: Settings) -> Settings:
    return settings.model_copy(update=FAST)


@pytest.fixture
def url(fast_settings: Settings, store: Store) -> Iterator[str]:
    app: FastAPI = create_app(fast_settings, store, RecordingDispatcher())
    with serve_in_thread(app) as base:
        yield base


@pytest.fixture
def worker_store(store: Store) -> Iterator[Store]:
    """A second store on the same database: its own connections, like a worker process's."""
    other = Store(store.url)
    yield other
    other.dispose()


def _create(url: str, **body: object) -> str:
    answer = httpx.post(f"{url}/v1/goals", json={"goal": "a red circle", **body})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def _run_to_the_end(store: Store, settings: Settings, goal_id: str) -> None:
    """The orchestrator and a worker, through `store`, until the goal ends."""
    while True:
        decision = advance(store, goal_id)
        if not decision.dispatch:
            break
        finish(store, settings, decision.dispatch, lambda c: 1.0 + c.ordinal / 10)
    assert store.get_goal(goal_id).status.terminal


def _listen(url: str, goal_id: str, into: queue.Queue, headers: dict[str, str] | None = None) -> threading.Thread:
    def read() -> None:
        with httpx.Client(timeout=30) as http, connect_sse(
            http, "GET", f"{url}/v1/goals/{goal_id}/events", headers=headers or {}
        ) as source:
            for sse in source.iter_sse():
                if sse.data:  # not a keep-alive (httpx-sse dispatches comments too)
                    into.put(sse)
        into.put(None)  # the server ended the stream

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _drain(into: queue.Queue, timeout: float = 20) -> list:
    got = []
    deadline = time.monotonic() + timeout
    while (item := into.get(timeout=max(deadline - time.monotonic(), 0.01))) is not None:
        got.append(item)
    return got


def test_the_stream_carries_every_event_live_and_ends_at_goal_finished(
    url: str, worker_store: Store, store: Store, fast_settings: Settings
) -> None:
    goal_id = _create(url, budget=4, fanout=2)
    received: queue.Queue = queue.Queue()
    thread = _listen(url, goal_id, received)
    first = received.get(timeout=10)  # goal.created arrives before anything else happens
    assert first.event == "goal.created"
    _run_to_the_end(worker_store, fast_settings, goal_id)
    rest = _drain(received)
    thread.join(5)
    got = [first, *rest]
    logged = store.events_after(goal_id)
    assert [int(s.id) for s in got] == [e.id for e in logged]
    assert [s.event for s in got] == [e.type for e in logged]
    assert got[-1].event == "goal.finished"
    body = got[-1].json()
    assert body["goal_id"] == goal_id and body["type"] == "goal.finished"
    assert body["data"]["status"] == "done" and body["created_at"].endswith("Z")
    succeeded = [s.json()["data"] for s in got if s.event == "candidate.succeeded"]
    assert len(succeeded) == 4 and all(d["image_url"].startswith("/v1/artifacts/") for d in succeeded)


def test_a_client_resuming_with_last_event_id_misses_nothing_and_sees_nothing_twice(
    url: str, worker_store: Store, store: Store, fast_settings: Settings
) -> None:
    goal_id = _create(url, budget=4, fanout=2)
    decision = advance(worker_store, goal_id)
    seen: list = []
    with httpx.Client(timeout=30) as http, connect_sse(
        http, "GET", f"{url}/v1/goals/{goal_id}/events"
    ) as source:
        for sse in source.iter_sse():
            if not sse.data:
                continue  # a keep-alive
            seen.append(sse)
            if len(seen) == 2:
                break  # the connection drops here
    finish(worker_store, fast_settings, decision.dispatch)  # meanwhile, work goes on
    _run_to_the_end(worker_store, fast_settings, goal_id)
    received: queue.Queue = queue.Queue()
    _listen(url, goal_id, received, {"Last-Event-ID": seen[-1].id}).join(20)
    seen += _drain(received)
    ids = [int(s.id) for s in seen]
    assert ids == [e.id for e in store.events_after(goal_id)]
    assert len(set(ids)) == len(ids)
    # ?after= does the same for a client that cannot set headers; past the end: an empty stream
    with httpx.Client(timeout=30) as http:
        with connect_sse(http, "GET", f"{url}/v1/goals/{goal_id}/events",
                         params={"after": ids[-3]}) as source:
            assert [int(s.id) for s in source.iter_sse() if s.data] == ids[-2:]
        with connect_sse(http, "GET", f"{url}/v1/goals/{goal_id}/events",
                         headers={"Last-Event-ID": str(ids[-1])}) as source:
            assert [s for s in source.iter_sse() if s.data] == []


def test_keep_alives_arrive_while_nothing_happens(url: str) -> None:
    goal_id = _create(url, reviser="external")  # pending until its first step: quiet
    pings = 0
    with httpx.Client(timeout=10) as http, http.stream(
        "GET", f"{url}/v1/goals/{goal_id}/events"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        started = time.monotonic()
        for line in response.iter_lines():
            pings += line.startswith(": ping")
            if pings >= 3 or time.monotonic() - started > 5:
                break
    assert pings >= 3


def test_events_as_a_json_list_and_404(url: str, worker_store: Store, fast_settings: Settings) -> None:
    goal_id = _create(url, budget=2, fanout=2)
    _run_to_the_end(worker_store, fast_settings, goal_id)
    events = httpx.get(f"{url}/v1/goals/{goal_id}/events", params={"stream": "false"}).json()
    assert events[0]["type"] == "goal.created" and events[-1]["type"] == "goal.finished"
    page = httpx.get(f"{url}/v1/goals/{goal_id}/events",
                     params={"stream": "false", "after": events[0]["id"], "limit": 2}).json()
    assert page == events[1:3]
    for stream in ("true", "false"):
        missing = httpx.get(f"{url}/v1/goals/{'0' * 32}/events", params={"stream": stream})
        assert missing.status_code == 404
