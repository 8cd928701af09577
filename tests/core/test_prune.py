"""Pruning through the loop: the reviser's pruned fan-out, its budget, and the real task
functions recording pruned candidates (status, preview, cost, events, API view)."""

from __future__ import annotations

import pytest

from agentloop.domain import (
    CandidateDraft,
    CandidateStatus,
    GoalRequest,
    GoalStatus,
    check_goal,
    finishing,
    generation_cost,
    prune_problems,
    split_parts,
)
from agentloop.models import CandidateOut, EventOut
from agentloop.orchestrator import _fit
from agentloop.revisers import REVISERS, ReviserContext, SearchReviser
from agentloop.settings import Settings
from agentloop.store import Store
from tests.core.helpers import make_goal
from tests.core.test_jobs import RecordingDispatcher
from workers.jobs import WorkerContext, advance_goal_job, generate_job
from workers.residency import Residency

SETTINGS = Settings(default_model="tiny-dit", default_scorer="tiny-clip")


def _group(n: int, keep: int, at: int, name: str = "g") -> list[CandidateDraft]:
    return [CandidateDraft("a red circle", seed=i, prune_group=name, prune_keep=keep,
                           prune_at_step=at) for i in range(n)]  # fmt: skip


def test_a_group_costs_its_denoiser_passes_in_generations() -> None:
    plain = [CandidateDraft("a red circle", seed=100 + i) for i in range(3)]
    assert generation_cost(plain, 20) == 3 and finishing(plain) == 3
    # 24 previewed for 4 of 20 steps, 4 finish: 4 + ceil(20 * 4 / 20) = 8
    assert generation_cost(_group(24, keep=4, at=4), 20) == 8
    assert finishing(_group(24, keep=4, at=4)) == 4
    assert generation_cost(_group(24, keep=4, at=3), 20) == 4 + 3  # ceil(20 * 3 / 20)
    assert generation_cost(_group(3, keep=4, at=3) + plain, 20) == 6  # a group under its keep
    assert generation_cost(_group(5, 1, 1, "a") + _group(5, 2, 2, "b"), 10) == 1 + 1 + 2 + 1


def test_the_orchestrator_takes_a_pruned_proposal_only_when_it_fits() -> None:
    wide = _group(24, keep=4, at=4)
    assert _fit(wide, n=4, left=16, steps=20) == wide
    for n, left in ((4, 7), (3, 16)):  # over the budget left; more finish than asked for
        fitted = _fit(wide, n=n, left=left, steps=20)
        assert len(fitted) == n and all(d.prune_group is None for d in fitted)
    bad = _group(4, keep=2, at=2) + [CandidateDraft("x", 9, prune_group="g", prune_keep=1,
                                                    prune_at_step=2)]  # fmt: skip
    assert prune_problems(bad, 20) and _fit(bad, n=4, left=16, steps=20) == [
        d.unpruned() for d in bad[:4]
    ]


def _ctx(goal: str, n: int = 4, left: int | None = 16, **kw) -> ReviserContext:  # noqa: ANN003
    spec = check_goal(GoalRequest(goal=goal, steps=20, **kw), SETTINGS)
    return ReviserContext(spec, split_parts(spec.goal), 0, n, [], left)


def test_the_reviser_proposes_a_pruned_fan_out_when_configured() -> None:
    ctx = _ctx("a red circle on the left")
    plain = SearchReviser().propose(ctx).candidates
    assert len(plain) == 4 and all(d.prune_group is None for d in plain)
    wide = SearchReviser(prune_factor=6, prune_at=0.2).propose(ctx)
    drafts = wide.candidates
    assert len(drafts) == 24 and finishing(drafts) == 4
    assert {(d.prune_group, d.prune_keep, d.prune_at_step) for d in drafts} == {("seed", 4, 4)}
    assert [d.seed for d in drafts[:4]] == [d.seed for d in plain]  # only adds candidates
    assert len({d.seed for d in drafts}) == 24
    assert wide.notes["pruning"] == {"factor": 6, "at_step": 4, "previewed": 24, "finishing": 4}
    assert generation_cost(drafts, 20) == 8


