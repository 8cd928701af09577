"""Noise variations: a request's initial noise blended toward a second seed's noise."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.runner import Runner, slerp
from engine.types import GenerationRequest, GenerationResult

PROMPT = "a red circle on the left"


@pytest.fixture(scope="module", params=["tiny-unet", "tiny-dit"])
def runner(request: pytest.FixtureRequest, cpu_config: EngineConfig) -> Runner:
    """One warm runner per preset, shared by the tests of this module."""
    return Runner(request.param, cpu_config)


def _request(runner: Runner, seed: int, **changes: object) -> GenerationRequest:
    base = GenerationRequest(PROMPT, seed=seed, steps=2, model=runner.model)
    return replace(base, **changes)


def _pixels(result: GenerationResult) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


def _max_diff(a: GenerationResult, b: GenerationResult) -> int:
    return int(np.abs(_pixels(a) - _pixels(b)).max())


def _mean_diff(a: GenerationResult, b: GenerationResult) -> float:
    return float(np.abs(_pixels(a) - _pixels(b)).mean())


def test_plain_batch_is_the_pipelines_own_draw(runner: Runner) -> None:
    """Without a variation the runner hands the pipeline one generator per request, as before."""
    requests = [_request(runner, s, variation_seed=99) for s in (3, 4)]  # strength 0: no variation
    first = requests[0]
    images = runner.pipe(
        prompt=[r.prompt for r in requests],
        height=first.height,
        width=first.width,
        num_inference_steps=first.steps,
        generator=[torch.Generator("cpu").manual_seed(r.seed) for r in requests],
        output_type="pil",
        **runner._call_kwargs(first),
    ).images
    results = runner.generate(requests)
    for result, image in zip(results, images, strict=True):
        assert np.array_equal(_pixels(result), np.asarray(image, dtype=np.int16))


def test_plain_requests_beside_a_variation_are_unchanged(runner: Runner) -> None:
    plain = [_request(runner, s) for s in (1, 2, 3)]
    mixed = [plain[0], _request(runner, 2, variation_seed=7, variation_strength=0.5), plain[2]]
    a, b = runner.generate(plain), runner.generate(mixed)
    assert a[1].timings["batch_size"] == b[1].timings["batch_size"] == 3
    assert _max_diff(a[0], b[0]) == 0 and _max_diff(a[2], b[2]) == 0
    assert _max_diff(a[1], b[1]) > 0


def test_strength_0_is_the_seed_and_1_is_the_variation_seed(runner: Runner) -> None:
    ends = [
        _request(runner, 1, variation_seed=7, variation_strength=0.0),
        _request(runner, 2, variation_seed=7, variation_strength=1.0),  # puts the batch on latents
    ]
    plain = [_request(runner, 1), _request(runner, 7)]
    got, want = runner.generate(ends), runner.generate(plain)
    assert _max_diff(got[0], want[0]) == 0
    assert _max_diff(got[1], want[1]) == 0


def test_a_small_strength_stays_near_its_parent(runner: Runner) -> None:
    parent, variation, fresh = runner.generate(
        [
            _request(runner, 5),
            _request(runner, 5, variation_seed=6, variation_strength=0.1),
            _request(runner, 6),
        ]
    )
    assert 0 < _mean_diff(parent, variation) < _mean_diff(parent, fresh)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"variation_seed": 3, "variation_strength": -0.1}, "variation_strength -0.1"),
        ({"variation_seed": 3, "variation_strength": 1.5}, "variation_strength 1.5"),
        ({"variation_seed": 3, "variation_strength": float("nan")}, "variation_strength nan"),
        ({"variation_strength": 2.0}, "variation_strength 2.0"),
        ({"variation_seed": -1, "variation_strength": 0.5}, "variation_seed -1"),
        ({"variation_seed": 2**64, "variation_strength": 0.5}, "variation_seed"),
    ],
)
def test_invalid_variations_raise(runner: Runner, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        runner.generate([_request(runner, 0), _request(runner, 1, **changes)])


def test_slerp_ends_norm_and_parallel_fallback() -> None:
    g = torch.Generator("cpu").manual_seed(0)
    a, b = torch.randn((1, 4, 8, 8), generator=g), torch.randn((1, 4, 8, 8), generator=g)
    assert torch.equal(slerp(a, b, 0.0), a) and torch.equal(slerp(a, b, 1.0), b)
    mid = slerp(a, b, 0.5)
    assert mid.shape == a.shape and mid.dtype == a.dtype
    # along the arc the norm stays near the ends' norms; a straight line would lose about 30%
    assert float(mid.norm()) == pytest.approx(float(0.5 * (a.norm() + b.norm())), rel=0.05)
    assert torch.allclose(slerp(a, 2 * a, 0.5), 1.5 * a)  # parallel: linear interpolation
