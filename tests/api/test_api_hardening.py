"""Input that can't break the server: over-long text, NUL, lone surrogates, NaN and infinity,
huge bodies and bad query parameters are answered 422 or 413 naming what is wrong, on both
backends, and write nothing; a database DataError is 422; every timestamp carries an offset.
Property tests: `check_goal` and `IterationIn` either accept within every limit or say which
field is wrong, for any input."""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from sqlalchemy.exc import DataError

from agentloop.api.schemas import IterationIn
from agentloop.domain import (
    MAX_ITERATIONS,
    MAX_PROMPT_CHARS,
    MAX_SEED,
    MAX_TENANT_CHARS,
    GoalInvalid,
    GoalRequest,
    check_goal,
)
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher, row_counts

NO_ROWS = {"goals": 0, "iterations": 0, "candidates": 0}


def post_raw(api: TestClient, url: str, text: str) -> Any:
    """POST a JSON text as is (json= would refuse NaN, and escapes what we mean to send)."""
    return api.post(url, content=text.encode("utf-8", "surrogatepass"),
                    headers={"content-type": "application/json"})


def fields_of(response: Any) -> list[str]:
    return [".".join(str(p) for p in d["loc"][1:]) for d in response.json()["detail"]]


# (name, raw JSON body, the field the answer must name)
BAD_BODIES: list[tuple[str, str, str]] = [
    ("NaN guidance", '{"goal": "a red circle", "guidance": NaN}', "guidance"),
    ("Infinity guidance", '{"goal": "a red circle", "guidance": Infinity}', "guidance"),
    ("-Infinity target", '{"goal": "a red circle", "target_score": -Infinity}', "target_score"),
    ("100-character tenant", json.dumps({"goal": "a red circle", "tenant": "t" * 100}), "tenant"),
    ("empty tenant", json.dumps({"goal": "a red circle", "tenant": ""}), "tenant"),
    ("NUL in goal", json.dumps({"goal": "a red\u0000 circle"}), "goal"),
    ("NUL in tenant", json.dumps({"goal": "a red circle", "tenant": "a\u0000"}), "tenant"),
    ("NUL in negative prompt", json.dumps({"goal": "x", "negative_prompt": "\u0000"}),
     "negative_prompt"),
    ("lone surrogate in goal", '{"goal": "a red \\ud800 circle"}', "goal"),
    ("lone low surrogate in model", '{"goal": "x", "model": "\\udfff"}', "model"),
    ("over-long negative prompt",
     json.dumps({"goal": "x", "negative_prompt": "n" * (MAX_PROMPT_CHARS + 1)}), "negative_prompt"),
    ("seed above 2**53-1", json.dumps({"goal": "x", "seed": MAX_SEED + 1}), "seed"),
    ("seed 2**64", json.dumps({"goal": "x", "seed": 2**64}), "seed"),
    ("budget 1e300", '{"goal": "x", "budget": 1e300}', "budget"),
    ("budget 2.5", '{"goal": "x", "budget": 2.5}', "budget"),
    ("budget as a string", '{"goal": "x", "budget": "16"}', "budget"),
    ("max_iterations huge", json.dumps({"goal": "x", "max_iterations": 10**30}), "max_iterations"),
]


def test_bad_bodies_are_422_naming_the_field_and_write_nothing(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher
) -> None:
    failures = []
    for name, text, field in BAD_BODIES:
        r = post_raw(api, "/v1/goals", text)
        if r.status_code != 422 or field not in fields_of(r):
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
        if row_counts(store) != NO_ROWS:
            failures.append(f"{name}: rows written {row_counts(store)}")
    assert not failures, "\n".join(failures)
    assert dispatcher.advanced == []


def test_whole_float_integers_are_integers(api: TestClient) -> None:
    """JSON has one number type: 4.0 is 4 (strict still refuses strings and booleans)."""
    r = post_raw(api, "/v1/goals", '{"goal": "a red circle", "budget": 4.0, "seed": 7.0}')
    assert r.status_code == 201, r.text
    assert r.json()["budget"] == 4 and r.json()["spec"]["seed"] == 7
    assert post_raw(api, "/v1/goals", '{"goal": "x", "budget": true}').status_code == 422


def test_a_2mb_negative_prompt_is_413_and_writes_nothing(api: TestClient, store: Store) -> None:
    r = api.post("/v1/goals", json={"goal": "a red circle", "negative_prompt": "n" * 2_000_000})
    assert r.status_code == 413, r.text[:300]
    assert "1048576 bytes" in r.json()["detail"]
    assert row_counts(store) == NO_ROWS


