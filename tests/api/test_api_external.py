"""The external-reviser flow over HTTP: the caller supplies each iteration's prompts."""

from __future__ import annotations

from fastapi.testclient import TestClient

from agentloop.orchestrator import advance
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher, files_under, finish, row_counts


def waiting_goal(api: TestClient, store: Store, budget: int = 5) -> str:
    """An external goal that the orchestrator has moved to `waiting`."""
    r = api.post("/v1/goals", json={"goal": "a red circle", "reviser": "external", "budget": budget})
    assert r.status_code == 201, r.text
    goal_id = r.json()["id"]
    assert r.json()["status"] == "pending"
    advance(store, goal_id)  # what the dispatched advance_goal task would do
    assert api.get(f"/v1/goals/{goal_id}").json()["status"] == "waiting"
    return goal_id


def post_prompts(api: TestClient, goal_id: str, *prompts: str):  # noqa: ANN201
    return api.post(
        f"/v1/goals/{goal_id}/iterations", json={"prompts": [{"prompt": p} for p in prompts]}
    )


def test_external_iterations_budget_and_close(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    goal_id = waiting_goal(api, store, budget=5)
    assert dispatcher.advanced == [goal_id]

    r = post_prompts(api, goal_id, "a red circle", "a crimson disc", "a red ring")
    assert r.status_code == 201, r.text
    accepted = r.json()
    assert accepted["goal_id"] == goal_id and accepted["iteration"] == 0
    ids = accepted["candidate_ids"]
    assert len(ids) == 3 and len(set(ids)) == 3
    cands = store.list_candidates(goal_id)
    assert [c.id for c in cands] == ids
    assert [c.prompt for c in cands] == ["a red circle", "a crimson disc", "a red ring"]
    assert {c.status.value for c in cands} == {"queued"} and {c.edit for c in cands} == {"external"}
    assert dispatcher.generated == [("tiny-dit", ids)]
    assert api.get(f"/v1/goals/{goal_id}").json()["generations_reserved"] == 3

    # The first iteration is still open: a second one is refused and writes nothing.
    r = post_prompts(api, goal_id, "a second try")
    assert r.status_code == 409, r.text
    assert row_counts(store) == {"goals": 1, "iterations": 1, "candidates": 3}
    assert len(dispatcher.generated) == 1

    finish(store, settings, ids, score=lambda c: 0.5 + 0.1 * c.ordinal)
    advance(store, goal_id)
    goal = api.get(f"/v1/goals/{goal_id}").json()
    assert goal["status"] == "waiting" and goal["best_candidate"]["id"] == ids[2]
    assert goal["iterations"][0]["status"] == "closed"

    # 2 generations are left: 3 prompts exceed them, and nothing is written.
    files_before = files_under(settings.resolved_artifacts_dir())
    r = post_prompts(api, goal_id, "one", "two", "three")
    assert r.status_code == 409 and "2 generations left" in r.json()["detail"]
    assert row_counts(store) == {"goals": 1, "iterations": 1, "candidates": 3}
    assert files_under(settings.resolved_artifacts_dir()) == files_before
    assert api.get(f"/v1/goals/{goal_id}").json()["status"] == "waiting"

    r = api.post(f"/v1/goals/{goal_id}/close")
    assert r.status_code == 200 and r.json()["status"] == "done"
    assert r.json()["stop_reason"] == "closed_by_caller"
    assert api.post(f"/v1/goals/{goal_id}/close").status_code == 409
    assert post_prompts(api, goal_id, "too late").status_code == 409


def test_external_goal_spends_its_budget_exactly(
    api: TestClient, store: Store, settings: Settings
) -> None:
    goal_id = waiting_goal(api, store, budget=3)
    ids = post_prompts(api, goal_id, "a", "b").json()["candidate_ids"]
    finish(store, settings, ids)
    advance(store, goal_id)
    ids = post_prompts(api, goal_id, "c").json()["candidate_ids"]
    finish(store, settings, ids)
    advance(store, goal_id)
    goal = api.get(f"/v1/goals/{goal_id}").json()
    assert goal["status"] == "done" and goal["stop_reason"] == "budget_spent"
    assert goal["generations_reserved"] == goal["generations_done"] == 3
    assert len(api.get(f"/v1/goals/{goal_id}/candidates").json()) == 3


def test_seeds_and_negative_prompts_are_kept(api: TestClient, store: Store) -> None:
    goal_id = waiting_goal(api, store)
    r = api.post(f"/v1/goals/{goal_id}/iterations", json={"prompts": [
        {"prompt": "a", "seed": 7, "negative_prompt": "blurry"}, {"prompt": "b"},
    ]})
    assert r.status_code == 201, r.text
    a, b = store.list_candidates(goal_id)
    assert (a.seed, a.negative_prompt) == (7, "blurry")
    assert b.negative_prompt == "" and b.seed >= 0


def test_layouts_and_variations_are_kept(api: TestClient, store: Store) -> None:
    goal_id = waiting_goal(api, store)
    regions = [{"prompt": "a red circle", "x": 0.25, "y": 0.5}, {"prompt": "a box", "x": 1, "y": 0}]
    r = api.post(f"/v1/goals/{goal_id}/iterations", json={"prompts": [
        {"prompt": "a red circle and a box", "seed": 3, "regions": regions},
        {"prompt": "a red circle", "seed": 3, "variation_seed": 9, "variation_strength": 0.3},
    ]})
    assert r.status_code == 201, r.text
    laid_out, varied = store.list_candidates(goal_id)
    assert laid_out.params["regions"] == [["a red circle", 0.25, 0.5], ["a box", 1.0, 0.0]]
    assert "variation_seed" not in laid_out.params
    assert (varied.params["variation_seed"], varied.params["variation_strength"]) == (9, 0.3)
    assert "regions" not in varied.params
    shown = api.get(f"/v1/goals/{goal_id}/candidates").json()
    assert shown[0]["params"]["regions"][1] == ["a box", 1.0, 0.0]


def test_prompts_for_a_search_goal_and_closing_a_pending_one_are_409(api: TestClient, store: Store) -> None:
    goal_id = api.post("/v1/goals", json={"goal": "a red circle", "budget": 4}).json()["id"]
    r = post_prompts(api, goal_id, "mine")
    assert r.status_code == 409 and "external" in r.json()["detail"]
    assert row_counts(store)["candidates"] == 0
    assert api.post(f"/v1/goals/{goal_id}/close").status_code == 409  # pending, not waiting


BAD_BODIES = [
    ({"prompts": []}, "prompts"),
    ({"prompts": [{"prompt": ""}]}, "prompts.0.prompt"),
    ({"prompts": ["a bare string"]}, "prompts.0"),
    ({"prompts": [{"prompt": "x", "steps": 3}]}, "prompts.0.steps"),
    ({"prompts": [{"prompt": "x", "seed": -1}]}, "prompts.0.seed"),
    ({"prompts": [{"prompt": "x", "variation_strength": 1.5}]}, "prompts.0.variation_strength"),
    ({"prompts": [{"prompt": "x", "regions": [{"prompt": "a", "x": 1.2, "y": 0}]}]},
     "prompts.0.regions.0.x"),
    ({"prompts": [{"prompt": "x", "regions": [{"prompt": "", "x": 0, "y": 0}]}]},
     "prompts.0.regions.0.prompt"),
    ({"prompts": [{"prompt": "x", "regions": [{"prompt": "a", "x": 0}]}]}, "prompts.0.regions.0.y"),
    ({"prompts": [{"prompt": "x", "regions": [{"prompt": "a", "x": 0, "y": 0}] * 9}]},
     "prompts.0.regions"),
    ({}, "prompts"),
]


def test_bad_iteration_bodies_are_422_and_write_nothing(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher
) -> None:
    goal_id = waiting_goal(api, store)
    failures = []
    for body, field in BAD_BODIES:
        r = api.post(f"/v1/goals/{goal_id}/iterations", json=body)
        fields = [".".join(map(str, d["loc"][1:])) for d in r.json()["detail"]]
        if r.status_code != 422 or field not in fields:
            failures.append(f"{body}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)
    assert row_counts(store) == {"goals": 1, "iterations": 0, "candidates": 0}
    assert dispatcher.generated == []
    assert api.get(f"/v1/goals/{goal_id}").json()["status"] == "waiting"


def test_a_large_iteration_is_dispatched_in_batches(
    api: TestClient, store: Store, dispatcher: RecordingDispatcher, settings: Settings
) -> None:
    goal_id = waiting_goal(api, store, budget=20)
    n = settings.generation_batch + 2
    ids = post_prompts(api, goal_id, *[f"prompt {i}" for i in range(n)]).json()["candidate_ids"]
    assert [len(batch) for _, batch in dispatcher.generated] == [settings.generation_batch, 2]
    assert [i for _, batch in dispatcher.generated for i in batch] == ids
