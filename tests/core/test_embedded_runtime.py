"""The embedded runtime: real task functions in threads; concurrent goals share batches."""

from __future__ import annotations

import time

import pytest

from agentloop.domain import SWEEP_HEARTBEAT, GoalStatus
from agentloop.store import Store
from tests.core.helpers import make_goal
from workers.embedded import embedded_runtime

pytestmark = pytest.mark.slow


def test_concurrent_goals_finish_and_share_generation_batches(sqlite_url: str, settings) -> None:  # noqa: ANN001
    store = Store(sqlite_url)
    dispatcher, _ctx = embedded_runtime(store, settings)
    try:
        goals = [make_goal(store, settings, goal=f"a red circle number {i}", budget=6, fanout=3,
                           steps=2, seed=i) for i in range(4)]
        for goal_id in goals:
            dispatcher.advance_goal(goal_id)
        deadline = time.monotonic() + 240
        while not all(store.get_goal(g).status.terminal for g in goals):
            assert time.monotonic() < deadline and not dispatcher.errors, dispatcher.errors
            time.sleep(0.05)
    finally:
        dispatcher.close()
    cands = [c for g in goals for c in store.list_candidates(g)]
    assert all(store.get_goal(g).status is GoalStatus.DONE for g in goals)
    assert len(cands) == 24 and all(c.clip_score is not None for c in cands)
    # candidates of different goals were generated in one call: batches larger than a fanout
    assert max(c.timings["batch_size"] for c in cands) > 3
    store.dispose()


def test_a_new_runtime_finishes_what_a_killed_process_left_behind(sqlite_url: str, settings) -> None:  # noqa: ANN001
    """One goal was created and never sent (the process died between commit and send); another
    had a candidate running in the dead process. A new runtime's start-up sweep finds both in
    the database, with no message at all, and both goals complete."""
    from agentloop.orchestrator import advance

    settings = settings.model_copy(update={"stall_after_seconds": 0.0, "outbox_grace_seconds": 0.0})
    store = Store(sqlite_url)
    never_sent = make_goal(store, settings, budget=2, fanout=2, steps=2)
    half_done = make_goal(store, settings, budget=2, fanout=2, steps=2)
    ids = advance(store, half_done).dispatch
    store.mark_dispatched(ids)
    store.claim_candidates(ids[:1], "dead-process", lease_seconds=-1, max_attempts=3)

    dispatcher, _ctx = embedded_runtime(store, settings)
    try:
        deadline = time.monotonic() + 240
        while not all(store.get_goal(g).status.terminal for g in (never_sent, half_done)):
            assert time.monotonic() < deadline and not dispatcher.errors, dispatcher.errors
            time.sleep(0.05)
    finally:
        dispatcher.close()
    for goal_id in (never_sent, half_done):
        assert store.get_goal(goal_id).status is GoalStatus.DONE
        assert {c.status.value for c in store.list_candidates(goal_id)} == {"succeeded"}
    retried = store.get_candidates(ids[:1])[0]
    assert retried.attempts == 2 and retried.worker == "embedded"
    beat = store.heartbeat(SWEEP_HEARTBEAT)  # the sweeps recorded that they ran (/healthz)
    assert beat is not None and not beat.stale
    assert beat.interval_seconds == settings.sweep_interval_seconds
    store.dispose()
