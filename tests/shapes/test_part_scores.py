"""Each part judged where it should be, with the real shapes-clip: on a view of the image that
keeps the part's region and fills the rest with the background."""

from __future__ import annotations

import random

import numpy as np
import pytest

from agentloop.layout import plan_layout
from agentloop.parts import goal_parts, part_regions
from agentloop.revisers.base import objective_of
from engine.scorer import Scorer, region_views
from engine.shapes import world
from engine.types import Region, ScoreRequest

LEFT, RIGHT = (0.25, 0.5), (0.75, 0.5)


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    return Scorer("shapes-clip", device="cpu")


def _scene(objects: list[dict[str, str]], seed: int = 0):  # noqa: ANN202 - PIL image
    return world.render_image(world.place(objects, random.Random(seed)))


def test_a_region_view_keeps_its_region_and_fills_the_rest_with_the_background() -> None:
    objs = [{"color": "red", "shape": "circle", "size": "large", "position": "left"},
            {"color": "blue", "shape": "square", "size": "large", "position": "right"}]
    image = _scene(objs)
    left, right = region_views(image, [Region("a", *LEFT), Region("b", *RIGHT)])
    arr, lv, rv = (np.asarray(im, dtype=np.int16) for im in (image, left, right))
    assert np.array_equal(lv[:, :12], arr[:, :12]) and np.array_equal(rv[:, 20:], arr[:, 20:])
    background = np.median(arr[0], axis=0)
    assert np.abs(lv[:, 20:] - background).max() <= 1  # the square is gone from the left view
    assert np.abs(rv[:, :12] - background).max() <= 1


def test_parts_on_their_regions_tell_bound_attributes_apart(scorer: Scorer) -> None:
    """Swapping colors between two objects hardly changes whole-image part scores; on their
    regions, each true part outscores its swapped twin, on every one of 12 scenes."""
    rng = random.Random(3)
    gaps_region, gaps_whole = [], []
    for k in range(12):
        objs = world.sample_objects(rng, 2, "heldout")
        if objs[0]["color"] == objs[1]["color"]:
            continue
        image = _scene(objs, k)
        true = tuple(world.object_phrase(o) for o in objs)
        swapped = tuple(world.object_phrase({**o, "color": objs[1 - i]["color"]})
                        for i, o in enumerate(objs))
        anchors = [(world.POSITIONS[o["position"]][0] / 32, world.POSITIONS[o["position"]][1] / 32)
                   for o in objs]
        text = world.canonical_caption(objs)
        for parts, sign in ((true, 1), (swapped, -1)):
            regions = tuple(Region(p, *a) for p, a in zip(parts, anchors, strict=True))
            on_region, on_whole = scorer.score(
                [image, image], [ScoreRequest(text, parts, regions), ScoreRequest(text, parts)])
            assert set(on_region.part_scores) == set(parts) == set(on_whole.part_scores)
            assert on_region.clip_score == pytest.approx(on_whole.clip_score)
            if sign == 1:
                truth_region, truth_whole = on_region.part_scores, on_whole.part_scores
            else:
                gaps_region += [truth_region[t] - on_region.part_scores[s]
                                for t, s in zip(true, swapped, strict=True)]
                gaps_whole += [truth_whole[t] - on_whole.part_scores[s]
                               for t, s in zip(true, swapped, strict=True)]
    assert len(gaps_region) >= 16
    assert min(gaps_region) > 0.1
    assert np.mean(gaps_region) > 3 * max(np.mean(gaps_whole), 0.05)


def test_a_part_without_a_region_is_judged_on_the_whole_image(scorer: Scorer) -> None:
    image = _scene([{"color": "red", "shape": "circle", "size": "large", "position": "left"},
                    {"color": "blue", "shape": "ring", "size": "large", "position": "right"}])
    text, parts = "a red circle and a blue ring", ("a red circle", "a blue ring")
    whole = scorer.score([image], [ScoreRequest(text, parts)])[0]
    mixed = scorer.score([image], [ScoreRequest(text, parts, (Region("a red circle", *LEFT), None))])[0]
    assert mixed.part_scores["a blue ring"] == pytest.approx(whole.part_scores["a blue ring"])
    assert mixed.part_scores["a red circle"] != pytest.approx(whole.part_scores["a red circle"])
    with pytest.raises(ValueError, match="1 part regions for 2 parts"):
        ScoreRequest(text, parts, (Region("a red circle", *LEFT),))


def _judge(scorer: Scorer, goal: str, images: list) -> list[float]:  # noqa: ANN001
    """The loop's objective for each image, its parts judged on the goal's planned regions
    as a worker judges a layout candidate."""
    parts = goal_parts(goal)
    regions = tuple(Region(*r) for r in part_regions(parts, plan_layout(parts) or ()))  # type: ignore[misc]
    request = ScoreRequest(goal, tuple(p.text for p in parts), regions)
    results = scorer.score(images, [request] * len(images))
    return [objective_of(r.clip_score, r.part_scores, request.parts) for r in results]


def test_the_loops_objective_prefers_the_right_render_to_a_color_swap_or_a_missing_object(
    scorer: Scorer,
) -> None:
    """On renders of held-out two-object goals, the right scene outranks the same scene with
    the two colors swapped, and the scene with either object left out."""
    goals = [g for g in world.heldout_goals(16, objects=2, seed=5)
             if g.objects[0]["color"] != g.objects[1]["color"]]
    assert len(goals) >= 10
    for k, goal in enumerate(goals):
        objs = goal.objects
        swapped = [{**o, "color": objs[1 - i]["color"]} for i, o in enumerate(objs)]
        images = [_scene(objs, k), _scene(swapped, k), _scene(objs[:1], k), _scene(objs[1:], k)]
        right, *wrong = _judge(scorer, goal.text, images)
        assert right > max(wrong), (goal.text, right, wrong)


def test_a_missing_object_fails_its_part(scorer: Scorer) -> None:
    goal = world.heldout_goals(1, objects=2, seed=5)[0]
    parts = goal_parts(goal.text)
    regions = tuple(Region(*r) for r in part_regions(parts, plan_layout(parts) or ()))  # type: ignore[misc]
    request = ScoreRequest(goal.text, tuple(p.text for p in parts), regions)
    both, first_only = scorer.score([_scene(goal.objects), _scene(goal.objects[:1])], [request] * 2)
    kept, dropped = request.parts
    assert first_only.part_scores[dropped] < both.part_scores[dropped] - 0.3
    assert first_only.part_scores[dropped] < first_only.part_scores[kept]
    assert first_only.part_scores[kept] == pytest.approx(both.part_scores[kept], abs=0.15)
