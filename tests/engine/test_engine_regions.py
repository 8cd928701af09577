"""Regional prompting: a layout request draws each region's prompt in its own area."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.regions import SOFTNESS, region_weights
from engine.runner import Runner
from engine.shapes import checker
from engine.types import MAX_REGIONS, GenerationRequest, Region

LEFT, RIGHT, TOP = (0.25, 0.5), (0.75, 0.5), (0.5, 0.25)


def _pixels(image) -> np.ndarray:  # noqa: ANN001 - PIL image
    return np.asarray(image, dtype=np.int16)


def test_weights_sum_to_one_and_the_nearest_anchor_rules() -> None:
    regions = [Region("a", *LEFT), Region("b", *RIGHT), Region("c", *TOP)]
    w = region_weights(regions, 8, 8)
    assert w.shape == (3, 8, 8)
    assert torch.allclose(w.sum(0), torch.ones(8, 8), atol=1e-6)
    assert w[0, 4, 0] > 0.99 and w[1, 4, 7] > 0.99 and w[2, 0, 4] > 0.99
    # a cell on the border between left and right shares them evenly
    assert torch.allclose(region_weights(regions[:2], 1, 2)[:, 0, 0], torch.tensor([1.0, 0.0]), atol=1e-3)
    assert torch.allclose(region_weights(regions[:2], 1, 3)[:, 0, 1], torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError):
        region_weights([], 8, 8)


def test_a_larger_scale_claims_more_of_the_image() -> None:
    plain = region_weights([Region("a", *LEFT), Region("b", *RIGHT)], 1, 16)[0, 0]
    big_left = region_weights([Region("a", *LEFT, scale=1.5), Region("b", *RIGHT)], 1, 16)[0, 0]
    small_left = region_weights([Region("a", *LEFT, scale=0.7), Region("b", *RIGHT)], 1, 16)[0, 0]
    # the border (weight 1/2) sits between the anchors at scale 1, further right for a larger
    # left region, further left for a smaller one; each anchor still rules its own cell
    assert int((plain > 0.5).sum()) == 8
    assert int((big_left > 0.5).sum()) > 8 > int((small_left > 0.5).sum())
    assert small_left[4] > 0.99 and big_left[12] < 0.01
    same = region_weights([Region("a", *LEFT, scale=2.0), Region("b", *RIGHT, scale=2.0)], 1, 16)
    assert int((same[0, 0] > 0.5).sum()) == 8  # equal scales: the border stays in the middle


def test_a_scale_must_be_positive_and_finite(tiny: Runner) -> None:
    for scale in (0.0, -1.0, float("nan"), 5.0):
        bad = GenerationRequest("x", seed=0, width=32, height=32, model="tiny-dit",
                                regions=(Region("a", *LEFT, scale=scale), Region("b", *RIGHT)))
        with pytest.raises(ValueError, match="region 0 scale"):
            tiny.validate(bad)


@pytest.fixture(scope="module")
def tiny(cpu_config: EngineConfig) -> Runner:
    return Runner("tiny-dit", cpu_config)


def _layout(runner: Runner, seed: int, regions: tuple[Region, ...], **kw) -> GenerationRequest:  # noqa: ANN003
    return GenerationRequest(
        "a red circle and a blue square", seed=seed, steps=3, guidance=2.0, model=runner.model,
        regions=regions, **kw,
    )


def test_one_prompt_in_every_region_is_the_plain_image(tiny: Runner) -> None:
    prompt = "a red circle on the left"
    plain = GenerationRequest(prompt, seed=4, steps=3, guidance=2.0, model=tiny.model)
    same = _layout(tiny, 4, (Region(prompt, *LEFT), Region(prompt, *RIGHT)))
    a, b = tiny.generate([plain, same])
    assert b.timings["regions"] == 2.0 and "regions" not in a.timings
    assert np.abs(_pixels(a.image) - _pixels(b.image)).max() <= 1


def test_a_layout_depends_on_its_own_request_only(tiny: Runner) -> None:
    regions = (Region("a red circle", *LEFT), Region("a blue square", *RIGHT))
    other = (Region("a green ring", *TOP), Region("a pink cross", *RIGHT))
    alone = tiny.generate([_layout(tiny, 7, regions)])[0]
    batch = tiny.generate([_layout(tiny, 8, other), _layout(tiny, 7, regions)])
    assert batch[1].timings["batch_size"] == 2.0
    assert np.abs(_pixels(alone.image) - _pixels(batch[1].image)).max() <= 1


def test_layouts_take_one_pipeline_row_per_region(tiny: Runner) -> None:
    regions = (Region("a", *LEFT), Region("b", *RIGHT))
    requests = [_layout(tiny, s, regions) for s in range(3)]  # max_batch 4 rows: 2 layouts a call
    assert [len(b) for b in tiny._batches(requests)] == [2, 1]
    plain = [replace(r, regions=()) for r in requests]
    assert [len(b) for b in tiny._batches(plain + requests)] == [3, 2, 1]


def test_bad_layouts_are_refused_with_every_reason(tiny: Runner, cpu_config: EngineConfig) -> None:
    bad = _layout(
        tiny, 1,
        (Region("", *LEFT), Region("x", 1.5, 0.5), Region("y", 0.5, float("nan"))),
    )
    with pytest.raises(ValueError) as err:
        tiny.generate([bad])
    message = str(err.value)
    assert "region 0 has an empty prompt" in message
    assert "region 1 x 1.5" in message and "region 2 y nan" in message
    many = _layout(tiny, 1, tuple(Region("x", i / MAX_REGIONS, 0.5) for i in range(MAX_REGIONS + 1)))
    with pytest.raises(ValueError, match=f"at most {MAX_REGIONS}"):
        tiny.generate([many])
    unet = Runner("tiny-unet", cpu_config)
    with pytest.raises(ValueError, match="FluxPipeline only"):
        unet.generate([_layout(unet, 1, (Region("a", *LEFT), Region("b", *RIGHT)))])


@pytest.mark.slow
def test_the_shapes_model_draws_each_part_where_its_region_is() -> None:
    """On the trained shapes model, a two-object goal drawn from a layout is right far more
    often than the same goal as one prompt (which the model gets right about 2% of the time)."""
    runner = Runner("shapes", EngineConfig(device="cpu", max_batch=16))
    objects = [
        {"color": "red", "shape": "square", "size": "large", "position": "left"},
        {"color": "blue", "shape": "circle", "size": "large", "position": "right"},
    ]
    parts = ("a large red square on the left", "a large blue circle on the right")
    base = GenerationRequest(" and ".join(parts), seed=0, width=32, height=32, steps=20,
                             guidance=3.0, model="shapes")
    regions = (Region(parts[0], *LEFT), Region(parts[1], *RIGHT))
    layouts = runner.generate([replace(base, seed=s, regions=regions) for s in range(8)])
    plain = runner.generate([replace(base, seed=s) for s in range(8)])
    right = [checker.check(r.image, objects).all_ok for r in layouts]
    plain_right = [checker.check(r.image, objects).all_ok for r in plain]
    assert sum(right) >= 4 > sum(plain_right), (right, plain_right)
    # the same two prompts with their anchors swapped: each part is drawn where it is not asked
    swapped = (Region(parts[0], *RIGHT), Region(parts[1], *LEFT))
    wrong = runner.generate([replace(base, seed=s, regions=swapped) for s in range(8)])
    assert sum(checker.check(r.image, objects).all_ok for r in wrong) < sum(right)


def test_a_layout_is_drawn_with_the_configured_seam(tiny: Runner, cpu_config: EngineConfig) -> None:
    """The own loop blends a layout's rows by ``EngineConfig.layout_softness``, softer than
    the seam the scorer cuts region views with (``regions.SOFTNESS``)."""
    regions = (Region("a red circle", *LEFT), Region("a blue square", *RIGHT), Region("x", *TOP))
    for softness in (0.02, cpu_config.layout_softness):
        runner = tiny if softness == cpu_config.layout_softness else Runner(
            "tiny-dit", replace(cpu_config, layout_softness=softness))
        state = runner.denoise_batch([_layout(runner, 0, regions)])
        assert state.weights is not None
        side = int(state.weights.shape[2] ** 0.5)  # the packed token grid
        drawn = state.weights[0, :, :, 0].reshape(3, side, side)
        assert torch.allclose(drawn, region_weights(regions, side, side, softness), atol=1e-6)
    assert cpu_config.layout_softness > SOFTNESS
