"""Per-part scores through the whole path: a layout sent over the API (with a region scale),
generated and scored by the real worker task on the real shapes model and shapes-clip, each
part judged on its region, stored, and returned by the API."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from agentloop.orchestrator import advance
from agentloop.settings import Settings
from agentloop.store import Store
from engine.scorer import Scorer
from engine.types import Region, ScoreRequest
from tests.api.fakes import RecordingDispatcher
from workers.jobs import WorkerContext, generate_job
from workers.residency import Residency

pytestmark = pytest.mark.slow

GOAL = "a red circle on the left, plus a blue square"
PARTS = ("a red circle on the left", "a blue square")


def test_part_scores_are_judged_on_regions_stored_and_returned(
    api: TestClient, store: Store, settings: Settings
) -> None:
    r = api.post("/v1/goals", json={"goal": GOAL, "reviser": "external", "budget": 2,
                                    "model": "shapes", "scorer": "shapes-clip", "steps": 2})
    assert r.status_code == 201, r.text
    goal_id = r.json()["id"]
    advance(store, goal_id)
    regions = [{"prompt": "a red circle on the left", "x": 0.25, "y": 0.5},
               {"prompt": "a blue square on the right", "x": 0.75, "y": 0.5, "scale": 1.2}]
    r = api.post(f"/v1/goals/{goal_id}/iterations", json={"prompts": [
        {"prompt": GOAL, "seed": 1, "regions": regions}, {"prompt": GOAL, "seed": 1}]})
    assert r.status_code == 201, r.text
    ids = r.json()["candidate_ids"]
    ctx = WorkerContext(store=store, dispatcher=RecordingDispatcher(), settings=settings,
                        residency=Residency(), worker_name="w1")
    assert sorted(generate_job(ctx, ids)) == sorted(ids)

    shown = {c["id"]: c for c in api.get(f"/v1/goals/{goal_id}/candidates").json()}
    laid_out, plain = (shown[i] for i in ids)
    assert laid_out["params"]["regions"] == [["a red circle on the left", 0.25, 0.5],
                                             ["a blue square on the right", 0.75, 0.5, 1.2]]
    scorer = Scorer("shapes-clip", device="cpu")
    root = settings.resolved_artifacts_dir()
    stored = {c.id: c for c in store.list_candidates(goal_id)}
    expected_regions = {
        # the layout's own regions, in the parts' order
        ids[0]: (Region("a red circle on the left", 0.25, 0.5),
                 Region("a blue square on the right", 0.75, 0.5, 1.2)),
        # no layout: the placed part on its place, the other on the whole image
        ids[1]: (Region("a red circle on the left", 0.25, 0.5), None),
    }
    for cid, shown_c in ((ids[0], laid_out), (ids[1], plain)):
        assert set(shown_c["part_scores"]) == set(PARTS)
        image = Image.open(root / stored[cid].artifact_uri).convert("RGB")
        want = scorer.score([image], [ScoreRequest(GOAL, PARTS, expected_regions[cid])])[0]
        assert shown_c["clip_score"] == pytest.approx(want.clip_score, abs=1e-5)
        assert shown_c["part_scores"] == pytest.approx(want.part_scores, abs=1e-5)
        whole = scorer.score([image], [ScoreRequest(GOAL, PARTS)])[0]
        assert shown_c["part_scores"]["a red circle on the left"] != pytest.approx(
            whole.part_scores["a red circle on the left"], abs=1e-4)


def test_a_region_scale_out_of_range_is_422(api: TestClient, store: Store) -> None:
    r = api.post("/v1/goals", json={"goal": "x", "reviser": "external", "budget": 2})
    goal_id = r.json()["id"]
    advance(store, goal_id)
    for scale, in ((0,), (-1,), (4.5,)):
        r = api.post(f"/v1/goals/{goal_id}/iterations", json={"prompts": [
            {"prompt": "x", "regions": [{"prompt": "a", "x": 0.5, "y": 0.5, "scale": scale}]}]})
        assert r.status_code == 422, r.text
        assert "prompts.0.regions.0.scale" in r.text
