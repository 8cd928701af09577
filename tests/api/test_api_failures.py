"""When the broker or the database is down, the API says so and leaves no goal stuck."""

from __future__ import annotations

from fastapi.testclient import TestClient

from agentloop.api.app import create_app
from agentloop.settings import Settings
from agentloop.store import Store


class DownBroker:
    """A dispatcher whose broker connection is refused, as kombu raises it."""

    def advance_goal(self, goal_id: str) -> None:
        raise ConnectionRefusedError("Error 111 connecting to 127.0.0.1:6399. Connection refused.")

    def generate(self, model: str, candidate_ids: list[str]) -> None:
        raise ConnectionRefusedError("Connection refused")


def test_broker_down_answers_503_and_fails_the_goal(settings: Settings, store: Store) -> None:
    with TestClient(create_app(settings, store, DownBroker())) as api:
        r = api.post("/v1/goals", json={"goal": "a red circle", "budget": 4})
        assert r.status_code == 503 and "broker" in r.json()["detail"]
        [goal] = api.get("/v1/goals").json()
    assert goal["status"] == "failed" and goal["stop_reason"] == "dispatch_failed"
    assert "Connection refused" in goal["error"]


def test_health_is_503_when_the_database_is_down(settings: Settings, tmp_path) -> None:  # noqa: ANN001
    dead = Store("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=1")
    with TestClient(create_app(settings, dead, DownBroker())) as api:
        r = api.get("/healthz")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"


def test_unknown_open_clip_tag_and_booleans_are_rejected(settings: Settings, store: Store) -> None:
    with TestClient(create_app(settings, store, DownBroker())) as api:
        r = api.post("/v1/goals", json={"goal": "a red circle", "scorer": "ViT-B-32:no_such_tag"})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "scorer"]
        r = api.post("/v1/goals", json={"goal": "a red circle", "budget": True})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "budget"]
        assert api.get("/v1/goals").json() == []
