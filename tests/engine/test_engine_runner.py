"""Loading presets and the batched runner: determinism, batching, text cache, validation."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.catalog import ModelLoadError, UnknownModelError
from engine.config import EngineConfig
from engine.loading import load_pipeline
from engine.runner import Runner
from engine.types import GenerationRequest, GenerationResult

PRESETS = ["tiny-unet", "tiny-dit"]
TOLERANCE = 1  # uint8 levels; batching may change float rounding, never the image


@pytest.fixture(scope="module", params=PRESETS)
def runner(request: pytest.FixtureRequest, cpu_config: EngineConfig) -> Runner:
    """One warm runner per preset, shared by the tests of this module."""
    return Runner(request.param, cpu_config)


def _request(runner: Runner, seed: int = 0, **changes: object) -> GenerationRequest:
    base = GenerationRequest(f"a red circle number {seed}", seed=seed, steps=2, model=runner.model)
    return replace(base, **changes)


def _pixels(result: GenerationResult) -> np.ndarray:
    return np.asarray(result.image, dtype=np.int16)


def _max_diff(a: GenerationResult, b: GenerationResult) -> int:
    return int(np.abs(_pixels(a) - _pixels(b)).max())


def test_preset_generates_32x32(runner: Runner) -> None:
    (result,) = runner.generate([_request(runner)])
    assert result.image.size == (32, 32) and result.image.mode == "RGB"
    assert _pixels(result).std() > 0  # not a blank image
    assert {"load_s", "encode_s", "denoise_s", "batch_size"} <= result.timings.keys()
    assert result.skipped == {}


def test_same_seed_same_image_other_seed_other_image(runner: Runner) -> None:
    a, b, c = runner.generate([_request(runner, 1), _request(runner, 1), _request(runner, 2)])
    assert _max_diff(a, b) == 0
    assert _max_diff(a, c) > 0


def test_preset_identical_in_a_new_runner(runner: Runner, cpu_config: EngineConfig) -> None:
    other = Runner(runner.model, cpu_config)
    (a,) = runner.generate([_request(runner, 5)])
    (b,) = other.generate([_request(other, 5)])
    assert _max_diff(a, b) == 0


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_alone_equals_inside_a_batch(runner: Runner, guidance: float) -> None:
    batch = [_request(runner, s, guidance=guidance, negative_prompt="blurry") for s in range(4)]
    together = runner.generate(batch)
    alone = runner.generate([batch[2]])[0]
    assert together[2].timings["batch_size"] == 4 and alone.timings["batch_size"] == 1
    assert _max_diff(together[2], alone) <= TOLERANCE


def test_results_in_request_order_across_groups(runner: Runner) -> None:
    requests = [_request(runner, s, steps=1 + s % 2) for s in range(5)]  # two batch keys
    results = runner.generate(requests)
    assert [r.request for r in results] == requests
    assert _max_diff(results[3], runner.generate([requests[3]])[0]) <= TOLERANCE


def test_text_embedding_cache_gives_the_same_image(
    runner: Runner, cpu_config: EngineConfig
) -> None:
    cached = Runner(runner.model, replace(cpu_config, text_embedding_cache=True))
    requests = [_request(runner, s, guidance=3.0, negative_prompt="dark") for s in range(3)]
    plain = Runner(runner.model, replace(cpu_config, text_embedding_cache=False)).generate(requests)
    first, second = cached.generate(requests), cached.generate(requests)
    assert max(_max_diff(a, b) for a, b in zip(plain, first, strict=True)) <= TOLERANCE
    assert max(_max_diff(a, b) for a, b in zip(first, second, strict=True)) == 0
    assert cached.text_cache_misses == 4  # three prompts and one shared negative
    assert cached.text_cache_hits == 2 * 6 - 4


def test_load_time_is_billed_once(runner: Runner, cpu_config: EngineConfig) -> None:
    fresh = Runner(runner.model, cpu_config)
    first = fresh.generate([_request(fresh, 0), _request(fresh, 1)])
    assert sum(r.timings["load_s"] for r in first) == pytest.approx(fresh.load_seconds)
    assert fresh.generate([_request(fresh, 0)])[0].timings["load_s"] == 0.0


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"width": 20}, "width 20"),
        ({"height": 0}, "height 0"),
        ({"steps": 0}, "steps 0"),
        ({"seed": -1}, "seed -1"),
        ({"model": "other"}, "serves"),
        ({"guidance": float("nan")}, "guidance"),
    ],
)
def test_invalid_requests_raise(runner: Runner, changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        runner.generate([_request(runner), _request(runner, **changes)])


def test_tiny_dit_sizes_are_multiples_of_8(cpu_config: EngineConfig) -> None:
    runner = Runner("tiny-dit", cpu_config)
    assert runner.size_multiple == 8
    (result,) = runner.generate([_request(runner, width=40, height=24, steps=1)])
    assert result.image.size == (40, 24)


@pytest.mark.slow
def test_preset_weights_identical_across_processes(cpu_config: EngineConfig) -> None:
    code = (
        "from engine.loading import load_pipeline; from engine.config import EngineConfig; "
        f"p = load_pipeline('tiny-dit', EngineConfig(device='cpu', dtype='float32', cache_dir={cpu_config.cache_dir!r})); "
        "print(sum(float(x.detach().double().sum()) for x in p.transformer.parameters()))"
    )
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, capture_output=True, env=env
    )
    here = load_pipeline("tiny-dit", cpu_config).transformer.parameters()
    assert float(out.stdout.decode().split()[-1]) == sum(
        float(x.detach().double().sum()) for x in here
    )


def test_unknown_model_raises(cpu_config: EngineConfig) -> None:
    with pytest.raises(UnknownModelError, match="unknown model 'no-such-model'"):
        Runner("no-such-model", cpu_config)
    with pytest.raises(UnknownModelError):  # a hub id nobody registered
        load_pipeline("agentloop-test/not-registered", cpu_config)


def test_registered_hub_id_really_tries_the_hub(cpu_config: EngineConfig) -> None:
    """The real from_pretrained runs; offline (or for a missing repo) it fails clearly."""
    hub_id = "agentloop-test/does-not-exist"
    with pytest.raises(ModelLoadError, match="Hugging Face Hub") as info:
        load_pipeline(hub_id, cpu_config, extra_models=[hub_id])
    assert isinstance(info.value.__cause__, OSError)


def test_fused_kernels_match_the_torch_path(cpu_config: EngineConfig) -> None:
    kernels = pytest.importorskip("kernels")
    if not hasattr(kernels, "install"):
        pytest.skip("kernels.install is not written yet (another engineer's area)")
    base = Runner("tiny-dit", cpu_config)
    fused = Runner("tiny-dit", replace(cpu_config, fused_adaln=True, fused_activations=True))
    assert any(fused.installed_kernels.values()) and not base.installed_kernels
    request = _request(base, 3)
    a, b = base.generate([request])[0], fused.generate([request])[0]
    assert _max_diff(a, b) <= 2


def test_dtype_is_applied(engine_cache: object) -> None:
    config = EngineConfig(device="cpu", dtype="bfloat16", cache_dir=str(engine_cache))
    pipe = load_pipeline("tiny-dit", config)
    assert pipe.transformer.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        load_pipeline("tiny-dit", replace(config, dtype="float8"))
