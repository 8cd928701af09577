"""Reviser `llm` over the API: listed and accepted only where the server has an endpoint; a
clear 422 otherwise (the endpoint is never called here: creating a goal only records it)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from agentloop.api.app import create_app
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher


def test_without_an_endpoint_llm_is_not_offered_and_a_goal_asking_for_it_is_422(api: TestClient) -> None:
    models = api.get("/v1/models").json()
    assert models["revisers"] == ["search", "external"]
    schema = api.get("/openapi.json").json()["components"]["schemas"]["GoalRequest"]
    assert schema["properties"]["reviser"]["enum"] == ["search", "external"]
    r = api.post("/v1/goals", json={"goal": "a red circle", "reviser": "llm"})
    assert r.status_code == 422
    (problem,) = r.json()["detail"]
    assert problem["loc"] == ["body", "reviser"] and "AGENTLOOP_LLM_BASE_URL" in problem["msg"]


def test_with_an_endpoint_llm_is_listed_and_accepted(
    settings: Settings, store: Store, dispatcher: RecordingDispatcher,
) -> None:
    configured = settings.model_copy(update={"llm_base_url": "http://127.0.0.1:9/v1",
                                             "llm_model": "qwen2.5-7b-instruct"})
    with TestClient(create_app(configured, store, dispatcher)) as api:
        assert api.get("/v1/models").json()["revisers"] == ["search", "external", "llm"]
        schema = api.get("/openapi.json").json()["components"]["schemas"]["GoalRequest"]
        assert schema["properties"]["reviser"]["enum"] == ["search", "external", "llm"]
        r = api.post("/v1/goals", json={"goal": "a red circle", "reviser": "llm"})
        assert r.status_code == 201, r.text
        assert r.json()["spec"]["reviser"] == "llm"
    assert dispatcher.advanced == [r.json()["id"]]
