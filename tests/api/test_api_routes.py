"""Reading routes, 404s, OpenAPI, health, and artifacts (including path traversal)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agentloop.domain import SWEEP_HEARTBEAT
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import png_bytes

MISSING = "0" * 32


def create(api: TestClient, **body: object) -> dict:
    r = api.post("/v1/goals", json={"goal": "a red circle", "budget": 4, **body})
    assert r.status_code == 201, r.text
    return r.json()


NOT_FOUND = [
    ("GET", f"/v1/goals/{MISSING}", None),
    ("GET", f"/v1/goals/{MISSING}/candidates", None),
    ("POST", f"/v1/goals/{MISSING}/close", None),
    ("POST", f"/v1/goals/{MISSING}/iterations", {"prompts": [{"prompt": "x"}]}),
    ("GET", f"/v1/artifacts/{MISSING}/{MISSING}.png", None),
    ("GET", "/v1/no-such-route", None),
]


def test_unknown_things_are_404(api: TestClient) -> None:
    failures = []
    for method, path, body in NOT_FOUND:
        r = api.request(method, path, json=body)
        if r.status_code != 404 or not r.json()["detail"]:
            failures.append(f"{method} {path}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)


def test_openapi_docs_and_health_are_served(api: TestClient) -> None:
    spec = api.get("/openapi.json")
    assert spec.status_code == 200
    paths = spec.json()["paths"]
    for path in ("/v1/goals", "/v1/goals/{goal_id}", "/v1/goals/{goal_id}/candidates",
                 "/v1/goals/{goal_id}/iterations", "/v1/goals/{goal_id}/close", "/healthz"):
        assert path in paths, path
    assert "CLIPScore" in spec.json()["info"]["description"]
    docs = api.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    health = api.get("/healthz")  # no sweep runs beside this app (a recording dispatcher)
    assert health.status_code == 200 and health.json() == {
        "status": "degraded", "database": "ok", "sweep": "never", "sweep_last": ""}


def test_health_tells_a_running_sweep_from_a_stopped_one(api: TestClient, store: Store) -> None:
    store.beat(SWEEP_HEARTBEAT, interval_seconds=10.0)  # what every sweep does when it finishes
    health = api.get("/healthz").json()
    assert (health["status"], health["sweep"]) == ("ok", "ok")
    last = datetime.fromisoformat(health["sweep_last"].removesuffix("Z"))
    assert abs((datetime.now(UTC).replace(tzinfo=None) - last).total_seconds()) < 60
    store.beat(SWEEP_HEARTBEAT, interval_seconds=0.05)  # a sweep due every 50 ms...
    time.sleep(0.3)  # ...that missed more than three runs
    health = api.get("/healthz")
    assert health.status_code == 200  # the API itself is fine
    assert (health.json()["status"], health.json()["sweep"]) == ("degraded", "stale")
    store.beat(SWEEP_HEARTBEAT, interval_seconds=10.0)  # it runs again
    assert api.get("/healthz").json()["sweep"] == "ok"


def test_goals_are_listed_newest_first_and_read_back(api: TestClient) -> None:
    first, second = create(api, goal="a red circle"), create(api, goal="a blue square")
    listed = api.get("/v1/goals").json()
    assert [g["id"] for g in listed] == [second["id"], first["id"]]
    assert [g["id"] for g in api.get("/v1/goals", params={"limit": 1}).json()] == [second["id"]]
    got = api.get(f"/v1/goals/{first['id']}").json()
    assert got["goal"] == "a red circle" and got["iterations"] == [] and got["best_candidate"] is None
    assert api.get(f"/v1/goals/{first['id']}/candidates").json() == []
    mine = create(api, tenant="acme")
    assert [g["id"] for g in api.get("/v1/goals", params={"tenant": "acme"}).json()] == [mine["id"]]


@pytest.fixture
def artifacts(settings: Settings) -> Path:
    """An artifact at <root>/g1/c1.png, and a PNG just outside the root that must stay private."""
    root = settings.resolved_artifacts_dir()
    (root / "g1").mkdir(parents=True)
    (root / "g1" / "c1.png").write_bytes(png_bytes("green"))
    (root.parent / "secret.png").write_bytes(png_bytes("black"))
    (root / "g1" / "notes.txt").write_text("not an image")
    (root / "g1" / "link.png").symlink_to(root.parent / "secret.png")
    return root


TRAVERSALS = [
    "/v1/artifacts/%2E%2E/secret.png",  # goal_id "..": reaches the route, escapes the root
    "/v1/artifacts/g1/..%2F..%2Fsecret.png",
    "/v1/artifacts/g1/%2E%2E%2F%2E%2E%2Fsecret.png",
    "/v1/artifacts/g1/link.png",  # a symlink out of the root
    "/v1/artifacts/g1/notes.txt",  # not a PNG
    "/v1/artifacts/g1/",
]


def test_artifacts_are_served_only_from_the_root(api: TestClient, artifacts: Path) -> None:
    r = api.get("/v1/artifacts/g1/c1.png")
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content == (artifacts / "g1" / "c1.png").read_bytes()
    secret = (artifacts.parent / "secret.png").read_bytes()
    failures = []
    for path in TRAVERSALS:
        r = api.get(path)
        if r.status_code != 404 or r.content == secret:
            failures.append(f"{path}: {r.status_code}")
    assert not failures, "\n".join(failures)
