"""The runner's own denoising loop against the stock FluxPipeline call; guidance truncation;
the text-embedding cache's batched encode."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.denoise import (
    CACHE_CONTEXT,
    DenoiseBatch,
    DenoiseStep,
    decode,
    guided_steps,
    split_step,
)
from engine.runner import Runner
from engine.types import GenerationRequest, GenerationResult, Region

MIN_PSNR_DB = 60.0
LAYOUT = (Region("a red circle", 0.25, 0.5), Region("a blue square", 0.75, 0.5))


def _psnr(a: GenerationResult, b: GenerationResult) -> float:
    x = np.asarray(a.image, dtype=np.float64)
    y = np.asarray(b.image, dtype=np.float64)
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _requests(model: str, steps: int) -> list[GenerationRequest]:
    """Plain (guidance 1 and 3, with and without a negative), a variation, layouts."""
    base = GenerationRequest("a red circle on the left", seed=0, steps=steps, model=model)
    return [
        base,
        replace(base, seed=1, guidance=3.0),
        replace(base, seed=2, guidance=3.0, negative_prompt="blurry"),
        replace(base, seed=3, guidance=3.0, variation_seed=9, variation_strength=0.4),
        replace(base, seed=4, variation_seed=8, variation_strength=0.7),
        replace(base, prompt="two shapes", seed=5, regions=LAYOUT),
        replace(base, prompt="two shapes", seed=6, guidance=3.0, regions=LAYOUT),
    ]


def _counting(runner: Runner) -> list[int]:
    """Rows of every transformer call, in order (a forward hook on the real module)."""
    rows: list[int] = []
    runner.pipe.transformer.register_forward_hook(
        lambda _m, _a, kwargs, _o: rows.append(int(kwargs["hidden_states"].shape[0])),
        with_kwargs=True,
    )
    return rows


@pytest.fixture(scope="module")
def tiny(cpu_config: EngineConfig) -> Runner:
    return Runner("tiny-dit", cpu_config)


@pytest.mark.parametrize(("model", "steps"), [("tiny-dit", 3), ("shapes", 6)])
def test_own_loop_matches_the_stock_pipeline(
    cpu_config: EngineConfig, model: str, steps: int
) -> None:
    own = Runner(model, cpu_config)
    stock = Runner(model, replace(cpu_config, own_loop=False))
    assert own.loop is not None and stock.loop is None
    requests = _requests(model, steps)
    for a, b in zip(own.generate(requests), stock.generate(requests), strict=True):
        assert _psnr(a, b) >= MIN_PSNR_DB, a.request


def test_one_transformer_call_per_step_with_cfg(cpu_config: EngineConfig) -> None:
    runner = Runner("tiny-dit", cpu_config)
    rows = _counting(runner)
    plain = [GenerationRequest("a red circle", seed=s, steps=3, guidance=3.0) for s in range(3)]
    runner.generate(plain)
    assert rows == [3 + 3] * 3  # three prompt rows, then three negative rows, once per step
    rows.clear()
    layouts = [replace(r, regions=LAYOUT) for r in plain[:2]]
    runner.generate(layouts)
    # blended (steps 0-1 of 3): a row per region, one negative row per request; apart (step
    # 2): a negative row per region as well
    assert rows == [2 * 2 + 2, 2 * 2 + 2, 2 * 2 * 2]
    rows.clear()
    runner.generate([replace(r, guidance=1.0) for r in plain])
    assert rows == [3] * 3  # no guidance: no negative rows
    blended = Runner("tiny-dit", replace(cpu_config, layout_split=1.0))
    blended_rows = _counting(blended)
    blended.generate(layouts)
    assert blended_rows == [2 * 2 + 2] * 3  # blended on every step


def test_stock_pipeline_calls_twice_per_step(cpu_config: EngineConfig) -> None:
    runner = Runner("tiny-dit", replace(cpu_config, own_loop=False))
    rows = _counting(runner)
    runner.generate([GenerationRequest("a red circle", seed=0, steps=2, guidance=3.0)])
    assert rows == [1, 1, 1, 1]


@pytest.mark.parametrize(
    ("fraction", "guided"), [(1.0, 4), (0.75, 3), (0.6, 3), (0.5, 2), (0.0, 0)]
)
def test_truncation_drops_the_unconditional_rows_at_the_right_step(
    cpu_config: EngineConfig, fraction: float, guided: int
) -> None:
    assert guided_steps(4, 3.0, fraction) == guided
    runner = Runner("tiny-dit", replace(cpu_config, cfg_truncation=fraction))
    rows = _counting(runner)
    requests = [GenerationRequest("a red circle", seed=s, steps=4, guidance=3.0) for s in range(2)]
    results = runner.generate(requests)
    assert rows == [4] * guided + [2] * (4 - guided)
    expected = {"unconditional_steps": 4 - guided} if 0 < guided < 4 else {}
    assert results[0].skipped == expected


def test_truncated_steps_predict_from_the_prompt_alone(cpu_config: EngineConfig) -> None:
    request = GenerationRequest("a red circle", seed=7, steps=4, guidance=3.0)
    unguided = Runner("tiny-dit", replace(cpu_config, cfg_truncation=0.0))
    half = Runner("tiny-dit", replace(cpu_config, cfg_truncation=0.5))
    full = Runner("tiny-dit", cpu_config)
    a = unguided.generate([request])[0]
    assert _psnr(a, full.generate([replace(request, guidance=1.0)])[0]) == math.inf
    b, c = half.generate([request])[0], full.generate([request])[0]
    assert _psnr(b, c) < math.inf and _psnr(a, b) < math.inf  # truncation changes the image


def test_invalid_truncation_is_refused() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="cfg_truncation"):
            EngineConfig(cfg_truncation=bad)


def test_text_misses_are_encoded_in_one_call(cpu_config: EngineConfig) -> None:
    runner = Runner("tiny-dit", cpu_config)
    assert runner.config.text_embedding_cache  # on by default
    calls: list[list[str]] = []
    encode = runner.pipe.encode_prompt

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(list(kwargs["prompt"]))  # type: ignore[call-overload]
        return encode(*args, **kwargs)

    runner.pipe.encode_prompt = counting  # type: ignore[method-assign]
    first = [GenerationRequest(f"a red circle {i}", seed=i, steps=1, guidance=3.0, negative_prompt="dark")
             for i in range(3)]  # fmt: skip
    runner.generate(first)
    assert calls == [["a red circle 0", "a red circle 1", "a red circle 2", "dark"]]
    assert (runner.text_cache_misses, runner.text_cache_hits) == (4, 2)
    runner.generate(first[1:] + [replace(first[0], prompt="a new prompt")])
    assert calls[1:] == [["a new prompt"]]  # only the miss, the rest from the cache
    runner.generate(first)
    assert len(calls) == 2  # everything cached: no encoder call
    assert (runner.text_cache_misses, runner.text_cache_hits) == (5, 2 + 5 + 6)


def test_cached_embeddings_are_the_encoders(cpu_config: EngineConfig) -> None:
    cached = Runner("tiny-dit", cpu_config)
    fresh = Runner("tiny-dit", replace(cpu_config, text_embedding_cache=False))
    requests = [
        GenerationRequest(f"a blue ring {i}", seed=i, steps=2, guidance=3.0) for i in range(3)
    ]
    cached.generate(requests[:1])  # one text cached alone, the others encoded beside it later
    for a, b in zip(cached.generate(requests), fresh.generate(requests), strict=True):
        assert _psnr(a, b) >= MIN_PSNR_DB
    assert fresh.text_cache_misses == fresh.text_cache_hits == 0


def test_cache_hooks_run_inside_the_loop(cpu_config: EngineConfig) -> None:
    """A stateful diffusers hook sees the loop's cache context and is reset per batch and
    when the unconditional rows are dropped."""
    from diffusers.hooks import HookRegistry, ModelHook
    from diffusers.hooks.hooks import BaseState, StateManager

    class Seen(BaseState):
        def __init__(self) -> None:
            self.calls = 0

        def reset(self) -> None:
            self.calls = 0

    class Recorder(ModelHook):
        _is_stateful = True

        def __init__(self) -> None:
            super().__init__()
            self.state = StateManager(Seen)
            self.contexts: list[tuple[str, int | None, int]] = []
            self.resets = 0

        def pre_forward(self, module: torch.nn.Module, *args: object, **kwargs: object) -> tuple:
            context = self.state.context
            self.state.get_state().calls += 1
            rows = int(kwargs["hidden_states"].shape[0])  # type: ignore[union-attr]
            self.contexts.append((context.name, context.step_index, rows))
            return args, kwargs

        def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
            self.resets += 1
            self.state.reset()
            return module

    runner = Runner("tiny-dit", replace(cpu_config, cfg_truncation=0.5))
    hook = Recorder()
    HookRegistry.check_if_exists_or_initialize(runner.pipe.transformer).register_hook(
        hook, "recorder"
    )
    runner.generate([GenerationRequest("a red circle", seed=0, steps=4, guidance=3.0)])
    assert hook.contexts == [(CACHE_CONTEXT, 0, 2), (CACHE_CONTEXT, 1, 2),
                             (CACHE_CONTEXT, 2, 1), (CACHE_CONTEXT, 3, 1)]  # fmt: skip
    assert hook.resets == 2  # at the start of the batch, and when the negative rows go


def test_diffusers_first_block_cache_works_in_the_loop(cpu_config: EngineConfig) -> None:
    from diffusers import FirstBlockCacheConfig

    request = GenerationRequest("a red circle", seed=2, steps=4, guidance=3.0)
    base = Runner("tiny-dit", replace(cpu_config, cfg_truncation=0.5))
    cached = Runner("tiny-dit", replace(cpu_config, cfg_truncation=0.5))
    cached.pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.0))  # never skips
    for _ in range(2):  # a second batch starts from a reset cache
        assert _psnr(base.generate([request])[0], cached.generate([request])[0]) >= MIN_PSNR_DB


@pytest.mark.parametrize("at", [1, 2])  # before and after the layout's regions go apart
def test_requests_can_be_dropped_mid_denoise(tiny: Runner, at: int) -> None:
    """``DenoiseBatch.select`` from a step callback: the survivors finish as if alone."""
    assert tiny.loop is not None and split_step(4, tiny.loop.layout_split) == 2
    requests = [replace(GenerationRequest("two shapes", seed=s, steps=4, guidance=3.0), regions=LAYOUT)
                for s in range(3)]  # fmt: skip

    def drop_the_first(step: DenoiseStep, batch: DenoiseBatch) -> DenoiseBatch | None:
        assert batch.is_split == (step.index >= 2)
        return batch.select([1, 2]) if step.index == at else None

    pruned = tiny.loop.run(tiny.denoise_batch(requests), 4, on_step=drop_the_first)
    assert pruned.ids == (1, 2) and pruned.size == 2
    alone = tiny.loop.run(tiny.denoise_batch(requests[2:]), 4)
    assert torch.allclose(pruned.latents[1], alone.latents[0], atol=1e-5)


@pytest.mark.parametrize(("steps", "fraction", "at"), [
    (8, 0.5, 4), (3, 0.5, 2), (6, 0.5, 3), (8, 0.0, 0), (8, 1.0, None), (8, 0.99, None), (4, 0.75, 3),
])
def test_a_layout_splits_after_its_share_of_the_steps(
    steps: int, fraction: float, at: int | None
) -> None:
    assert split_step(steps, fraction) == at


def test_apart_each_region_denoises_as_if_it_were_alone(cpu_config: EngineConfig) -> None:
    """Split from the first step, a region's own row is its prompt's plain trajectory (guided
    against the negative on that row), so the layout is the blend of the plain images'
    latents; blended on every step, it is not."""
    requests = [GenerationRequest(r.prompt, seed=3, steps=3, guidance=3.0) for r in LAYOUT]
    layout = replace(requests[0], prompt="two shapes", regions=LAYOUT)
    for fraction, apart in ((0.0, True), (1.0, False)):
        runner = Runner("tiny-dit", replace(cpu_config, layout_split=fraction))
        assert runner.loop is not None
        plain = runner.loop.run(runner.denoise_batch(requests), 3).latents
        state = runner.denoise_batch([layout])
        assert state.weights is not None
        out = runner.loop.run(state, 3)
        assert out.is_split == apart
        blend = (state.weights[0] * plain).sum(dim=0)
        assert torch.allclose(out.latents[0], blend, atol=1e-4) == apart, fraction


def test_a_layout_split_is_a_fraction_and_its_softness_positive() -> None:
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="layout_split"):
            EngineConfig(layout_split=bad)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="layout_softness"):
            EngineConfig(layout_softness=bad)


def test_last_step_x0_preview_is_the_final_latents(tiny: Runner) -> None:
    assert tiny.loop is not None
    requests = [GenerationRequest("a red circle", seed=s, steps=3, guidance=3.0) for s in range(2)]
    steps: list[DenoiseStep] = []
    out = tiny.loop.run(tiny.denoise_batch(requests), 3, on_step=lambda s, _b: steps.append(s))
    assert [s.index for s in steps] == [0, 1, 2] and steps[-1].sigma_next == 0.0
    assert torch.allclose(steps[-1].x0(), out.latents, atol=1e-6)
    early = decode(tiny.pipe, steps[0].x0(), 32, 32)  # a preview decodes like a finished image
    assert len(early) == 2 and early[0].size == (32, 32)


def test_a_workers_runner_keeps_its_text_cache_across_iterations(cpu_config: EngineConfig) -> None:
    """Embedded and Celery workers hold one Residency per runtime / process: a goal's next
    iteration gets the same runner, whose cache already holds the goal's text."""
    from workers.residency import Residency

    residency = Residency(cpu_config)
    request = GenerationRequest("a green ring", seed=0, steps=1)
    residency.runner("tiny-dit").generate([request])
    runner = residency.runner("tiny-dit")
    runner.generate([replace(request, seed=1)])
    assert (runner.text_cache_misses, runner.text_cache_hits) == (1, 1)
