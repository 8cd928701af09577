"""The shapes world: determinism, the held-out split, captions."""

from __future__ import annotations

import random

import numpy as np

from engine.shapes import checker, world


def test_sample_is_deterministic_from_seed() -> None:
    a_img, a_cap, a_scn = world.sample(3, 20)
    b_img, b_cap, b_scn = world.sample(3, 20)
    c_img, c_cap, _ = world.sample(4, 20)
    assert np.array_equal(a_img, b_img) and a_cap == b_cap and a_scn == b_scn
    assert not np.array_equal(a_img, c_img) and a_cap != c_cap
    assert a_img.shape == (20, 32, 32, 3) and a_img.dtype == np.uint8


def test_grammar_size() -> None:
    assert len(world.COLORS) >= 8 and len(world.SHAPES) >= 5
    assert len(world.SIZES) == 2 and len(world.POSITIONS) >= 5 and len(world.BACKGROUNDS) >= 3


def test_split_holds_out_combinations_but_every_pair_is_seen() -> None:
    train, held = world.combinations("train"), world.combinations("heldout")
    assert len(held) == 40 and len(train) == 160 and not set(train) & set(held)
    pairs = [(0, 1), (0, 2), (1, 2)]
    for i, j in pairs:
        assert {(c[i], c[j]) for c in train} == {(c[i], c[j]) for c in world.combinations("all")}


def test_train_samples_never_hit_heldout() -> None:
    _, _, scenes = world.sample(0, 500, "train", two_object_prob=0.5)
    for scene in scenes:
        for o in scene.objects:
            assert not world.is_heldout(o.color, o.shape, o.position)


def test_two_object_scenes_are_apart() -> None:
    rng = random.Random(0)
    for _ in range(200):
        scene = world.sample_scene(rng, 2)
        a, b = scene.objects
        assert a.position != b.position
        ax0, ay0, ax1, ay1 = a.bbox()
        bx0, by0, bx1, by1 = b.bbox()
        assert ax1 < bx0 or bx1 < ax0 or ay1 < by0 or by1 < ay0


def test_heldout_goals() -> None:
    goals = world.heldout_goals(30, objects=1, seed=5)
    assert goals == world.heldout_goals(30, objects=1, seed=5)
    assert goals != world.heldout_goals(30, objects=1, seed=6)
    for g in goals:
        (o,) = g.objects
        assert world.is_heldout(o["color"], o["shape"], o["position"])
        assert checker.parse_goal(g.text) == [o]
    for g in world.heldout_goals(30, objects=2, seed=5):
        assert " and " in g.text and len(g.objects) == 2
        assert all(world.is_heldout(o["color"], o["shape"], o["position"]) for o in g.objects)
        assert world.fits_together(g.objects)


def test_captions_paraphrase_and_parse_back() -> None:
    rng = random.Random(1)
    texts = set()
    for _ in range(300):
        scene = world.sample_scene(rng, 1 + (rng.random() < 0.5), "all")
        text = world.caption(scene, rng, drop=0.0)
        texts.add(text)
        key = lambda o: o["position"]  # noqa: E731
        assert sorted(checker.parse_goal(text), key=key) == sorted(scene.attributes(), key=key), (
            text
        )
    assert len(texts) > 250
    assert world.canonical_caption(
        [{"color": "red", "shape": "circle", "size": "small", "position": "left"}]
    ) == ("a small red circle on the left")
