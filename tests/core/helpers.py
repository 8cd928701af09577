"""Test helpers that act as a generation worker would, without a diffusion model.

They drive the store's claim/complete transitions directly so orchestrator logic can be
tested on its own; the real task functions are exercised in test_embedded and the
distributed integration test.
"""

from __future__ import annotations

from collections.abc import Callable

from agentloop.domain import CandidateView, GoalRequest, check_goal
from agentloop.settings import Settings
from agentloop.store import Store


def make_goal(store: Store, settings: Settings, **options: object) -> str:
    spec = check_goal(GoalRequest(goal=str(options.pop("goal", "a red circle on the left")), **options), settings)  # type: ignore[arg-type]
    return store.create_goal(spec).id


def finish_all(
    store: Store, ids: list[str], score: Callable[[CandidateView], float], worker: str = "w1"
) -> None:
    """Claim and complete candidates with scores from `score`."""
    for c in store.claim_candidates(ids, worker, lease_seconds=900, max_attempts=3):
        store.complete_candidate(
            c.id, c.claim_token, clip_score=score(c), part_scores={}, artifact_uri=f"{c.goal_id}/{c.id}.png",
            timings={"denoise_s": 0.01},
        )
