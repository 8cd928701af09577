"""The orchestrator's step on a real database: budget, stop rules, idempotency, retries."""

from __future__ import annotations

import threading

import pytest

from agentloop.domain import CandidateStatus, GoalStatus, IterationStatus, StopReason
from agentloop.orchestrator import advance
from agentloop.store import Store
from tests.core.helpers import finish_all, make_goal


@pytest.fixture
def store(db_url: str):  # noqa: ANN201
    s = Store(db_url)
    yield s
    s.dispose()


def run_to_end(store: Store, goal_id: str, score=lambda c: 1.0, max_steps: int = 100) -> None:  # noqa: ANN001
    for _ in range(max_steps):
        decision = advance(store, goal_id)
        assert decision is not None
        if decision.dispatch:
            finish_all(store, decision.dispatch, score)
        goal = store.get_goal(goal_id)
        if goal.status.terminal:
            return
    raise AssertionError("goal did not finish")


def test_budget_is_spent_exactly_and_never_exceeded(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=8, fanout=3, max_iterations=10, patience=10)
    run_to_end(store, goal_id, score=lambda c: 0.1 * c.iteration + 0.001 * c.ordinal)
    goal = store.get_goal(goal_id)
    cands = store.list_candidates(goal_id)
    assert goal.status is GoalStatus.DONE and goal.stop_reason == StopReason.BUDGET_SPENT
    assert len(cands) == goal.generations_reserved == 8
    assert [len([c for c in cands if c.iteration == i]) for i in range(3)] == [3, 3, 2]
    best = max(cands, key=lambda c: c.clip_score)
    assert goal.best_candidate_id == best.id and goal.best_score == pytest.approx(best.clip_score)


def test_duplicate_advance_deliveries_change_nothing(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=8, fanout=4)
    first = advance(store, goal_id)
    assert len(first.dispatch) == 4
    for _ in range(3):  # redelivered while the iteration runs
        again = advance(store, goal_id)
        assert again.dispatch == [] and again.is_noop
    assert store.count_candidates(goal_id) == 4
    finish_all(store, first.dispatch, lambda c: 0.5)
    second = advance(store, goal_id)
    assert len(second.dispatch) == 4
    # every finished generation re-triggers the orchestrator; only one call moves the goal on
    for _ in range(4):
        assert advance(store, goal_id).dispatch == []
    assert store.count_candidates(goal_id) == 8
    assert store.get_goal(goal_id).generations_reserved == 8


