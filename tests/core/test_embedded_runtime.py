"""The embedded runtime: real task functions in threads; concurrent goals share batches."""

from __future__ import annotations

import time

import pytest

from agentloop.domain import GoalStatus
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
