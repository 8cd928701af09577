"""The contract agents read: error codes for each refusal, goal summaries in the list, cursor
pages that visit every goal once, filters, and the OpenAPI document's ids, tags and enums."""

from __future__ import annotations

from fastapi.testclient import TestClient

from agentloop.orchestrator import advance
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import finish
from tests.api.test_api_external import post_prompts, waiting_goal

MISSING = "0" * 32


def code_of(r) -> str:  # noqa: ANN001
    return r.json()["error"]["code"]


def test_each_refusal_has_its_code(api: TestClient, store: Store, settings: Settings) -> None:
    r = api.get(f"/v1/goals/{MISSING}")
    assert r.status_code == 404 and code_of(r) == "not_found" and r.json()["detail"]
    assert code_of(api.get("/v1/nowhere")) == "not_found"
    r = api.delete("/v1/goals")
    assert r.status_code == 405 and code_of(r) == "method_not_allowed"
    r = api.post("/v1/goals", json={"goal": "a red circle", "budget": 0, "size": 12})
    assert r.status_code == 422 and code_of(r) == "validation_error"
    assert [e["field"] for e in r.json()["error"]["errors"]] == ["budget", "size"]
    assert [d["loc"] for d in r.json()["detail"]] == [["body", "budget"], ["body", "size"]]
    r = api.post("/v1/goals", content=b"x" * (settings.max_body_bytes + 1))
    assert r.status_code == 413 and code_of(r) == "body_too_large"

    plain = api.post("/v1/goals", json={"goal": "a red circle", "budget": 4}).json()["id"]
    assert code_of(post_prompts(api, plain, "x")) == "not_external"

    goal_id = waiting_goal(api, store, budget=2)
    r = post_prompts(api, goal_id, "a", "b", "c")
    assert r.status_code == 409 and code_of(r) == "budget_exceeded"
    ids = post_prompts(api, goal_id, "a").json()["candidate_ids"]
    assert code_of(post_prompts(api, goal_id, "b")) == "iteration_open"
    assert code_of(api.post(f"/v1/goals/{goal_id}/close")) == "goal_not_waiting"
    finish(store, settings, ids)
    advance(store, goal_id)
    assert api.post(f"/v1/goals/{goal_id}/close").status_code == 200
    for r in (post_prompts(api, goal_id, "b"), api.post(f"/v1/goals/{goal_id}/cancel"),
              api.post(f"/v1/goals/{goal_id}/close")):
        assert r.status_code == 409 and code_of(r) == "goal_finished"


def test_the_list_carries_each_goals_summary(
    api: TestClient, store: Store, settings: Settings
) -> None:
    goal_id = waiting_goal(api, store, budget=4)
    ids = post_prompts(api, goal_id, "a", "b").json()["candidate_ids"]
    finish(store, settings, ids, score=lambda c: 0.5 + c.ordinal)
    advance(store, goal_id)
    [listed] = api.get("/v1/goals").json()
    full = api.get(f"/v1/goals/{goal_id}").json()
    assert listed["generations_done"] == 2 and listed["best_score"] == 1.5
    assert listed["best_candidate"]["id"] == ids[1]
    assert listed == full


def test_pages_visit_every_goal_once_and_filters_hold(api: TestClient, store: Store) -> None:
    made = [api.post("/v1/goals", json={"goal": f"a red circle {i}", "budget": 2,
                                        "tenant": "a" if i % 2 else "b"}).json()["id"]
            for i in range(7)]
    api.post(f"/v1/goals/{made[0]}/cancel")
    seen, cursor, pages = [], None, 0
    while True:
        r = api.get("/v1/goals", params={"limit": 3, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200
        seen += [g["id"] for g in r.json()]
        pages += 1
        cursor = r.headers.get("x-next-cursor")
        if cursor is None:
            break
        assert 'rel="next"' in r.headers["link"]
    assert seen == made[::-1] and pages == 3
    tenant_a = [g["id"] for g in api.get("/v1/goals", params={"tenant": "a"}).json()]
    assert tenant_a == [m for i, m in enumerate(made) if i % 2][::-1]
    r = api.get("/v1/goals", params=[("status", "cancelled"), ("status", "failed")])
    assert [g["id"] for g in r.json()] == [made[0]]
    r = api.get("/v1/goals", params={"status": "nonsense"})
    assert r.status_code == 422 and code_of(r) == "validation_error"
    r = api.get("/v1/goals", params={"cursor": "not-a-cursor"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "cursor"


def test_candidate_pages_and_filters(api: TestClient, store: Store, settings: Settings) -> None:
    goal_id = waiting_goal(api, store, budget=8)
    first = post_prompts(api, goal_id, "a", "b", "c").json()["candidate_ids"]
    finish(store, settings, first[:1])
    url = f"/v1/goals/{goal_id}/candidates"
    seen, cursor = [], None
    while True:
        r = api.get(url, params={"limit": 2, **({"cursor": cursor} if cursor else {})})
        seen += [c["id"] for c in r.json()]
        cursor = r.headers.get("x-next-cursor")
        if cursor is None:
            break
    assert seen == first
    assert [c["id"] for c in api.get(url, params={"status": "succeeded"}).json()] == first[:1]
    assert [c["id"] for c in api.get(url, params={"iteration": 0}).json()] == first
    assert api.get(url, params={"iteration": 1}).json() == []


def test_openapi_names_operations_tags_enums_and_errors(api: TestClient) -> None:
    doc = api.get("/openapi.json").json()
    ops = {op["operationId"]: (path, method, op) for path, methods in doc["paths"].items()
           for method, op in methods.items()}
    assert {"create_goal", "list_goals", "get_goal", "list_candidates", "add_iteration",
            "close_goal", "cancel_goal", "get_artifact", "healthz"} <= ops.keys()
    for name, (_path, _method, op) in ops.items():
        assert op.get("tags") and op.get("summary"), name
        for code, answer in op["responses"].items():
            if code.startswith(("4", "5")) and name != "healthz":
                ref = answer["content"]["application/json"]["schema"]["$ref"]
                assert ref.endswith("/ErrorOut"), (name, code)
    schemas = doc["components"]["schemas"]
    assert schemas["GoalStatus"]["enum"] == ["pending", "running", "waiting", "done", "failed",
                                             "cancelled"]
    assert "CandidateStatus" in schemas and "IterationStatus" in schemas
    assert {"409", "422", "503"} <= ops["add_iteration"][2]["responses"].keys()
    create = ops["create_goal"][2]
    assert create["requestBody"]["content"]["application/json"]["examples"]
    assert any(p["name"] == "Idempotency-Key" for p in create["parameters"])
