"""Client and AsyncClient against the real app in-process: an external goal, a whole loop."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from agentloop.api.app import create_app
from agentloop.orchestrator import advance
from agentloop.sdk import AsyncClient, Candidate, Client, Goal, IterationAccepted
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import RecordingDispatcher, finish, png_bytes, threaded_loop


def test_external_goal_with_the_sync_client(
    client: Client, store: Store, settings: Settings, dispatcher: RecordingDispatcher
) -> None:
    health = client.health()  # no sweep beside this app (a recording dispatcher): degraded
    assert (health["status"], health["database"], health["sweep"]) == ("degraded", "ok", "never")
    goal = client.create_goal("a red circle", reviser="external", budget=4)
    assert isinstance(goal, Goal) and goal.status == "pending" and dispatcher.advanced == [goal.id]
    advance(store, goal.id)  # the dispatched advance_goal task
    assert client.wait(goal.id, timeout=5, poll=0.01).status == "waiting"

    accepted = client.add_iteration(goal, ["a red circle", {"prompt": "a red disc", "seed": 3}])
    assert isinstance(accepted, IterationAccepted) and accepted.iteration == 0
    cands = client.candidates(goal.id)
    assert all(isinstance(c, Candidate) for c in cands)
    assert [c.id for c in cands] == accepted.candidate_ids
    assert [(c.prompt, c.status) for c in cands] == [("a red circle", "queued"), ("a red disc", "queued")]
    assert cands[1].seed == 3 and dispatcher.generated == [("tiny-dit", accepted.candidate_ids)]

    finish(store, settings, accepted.candidate_ids, score=lambda c: 0.4 + c.ordinal / 10)
    advance(store, goal.id)
    goal = client.wait(goal, timeout=5, poll=0.01)
    assert goal.status == "waiting" and goal.best_candidate is not None
    assert goal.best_score == pytest.approx(0.5) and "CLIPScore" in goal.score_scale
    assert client.artifact(goal.best_candidate) == png_bytes()
    assert goal.best_candidate.artifact_url is not None
    assert client.artifact(goal.best_candidate.artifact_url) == png_bytes()

    done = client.close_goal(goal.id)
    assert done.status == "done" and done.stop_reason == "closed_by_caller"
    assert [g.id for g in client.list_goals()] == [goal.id]
    assert client.list_goals(tenant="nobody") == []

    other = client.create_goal("a blue square", budget=4)
    cancelled = client.cancel_goal(other)
    assert cancelled.status == "cancelled" and cancelled.stop_reason == "cancelled_by_caller"
    assert client.wait(other.id, timeout=5, poll=0.01).status == "cancelled"


@pytest.mark.anyio
async def test_external_goal_with_the_async_client(
    aclient: AsyncClient, store: Store, settings: Settings, dispatcher: RecordingDispatcher
) -> None:
    assert (await aclient.health())["database"] == "ok"
    goal = await aclient.create_goal("a red circle", reviser="external", budget=4)
    assert goal.status == "pending" and dispatcher.advanced == [goal.id]
    advance(store, goal.id)
    assert (await aclient.wait(goal.id, timeout=5, poll=0.01)).status == "waiting"

    accepted = await aclient.add_iteration(goal, ["a red circle", {"prompt": "a red disc", "seed": 3}])
    cands = await aclient.candidates(goal.id)
    assert [c.id for c in cands] == accepted.candidate_ids
    assert [c.prompt for c in cands] == ["a red circle", "a red disc"] and cands[1].seed == 3

    finish(store, settings, accepted.candidate_ids, score=lambda c: 0.4 + c.ordinal / 10)
    advance(store, goal.id)
    goal = await aclient.wait(goal, timeout=5, poll=0.01)
    assert goal.status == "waiting" and goal.best_candidate is not None
    assert await aclient.artifact(goal.best_candidate) == png_bytes()

    done = await aclient.close_goal(goal.id)
    assert done.status == "done" and done.stop_reason == "closed_by_caller"
    assert [g.id for g in await aclient.list_goals(limit=5)] == [goal.id]
    other = await aclient.create_goal("a blue square", budget=4)
    assert (await aclient.cancel_goal(other.id)).status == "cancelled"


@pytest.mark.anyio
async def test_a_whole_search_loop_runs_while_the_client_waits(
    db_url: str, settings: Settings, anyio_backend: str
) -> None:
    """The orchestrator for real in background threads, a fake worker in place of the GPU."""
    import httpx

    store = Store(db_url)
    loop = threaded_loop(store, settings, score=lambda c: 0.2 + 0.1 * c.iteration + 0.01 * c.ordinal)
    app = create_app(settings, store, loop)
    try:
        async with (
            app.router.lifespan_context(app),
            AsyncClient("http://t", transport=httpx.ASGITransport(app)) as aclient,
        ):
            goal = await aclient.create_goal("a red circle and a blue square", budget=7, fanout=3)
            goal = await aclient.wait(goal.id, timeout=30, poll=0.02)
            assert goal.status == "done", goal
            assert goal.stop_reason == "budget_spent"
            assert goal.generations_reserved == goal.generations_done == 7
            cands = await aclient.candidates(goal)
            assert [c.iteration for c in cands] == [0, 0, 0, 1, 1, 1, 2]
            assert {c.status for c in cands} == {"succeeded"}
            assert goal.best_candidate is not None and goal.best_candidate.iteration == 2
            assert await aclient.artifact(goal.best_candidate) == png_bytes()
    finally:
        loop.close(wait=True)
        store.dispose()
    assert loop.errors == []


def test_sync_client_accepts_an_http_client(app: FastAPI) -> None:
    # Starlette's TestClient is built on httpx2, not httpx; the SDK needs only `.request()`.
    with TestClient(app) as http:
        client = Client("http://testserver", http_client=http)  # type: ignore[arg-type]
        goal = client.create_goal("a red circle")
        assert client.get_goal(goal.id).goal == "a red circle"
        client.close()
        assert http.get("/healthz").status_code == 200  # not closed: it is the caller's
