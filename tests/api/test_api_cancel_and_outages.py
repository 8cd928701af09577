"""Cancel over HTTP, and what the API answers while the broker or the database is away."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from agentloop.api.app import create_app
from agentloop.orchestrator import advance
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher, finish, row_counts
from tests.api.test_api_external import post_prompts, waiting_goal


def test_cancel_a_running_goal_is_final_and_idempotent(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    goal_id = api.post("/v1/goals", json={"goal": "a red circle", "budget": 8, "fanout": 4}).json()["id"]
    ids = advance(store, goal_id).dispatch
    finish(store, settings, ids[:1])
    r = api.post(f"/v1/goals/{goal_id}/cancel")
    assert r.status_code == 200, r.text
    goal = r.json()
    assert goal["status"] == "cancelled" and goal["stop_reason"] == "cancelled_by_caller"
    assert goal["finished_at"] is not None
    statuses = sorted(c["status"] for c in api.get(f"/v1/goals/{goal_id}/candidates").json())
    assert statuses == ["cancelled", "cancelled", "cancelled", "succeeded"]
    # a late generation message claims nothing; cancelling again answers the same goal
    assert store.claim_candidates(ids, "late", lease_seconds=60, max_attempts=3) == []
    again = api.post(f"/v1/goals/{goal_id}/cancel")
    assert again.status_code == 200 and again.json()["finished_at"] == goal["finished_at"]


def test_cancel_a_finished_or_unknown_goal(api: TestClient, store: Store, settings: Settings) -> None:
    goal_id = waiting_goal(api, store, budget=2)
    assert api.post(f"/v1/goals/{goal_id}/close").json()["status"] == "done"
    r = api.post(f"/v1/goals/{goal_id}/cancel")
    assert r.status_code == 409 and "done" in r.json()["detail"]
    assert api.post(f"/v1/goals/{'0' * 32}/cancel").status_code == 404


def test_cancel_a_waiting_external_goal(api: TestClient, store: Store) -> None:
    goal_id = waiting_goal(api, store, budget=2)
    assert api.post(f"/v1/goals/{goal_id}/cancel").json()["status"] == "cancelled"
    assert post_prompts(api, goal_id, "too late").status_code == 409


class BrokerDownForGeneration(RecordingDispatcher):
    """The broker is reachable for the goal's first task, then refuses connections."""

    def generate(self, model: str, candidate_ids: list[str]) -> None:
        raise ConnectionRefusedError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")


def test_prompts_sent_while_the_broker_is_down_are_refused_and_can_be_sent_again(
    settings: Settings, store: Store
) -> None:
    down = BrokerDownForGeneration()
    with TestClient(create_app(settings, store, down)) as api:
        goal_id = waiting_goal(api, store, budget=4)
        r = post_prompts(api, goal_id, "a red circle", "a blue square")
        assert r.status_code == 503 and "send them again" in r.json()["detail"]
        goal = api.get(f"/v1/goals/{goal_id}").json()
        assert goal["status"] == "waiting" and goal["generations_reserved"] == 0
        assert row_counts(store) == {"goals": 1, "iterations": 0, "candidates": 0}
    recorder = RecordingDispatcher()
    with TestClient(create_app(settings, store, recorder)) as api:
        r = post_prompts(api, goal_id, "a red circle", "a blue square")
        assert r.status_code == 201 and r.json()["iteration"] == 0
        assert recorder.generated == [("tiny-dit", r.json()["candidate_ids"])]
    assert all(c.dispatched_at is not None for c in store.list_candidates(goal_id))


def test_database_down_answers_503_quickly_not_500(settings: Settings) -> None:
    dead = Store("postgresql+psycopg://postgres@127.0.0.1:1/none", connect_timeout=2)
    with TestClient(create_app(settings, dead, RecordingDispatcher())) as api:
        for method, path in (("GET", f"/v1/goals/{'0' * 32}"), ("GET", "/v1/goals"),
                             ("POST", f"/v1/goals/{'0' * 32}/cancel")):
            t0 = time.monotonic()
            r = api.request(method, path)
            assert r.status_code == 503, (path, r.text)
            assert "database" in r.json()["detail"] and r.headers["retry-after"]
            assert time.monotonic() - t0 < 5
