"""Repairs and refinements in a real embedded loop: children stored with their parent, their
edit and the image they started from; a goal that starts from an earlier candidate's image."""

from __future__ import annotations

import time

import numpy as np
import pytest
from PIL import Image

from agentloop.domain import CandidateStatus, GoalRequest, GoalStatus, check_goal
from agentloop.images import resolve_init
from agentloop.models import CandidateOut
from agentloop.revisers import REVISERS, SearchReviser
from agentloop.store import Store
from workers.embedded import embedded_runtime

pytestmark = pytest.mark.slow

TWO = "a red circle on the left and a blue square on the right"


def _wait(store: Store, dispatcher, goal_id: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 240
    while not store.get_goal(goal_id).status.terminal:
        assert time.monotonic() < deadline and not dispatcher.errors, dispatcher.errors
        time.sleep(0.05)


def _pixels(root, uri: str) -> np.ndarray:  # noqa: ANN001
    return np.asarray(Image.open(root / uri).convert("RGB"), dtype=np.float64)


def test_a_goal_repairs_its_layout_candidates_and_a_new_goal_starts_from_one(
    sqlite_url: str, settings, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    # tiny-dit and tiny-clip have random weights, so their part scores say nothing: a gap of 0
    # makes every layout candidate's weaker part "failing", so the loop is sure to repair
    monkeypatch.setitem(REVISERS, "search", SearchReviser(repair=True, refine=True, repair_gap=0.0))
    store = Store(sqlite_url)
    root = settings.resolved_artifacts_dir()
    dispatcher, _ctx = embedded_runtime(store, settings)
    try:
        spec = check_goal(GoalRequest(goal=TWO, budget=8, fanout=4, steps=2, max_iterations=2,
                                      patience=2), settings)
        goal_id = store.create_goal(spec).id
        dispatcher.advance_goal(goal_id)
        _wait(store, dispatcher, goal_id)
        cands = store.list_candidates(goal_id)
        by_id = {c.id: c for c in cands}
        assert store.get_goal(goal_id).status is GoalStatus.DONE
        assert all(c.regions for c in cands if c.iteration == 0)
        repairs = [c for c in cands if (c.edit or "").startswith("repair:")]
        assert repairs and all(c.status is CandidateStatus.SUCCEEDED for c in repairs)
        for c in repairs:
            parent = by_id[c.parent_id]
            assert c.init_image == parent.artifact_uri and c.strength == 0.7
            assert c.regions == parent.regions and c.repair_region in (0, 1)
            assert c.edit == f"repair:{parent.regions[c.repair_region][0]}"
            child, before = _pixels(root, c.artifact_uri), _pixels(root, parent.artifact_uri)
            kept = slice(0, 12) if c.repair_region == 1 else slice(20, 32)  # far from the region
            assert np.abs(child[:, kept] - before[:, kept]).max() <= 1
            out = CandidateOut.of(c)
            assert out.parent_id == parent.id and out.edit == c.edit
            assert out.init_image_url == f"/v1/artifacts/{parent.artifact_uri}"
            assert out.params["repair_region"] == c.repair_region
        refines = [c for c in cands if c.edit == "refine"]
        assert refines and all(by_id[c.parent_id].artifact_uri == c.init_image for c in refines)

        # a second goal starts from the first goal's best image
        best = store.get_goal(goal_id).best_candidate_id
        assert best is not None
        spec2 = check_goal(GoalRequest(goal="a red circle", budget=4, fanout=4, steps=2,
                                       max_iterations=1, init_candidate_id=best,
                                       init_strength=0.5), settings)
        spec2 = resolve_init(spec2, store, settings, None, best)
        assert spec2.init_image == by_id[best].artifact_uri and spec2.init_candidate_id == best
        second = store.create_goal(spec2).id
        dispatcher.advance_goal(second)
        _wait(store, dispatcher, second)
    finally:
        dispatcher.close()
    started = store.list_candidates(second)
    assert len(started) == 4
    assert all(c.edit == "refine" and c.init_image == by_id[best].artifact_uri and c.strength == 0.5
               and c.status is CandidateStatus.SUCCEEDED for c in started)
    assert store.get_goal(second).spec.init_candidate_id == best
    store.dispose()