def test_the_reviser_narrows_the_fan_out_to_the_budget_and_prunes_layouts_apart() -> None:
    tight = SearchReviser(prune_factor=6).propose(_ctx("a red circle", left=6)).candidates
    assert len(tight) == 4 * 3 and generation_cost(tight, 20) <= 6  # factor 3: 4 + ceil(1.6)
    none = SearchReviser(prune_factor=6).propose(_ctx("a red circle", left=4)).candidates
    assert len(none) == 4 and all(d.prune_group is None for d in none)
    two = "a red circle on the left and a blue square on the right"
    mixed = SearchReviser(layout_share=0.5, prune_factor=2).propose(_ctx(two)).candidates
    groups = {d.prune_group: [e for e in mixed if e.prune_group == d.prune_group] for d in mixed}
    assert set(groups) == {"seed", "layout"}
    assert all(len(g) == 4 and g[0].prune_keep == 2 for g in groups.values())
    assert all(bool(d.regions) == (d.prune_group == "layout") for d in mixed)
    with pytest.raises(ValueError, match="prune_factor"):
        SearchReviser(prune_factor=-1)
    with pytest.raises(ValueError, match="prune_at"):
        SearchReviser(prune_at=1.0)


@pytest.mark.slow
def test_pruned_candidates_through_the_task_functions(
    pg_url: str, settings, monkeypatch: pytest.MonkeyPatch  # noqa: ANN001
) -> None:
    monkeypatch.setitem(REVISERS, "search", SearchReviser(prune_factor=3, prune_at=0.25))
    store = Store(pg_url)
    ctx = WorkerContext(store=store, dispatcher=RecordingDispatcher(), settings=settings,
                        residency=Residency(), worker_name="w1")  # fmt: skip
    goal_ids = [make_goal(store, settings, budget=6, fanout=2, steps=8, max_iterations=1,
                          seed=s) for s in (1, 2)]  # fmt: skip
    for goal_id in goal_ids:
        advance_goal_job(ctx, goal_id)
    first, second = ctx.dispatcher.generations
    assert len(first) == len(second) == 6
    assert store.get_goal(goal_ids[0]).generations_reserved == 2 + 1  # 4 more run 2/8 steps
    # a worker handed part of each goal's group claims the rest: each group is cut as one,
    # and two goals' groups of the same name in one batch are cut apart
    assert sorted(generate_job(ctx, [first[0], second[0]])) == sorted(first + second)
    for goal_id in goal_ids:
        _check_pruned_goal(store, settings, ctx, goal_id)


def _check_pruned_goal(store: Store, settings, ctx: WorkerContext, goal_id: str) -> None:  # noqa: ANN001
    advance_goal_job(ctx, goal_id)
    cands = store.list_candidates(goal_id)
    by_status = {s: [c for c in cands if c.status is s] for s in CandidateStatus}
    pruned, kept = by_status[CandidateStatus.PRUNED], by_status[CandidateStatus.SUCCEEDED]
    assert len(kept) == 2 and len(pruned) == 4
    assert min(c.preview_score for c in kept) >= max(c.preview_score for c in pruned)
    for c in pruned:
        assert c.clip_score is None and c.artifact_uri and c.pruned_at_step == 2
        assert c.timings["generation_cost"] == 2 / 8
        assert (settings.resolved_artifacts_dir() / c.artifact_uri).is_file()  # its preview
        out = CandidateOut.of(c).model_dump(mode="json")
        assert out["status"] == "pruned" and out["pruned_at_step"] == 2
        assert out["preview_score"] == pytest.approx(c.preview_score)
    assert all(c.clip_score is not None and c.pruned_at_step is None for c in kept)
    goal = store.get_goal(goal_id)
    assert goal.status is GoalStatus.DONE and goal.best_candidate_id in {c.id for c in kept}
    events = [EventOut.of(e) for e in store.events_after(goal_id)]
    pruned_events = [e for e in events if e.type == "candidate.pruned"]
    assert sorted(e.data["candidate_id"] for e in pruned_events) == sorted(c.id for c in pruned)
    assert all(e.data["pruned_at_step"] == 2 and e.data["image_url"] for e in pruned_events)
    succeeded = [e for e in events if e.type == "candidate.succeeded"]
    assert len(succeeded) == 2 and all("preview_score" in e.data for e in succeeded)
    # the API lists pruned candidates by status
    listed = store.list_candidates_page(goal_id, 50, statuses=["pruned"])
    assert {c.id for c in listed} \
        == {c.id for c in pruned}
