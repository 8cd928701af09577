"""The exact checker: agreement with the ground truth on clean and noisy renders, parsing."""

from __future__ import annotations

import random

import numpy as np
from PIL import Image, ImageFilter

from engine.shapes import checker, world


def test_agreement_on_renders() -> None:
    images, _, scenes = world.sample(11, 400, "all", two_object_prob=0.4)
    acc = checker.accuracy(list(images), [s.attributes() for s in scenes])
    assert acc["all"] >= 0.99, acc
    for attr in world.ATTRIBUTES:
        assert acc[attr] >= 0.99, acc


def test_agreement_on_noisy_blurred_renders() -> None:
    images, _, scenes = world.sample(12, 300, "all", two_object_prob=0.3)
    rng = np.random.default_rng(0)
    noisy = []
    for im in images:
        blurred = np.asarray(
            Image.fromarray(im).filter(ImageFilter.GaussianBlur(0.6)), dtype=np.float32
        )
        noisy.append(np.clip(blurred + rng.normal(0, 10, blurred.shape), 0, 255).astype(np.uint8))
    acc = checker.accuracy(noisy, [s.attributes() for s in scenes])
    assert acc["all"] >= 0.97, acc


def test_wrong_attributes_are_flagged() -> None:
    truth = {"color": "red", "shape": "circle", "size": "small", "position": "left"}
    image = world.render_image(world.place([truth], random.Random(0), background="white"))
    assert checker.check(image, [truth]).all_ok
    asked = {"color": "blue", "shape": "ring", "size": "small", "position": "right"}
    result = checker.check(image, [asked])
    assert result.objects == [{"color": False, "shape": False, "size": True, "position": False}]
    assert not checker.check(image, [truth, asked]).all_ok  # a missing second object
    partial = checker.check(image, [{"color": "red", "position": "left"}])
    assert partial.all_ok and partial.objects == [{"color": True, "position": True}]


def test_float_images_and_blank_image() -> None:
    images, _, scenes = world.sample(13, 5)
    for im, s in zip(images, scenes, strict=True):
        assert checker.check(im.astype(np.float32) / 255.0, s.attributes()).all_ok
    blank = np.full((32, 32, 3), 20, dtype=np.uint8)
    assert checker.detect(blank) == []
    assert not checker.check(blank, [{"color": "red"}]).all_ok


def test_parse_goal() -> None:
    assert checker.parse_goal("a small red circle on the left") == [
        {"size": "small", "color": "red", "shape": "circle", "position": "left"}
    ]
    assert checker.parse_goal(
        "On the right, a blue plus sign, big and a tiny donut in pink at the top"
    ) == [
        {"position": "right", "color": "blue", "shape": "cross", "size": "large"},
        {"size": "small", "shape": "ring", "color": "pink", "position": "top"},
    ]
    assert checker.parse_goal("a green triangle, on a white background") == [
        {"color": "green", "shape": "triangle"}
    ]
    assert checker.parse_goal("something else entirely") == []
