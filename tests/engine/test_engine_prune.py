"""Pruning a prune group mid-denoise: kept requests get the very images they get without
pruning, cut ones come back flagged with their preview and cost, a group is never split."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from engine.config import EngineConfig
from engine.runner import Runner
from engine.types import GenerationRequest, Region

LAYOUT = (Region("a red circle", 0.25, 0.5), Region("a blue square", 0.75, 0.5))


def _brightness(calls: list[list[int]]):  # noqa: ANN202 - a PreviewScorer
    """A preview scorer that ranks by mean brightness and records what it was asked."""

    def score(positions: Sequence[int], previews: Sequence[Image.Image]) -> list[float]:
        calls.append(list(positions))
        return [float(np.asarray(p, dtype=np.float64).mean()) for p in previews]

    return score


@pytest.fixture(scope="module")
def shapes(cpu_config: EngineConfig) -> Runner:
    return Runner("shapes", cpu_config)  # max_batch 4: a group of 6 exceeds it


def _group(
    requests: list[GenerationRequest], keep: int, at: int, name: str = "g"
) -> list[GenerationRequest]:
    return [replace(r, prune_group=name, prune_keep=keep, prune_at_step=at) for r in requests]


@pytest.mark.parametrize("layout", [False, True])
def test_kept_requests_match_unpruned_generation(shapes: Runner, layout: bool) -> None:
    base = GenerationRequest(
        "a red circle on the left",
        seed=0,
        steps=6,
        guidance=3.0,
        model="shapes",
        regions=LAYOUT if layout else (),
    )
    requests = [replace(base, seed=s) for s in range(6)]
    plain = shapes.generate(requests)
    calls: list[list[int]] = []
    pruned = shapes.generate(_group(requests, keep=2, at=2), preview_scorer=_brightness(calls))
    assert calls == [[0, 1, 2, 3, 4, 5]]  # one call for the whole group: never split
    kept = [r for r in pruned if not r.pruned]
    assert len(kept) == 2
    scores = [r.skipped["preview_score"] for r in pruned]
    assert sorted(scores, reverse=True)[:2] == sorted(
        (r.skipped["preview_score"] for r in kept), reverse=True
    )
    for a, b in zip(plain, pruned, strict=True):
        if b.pruned:
            assert b.skipped["pruned_at_step"] == 2
            assert b.timings["denoise_steps"] == 2.0
            assert b.image.size == a.image.size
            assert not np.array_equal(np.asarray(a.image), np.asarray(b.image))  # a preview
        else:
            assert b.timings["denoise_steps"] == 6.0
            assert np.array_equal(np.asarray(a.image), np.asarray(b.image)), b.request.seed


def test_preview_is_the_x0_prediction(shapes: Runner) -> None:
    """At the last step the x0 preview is the finished image; earlier it is not."""
    base = GenerationRequest("a blue square", seed=3, steps=4, guidance=3.0, model="shapes")
    requests = [replace(base, seed=s) for s in range(3)]
    full = shapes.generate(requests)
    # ranked by brightness: the dimmest is cut after 3 of 4 steps, close to its final image
    out = shapes.generate(_group(requests, keep=2, at=3), preview_scorer=_brightness([]))
    (cut,) = [r for r in out if r.pruned]
    final = np.asarray(full[cut.request.seed].image, dtype=np.float64)
    early = shapes.generate(_group(requests, keep=2, at=1), preview_scorer=_brightness([]))
    (cut_early,) = [r for r in early if r.pruned]
    far = np.abs(
        np.asarray(cut_early.image, dtype=np.float64)
        - np.asarray(full[cut_early.request.seed].image, dtype=np.float64)
    ).mean()
    diff = np.abs(np.asarray(cut.image, dtype=np.float64) - final).mean()
    assert diff < far  # one step short of the end: nearer the image than after one step


def test_groups_and_plain_requests_side_by_side(shapes: Runner) -> None:
    base = GenerationRequest("a green triangle", seed=0, steps=4, guidance=3.0, model="shapes")
    a = _group([replace(base, seed=s) for s in range(5)], keep=1, at=1, name="a")
    b = _group([replace(base, seed=s) for s in range(10, 13)], keep=2, at=2, name="b")
    plain = [replace(base, seed=s) for s in (20, 21)]
    mixed = [a[0], plain[0], b[0], *a[1:], *b[1:], plain[1]]
    calls: list[list[int]] = []
    out = shapes.generate(mixed, preview_scorer=_brightness(calls))
    assert sorted(calls) == [[0, 3, 4, 5, 6], [2, 7, 8]]  # positions in `mixed`, per group
    assert [r.request for r in out] == mixed
    assert sum(not r.pruned for r in out if r.request.prune_group == "a") == 1
    assert sum(not r.pruned for r in out if r.request.prune_group == "b") == 2
    assert not any(r.pruned for r in out if r.request.prune_group is None)


def test_without_a_scorer_every_member_finishes(shapes: Runner) -> None:
    base = GenerationRequest("a red circle", seed=0, steps=3, guidance=3.0, model="shapes")
    out = shapes.generate(_group([replace(base, seed=s) for s in range(3)], keep=1, at=1))
    assert not any(r.pruned for r in out)


def test_bad_groups_are_refused(shapes: Runner) -> None:
    base = GenerationRequest("a red circle", seed=0, steps=3, guidance=3.0, model="shapes")
    with pytest.raises(ValueError, match="prune_at_step"):
        shapes.validate(replace(base, prune_group="g", prune_keep=1, prune_at_step=3))
    with pytest.raises(ValueError, match="prune_keep"):
        shapes.validate(replace(base, prune_group="g", prune_keep=0, prune_at_step=1))
    mixed = [
        replace(base, prune_group="g", prune_keep=1, prune_at_step=1),
        replace(base, seed=1, steps=4, prune_group="g", prune_keep=1, prune_at_step=1),
    ]
    with pytest.raises(ValueError, match="cannot run as one batch"):
        shapes.generate(mixed, preview_scorer=_brightness([]))
    with pytest.raises(ValueError, match="scores for"):
        shapes.generate(
            _group([base, replace(base, seed=1)], keep=1, at=1),
            preview_scorer=lambda positions, previews: [1.0],
        )
