"""The preview scorer: which scorer ranks a pruned fan-out's x0 previews (``Settings.
preview_scorers``), and that the worker asks for it only for previews."""

from __future__ import annotations

from typing import Any

import pytest

from agentloop.domain import CandidateStatus
from agentloop.revisers import REVISERS, SearchReviser
from agentloop.settings import Settings
from agentloop.store import Store
from tests.core.helpers import make_goal
from tests.core.test_jobs import RecordingDispatcher
from workers.jobs import WorkerContext, advance_goal_job, generate_job, preview_scorer_name
from workers.residency import Residency


def test_the_named_preview_scorer_when_it_resolves() -> None:
    settings = Settings(preview_scorers={"tiny-clip": "shapes-clip"})  # shapes-clip is shipped
    assert preview_scorer_name(settings, "tiny-clip") == "shapes-clip"


def test_a_scorer_without_a_resolvable_preview_scorer_ranks_its_own_previews() -> None:
    assert preview_scorer_name(Settings(), "tiny-clip") == "tiny-clip"  # none named
    named = Settings(preview_scorers={"tiny-clip": "no-such-scorer", "shapes-clip": "shapes-clip"})
    assert preview_scorer_name(named, "tiny-clip") == "tiny-clip"  # does not resolve
    assert preview_scorer_name(named, "shapes-clip") == "shapes-clip"  # itself
    assert preview_scorer_name(named, "other") == "other"  # not listed


def test_preview_scorers_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_PREVIEW_SCORERS", '{"shapes-clip": "shapes-clip-preview"}')
    assert Settings().preview_scorers == {"shapes-clip": "shapes-clip-preview"}


class _Counting:
    """A scorer that counts the images it is asked to score."""

    def __init__(self, inner: Any, counts: dict[str, list[int]], name: str) -> None:
        self.inner, self.counts, self.name = inner, counts, name

    def score(self, images, requests):  # noqa: ANN001, ANN201
        self.counts.setdefault(self.name, []).append(len(images))
        return self.inner.score(images, requests)


class _SpyResidency(Residency):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, list[int]] = {}

    def scorer(self, name: str):  # noqa: ANN201
        return _Counting(super().scorer(name), self.counts, name)


@pytest.mark.slow
@pytest.mark.parametrize("preview", ["shapes-clip", None])
def test_the_worker_ranks_previews_with_the_preview_scorer(
    sqlite_url: str, settings: Settings, monkeypatch: pytest.MonkeyPatch, preview: str | None
) -> None:
    """Six candidates cut to two at step 2 of 8: the previews (six) go to the preview scorer,
    the two finished images to the goal's own scorer; without one, both go to the goal's."""
    monkeypatch.setitem(REVISERS, "search", SearchReviser(prune_factor=3, prune_at=0.25))
    if preview is not None:
        settings = settings.model_copy(update={"preview_scorers": {"tiny-clip": preview}})
    store = Store(sqlite_url)
    residency = _SpyResidency()
    ctx = WorkerContext(store=store, dispatcher=RecordingDispatcher(), settings=settings,
                        residency=residency, worker_name="w1")  # fmt: skip
    goal_id = make_goal(store, settings, budget=6, fanout=2, steps=8, max_iterations=1, seed=1)
    advance_goal_job(ctx, goal_id)
    (group,) = ctx.dispatcher.generations
    assert len(group) == 6
    assert sorted(generate_job(ctx, group)) == sorted(group)
    if preview is None:
        assert residency.counts == {"tiny-clip": [6, 2]}  # previews, then the finished
    else:
        assert residency.counts == {"shapes-clip": [6], "tiny-clip": [2]}
    cands = store.list_candidates(goal_id)
    assert sorted(c.status.value for c in cands).count(CandidateStatus.PRUNED.value) == 4
    kept = [c for c in cands if c.status is CandidateStatus.SUCCEEDED]
    pruned = [c for c in cands if c.status is CandidateStatus.PRUNED]
    assert min(c.preview_score for c in kept) >= max(c.preview_score for c in pruned)
