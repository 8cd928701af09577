"""A draft's noise variation on a real database: into the candidate's params, the API view, and
the engine request a generation worker builds."""

from __future__ import annotations

import pytest

from agentloop.api.schemas import CandidateOut
from agentloop.domain import CandidateDraft
from agentloop.orchestrator import submit_iteration
from agentloop.store import Store
from tests.core.helpers import make_goal
from workers.jobs import _request


@pytest.fixture
def store(db_url: str):  # noqa: ANN201
    s = Store(db_url)
    yield s
    s.dispose()


def test_a_variation_round_trips_into_params_and_the_request(store: Store, settings) -> None:  # noqa: ANN001
    goal_id = make_goal(store, settings, reviser="external", budget=3, steps=2)
    drafts = [
        CandidateDraft("a red circle", 11),
        CandidateDraft(
            "a red circle",
            11,
            edit="variation:0.35",
            variation_seed=2**40 + 3,
            variation_strength=0.35,
        ),
        CandidateDraft("a red circle", 12, variation_seed=5),  # strength 0: no variation
    ]
    decision = submit_iteration(store, goal_id, drafts)
    assert decision is not None and len(decision.dispatch) == 3
    plain, varied, unvaried = store.list_candidates(goal_id)

    assert varied.params["variation_seed"] == 2**40 + 3
    assert varied.params["variation_strength"] == 0.35
    assert varied.edit == "variation:0.35"
    for c in (plain, unvaried):
        assert "variation_seed" not in c.params and "variation_strength" not in c.params
    assert {
        k: v for k, v in varied.params.items() if not k.startswith("variation_")
    } == plain.params
    assert CandidateOut.of(varied).params["variation_strength"] == 0.35

    request = _request(varied)
    assert (request.seed, request.variation_seed, request.variation_strength) == (
        11,
        2**40 + 3,
        0.35,
    )
    assert request.has_variation and request.batch_key() == _request(plain).batch_key()
    for c in (plain, unvaried):
        request = _request(c)
        assert request.variation_seed is None and request.variation_strength == 0.0
        assert not request.has_variation
