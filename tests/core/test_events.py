"""The event log, on both backends: every transition appends its event in its own
transaction, ids only grow, a goal's last event is `goal.finished`."""

from __future__ import annotations

import pytest

from agentloop.domain import CandidateDraft, CandidateStatus, Decision, EventView, GoalStatus
from agentloop.orchestrator import IterationRejected, Policy, advance, cancel_goal, submit_iteration
from agentloop.store import BudgetExceeded, Outcome, Store
from tests.core.helpers import finish_all, make_goal


@pytest.fixture
def store(db_url: str):  # noqa: ANN201
    s = Store(db_url)
    yield s
    s.dispose()


def _types(events: list[EventView]) -> list[str]:
    return [e.type for e in events]


def _check_log(events: list[EventView]) -> None:
    ids = [e.id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert _types(events).count("goal.finished") == 1 and events[-1].type == "goal.finished"


def test_a_goal_s_whole_life_is_in_its_log(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=4, fanout=2, max_iterations=2, patience=5)
    [created] = store.events_after(goal_id)
    goal = store.get_goal(goal_id)
    assert created.type == "goal.created" and created.data["budget"] == 4
    assert created.created_at == goal.created_at  # written with the goal, on its clock

    first = advance(store, goal_id).dispatch
    [a, b] = store.claim_candidates(first, "w1", lease_seconds=900, max_attempts=3)
    store.release_candidates(a.claim_token, {a.id: "RuntimeError: out of memory"}, 3)
    store.complete_candidates(
        b.claim_token, [Outcome(b.id, 1.25, {"a red circle": 1.1}, f"{goal_id}/{b.id}-1.png", {})]
    )
    finish_all(store, [a.id], lambda c: 1.5)  # the retry succeeds
    second = advance(store, goal_id).dispatch
    finish_all(store, second, lambda c: 0.5)
    advance(store, goal_id)

    events = store.events_after(goal_id)
    _check_log(events)
    assert _types(events) == [
        "goal.created",
        "iteration.opened", "goal.status",
        "candidate.started", "candidate.started", "candidate.failed", "candidate.succeeded",
        "candidate.started", "candidate.succeeded",
        "iteration.closed", "goal.best", "iteration.opened",
        "candidate.started", "candidate.started", "candidate.succeeded", "candidate.succeeded",
        "iteration.closed", "goal.status", "goal.finished",
    ]
    by_type = {e.type: e for e in events}
    assert events[1].data == {"index": 0, "candidate_ids": first}
    assert events[2].data == {"from": "pending", "to": "running", "stop_reason": None}
    failed = by_type["candidate.failed"].data
    assert failed["candidate_id"] == a.id and failed["retry"] is True
    assert "out of memory" in failed["error"] and failed["attempt"] == 1
    ok = events[6].data
    assert ok == {
        "candidate_id": b.id, "iteration": 0, "attempt": 1, "clip_score": 1.25,
        "part_scores": {"a red circle": 1.1}, "image_url": f"/v1/artifacts/{goal_id}/{b.id}-1.png",
    }
    assert events[7].data["attempt"] == 2 and events[7].data["worker"] == "w1"
    assert by_type["goal.best"].data == {"candidate_id": a.id, "score": 1.5}
    done = store.get_goal(goal_id)
    assert events[-1].data == {
        "status": "done", "stop_reason": done.stop_reason, "error": None,
        "best_candidate_id": a.id, "best_score": 1.5,
    }
    assert events[-1].created_at == done.finished_at
    succeeded = {e.data["candidate_id"] for e in events if e.type == "candidate.succeeded"}
    assert succeeded == {c.id for c in store.list_candidates(goal_id)}
    # reading from a cursor, a page at a time
    assert store.events_after(goal_id, events[5].id, limit=2) == events[6:8]
    assert store.finished_event_id(goal_id) == events[-1].id


def test_a_cancelled_goal_logs_each_candidate_it_cancelled_then_finishes(
    store: Store, settings  # noqa: ANN001
) -> None:
    goal_id = make_goal(store, settings, budget=3, fanout=3)
    ids = advance(store, goal_id).dispatch
    store.claim_candidates(ids[:1], "w1", lease_seconds=900, max_attempts=3)
    cancel_goal(store, goal_id)
    cancel_goal(store, goal_id)  # idempotent: no second event
    events = store.events_after(goal_id)
    _check_log(events)
    assert _types(events)[-5:] == [
        "goal.status", "candidate.cancelled", "candidate.cancelled", "iteration.closed",
        "goal.finished",
    ]
    assert {e.data["candidate_id"] for e in events if e.type == "candidate.cancelled"} == set(ids[1:])
    assert events[-1].data["status"] == "cancelled"
    assert events[-1].data["stop_reason"] == "cancelled_by_caller"


def test_a_lease_taken_back_is_logged_as_a_retry_then_a_failure(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=1, fanout=1, max_iterations=1)
    [cid] = advance(store, goal_id).dispatch
    policy = Policy(max_attempts=2)
    store.claim_candidates([cid], "dies-1", lease_seconds=-1, max_attempts=2)
    advance(store, goal_id, policy)
    store.claim_candidates([cid], "dies-2", lease_seconds=-1, max_attempts=2)
    advance(store, goal_id, policy)
    events = store.events_after(goal_id)
    _check_log(events)
    failed = [e.data for e in events if e.type == "candidate.failed"]
    assert [(f["attempt"], f["retry"]) for f in failed] == [(1, True), (2, False)]
    assert "dies-1 stopped renewing its lease" in failed[0]["error"]
    assert events[-1].data["status"] == "failed" and events[-1].data["best_score"] is None


def test_a_transition_that_rolls_back_leaves_no_event(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=2, fanout=2, reviser="external")
    advance(store, goal_id)  # waiting for prompts
    before = store.events_after(goal_id)
    assert _types(before) == ["goal.created", "goal.status"]
    drafts = [CandidateDraft(prompt="a red circle", seed=i) for i in range(3)]
    with pytest.raises(BudgetExceeded):
        store.decide(goal_id, lambda state: Decision(new_candidates=drafts,
                                                     goal_status=GoalStatus.RUNNING))
    with pytest.raises(IterationRejected):
        submit_iteration(store, goal_id, drafts)
    assert store.events_after(goal_id) == before


def test_a_withdrawn_iteration_is_logged(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=2, fanout=2, reviser="external")
    advance(store, goal_id)
    decision = submit_iteration(store, goal_id, [CandidateDraft(prompt="a red circle", seed=1)])
    assert store.withdraw_iteration(goal_id, 0)
    events = store.events_after(goal_id)
    assert _types(events)[-2:] == ["iteration.withdrawn", "goal.status"]
    assert events[-2].data == {"index": 0, "candidate_ids": decision.dispatch}
    assert events[-1].data["to"] == "waiting"
    assert store.get_candidates(decision.dispatch) == []
    assert all(c.status is not CandidateStatus.QUEUED for c in store.list_candidates(goal_id))
