"""Idempotency-Key on the creating POSTs, on both backends: replays answer the first response
and create nothing, another body is refused, keys are per tenant, concurrent requests with one
key create once, and a broker outage leaves the key free for a retry."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from agentloop.api.app import create_app
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher, row_counts
from tests.api.test_api_cancel_and_outages import BrokerDownForGeneration
from tests.api.test_api_external import waiting_goal
from tests.api.test_api_failures import DownBroker

GOAL = {"goal": "a red circle", "budget": 4}


def test_same_key_same_body_answers_the_first_goal_once(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher
) -> None:
    first = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k-1"})
    again = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() and again.headers["idempotent-replayed"] == "true"
    assert row_counts(store)["goals"] == 1 and dispatcher.advanced == [first.json()["id"]]

    other = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k-2"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    plain = [api.post("/v1/goals", json=GOAL) for _ in range(2)]
    assert len({r.json()["id"] for r in plain}) == 2  # no key: no deduplication
    assert row_counts(store)["goals"] == 4


def test_same_key_other_body_is_refused(api: TestClient, store: Store) -> None:
    assert api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k"}).status_code == 201
    r = api.post("/v1/goals", json={**GOAL, "budget": 5}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "idempotency_key_reused"
    assert r.json()["error"]["field"] == "Idempotency-Key"
    assert row_counts(store)["goals"] == 1


def test_keys_are_per_tenant(api: TestClient, store: Store) -> None:
    a = api.post("/v1/goals", json={**GOAL, "tenant": "a"}, headers={"Idempotency-Key": "k"})
    b = api.post("/v1/goals", json={**GOAL, "tenant": "b"}, headers={"Idempotency-Key": "k"})
    assert a.status_code == b.status_code == 201 and a.json()["id"] != b.json()["id"]


def test_an_invalid_key_is_a_validation_error(api: TestClient) -> None:
    r = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "x" * 256})
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"
    assert r.json()["error"]["errors"][0]["field"] == "Idempotency-Key"


def test_concurrent_requests_with_one_key_create_one_goal(api: TestClient, store: Store) -> None:
    answers: list[tuple[int, str]] = []
    gate = threading.Barrier(6)

    def post() -> None:
        gate.wait()
        r = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "race"})
        answers.append((r.status_code, r.json().get("id") or r.json()["error"]["code"]))

    threads = [threading.Thread(target=post) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert row_counts(store)["goals"] == 1
    created = {gid for code, gid in answers if code == 201}
    assert len(created) == 1
    assert all(code == 201 or gid == "idempotency_in_progress" for code, gid in answers)


def test_iteration_replay_creates_and_dispatches_once(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher
) -> None:
    goal_id = waiting_goal(api, store, budget=4)
    body = {"prompts": [{"prompt": "a red circle"}, {"prompt": "a crimson disc"}]}
    url = f"/v1/goals/{goal_id}/iterations"
    first = api.post(url, json=body, headers={"Idempotency-Key": "it"})
    again = api.post(url, json=body, headers={"Idempotency-Key": "it"})
    assert first.status_code == again.status_code == 201 and again.json() == first.json()
    assert row_counts(store) == {"goals": 1, "iterations": 1, "candidates": 2}
    assert len(dispatcher.generated) == 1
    r = api.post(url, json={"prompts": [{"prompt": "other"}]}, headers={"Idempotency-Key": "it"})
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"
    # without the key, the same prompts are a second iteration, refused while one is open
    r = api.post(url, json=body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "iteration_open"


def test_a_503_is_not_the_keys_answer(settings: Settings, store: Store) -> None:
    with TestClient(create_app(settings, store, DownBroker())) as api:
        r = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable"
    with TestClient(create_app(settings, store, RecordingDispatcher())) as api:
        r = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k"})
        assert r.status_code == 201 and r.json()["status"] == "pending"
        assert api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k"}).json() == r.json()

    down = BrokerDownForGeneration()
    with TestClient(create_app(settings, store, down)) as api:
        goal_id = waiting_goal(api, store, budget=4)
        url, body = f"/v1/goals/{goal_id}/iterations", {"prompts": [{"prompt": "a red circle"}]}
        r = api.post(url, json=body, headers={"Idempotency-Key": "it"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable"
    recorder = RecordingDispatcher()
    with TestClient(create_app(settings, store, recorder)) as api:
        r = api.post(url, json=body, headers={"Idempotency-Key": "it"})
        assert r.status_code == 201 and len(recorder.generated) == 1


def test_expired_keys_are_forgotten(settings: Settings, store: Store) -> None:
    expiring = settings.model_copy(update={"idempotency_retention_seconds": 0.0})
    with TestClient(create_app(expiring, store, RecordingDispatcher())) as api:
        a = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k"})
        b = api.post("/v1/goals", json=GOAL, headers={"Idempotency-Key": "k"})
    assert a.status_code == b.status_code == 201 and a.json()["id"] != b.json()["id"]