def test_body_over_the_limit_is_413_by_length_and_by_streamed_bytes(
    settings: Settings, store: Store, dispatcher: RecordingDispatcher, api: TestClient
) -> None:
    small = Settings(**{**settings.model_dump(), "max_body_bytes": 64})
    body = json.dumps({"goal": "a red circle", "negative_prompt": "n" * 100}).encode()
    with TestClient(_app(small, store, dispatcher)) as client:
        assert client.post("/v1/goals", content=body,
                           headers={"content-type": "application/json"}).status_code == 413

        def chunks() -> Any:  # no Content-Length: chunked, counted as it arrives
            yield body[:40]
            yield body[40:]

        r = client.post("/v1/goals", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert client.post("/v1/goals", json={"goal": "ok"}).status_code == 201
    assert row_counts(store)["goals"] == 1


def _app(settings: Settings, store: Store, dispatcher: RecordingDispatcher) -> FastAPI:
    from agentloop.api.app import create_app

    return create_app(settings, store, dispatcher)


def test_bad_iteration_bodies_are_422_naming_the_field(api: TestClient, store: Store) -> None:
    goal = api.post("/v1/goals", json={"goal": "a red circle", "reviser": "external"}).json()
    url = f"/v1/goals/{goal['id']}/iterations"
    before = row_counts(store)
    cases = [
        ('{"prompts": [{"prompt": "x", "variation_strength": NaN}]}', "prompts.0.variation_strength"),
        ('{"prompts": [{"prompt": "x", "regions": [{"prompt": "a", "x": Infinity, "y": 0.5}]}]}',
         "prompts.0.regions.0.x"),
        ('{"prompts": [{"prompt": "x", "regions": [{"prompt": "a", "x": 0.5, "y": NaN}]}]}',
         "prompts.0.regions.0.y"),
        (json.dumps({"prompts": [{"prompt": "a\u0000b"}]}), "prompts.0.prompt"),
        ('{"prompts": [{"prompt": "\\udc00"}]}', "prompts.0.prompt"),
        (json.dumps({"prompts": [{"prompt": "x", "negative_prompt": "n" * (MAX_PROMPT_CHARS + 1)}]}),
         "prompts.0.negative_prompt"),
        (json.dumps({"prompts": [{"prompt": "x", "regions": [{"prompt": "\u0000", "x": 0, "y": 0}]}]}),
         "prompts.0.regions.0.prompt"),
        (json.dumps({"prompts": [{"prompt": "x", "seed": 2**63}]}), "prompts.0.seed"),
    ]
    failures = []
    for text, field in cases:
        r = post_raw(api, url, text)
        if r.status_code != 422 or field not in fields_of(r):
            failures.append(f"{text[:80]}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    assert row_counts(store) == before


def test_query_and_path_parameters_are_checked(api: TestClient, store: Store) -> None:
    for params, field in [({"limit": 0}, "limit"), ({"limit": 501}, "limit"),
                          ({"limit": "many"}, "limit"), ({"tenant": "t" * 65}, "tenant"),
                          ({"tenant": "a\u0000"}, "tenant")]:
        r = api.get("/v1/goals", params=params)
        assert r.status_code == 422 and field in fields_of(r), (params, r.text)
    assert api.get("/v1/goals", params={"limit": 500, "tenant": "t" * 64}).json() == []
    assert api.get("/v1/goals/a%00b").status_code == 422
    assert api.get("/v1/goals/nope").status_code == 404
    assert api.get("/v1/artifacts/g/a%00.png").status_code == 422
    assert row_counts(store) == NO_ROWS


def test_a_database_data_error_is_422_not_500(
    api: TestClient, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backstop behind validation: whatever the database refuses is the caller's input."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise DataError("INSERT ...", {}, Exception("value too long for type character varying(64)"))

    monkeypatch.setattr(store, "create_goal", refuse)
    r = api.post("/v1/goals", json={"goal": "a red circle"})
    assert r.status_code == 422, r.text
    assert "value too long" in r.json()["detail"][0]["msg"]


def _is_aware_rfc3339(value: str) -> bool:
    parsed = datetime.fromisoformat(value)
    return parsed.tzinfo is not None and parsed.utcoffset() is not None and "T" in value


def test_every_timestamp_in_a_response_carries_an_offset(
    api: TestClient, store: Store, settings: Settings
) -> None:
    from tests.api.fakes import finish

    goal = api.post("/v1/goals", json={"goal": "a red circle", "reviser": "external"}).json()
    ids = api.post(f"/v1/goals/{goal['id']}/iterations",
                   json={"prompts": [{"prompt": "a red circle"}]}).json()["candidate_ids"]
    finish(store, settings, ids)
    bodies = [goal, api.get(f"/v1/goals/{goal['id']}").json(),
              *api.get(f"/v1/goals/{goal['id']}/candidates").json(), *api.get("/v1/goals").json()]
    stamps = [v for b in bodies for k, v in b.items() if k.endswith("_at") and v is not None]
    assert len(stamps) >= 5
    assert all(_is_aware_rfc3339(s) for s in stamps), stamps


# --- properties -----------------------------------------------------------------------------

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

any_text = st.text(st.characters(codec=None), max_size=80) | st.sampled_from(
    ["", " ", "\x00", "a\ud800", "t" * 65, "n" * (MAX_PROMPT_CHARS + 1)]
)
any_number = st.integers(-(2**70), 2**70) | st.floats() | st.sampled_from([0, 1, 8, 16, 2.0])
any_value = any_number | any_text | st.none() | st.booleans()
GOAL_FIELDS = list(GoalRequest.model_fields)
goal_dicts = st.fixed_dictionaries(
    {"goal": st.sampled_from(["a red circle", "  a  blue square "]) | any_text},
    optional={name: any_value for name in GOAL_FIELDS if name != "goal"}
    | {"colour": any_value},
)


def _storable(text: str) -> bool:
    return "\x00" not in text and not any("\ud800" <= ch <= "\udfff" for ch in text)


@PROPERTY
@given(data=goal_dicts)
def test_check_goal_accepts_within_every_limit_or_names_the_fields(data: dict[str, Any]) -> None:
    s = Settings(default_model="tiny-dit", default_scorer="tiny-clip")
    try:
        spec = check_goal(data, s)
    except GoalInvalid as exc:
        assert exc.errors and all(f and m for f, m in exc.errors)
        known = set(GOAL_FIELDS) | {"colour", "body"}
        assert all(f.split(".")[0] in known for f, _ in exc.errors), exc.errors
        return
    assert "colour" not in data
    assert spec.goal.strip() and len(spec.goal) <= s.max_goal_chars and _storable(spec.goal)
    assert 1 <= spec.budget <= s.max_budget and 1 <= spec.fanout <= s.max_fanout
    assert 1 <= spec.max_iterations <= MAX_ITERATIONS and 1 <= spec.patience <= MAX_ITERATIONS
    assert 1 <= spec.steps <= s.max_steps and 0 < spec.size <= s.max_size and spec.size % 8 == 0
    assert 0 <= spec.seed <= MAX_SEED
    assert math.isfinite(spec.guidance) and spec.guidance >= 0
    assert spec.target_score is None or 0 < spec.target_score <= 2.5
    assert 1 <= len(spec.tenant) <= MAX_TENANT_CHARS and _storable(spec.tenant)
    assert len(spec.negative_prompt) <= MAX_PROMPT_CHARS and _storable(spec.negative_prompt)
    json.dumps(spec.to_json(), allow_nan=False)  # storable as strict JSON


region = st.fixed_dictionaries({"prompt": any_text, "x": any_number, "y": any_number},
                               optional={"extra": any_value})
prompt = st.fixed_dictionaries(
    {"prompt": st.just("a red circle") | any_text},
    optional={"seed": any_number | st.none(), "negative_prompt": any_text | st.none(),
              "variation_seed": any_number | st.none(), "variation_strength": any_number,
              "regions": st.lists(region, max_size=3)},
)
iteration_bodies = st.fixed_dictionaries({"prompts": st.lists(prompt, max_size=3)}) | any_value


@PROPERTY
@given(body=iteration_bodies)
def test_iteration_body_is_valid_within_every_limit_or_a_validation_error(body: Any) -> None:
    try:
        it = IterationIn.model_validate(body)
    except ValidationError as exc:
        assert all(e["msg"] for e in exc.errors())
        return
    assert 1 <= len(it.prompts) <= 256
    for p in it.prompts:
        assert 1 <= len(p.prompt) <= MAX_PROMPT_CHARS and _storable(p.prompt)
        assert p.negative_prompt is None or (
            len(p.negative_prompt) <= MAX_PROMPT_CHARS and _storable(p.negative_prompt))
        assert p.seed is None or 0 <= p.seed <= MAX_SEED
        assert p.variation_seed is None or 0 <= p.variation_seed <= MAX_SEED
        assert 0 <= p.variation_strength <= 1
        for r in p.regions:
            assert 0 <= r.x <= 1 and 0 <= r.y <= 1 and _storable(r.prompt)