def test_concurrent_advances_create_one_iteration(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=12, fanout=4)
    finish_all(store, advance(store, goal_id).dispatch, lambda c: 0.5)
    results: list[list[str]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(advance(store, goal_id).dispatch)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sorted(len(r) for r in results) == [0, 0, 0, 0, 0, 4]
    assert store.count_candidates(goal_id) == 8


def test_duplicate_generate_delivery_claims_nothing(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=4, fanout=4)
    ids = advance(store, goal_id).dispatch
    claimed = store.claim_candidates(ids, "w1", 900, 3)
    assert len(claimed) == 4 and len({c.claim_token for c in claimed}) == 1
    assert store.claim_candidates(ids, "w2", 900, 3) == []  # a second delivery
    c, token = claimed[0], claimed[0].claim_token
    assert store.complete_candidate(c.id, "not-our-token", clip_score=1, part_scores={}, artifact_uri="x", timings={}) is False
    assert store.complete_candidate(c.id, token, clip_score=1, part_scores={}, artifact_uri="x", timings={}) is True
    assert store.complete_candidate(c.id, token, clip_score=2, part_scores={}, artifact_uri="x", timings={}) is False
    assert store.get_candidates([c.id])[0].clip_score == 1


def test_retries_do_not_spend_budget_and_fail_after_max_attempts(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=2, fanout=2)
    ids = advance(store, goal_id).dispatch
    for attempt in range(1, 4):
        claimed = store.claim_candidates(ids, "w1", 900, max_attempts=3)
        assert [c.attempts for c in claimed] == [attempt, attempt]
        statuses = {store.release_candidate(c.id, c.claim_token, "CUDA out of memory", 3) for c in claimed}
        assert statuses == ({CandidateStatus.QUEUED} if attempt < 3 else {CandidateStatus.FAILED})
    assert store.claim_candidates(ids, "w1", 900, max_attempts=3) == []
    assert store.get_goal(goal_id).generations_reserved == 2
    advance(store, goal_id)
    goal = store.get_goal(goal_id)
    assert goal.status is GoalStatus.FAILED and goal.stop_reason == StopReason.GENERATION_FAILED
    assert "out of memory" in goal.error
    assert store.count_candidates(goal_id) == 2


def test_stale_running_candidate_can_be_reclaimed(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=1, fanout=1)
    ids = advance(store, goal_id).dispatch
    [dead] = store.claim_candidates(ids, "dead-worker", lease_seconds=-1, max_attempts=3)
    assert store.claim_candidates(ids, "w2", lease_seconds=900, max_attempts=3) != []
    assert store.claim_candidates(ids, "w3", lease_seconds=900, max_attempts=3) == []
    [c] = store.get_candidates(ids)
    assert c.worker == "w2" and c.attempts == 2 and c.claim_token != dead.claim_token
    # the dead worker's late result is refused: its claim is gone
    assert not store.complete_candidate(c.id, dead.claim_token, clip_score=1, part_scores={},
                                        artifact_uri="x", timings={})


def test_target_score_stops_early(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=40, fanout=4, target_score=0.8)
    run_to_end(store, goal_id, score=lambda c: 0.3 + 0.2 * c.iteration)
    goal = store.get_goal(goal_id)
    assert goal.stop_reason == StopReason.TARGET_REACHED
    assert goal.best_score == pytest.approx(0.9)
    assert store.count_candidates(goal_id) == 16  # iterations 0..3 score 0.3, 0.5, 0.7, 0.9


def test_patience_stops_without_improvement(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=100, fanout=2, patience=2, max_iterations=50)
    run_to_end(store, goal_id, score=lambda c: 1.0 if c.iteration == 0 else 0.5)
    goal = store.get_goal(goal_id)
    assert goal.stop_reason == StopReason.NO_IMPROVEMENT
    assert store.count_candidates(goal_id) == 6  # iteration 0, then two without improvement


def test_max_iterations(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=100, fanout=2, max_iterations=3, patience=10)
    run_to_end(store, goal_id, score=lambda c: 0.1 * c.iteration)
    state = store.get_state(goal_id)
    assert state.goal.stop_reason == StopReason.MAX_ITERATIONS
    assert [it.status for it in state.iterations] == [IterationStatus.CLOSED] * 3
    assert [it.best_score for it in state.iterations] == pytest.approx([0.0, 0.1, 0.2])


def test_unknown_goal(store: Store) -> None:
    assert advance(store, "0" * 32) is None


class _Raising:
    """A reviser with a bug: it raises from its second iteration on."""

    def __init__(self, name: str) -> None:
        self.name = name

    def propose(self, ctx):  # noqa: ANN001, ANN201
        if ctx.iteration >= 1:
            raise KeyError("a bug in the reviser")
        from agentloop.revisers import SearchReviser

        return SearchReviser().propose(ctx)


def test_a_reviser_that_raises_is_replaced_by_search_and_the_notes_say_why(
    store: Store, settings, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    from agentloop import revisers

    monkeypatch.setitem(revisers.REVISERS, "external", _Raising("external"))
    goal_id = make_goal(store, settings, budget=8, fanout=4, reviser="external")
    run_to_end(store, goal_id)
    state = store.get_state(goal_id)
    assert state.goal.status is GoalStatus.DONE and state.goal.stop_reason == StopReason.BUDGET_SPENT
    assert "fallback" not in state.iterations[0].notes
    assert state.iterations[1].notes["fallback"] == "search"
    assert state.iterations[1].notes["reviser_error"] == (
        "reviser external raised KeyError: 'a bug in the reviser'")


def test_when_search_itself_raises_the_goal_fails_with_the_error_instead_of_sticking(
    store: Store, settings, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    from agentloop import revisers

    monkeypatch.setitem(revisers.REVISERS, "search", _Raising("search"))
    goal_id = make_goal(store, settings, budget=8, fanout=4)
    run_to_end(store, goal_id)
    goal = store.get_goal(goal_id)
    assert goal.status is GoalStatus.FAILED and goal.stop_reason == StopReason.REVISER_FAILED
    assert goal.error == "reviser search raised KeyError: 'a bug in the reviser'"
    assert store.count_candidates(goal_id) == 4  # the first iteration ran; nothing after
    assert advance(store, goal_id).dispatch == []  # terminal: a later delivery changes nothing
