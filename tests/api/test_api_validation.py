"""Every bad goal is refused with 422 naming its field, and leaves no trace behind."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient

from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher, files_under, row_counts

NO_ROWS = {"goals": 0, "iterations": 0, "candidates": 0}

Body = Callable[[Settings], dict[str, Any]]
BAD_GOALS: list[tuple[str, Body, str]] = [
    ("empty goal", lambda s: {"goal": ""}, "goal"),
    ("whitespace goal", lambda s: {"goal": " \t\n "}, "goal"),
    ("over-long goal", lambda s: {"goal": "x" * (s.max_goal_chars + 1)}, "goal"),
    ("budget 0", lambda s: {"budget": 0}, "budget"),
    ("negative budget", lambda s: {"budget": -3}, "budget"),
    ("budget above max", lambda s: {"budget": s.max_budget + 1}, "budget"),
    ("fanout 0", lambda s: {"fanout": 0}, "fanout"),
    ("unknown model", lambda s: {"model": "no-such-model"}, "model"),
    ("unknown scorer", lambda s: {"scorer": "no-such-scorer"}, "scorer"),
    ("size not a multiple of 8", lambda s: {"size": 36}, "size"),
    ("size above max", lambda s: {"size": s.max_size + 8}, "size"),
    ("steps 0", lambda s: {"steps": 0}, "steps"),
    ("budget not a number", lambda s: {"budget": "many"}, "budget"),
    ("unknown field", lambda s: {"colour": "red"}, "colour"),
    ("unknown reviser", lambda s: {"reviser": "oracle"}, "reviser"),
    ("llm reviser, no endpoint configured", lambda s: {"reviser": "llm"}, "reviser"),
]


def field_of(item: dict[str, Any]) -> str:
    loc = item["loc"]
    assert loc[0] == "body", loc
    return ".".join(str(p) for p in loc[1:])


def test_bad_goals_are_422_naming_the_field_and_write_nothing(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    # One database per backend for all cases (a fresh one each would cost 0.3 s a case);
    # after every case the tables must still be empty.
    failures = []
    for name, body, field in BAD_GOALS:
        r = api.post("/v1/goals", json={"goal": "a red circle", **body(settings)})
        fields = [field_of(d) for d in r.json()["detail"]] if r.status_code == 422 else []
        if r.status_code != 422 or field not in fields or not all(d["msg"] for d in r.json()["detail"]):
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
        if row_counts(store) != NO_ROWS:
            failures.append(f"{name}: rows written {row_counts(store)}")
    assert not failures, "\n".join(failures)
    assert dispatcher.advanced == [] and dispatcher.generated == []
    assert files_under(settings.resolved_artifacts_dir()) == []


def test_missing_goal_and_many_bad_fields_at_once(api: TestClient, store: Store) -> None:
    r = api.post("/v1/goals", json={"budget": 4})
    assert r.status_code == 422
    assert [field_of(d) for d in r.json()["detail"]] == ["goal"]
    r = api.post("/v1/goals", json={"goal": " ", "budget": 0, "fanout": 0, "size": 12, "steps": 0})
    assert r.status_code == 422
    assert {field_of(d) for d in r.json()["detail"]} == {"goal", "budget", "fanout", "size", "steps"}
    assert row_counts(store) == NO_ROWS


def test_a_good_goal_is_created_with_its_defaults_resolved(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher
) -> None:
    r = api.post("/v1/goals", json={"goal": "  a red   circle ", "budget": 4})
    assert r.status_code == 201, r.text
    goal = r.json()
    assert goal["status"] == "pending" and goal["goal"] == "a red circle"
    assert goal["spec"]["model"] == "tiny-dit" and goal["spec"]["scorer"] == "tiny-clip"
    assert goal["spec"]["steps"] >= 1 and goal["spec"]["size"] % 8 == 0
    assert goal["budget"] == 4 and goal["generations_reserved"] == 0
    assert dispatcher.advanced == [goal["id"]]
    assert row_counts(store) == {"goals": 1, "iterations": 0, "candidates": 0}
