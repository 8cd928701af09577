"""Training batches of the shapes CLIP: rounded-off objects as negatives for their shape."""

from __future__ import annotations

import random

import numpy as np

from engine.shapes import checker, world
from engine.shapes.train_clip import BLOB, make_batch, render_rounded


def test_a_rounded_object_keeps_its_place_and_color_and_loses_its_corners() -> None:
    rng = random.Random(0)
    objs = [{"color": "red", "shape": "cross", "size": "large", "position": "left"},
            {"color": "blue", "shape": "square", "size": "large", "position": "right"}]
    scene = world.place(objs, rng)
    crisp, rounded = world.render(scene), render_rounded(scene, 0, rng)
    assert np.array_equal(crisp[:, 20:], rounded[:, 20:])  # the other object is untouched
    found = checker.detect(rounded)
    assert len(found) == 2
    cross = min(found, key=lambda d: d.cx)
    assert (cross.color, cross.position) == ("red", "left")
    assert cross.shape != "cross"  # its arms are gone
    assert checker.check(crisp, objs).all_ok


def test_a_rounded_objects_captions_leave_its_shape_unsaid_and_its_negative_names_it() -> None:
    images, texts, target = make_batch(random.Random(1), 16, 0.0, 0.0, blob_prob=1.0)
    n = len(images)
    assert target.shape == (n, 2 * n)
    assert all(target[k, k] == 1 for k in range(n))  # each image's own caption describes it
    assert all(target[k, n + k] == 0 for k in range(n))  # its negative does not
    def names(text: str, shapes: tuple[str, ...]) -> bool:
        return any(w in text for s in shapes for w in world.SHAPE_WORDS[s])

    unsaid = [k for k in range(n) if not names(texts[k], tuple(world.SHAPES))]
    assert len(unsaid) >= 4  # lone rounded objects: their shape is not said
    assert all(names(texts[n + k], ("cross", "square", "triangle")) for k in unsaid)
    assert BLOB not in " ".join(texts)
