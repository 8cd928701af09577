"""Webhooks, both backends: a goal names a URL and event types; `deliver_webhooks` (what the
beat task and the embedded thread run) POSTs each wanted event once, signed per Standard
Webhooks, to a real HTTP receiver on 127.0.0.1 that verifies the signature; failures are
retried with backoff and recorded; bad input is refused naming the field; the secret is
never answered."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from standardwebhooks import Webhook

from agentloop.api.app import create_app
from agentloop.orchestrator import advance
from agentloop.settings import Settings
from agentloop.store import Store
from agentloop.store.models import GoalRow, WebhookDeliveryRow, WebhookRow
from tests.api.fakes import RecordingDispatcher, finish
from workers.webhooks import deliver_webhooks

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
SERVER_SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
FAST = {"webhook_backoff_seconds": 0.01, "webhook_backoff_max_seconds": 0.02,
        "webhook_max_attempts": 3, "webhook_timeout_seconds": 5}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update=FAST)


@dataclass
class Receiver:
    """A local webhook receiver: answers with `script`'s statuses in turn (then 200),
    verifies every request's signature and keeps what it got."""

    secret: str
    script: list[int] = field(default_factory=list)
    always: int | None = None
    verified: list[dict[str, Any]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    requests: int = 0
    url: str = ""


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver(SECRET)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            rec.requests += 1
            try:
                payload = Webhook(rec.secret).verify(body, dict(self.headers.items()))
            except Exception as exc:  # noqa: BLE001 - recorded, the test fails on it
                rec.bad.append(repr(exc))
                payload = None
            code = rec.script.pop(0) if rec.script else (rec.always or 200)
            if payload is not None and 200 <= code < 300:
                rec.verified.append(payload)
                rec.ids.append(self.headers["webhook-id"])
            self.send_response(code)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    rec.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _run_to_the_end(store: Store, settings: Settings, goal_id: str) -> None:
    while True:
        decision = advance(store, goal_id)
        if not decision.dispatch:
            break
        finish(store, settings, decision.dispatch, lambda c: 1.0 + c.ordinal / 10)
    assert store.get_goal(goal_id).status.terminal


def _deliver_all(store: Store, settings: Settings, rounds: int = 50) -> None:
    """Run delivery passes until nothing is pending (retries are due after ~10 ms)."""
    with httpx.Client() as http:
        for _ in range(rounds):
            deliver_webhooks(store, settings, http)
            open_ = [d for g in _goal_ids(store) for d in store.webhook_deliveries(g)
                     if d.status in ("pending", "delivering")]
            if not open_:
                return
            time.sleep(0.03)
    raise AssertionError("deliveries still pending")


def _goal_ids(store: Store) -> list[str]:
    with store.engine.connect() as conn:
        return list(conn.scalars(select(GoalRow.id)))


def _create(api: TestClient, webhook: dict[str, Any], **body: Any) -> dict[str, Any]:
    answer = api.post("/v1/goals", json={"goal": "a red circle", "budget": 4, "fanout": 2,
                                         "webhook": webhook, **body})
    assert answer.status_code == 201, answer.text
    return answer.json()


def test_wanted_events_arrive_once_each_signed(
    api: TestClient, store: Store, settings: Settings, receiver: Receiver
) -> None:
    wanted = ["goal.created", "iteration.opened", "goal.finished"]
    goal = _create(api, {"url": receiver.url, "events": wanted, "secret": SECRET})
    assert goal["spec"]["webhook"] == {"url": receiver.url, "events": wanted}
    _run_to_the_end(store, settings, goal["id"])
    _deliver_all(store, settings)
    _deliver_all(store, settings)  # another pass sends nothing again

    assert receiver.bad == []
    types = [p["type"] for p in receiver.verified]
    n_iterations = len(api.get(f"/v1/goals/{goal['id']}").json()["iterations"])
    assert sorted(types) == sorted(["goal.created", "goal.finished"]
                                   + ["iteration.opened"] * n_iterations)
    assert len(set(receiver.ids)) == len(receiver.ids)  # each event once
    events = {e["id"]: e for e in api.get(f"/v1/goals/{goal['id']}/events?stream=false").json()}
    for payload, msg_id in zip(receiver.verified, receiver.ids, strict=True):
        data = payload["data"]
        assert msg_id == f"evt_{data['event_id']}" and data["goal_id"] == goal["id"]
        assert events[data["event_id"]]["type"] == payload["type"]
        assert payload["timestamp"].endswith("Z")
    finished = next(p for p in receiver.verified if p["type"] == "goal.finished")
    assert finished["data"]["status"] == "done"

    deliveries = api.get(f"/v1/goals/{goal['id']}/webhook-deliveries")
    assert deliveries.status_code == 200
    assert {(d["status"], d["attempts"], d["last_status_code"]) for d in deliveries.json()} == {
        ("delivered", 1, 200)}
    assert len(deliveries.json()) == len(types)
    assert SECRET not in json.dumps(goal) + deliveries.text
    assert SECRET not in api.get(f"/v1/goals/{goal['id']}").text
    assert SECRET not in api.get("/v1/goals").text
    assert SECRET not in api.get(f"/v1/goals/{goal['id']}/events?stream=false").text


def test_default_is_goal_finished_and_star_is_everything(
    api: TestClient, store: Store, settings: Settings, receiver: Receiver
) -> None:
    only_end = _create(api, {"url": receiver.url, "secret": SECRET})
    every = _create(api, {"url": receiver.url, "events": ["*"], "secret": SECRET})
    for g in (only_end, every):
        _run_to_the_end(store, settings, g["id"])
    _deliver_all(store, settings)
    assert receiver.bad == []
    got = {g["id"]: [p["type"] for p in receiver.verified if p["data"]["goal_id"] == g["id"]]
           for g in (only_end, every)}
    assert got[only_end["id"]] == ["goal.finished"]
    n_events = len(store.events_after(every["id"]))
    assert len(got[every["id"]]) == n_events and got[every["id"]][-1] == "goal.finished"


def test_a_failing_receiver_is_retried_and_recorded(
    api: TestClient, store: Store, settings: Settings, receiver: Receiver
) -> None:
    receiver.script = [500]  # the first attempt fails, the second succeeds
    goal = _create(api, {"url": receiver.url, "secret": SECRET})
    _run_to_the_end(store, settings, goal["id"])
    _deliver_all(store, settings)
    [d] = api.get(f"/v1/goals/{goal['id']}/webhook-deliveries").json()
    assert (d["status"], d["attempts"], d["last_status_code"]) == ("delivered", 2, 200)
    assert d["event_type"] == "goal.finished" and d["delivered_at"] is not None
    assert receiver.requests == 2 and len(receiver.verified) == 1 and receiver.bad == []


def test_a_receiver_that_always_fails_ends_failed(
    api: TestClient, store: Store, settings: Settings, receiver: Receiver
) -> None:
    receiver.always = 503
    goal = _create(api, {"url": receiver.url, "secret": SECRET})
    _run_to_the_end(store, settings, goal["id"])
    _deliver_all(store, settings)
    [d] = api.get(f"/v1/goals/{goal['id']}/webhook-deliveries").json()
    assert (d["status"], d["attempts"], d["last_status_code"]) == ("failed", 3, 503)
    assert "503" in d["last_error"] and d["delivered_at"] is None
    assert receiver.requests == 3


def test_an_unreachable_receiver_records_the_error(
    api: TestClient, store: Store, settings: Settings
) -> None:
    from tests.live import free_port

    goal = _create(api, {"url": f"http://127.0.0.1:{free_port()}/", "secret": SECRET})
    _run_to_the_end(store, settings, goal["id"])
    _deliver_all(store, settings)
    [d] = store.webhook_deliveries(goal["id"])
    assert (d.status, d.attempts, d.last_status_code) == ("failed", 3, None)
    assert "ConnectError" in (d.last_error or "")


def test_two_deliverers_never_send_one_delivery_twice(
    api: TestClient, store: Store, settings: Settings, receiver: Receiver
) -> None:
    goals = [_create(api, {"url": receiver.url, "events": ["*"], "secret": SECRET})["id"]
             for _ in range(2)]
    for g in goals:
        _run_to_the_end(store, settings, g)
    other = Store(store.url)
    try:
        threads = [threading.Thread(target=_deliver_all, args=(s, settings))
                   for s in (store, other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        other.dispose()
    n_events = sum(len(store.events_after(g)) for g in goals)
    assert receiver.bad == [] and receiver.requests == n_events
    assert sorted(receiver.ids) == sorted(set(receiver.ids))


BAD_WEBHOOKS = [
    ({"url": "ftp://example.com/x", "secret": SECRET}, "webhook.url"),
    ({"url": "not a url", "secret": SECRET}, "webhook.url"),
    ({"url": "http://x/" + "a" * 2000, "secret": SECRET}, "webhook.url"),
    ({"url": "http://example.com", "events": ["goal.exploded"], "secret": SECRET},
     "webhook.events.0"),
    ({"url": "http://example.com", "events": [], "secret": SECRET}, "webhook.events"),
    ({"url": "http://example.com", "secret": "hunter2"}, "webhook.secret"),
    ({"url": "http://example.com", "secret": "whsec_AAAA"}, "webhook.secret"),
    ({"url": "http://example.com"}, "webhook.secret"),
    ({"url": "http://example.com", "secret": SECRET, "extra": 1}, "webhook.extra"),
    ({"secret": SECRET}, "webhook.url"),
    ("http://example.com", "webhook"),
]


@pytest.mark.parametrize(("webhook", "bad_field"), BAD_WEBHOOKS)
def test_bad_webhooks_are_refused_naming_the_field(
    api: TestClient, store: Store, webhook: Any, bad_field: str
) -> None:
    answer = api.post("/v1/goals", json={"goal": "a red circle", "webhook": webhook})
    assert answer.status_code == 422, answer.text
    fields = [e["field"] for e in answer.json()["error"]["errors"]]
    assert bad_field in fields, answer.json()
    if bad_field == "webhook.secret" and "secret" not in webhook:
        assert "required (no server default configured)" in answer.text
    assert SECRET not in answer.text
    with store.engine.connect() as conn:
        for row in (GoalRow, WebhookRow, WebhookDeliveryRow):
            assert conn.scalar(select(func.count()).select_from(row)) == 0


def test_the_server_secret_signs_when_the_goal_brings_none(
    store: Store, settings: Settings, receiver: Receiver
) -> None:
    receiver.secret = SERVER_SECRET
    server_settings = settings.model_copy(update={"webhook_secret": SERVER_SECRET})
    with TestClient(create_app(server_settings, store, RecordingDispatcher())) as api:
        goal = _create(api, {"url": receiver.url})
        _run_to_the_end(store, server_settings, goal["id"])
        _deliver_all(store, server_settings)
        assert SERVER_SECRET not in api.get(f"/v1/goals/{goal['id']}").text
    assert [p["type"] for p in receiver.verified] == ["goal.finished"] and receiver.bad == []


def test_a_bad_server_secret_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="webhook_secret"):
        Settings(webhook_secret="not-a-secret")


def test_deliveries_of_an_unknown_goal_are_404(api: TestClient) -> None:
    answer = api.get("/v1/goals/" + "0" * 32 + "/webhook-deliveries")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


def test_a_goal_without_webhook_keeps_its_spec_and_gets_no_deliveries(
    api: TestClient, store: Store, settings: Settings
) -> None:
    answer = api.post("/v1/goals", json={"goal": "a red circle", "budget": 2})
    assert "webhook" not in answer.json()["spec"]
    _run_to_the_end(store, settings, answer.json()["id"])
    with httpx.Client() as http:
        assert deliver_webhooks(store, settings, http) == 0
    assert api.get(f"/v1/goals/{answer.json()['id']}/webhook-deliveries").json() == []
