"""Each part judged where it should be, with the real shapes-clip: on a view of the image that
keeps the part's region and fills the rest with the background."""

from __future__ import annotations

import random

import numpy as np
import pytest

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
