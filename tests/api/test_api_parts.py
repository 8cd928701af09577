"""A goal's parts given by the caller, or read once by a language model (`goal_parser` "llm"):
stored with the goal, laid out and judged by them, and refused with a clear 422 when wrong.

The language model is the scripted chat-completions server of `tests/core/llm_server.py` (no
model runs here); everything else is real: the app, the store, the orchestrator, the worker
task on the shapes model and shapes-clip."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from agentloop.api.app import create_app
from agentloop.llm import AnswerInvalid
from agentloop.orchestrator import advance
from agentloop.parse_llm import validate_answer
from agentloop.parts import Part, parts_of
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher
from tests.core.llm_server import Reply, ScriptedLLM, chat
from workers.jobs import WorkerContext, generate_job
from workers.residency import Residency

# The rules read this as one object (no joining word, relation or count): only a reader of
# meaning, or the caller, splits it into the two things it asks for.
GOAL = "a green ring resting on a yellow bar"
PARTS = [{"text": "a green ring", "place": [0.5, 0.25], "scale": 1.0},
         {"text": "a yellow bar at the bottom", "place": [0.5, 0.75], "scale": 1.2}]


def _create(api: TestClient, **body: Any) -> dict[str, Any]:
    r = api.post("/v1/goals", json={"goal": GOAL, "model": "shapes", "scorer": "shapes-clip",
                                    "budget": 4, "fanout": 2, **body})
    assert r.status_code == 201, r.text
    return r.json()


def _first_regions(store: Store, goal_id: str) -> list[list[Any]]:
    advance(store, goal_id)
    return sorted({json.dumps(c.regions) for c in store.list_candidates(goal_id)})


def test_a_goal_with_its_own_parts_is_laid_out_by_them(api: TestClient, store: Store) -> None:
    goal = _create(api, parts=PARTS)
    assert goal["spec"]["parts"] == [
        {"text": "a green ring", "subject": "a green ring", "place": [0.5, 0.25], "scale": 1.0,
         "stated_place": True},
        {"text": "a yellow bar at the bottom", "subject": "a yellow bar", "place": [0.5, 0.75],
         "scale": 1.2, "stated_place": True},
    ]
    # the search reviser lays out every slot, each part drawn with its place in words
    (regions,) = _first_regions(store, goal["id"])
    assert json.loads(regions) == [["a green ring at the top", 0.5, 0.25],
                                   ["a yellow bar at the bottom", 0.5, 0.75, 1.2]]


def test_without_parts_the_rules_read_the_goal_as_one_object(api: TestClient, store: Store) -> None:
    goal = _create(api)
    assert "parts" not in goal["spec"]
    assert _first_regions(store, goal["id"]) == ["[]"]  # no parts: plain samples, no layout


@pytest.mark.slow
def test_the_worker_scores_the_callers_parts_on_their_regions(
    api: TestClient, store: Store, settings: Settings
) -> None:
    goal = _create(api, parts=PARTS, steps=2)
    advance(store, goal["id"])
    ids = [c.id for c in store.list_candidates(goal["id"])]
    ctx = WorkerContext(store=store, dispatcher=RecordingDispatcher(), settings=settings,
                        residency=Residency(), worker_name="w1")
    assert sorted(generate_job(ctx, ids)) == sorted(ids)
    for c in api.get(f"/v1/goals/{goal['id']}/candidates").json():
        assert set(c["part_scores"]) == {"a green ring", "a yellow bar at the bottom"}
        assert all(0 <= v <= 2.5 for v in c["part_scores"].values())


@pytest.mark.parametrize(("parts", "loc", "words"), [
    ([PARTS[0]], ["body", "parts"], "2 to 8"),
    ([PARTS[0], {**PARTS[1], "text": " A  green ring "}], ["body", "parts.1.text"], "distinct"),
    ([PARTS[0], {**PARTS[1], "place": [0.5, 1.5]}], ["body", "parts.1.place"], "[0, 1]"),
    ([PARTS[0], {**PARTS[1], "scale": 3}], ["body", "parts.1.scale"], "[0.5, 2.0]"),
    ([PARTS[0], {**PARTS[1], "place": [0.5]}], ["body", "parts", 1, "place"], "at least 2"),
    ([PARTS[0], {**PARTS[1], "colour": "red"}], ["body", "parts", 1, "colour"], "not permitted"),
    ([PARTS[0], {**PARTS[1], "text": "   "}], ["body", "parts.1.text"], "empty"),
])
def test_bad_parts_are_refused_naming_the_field(
    api: TestClient, store: Store, parts: list[dict], loc: list, words: str
) -> None:
    before = len(store.list_goals())
    r = api.post("/v1/goals", json={"goal": GOAL, "parts": parts})
    assert r.status_code == 422, r.text
    problems = r.json()["detail"]
    assert any(p["loc"] == loc and words in p["msg"] for p in problems), problems
    assert len(store.list_goals()) == before  # nothing was created


def test_the_schema_states_the_parts_limits(api: TestClient) -> None:
    schemas = api.get("/openapi.json").json()["components"]["schemas"]
    parts = schemas["GoalRequest"]["properties"]["parts"]["anyOf"][0]
    assert (parts["minItems"], parts["maxItems"]) == (2, 8)
    part = schemas["PartRequest"]["properties"]
    assert part["place"]["anyOf"][0]["items"] == {"type": "number", "minimum": 0, "maximum": 1}
    assert (part["scale"]["minimum"], part["scale"]["maximum"]) == (0.5, 2.0)


LLM_ANSWER = {"parts": [
    {"text": "a green ring above", "place": [0.5, 0.25], "scale": 1.0},
    {"text": "a yellow bar below", "place": [0.5, 0.75], "scale": 1.0},
]}


def _llm_api(settings: Settings, store: Store, server: ScriptedLLM, **kw: Any) -> TestClient:
    configured = settings.model_copy(update={
        "llm_base_url": server.url, "llm_model": "scripted", "goal_parser": "llm",
        "llm_backoff_seconds": 0.0, **kw})
    return TestClient(create_app(configured, store, RecordingDispatcher()))


def test_the_llm_parser_is_asked_once_and_its_parts_are_stored(settings: Settings, store: Store) -> None:
    with ScriptedLLM([chat(LLM_ANSWER)]) as server, _llm_api(settings, store, server) as api:
        goal = _create(api)
        assert [p["text"] for p in goal["spec"]["parts"]] == ["a green ring above", "a yellow bar below"]
        assert [p["place"] for p in goal["spec"]["parts"]] == [[0.5, 0.25], [0.5, 0.75]]
        (asked,) = server.requests
        assert asked["messages"][-1] == {"role": "user", "content": GOAL}
        assert asked["response_format"]["type"] == "json_schema"
        # the stored parts, not a new question, are what the loop reads from now on
        (regions,) = _first_regions(store, goal["id"])
        assert [r[0] for r in json.loads(regions)] == ["a green ring above at the top",
                                                       "a yellow bar below at the bottom"]
        assert len(server.requests) == 1
        # a caller's own parts are never sent to the model
        assert _create(api, parts=PARTS)["spec"]["parts"][0]["text"] == "a green ring"
        assert len(server.requests) == 1


def test_a_malformed_parse_is_retried_with_what_was_wrong(settings: Settings, store: Store) -> None:
    repeated = {"parts": [LLM_ANSWER["parts"][0], LLM_ANSWER["parts"][0]]}
    with ScriptedLLM([chat("{\"parts\": [ {\"text\""), chat(repeated), chat(LLM_ANSWER)]) as server, \
            _llm_api(settings, store, server) as api:
        goal = _create(api)
        assert len(goal["spec"]["parts"]) == 2 and len(server.requests) == 3
        assert "repeats an earlier part" in server.requests[2]["messages"][-1]["content"]


@pytest.mark.parametrize("script", [
    [chat("not json at all")] * 3,
    [Reply(delay=1.5, body={})] * 3,
    [Reply(500, {"error": {"message": "overloaded"}})] * 3,
], ids=["malformed", "slow", "server-error"])
def test_without_a_valid_parse_the_goal_is_created_and_the_rules_read_it(
    settings: Settings, store: Store, script: list[Reply]
) -> None:
    with ScriptedLLM(script) as server, \
            _llm_api(settings, store, server, llm_timeout_seconds=0.5) as api:
        goal = _create(api, goal="a red circle on the left and a blue square on the right")
        assert "parts" not in goal["spec"] and len(server.requests) == 3
        state = store.get_state(goal["id"])
        assert [p.text for p in parts_of(state.goal.spec.goal, state.goal.spec.parts, "llm")] == [
            "a red circle on the left", "a blue square on the right"]


def test_a_one_object_answer_stores_no_parts_and_the_rules_are_not_asked(
    settings: Settings, store: Store
) -> None:
    one = {"parts": [{"text": "a black and white cat", "place": None, "scale": 1.0}]}
    with ScriptedLLM([chat(one)]) as server, _llm_api(settings, store, server) as api:
        goal = _create(api, goal="a black and white cat with a bell")
        assert goal["spec"]["parts"] == []
        state = store.get_state(goal["id"])
        assert parts_of(state.goal.spec.goal, state.goal.spec.parts, "llm") == ()


def test_goal_parser_llm_needs_an_endpoint() -> None:
    with pytest.raises(ValueError, match="goal_parser 'llm'"):
        Settings(goal_parser="llm")


@pytest.mark.parametrize(("answer", "problem"), [
    ({"parts": []}, "at least one part"),
    ({"items": []}, '{"parts": [...]}'),
    ({"parts": [{"text": "a", "place": [0.2, 2], "scale": 1}]}, "place must be"),
    ({"parts": [{"text": "a", "place": None, "scale": True}]}, "scale must be"),
    ({"parts": [{"text": "", "place": None, "scale": 1}]}, "text must be"),
    ({"parts": [{"text": "x", "place": None, "scale": 1}] * 9}, "at most 8"),
])
def test_invalid_answers_say_what_is_wrong(answer: Any, problem: str) -> None:
    with pytest.raises(AnswerInvalid, match=problem.replace("[", r"\[").replace("{", r"\{")):
        validate_answer(answer)


def test_a_valid_answer_reads_subjects_places_and_scales() -> None:
    stored = validate_answer({"parts": [
        {"text": "a small red circle on the left", "place": [0.25, 0.5], "scale": 0.85},
        {"text": "two  blue squares", "place": None, "scale": 1},
    ]})
    assert [Part(**{**p, "place": tuple(p["place"]) if p["place"] else None}) for p in stored] \
        == list(parts_of("", stored))
    assert parts_of("", stored)[0] == Part("a small red circle on the left", "a small red circle",
                                           (0.25, 0.5), 0.85, True)
    assert parts_of("", stored)[1] == Part("two blue squares", "two blue squares", None, 1.0, False)
