"""Leases, the outbox, the sweep and cancel, on both backends: the database says what is owed,
and the orchestrator takes back whatever a lost worker or a lost message left behind.

Time is moved by asking for leases and thresholds of zero or less, not by sleeping.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from agentloop.domain import CandidateStatus, GoalStatus, IterationStatus, StopReason
from agentloop.orchestrator import IterationRejected, Policy, advance, cancel_goal
from agentloop.store import Outcome, Store
from tests.core.helpers import finish_all, make_goal

NOW = {"outbox_grace": 0.0, "redispatch_after": 0.0, "stall_after": 0.0}
"""Sweep thresholds of zero: anything owed is owed now."""
LATER = {"outbox_grace": 3600.0, "redispatch_after": 3600.0, "stall_after": 3600.0}


@pytest.fixture
def store(db_url: str):  # noqa: ANN201
    s = Store(db_url)
    yield s
    s.dispose()


def _outcome(cid: str) -> Outcome:
    return Outcome(cid, 1.0, {}, f"x/{cid}.png", {"denoise_s": 0.01})


def test_a_claim_carries_a_token_and_a_lease_on_the_database_clock(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=2, fanout=2)
    ids = advance(store, goal_id).dispatch
    claimed = store.claim_candidates(ids, "w1", lease_seconds=30, max_attempts=3)
    assert len({c.claim_token for c in claimed}) == 1 and claimed[0].claim_token
    for c in claimed:
        assert c.status is CandidateStatus.RUNNING and c.worker == "w1" and c.attempts == 1
        lease = (c.lease_expires_at - c.started_at).total_seconds()
        assert lease == pytest.approx(30, abs=0.01)


def test_renewal_extends_only_the_leases_the_claim_still_holds(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=2, fanout=2)
    ids = advance(store, goal_id).dispatch
    a, b = store.claim_candidates(ids, "w1", lease_seconds=-1, max_attempts=3)  # already expired
    # b's worker is presumed dead: another worker claims it
    [b2] = store.claim_candidates([b.id], "w2", lease_seconds=30, max_attempts=3)
    assert store.renew_leases(ids, a.claim_token, lease_seconds=60) == {a.id}
    renewed = store.get_candidates([a.id])[0]
    assert (renewed.lease_expires_at - renewed.started_at).total_seconds() > 59
    # the first worker comes back with b's result: refused, b2's claim stands
    assert store.complete_candidates(a.claim_token, [_outcome(a.id), _outcome(b.id)]) == [a.id]
    assert store.get_candidates([b.id])[0].claim_token == b2.claim_token


def test_an_expired_lease_is_taken_back_requeued_then_failed_on_the_last_attempt(
    store: Store, settings  # noqa: ANN001
) -> None:
    goal_id = make_goal(store, settings, budget=1, fanout=1, max_iterations=1)
    [cid] = advance(store, goal_id).dispatch
    policy = Policy(max_attempts=2)
    store.claim_candidates([cid], "dies-1", lease_seconds=-1, max_attempts=2)
    assert store.goals_needing_attention(**LATER) == [goal_id]  # found without any message
    decision = advance(store, goal_id, policy)
    assert decision.dispatch == [cid]  # requeued and sent again
    [c] = store.get_candidates([cid])
    assert c.status is CandidateStatus.QUEUED and c.claim_token is None and c.dispatched_at is None
    assert "dies-1 stopped renewing its lease" in c.error

    store.claim_candidates([cid], "dies-2", lease_seconds=-1, max_attempts=2)
    advance(store, goal_id, policy)
    [c] = store.get_candidates([cid])
    assert c.status is CandidateStatus.FAILED and "no attempts left" in c.error
    goal = store.get_goal(goal_id)  # the same step closed the iteration and ended the goal
    assert goal.status is GoalStatus.FAILED and goal.stop_reason == StopReason.GENERATION_FAILED
    assert "no attempts left" in goal.error
    assert store.goals_needing_attention(**NOW) == []
    assert goal.generations_reserved == 1 and store.count_candidates(goal_id) == 1


def test_a_live_lease_is_left_alone(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=1, fanout=1)
    ids = advance(store, goal_id).dispatch
    store.mark_dispatched(ids)
    store.claim_candidates(ids, "alive", lease_seconds=300, max_attempts=3)
    assert store.goals_needing_attention(**NOW) == []
    assert advance(store, goal_id).is_noop


def test_the_outbox_sends_what_a_crash_between_commit_and_send_left_unsent(
    store: Store, settings  # noqa: ANN001
) -> None:
    goal_id = make_goal(store, settings, budget=4, fanout=4)
    ids = advance(store, goal_id).dispatch  # committed; the process "dies" before sending
    assert store.goals_needing_attention(**LATER) == []  # within the outbox's grace
    assert store.goals_needing_attention(**{**LATER, "outbox_grace": 0}) == [goal_id]
    assert sorted(advance(store, goal_id, Policy(outbox_grace_seconds=0)).dispatch) == sorted(ids)
    store.mark_dispatched(ids)
    # sent: owed again only once a message can be presumed lost
    assert store.goals_needing_attention(**{**LATER, "outbox_grace": 0}) == []
    assert store.goals_needing_attention(**{**LATER, "redispatch_after": 0}) == [goal_id]
    assert advance(store, goal_id, Policy(redispatch_after_seconds=3600)).dispatch == []
    assert sorted(advance(store, goal_id, Policy(redispatch_after_seconds=0)).dispatch) == sorted(ids)


def test_a_goal_whose_next_message_was_lost_is_found_stalled(store: Store, settings) -> None:  # noqa: ANN001
    pending = make_goal(store, settings, budget=2, fanout=2)  # its first message never sent
    running = make_goal(store, settings, budget=4, fanout=2)
    ids = advance(store, running).dispatch
    store.mark_dispatched(ids)
    finish_all(store, ids, score=lambda c: 1.0)  # the follow-up advance message is lost
    assert set(store.goals_needing_attention(**{**LATER, "stall_after": 0})) == {pending, running}
    assert store.goals_needing_attention(**LATER) == []
    assert len(advance(store, running).dispatch) == 2  # the sweep moves it on
    state = store.get_state(running)
    assert [it.status for it in state.iterations] == [IterationStatus.CLOSED, IterationStatus.OPEN]


def test_cancel_ends_the_goal_and_its_queued_work_in_one_step(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=8, fanout=4)
    ids = advance(store, goal_id).dispatch
    [running] = store.claim_candidates(ids[:1], "w1", lease_seconds=300, max_attempts=3)
    cancel_goal(store, goal_id)
    state = store.get_state(goal_id)
    assert state.goal.status is GoalStatus.CANCELLED and state.goal.finished_at is not None
    assert state.goal.stop_reason == StopReason.CANCELLED_BY_CALLER
    assert [it.status for it in state.iterations] == [IterationStatus.CLOSED]
    statuses = {c.id: c.status for c in state.candidates}
    assert statuses[running.id] is CandidateStatus.RUNNING
    assert {statuses[i] for i in ids[1:]} == {CandidateStatus.CANCELLED}
    # a late or duplicate message claims nothing, and the orchestrator does nothing
    assert store.claim_candidates(ids, "w2", lease_seconds=300, max_attempts=3) == []
    assert advance(store, goal_id).is_noop
    # the running one may finish; it is recorded, nothing is counted twice
    assert store.complete_candidates(running.claim_token, [_outcome(running.id)]) == [running.id]
    goal = store.get_goal(goal_id)
    assert goal.status is GoalStatus.CANCELLED and goal.generations_reserved == 4
    cancel_goal(store, goal_id)  # again: nothing changes
    assert store.get_goal(goal_id).finished_at == goal.finished_at


def test_a_cancelled_goals_dead_worker_is_tidied_not_retried(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=2, fanout=2)
    ids = advance(store, goal_id).dispatch
    store.claim_candidates(ids, "dies", lease_seconds=-1, max_attempts=3)
    cancel_goal(store, goal_id)
    assert store.goals_needing_attention(**LATER) == [goal_id]
    assert advance(store, goal_id).dispatch == []
    assert {c.status for c in store.list_candidates(goal_id)} == {CandidateStatus.CANCELLED}
    assert store.goals_needing_attention(**NOW) == []


def test_a_finished_goal_cannot_be_cancelled(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=2, fanout=2)
    finish_all(store, advance(store, goal_id).dispatch, score=lambda c: 1.0)
    advance(store, goal_id)
    assert store.get_goal(goal_id).status is GoalStatus.DONE
    with pytest.raises(IterationRejected, match="done"):
        cancel_goal(store, goal_id)
    assert store.get_goal(goal_id).status is GoalStatus.DONE


def test_an_unsent_iteration_is_withdrawn_with_its_budget(store: Store, settings) -> None:  # noqa: ANN001
    from agentloop.domain import CandidateDraft
    from agentloop.orchestrator import submit_iteration

    goal_id = make_goal(store, settings, reviser="external", budget=4)
    advance(store, goal_id)
    assert store.get_goal(goal_id).status is GoalStatus.WAITING
    drafts = [CandidateDraft("a red circle", 1), CandidateDraft("a blue circle", 2)]
    submit_iteration(store, goal_id, drafts)
    assert store.withdraw_iteration(goal_id, 0)
    goal = store.get_goal(goal_id)
    assert goal.status is GoalStatus.WAITING and goal.generations_reserved == 0
    assert store.count_candidates(goal_id) == 0 and store.get_state(goal_id).iterations == []
    # once a worker has any of them, they stay accepted
    ids = submit_iteration(store, goal_id, drafts).dispatch
    store.claim_candidates(ids[:1], "w1", lease_seconds=300, max_attempts=3)
    assert not store.withdraw_iteration(goal_id, 0)
    assert store.count_candidates(goal_id) == 2


def test_a_lease_longer_than_the_visibility_timeout_is_refused_at_start_up() -> None:
    from pydantic import ValidationError

    from agentloop.settings import Settings

    with pytest.raises(ValidationError, match="shorter than visibility_timeout"):
        Settings(lease_seconds=4000, visibility_timeout=3600)
    with pytest.raises(ValidationError, match="must be positive"):
        Settings(lease_seconds=0)
    assert Settings(lease_seconds=30, visibility_timeout=3600).lease_seconds == 30


def test_transient_errors_are_retried_by_celery_with_backoff_and_jitter() -> None:
    from sqlalchemy.exc import OperationalError

    from workers.tasks import advance_goal, generate

    for task in (advance_goal, generate):
        assert OperationalError in task.autoretry_for
        assert task.retry_backoff and task.retry_jitter and task.max_retries


def test_a_sent_candidate_whose_queue_is_empty_is_sent_again_after_the_grace(
    store: Store, settings  # noqa: ANN001
) -> None:
    """A flushed broker: the candidates were sent, nothing waits in their queue, nobody claimed
    them. The sweep need not wait `redispatch_after` for that."""
    goal_id = make_goal(store, settings, budget=2, fanout=2)
    ids = advance(store, goal_id).dispatch
    store.mark_dispatched(ids)
    asked: list[set[str]] = []

    def idle(models: set[str]) -> set[str]:
        asked.append(models)
        return models

    busy = {**LATER, "outbox_grace": 0}
    assert store.goals_needing_attention(**busy, idle_models=lambda m: set()) == []
    assert store.goals_needing_attention(**busy, idle_models=idle) == [goal_id]
    assert asked == [{"tiny-dit"}]
    assert advance(store, goal_id, Policy(outbox_grace_seconds=0)).dispatch == []
    lost = Policy(outbox_grace_seconds=0, idle_queues=frozenset({"tiny-dit"}))
    assert sorted(advance(store, goal_id, lost).dispatch) == sorted(ids)


def test_a_goal_whose_last_candidate_just_finished_is_not_stalled(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, budget=4, fanout=2)
    ids = advance(store, goal_id).dispatch
    from sqlalchemy import update

    from agentloop.store.models import GoalRow

    with store.engine.begin() as conn:  # the goal itself last changed an hour ago
        conn.execute(update(GoalRow).values(updated_at=GoalRow.updated_at - timedelta(hours=1)))
    finish_all(store, ids, score=lambda c: 1.0)
    assert store.goals_needing_attention(**{**LATER, "stall_after": 60}) == []
    assert store.goals_needing_attention(**{**LATER, "stall_after": 0}) == [goal_id]


def test_the_celery_dispatcher_reads_its_queue_depth_from_redis() -> None:
    import redis
    from celery import Celery

    from tests.conftest import REDIS_URL
    from workers.celery_dispatch import CeleryDispatcher

    url = REDIS_URL.rsplit("/", 1)[0] + "/8"
    redis.Redis.from_url(url).flushdb()
    dispatcher = CeleryDispatcher(Celery("depth-test", broker=url))
    try:
        assert dispatcher.waiting("depth-model") == 0  # never declared
        dispatcher.generate("depth-model", ["a"])
        dispatcher.generate("depth-model", ["b"])
        assert dispatcher.waiting("depth-model") == 2
        redis.Redis.from_url(url).flushdb()  # the broker loses its data
        assert dispatcher.waiting("depth-model") == 0
    finally:
        redis.Redis.from_url(url).flushdb()
