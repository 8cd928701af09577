"""The batched runner: turns GenerationRequests into GenerationResults on one warm pipeline.

Requests that share a ``batch_key()`` run together, up to ``EngineConfig.max_batch`` at a time.
Each request gets its own ``torch.Generator`` seeded with its seed (drawn on the CPU), so an
image depends only on its own request, never on its batch neighbours or on the device.

A request with a variation (``variation_seed`` and a ``variation_strength`` above 0) starts
from a blend of its seed's noise and the variation seed's noise. A batch holding one is given
its initial noise built here, drawn exactly as the pipeline would draw it, so the plain
requests of that batch get the very images they get without it.

A request with ``regions`` (a layout) runs as one pipeline row per region, every row from the
request's own noise; after each of the first ``EngineConfig.layout_split`` of the steps the
rows are blended by ``engine.regions`` weights, then each row goes on alone and the finished
rows are blended once, so each region's prompt draws the area nearest its anchor. Layouts run
on Flux pipelines, whose flow-matching Euler step is linear in the model output (so blending
after the step is blending the predictions).

Flux pipelines run the runner's own loop (``engine.denoise``, ``EngineConfig.own_loop``):
the same noise, timesteps and Euler steps as the stock pipeline call, with the prompts' and
the negatives' rows in one transformer call per step, and optionally no negative rows in the
late steps (``EngineConfig.cfg_truncation``). With ``own_loop`` off, or for other pipelines,
the stock pipeline call runs (layouts through its step-end callback).

Prompt embeddings are cached by text (``EngineConfig.text_embedding_cache``); the texts a
batch misses are encoded in one call.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusionPipeline
from PIL import Image

from engine.catalog import ModelSource, resolve_model
from engine.config import EngineConfig, StepCacheSettings
from engine.denoise import (
    DenoiseBatch,
    DenoiseStep,
    FluxDenoiseLoop,
    decode,
    decode_x0,
    split_step,
)
from engine.edits import Editor, edit_problems
from engine.loading import load_pipeline
from engine.regions import region_weights
from engine.speedups import apply_speedups
from engine.types import MAX_REGION_SCALE, GenerationRequest, GenerationResult

PreviewScorer = Callable[[Sequence[int], Sequence[Image.Image]], Sequence[float]]
"""Scores previews for pruning: called with the positions (in the requests given to
``Runner.generate``) of a prune group's members and their preview images, returns one score
per image, higher better (NaN ranks last)."""


def check_prune_groups(requests: Sequence[GenerationRequest]) -> None:
    """Raise ValueError unless every prune group's members agree on what makes them one batch
    (size, steps, guidance, model, regions) and on ``prune_keep`` and ``prune_at_step``."""
    seen: dict[str, tuple[Any, ...]] = {}
    for request in requests:
        if request.prune_group is None:
            continue
        key = (request.batch_key(), request.prune_keep, request.prune_at_step)
        if seen.setdefault(request.prune_group, key) != key:
            raise ValueError(
                f"prune group {request.prune_group!r} mixes requests that cannot run as one "
                f"batch or disagree on prune_keep/prune_at_step: {seen[request.prune_group]} "
                f"and {key}"
            )


class Pruning:
    """Cuts one prune group mid-denoise (the own loop's step callback).

    After ``prune_at_step`` steps, each member's predicted clean latents (x0 = x_t - sigma_t
    * v from that step's prediction) are decoded into previews and scored; the
    ``prune_keep`` best (ties: earlier request first) continue from their own latents, the
    rest stop there. A kept request's rows are the very rows it had: its image is the one it
    gets without pruning (float rounding of a smaller batch aside).
    """

    def __init__(
        self, pipe: Any, first: GenerationRequest, positions: Sequence[int],
        scorer: PreviewScorer,
    ) -> None:
        self.pipe, self.first, self.positions, self.scorer = pipe, first, positions, scorer
        self.previews: dict[int, Image.Image] = {}
        self.scores: dict[int, float] = {}
        self.kept: set[int] = set()

    def on_step(self, step: DenoiseStep, batch: DenoiseBatch) -> DenoiseBatch | None:
        """At the cut step: preview, score, keep the best; otherwise nothing."""
        first = self.first
        if step.index + 1 != first.prune_at_step or batch.size <= first.prune_keep:
            return None
        previews = decode_x0(self.pipe, step, first.height, first.width)
        scores = [float(s) for s in self.scorer([self.positions[i] for i in batch.ids], previews)]
        if len(scores) != batch.size:
            raise ValueError(f"preview scorer gave {len(scores)} scores for {batch.size} previews")
        rank = sorted(range(batch.size),
                      key=lambda i: (-scores[i] if math.isfinite(scores[i]) else math.inf, i))
        keep = sorted(rank[: first.prune_keep])
        for i, request_id in enumerate(batch.ids):
            self.previews[request_id], self.scores[request_id] = previews[i], scores[i]
        self.kept = {batch.ids[i] for i in keep}
        return batch.select(keep)

    def annotate(self, i: int, result: GenerationResult) -> None:
        """Mark request ``i``'s result: its preview score, and if it was cut, its preview as
        its image and the steps it ran."""
        if i not in self.scores:
            return  # the group was no larger than prune_keep: nothing was cut
        result.skipped["preview_score"] = self.scores[i]
        if i not in self.kept:
            result.image = self.previews[i]
            result.skipped["pruned_at_step"] = self.first.prune_at_step
            result.timings["denoise_steps"] = float(self.first.prune_at_step)

TEXT_CACHE_SIZE = 4096
"""Most texts whose embeddings the runner keeps (least recently used are dropped)."""

TEXT_CACHE_BYTES = 512 * 2**20
"""Most memory the kept embeddings may take (a large model's T5 states are MBs per text)."""

_VARIATION_PIPELINES = (FluxPipeline, StableDiffusionPipeline)
"""Pipelines whose initial noise the runner knows how to draw (and so to vary)."""

SLERP_PARALLEL = 0.9995
"""Above this |cos| between two noises, ``slerp`` interpolates linearly (the angle is too small)."""


def slerp(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation from ``a`` (t = 0) to ``b`` (t = 1), over the flattened tensors.

    Two Gaussian noises are nearly orthogonal, and moving along the arc between them keeps the
    norm a noise should have, where a straight line would shrink it toward the middle.
    Computed in float64, returned in ``a``'s dtype; the ends are returned exactly.
    """
    if t <= 0:
        return a
    if t >= 1:
        return b.to(a.dtype)
    x, y = a.double().flatten(), b.double().flatten()
    norms = x.norm() * y.norm()
    cos = float((x @ y) / norms) if norms > 0 else 1.0
    if abs(cos) > SLERP_PARALLEL:
        out = (1 - t) * x + t * y
    else:
        omega = math.acos(max(-1.0, min(1.0, cos)))
        out = (math.sin((1 - t) * omega) * x + math.sin(t * omega) * y) / math.sin(omega)
    return out.reshape(a.shape).to(a.dtype)


@dataclass(frozen=True)
class _TextEmbedding:
    """One text's encoder outputs, batch dimension 1."""

    hidden: torch.Tensor
    pooled: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Memory the tensors hold."""
        pooled = 0 if self.pooled is None else self.pooled.numel() * self.pooled.element_size()
        return self.hidden.numel() * self.hidden.element_size() + pooled


class Runner:
    """One model kept warm; generates batches of requests for it."""

    def __init__(
        self, model: str, config: EngineConfig = EngineConfig(), extra_models: Iterable[str] = ()
    ) -> None:
        """Load ``model`` (a catalog name), apply the speed-ups the config resolves to
        (dtype, attention backend, compilation, kernels), then its step cache (the order of
        kernels and cache does not matter to either, see kernels.flux)."""
        self.model = model
        self.config = config
        start = time.perf_counter()
        self.pipe: DiffusionPipeline = load_pipeline(model, config, extra_models)
        self.load_seconds = time.perf_counter() - start
        self._unbilled_load = self.load_seconds
        self._text_cache: OrderedDict[str, _TextEmbedding] = OrderedDict()
        self._text_cache_bytes = 0
        self.text_cache_hits = 0
        self.text_cache_misses = 0
        self.resolved = config.resolve()
        """What the config's "auto" switches mean on this device."""
        self.engine_report: dict[str, Any] = apply_speedups(self.pipe, self.resolved)
        """What was applied: dtype, TF32, attention backend, compiled blocks, kernels, and
        any speed-up that failed and was skipped (``errors``); benches and workers show it."""
        self.installed_kernels: dict[str, int] = dict(self.engine_report["kernels"])
        """What ``kernels.install`` patched, by kind (empty when no kernel switch is on)."""
        self.step_cache = self._install_step_cache(extra_models)
        """The step cache on the denoiser (``method`` "none" when the switch is off)."""
        self._loop: FluxDenoiseLoop | None = None
        """The runner's own denoising loop, where ``config.own_loop`` is on and the pipeline
        is a FluxPipeline; None: the stock pipeline call."""
        if config.own_loop and isinstance(self.pipe, FluxPipeline):
            self._loop = FluxDenoiseLoop(
                self.pipe, config.cfg_truncation, config.solver, config.layout_split
            )
        self.editor = Editor(self)
        """Runs image-to-image and repair requests (``engine.edits``)."""

    @property
    def denoiser(self) -> torch.nn.Module:
        """The pipeline's denoising network (``transformer`` or ``unet``)."""
        net = getattr(self.pipe, "transformer", None) or getattr(self.pipe, "unet", None)
        if net is None:
            raise TypeError(f"{type(self.pipe).__name__} has neither a transformer nor a unet")
        return net

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this (VAE factor, times 2 for Flux packing)."""
        factor = int(getattr(self.pipe, "vae_scale_factor", 8))
        if isinstance(self.pipe, FluxPipeline):
            factor *= 2
        return math.lcm(8, factor)

    def _install_step_cache(self, extra_models: Iterable[str]) -> Any:
        settings = StepCacheSettings.from_config(self.config)
        from engine.step_cache import StepCache  # lazily: imports diffusers' hooks

        spec = resolve_model(self.model, tuple(extra_models))
        folder = Path(spec.location) if spec is not None and spec.source is ModelSource.LOCAL else None
        return StepCache(self.denoiser, settings, folder)

    def _step_cache_prepare(self, steps: int) -> dict[str, Any]:
        """Clear the step cache for a new batch; returns counters to diff after it."""
        self.step_cache.prepare(steps)
        rows = self.step_cache.row_cache
        return dict(vars(rows.counters)) if rows is not None else {}

    def _step_cache_report(self, before: dict[str, Any]) -> dict[str, Any]:
        """What the step cache skipped in one batch (``GenerationResult.skipped``)."""
        method = self.step_cache.settings.method
        if method == "none":
            return {}
        report: dict[str, Any] = {"step_cache": method}
        rows = self.step_cache.row_cache
        if rows is not None and before:
            after = vars(rows.counters)
            seen = after["rows"] - before["rows"]
            skipped = after["rows_skipped"] - before["rows_skipped"]
            report["step_cache_skipped_share"] = skipped / seen if seen else 0.0
        return report

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError if this runner cannot serve ``request``."""
        problems = request.problems(self.model, self.size_multiple)
        if request.has_variation and not isinstance(self.pipe, _VARIATION_PIPELINES):
            problems.append(f"variations are not supported for {type(self.pipe).__name__}")
        if request.regions:
            problems += self._layout_problems(request)
        problems += edit_problems(self.pipe, request)
        if problems:
            raise ValueError(f"invalid request {request.prompt!r}: " + "; ".join(problems))

    def _layout_problems(self, request: GenerationRequest) -> list[str]:
        problems = []
        if not isinstance(self.pipe, FluxPipeline):
            problems.append(f"regions are supported for FluxPipeline only, not {type(self.pipe).__name__}")
        elif getattr(self.pipe.scheduler.config, "stochastic_sampling", False):
            problems.append("regions need a deterministic scheduler (stochastic_sampling is on)")
        for k, region in enumerate(request.regions):
            if not region.prompt.strip():
                problems.append(f"region {k} has an empty prompt")
            for name in ("x", "y"):
                value = getattr(region, name)
                if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1):
                    problems.append(f"region {k} {name} {value!r} is not a number in [0, 1]")
            scale = region.scale
            if not (isinstance(scale, int | float) and math.isfinite(scale) and 0 < scale <= MAX_REGION_SCALE):
                problems.append(f"region {k} scale {scale!r} is not a number in (0, {MAX_REGION_SCALE:g}]")
        return problems

    def generate(
        self, requests: Sequence[GenerationRequest], preview_scorer: PreviewScorer | None = None
    ) -> list[GenerationResult]:
        """Generate one image per request; results come back in request order.

        Requests of a prune group (``GenerationRequest.prune_group``) run as one batch; with a
        ``preview_scorer`` (and the own loop), the group is cut after ``prune_at_step`` steps
        to its ``prune_keep`` best previews, and the others come back pruned (see ``prune``
        below). Without a scorer, or on the stock pipeline call, every member finishes.
        """
        for request in requests:
            self.validate(request)
        check_prune_groups(requests)
        results: list[GenerationResult | None] = [None] * len(requests)
        load_share = self._unbilled_load / max(len(requests), 1)
        self._unbilled_load = 0.0 if requests else self._unbilled_load
        for batch in self._batches(requests):
            members = [requests[i] for i in batch]
            for i, result in zip(batch, self._run_batch(members, batch, preview_scorer), strict=True):
                result.timings["load_s"] = load_share
                results[i] = result
        return [r for r in results if r is not None]

    def _batches(self, requests: Sequence[GenerationRequest]) -> list[list[int]]:
        """Indices grouped by batch key (first-seen order), cut to at most max_batch pipeline
        rows (a layout takes one row per region). A prune group is one batch of its own,
        never cut: its previews are ranked against each other at one step."""
        rows = max(self.config.max_batch, 1) if self.config.batching else 1
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault((request.batch_key(), request.prune_key), []).append(i)
        out = []
        for (_, prune_key), idx in groups.items():
            if prune_key is not None:
                out.append(idx)
                continue
            size = max(1, rows // requests[idx[0]].denoiser_passes)
            out += [idx[s : s + size] for s in range(0, len(idx), size)]
        return out

    def _run_batch(
        self, batch: list[GenerationRequest], positions: Sequence[int] = (),
        preview_scorer: PreviewScorer | None = None,
    ) -> list[GenerationResult]:
        """One pipeline call for requests that share a batch key (``positions``: theirs in
        the requests given to ``generate``, which is how the preview scorer names them)."""
        first = batch[0]
        if first.kind != "text":
            return self.editor.run_batch(batch)
        if self._loop is not None:
            return self._run_own_loop(batch, positions or range(len(batch)), preview_scorer)
        if first.regions:
            return self._run_layout_batch(batch)
        start = time.perf_counter()
        text_kwargs = self._text_kwargs(
            [r.prompt for r in batch], [r.negative_prompt for r in batch], first.guidance
        )
        encode_s = time.perf_counter() - start
        kwargs = self._call_kwargs(first) | text_kwargs
        start = time.perf_counter()
        generators = [torch.Generator("cpu").manual_seed(r.seed) for r in batch]
        if any(r.has_variation for r in batch):
            # drawn from the same generators, which the pipeline then carries on with
            kwargs["latents"] = self._initial_noise(
                batch, generators, self._noise_dtype(text_kwargs)
            )
        counters = self._step_cache_prepare(first.steps)
        images = self.pipe(
            height=first.height,
            width=first.width,
            num_inference_steps=first.steps,
            generator=generators,
            output_type="pil",
            **kwargs,
        ).images
        denoise_s = time.perf_counter() - start
        n = len(batch)
        timings = {"encode_s": encode_s / n, "denoise_s": denoise_s / n, "batch_size": float(n)}
        skipped = self._step_cache_report(counters)
        return [
            GenerationResult(r, img, dict(timings), dict(skipped))
            for r, img in zip(batch, images, strict=True)
        ]

    def _run_layout_batch(self, batch: list[GenerationRequest]) -> list[GenerationResult]:
        """One pipeline call for layouts of as many regions: one row per region, blended after
        every step until the split and once after the last, and one decode per request."""
        first, k = batch[0], len(batch[0].regions)
        start = time.perf_counter()
        text_kwargs = self._text_kwargs(
            [region.prompt for r in batch for region in r.regions],
            [r.negative_prompt for r in batch for _ in range(k)],
            first.guidance,
        )
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        generators = [torch.Generator("cpu").manual_seed(r.seed) for r in batch]
        noise = self._initial_noise(batch, generators, self._noise_dtype(text_kwargs))
        weights = self._layout_weights(batch).to(noise.device, noise.dtype)

        split_at = split_step(first.steps, self.config.layout_split)

        def blend(_pipe: Any, i: int, _t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if split_at is not None and split_at <= i < first.steps - 1:
                return {}  # the regions denoise apart; blended once after the last step
            latents = tensors["latents"]
            per_request = latents.reshape(len(batch), k, *latents.shape[1:])
            mixed = (per_request * weights.to(latents.dtype)).sum(dim=1)
            return {"latents": mixed.repeat_interleave(k, dim=0)}

        counters = self._step_cache_prepare(first.steps)
        latents = self.pipe(
            height=first.height,
            width=first.width,
            num_inference_steps=first.steps,
            latents=noise.repeat_interleave(k, dim=0),
            output_type="latent",
            callback_on_step_end=blend,
            callback_on_step_end_tensor_inputs=["latents"],
            **(self._call_kwargs(first) | text_kwargs),
        ).images[::k]
        images = decode(self.pipe, latents, first.height, first.width)
        denoise_s = time.perf_counter() - start
        n = len(batch)
        timings = {
            "encode_s": encode_s / n, "denoise_s": denoise_s / n, "batch_size": float(n),
            "regions": float(k),
        }
        skipped = self._step_cache_report(counters)
        return [
            GenerationResult(r, img, dict(timings), dict(skipped))
            for r, img in zip(batch, images, strict=True)
        ]

    def _run_own_loop(
        self, batch: list[GenerationRequest], positions: Sequence[int] = (),
        preview_scorer: PreviewScorer | None = None,
    ) -> list[GenerationResult]:
        """One batch through the runner's own loop (``engine.denoise``): plain requests,
        variations and layouts alike, one transformer call per step; a prune group is cut
        to its best previews after ``prune_at_step`` steps."""
        assert self._loop is not None
        first = batch[0]
        positions = list(positions) or list(range(len(batch)))
        start = time.perf_counter()
        state = self.denoise_batch(batch)
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        counters = self._step_cache_prepare(first.steps)
        cut: Pruning | None = None
        if first.prune_group is not None and preview_scorer is not None:
            cut = Pruning(self.pipe, first, positions, preview_scorer)
        final = self._loop.run(state, first.steps, cut.on_step if cut else None)
        images = dict(zip(final.ids, decode(self.pipe, final.latents, first.height, first.width),
                          strict=True))
        denoise_s = time.perf_counter() - start
        n = len(batch)
        timings = {"encode_s": encode_s / n, "denoise_s": denoise_s / n, "batch_size": float(n)}
        if first.regions:
            timings["regions"] = float(first.denoiser_passes)
        skipped: dict[str, Any] = self._step_cache_report(counters)
        guided = self._guided_steps(first)
        if 0 < guided < first.steps:
            skipped["unconditional_steps"] = first.steps - guided
        results = []
        for i, request in enumerate(batch):
            result = GenerationResult(request, images.get(i), dict(timings), dict(skipped))  # type: ignore[arg-type]
            result.timings["denoise_steps"] = float(first.steps)
            if cut is not None:
                cut.annotate(i, result)
            results.append(result)
        return results

    def _guided_steps(self, request: GenerationRequest) -> int:
        """Steps of ``request`` that run the unconditional rows in the own loop."""
        return 0 if self._loop is None else self._loop.guided_steps(request.steps, request.guidance)

    def _layout_weights(self, batch: Sequence[GenerationRequest]) -> torch.Tensor:
        """(B, regions, tokens, 1) weights of layouts that share a batch key, on the packed
        token grid, with the drawing seam (``EngineConfig.layout_softness``)."""
        _, height, width = self._noise_shape(batch[0])
        rows, cols = height // 2, width // 2  # Flux packs 2x2 latent patches into one token
        softness = self.config.layout_softness
        weights = torch.stack([region_weights(r.regions, rows, cols, softness) for r in batch])
        return weights.reshape(len(batch), len(batch[0].regions), rows * cols, 1)

    def denoise_batch(self, batch: Sequence[GenerationRequest]) -> DenoiseBatch:
        """The own loop's starting state for requests that share a batch key: their text rows
        (from the cache, misses encoded in one call) and initial noise (drawn as the stock
        pipeline draws it, variations blended in), plus region weights for layouts."""
        first = batch[0]
        if self._loop is None:
            raise RuntimeError(f"{type(self.pipe).__name__} does not run the own loop here")
        if first.regions:
            prompts = [region.prompt for r in batch for region in r.regions]
        else:
            prompts = [r.prompt for r in batch]
        negatives = [r.negative_prompt for r in batch] if self._guided_steps(first) else []
        embeddings = self._embed_many(prompts + negatives)
        cond, uncond = embeddings[: len(prompts)], embeddings[len(prompts) :]
        hidden = torch.cat([e.hidden for e in cond])
        device, dtype = hidden.device, hidden.dtype
        generators = [torch.Generator("cpu").manual_seed(r.seed) for r in batch]
        noise = self._initial_noise(list(batch), generators, dtype).to(device)
        weights = None
        if first.regions:
            weights = self._layout_weights(batch).to(device, dtype)

        def pooled(embeddings: list[_TextEmbedding]) -> torch.Tensor:
            return torch.cat([e.pooled for e in embeddings if e.pooled is not None])

        return DenoiseBatch(
            latents=noise,
            cond_hidden=hidden,
            cond_pooled=pooled(cond),
            uncond_hidden=torch.cat([e.hidden for e in uncond]) if uncond else None,
            uncond_pooled=pooled(uncond) if uncond else None,
            text_ids=torch.zeros(hidden.shape[1], 3, device=device, dtype=dtype),
            image_ids=self._loop.image_ids(first.height, first.width, dtype),
            guidance=first.guidance,
            weights=weights,
        )

    @property
    def loop(self) -> FluxDenoiseLoop | None:
        """The own denoising loop (None where the stock pipeline call runs)."""
        return self._loop

    def _initial_noise(
        self, batch: list[GenerationRequest], generators: list[torch.Generator], dtype: torch.dtype
    ) -> torch.Tensor:
        """The batch's initial latents: each request's noise as the pipeline itself would draw it
        (``randn_tensor`` with one CPU generator per request), blended toward the variation
        seed's noise for requests that ask for a variation."""
        channels, height, width = self._noise_shape(batch[0])
        shape = (1, channels, height, width)
        noises = []
        for request, generator in zip(batch, generators, strict=True):
            noise = torch.randn(shape, generator=generator, dtype=dtype)
            if request.has_variation:
                assert request.variation_seed is not None  # has_variation says so
                other = torch.Generator("cpu").manual_seed(request.variation_seed)
                target = torch.randn(shape, generator=other, dtype=dtype)
                noise = slerp(noise, target, request.variation_strength)
            noises.append(noise)
        latents = torch.cat(noises)
        if isinstance(self.pipe, FluxPipeline):
            latents = FluxPipeline._pack_latents(latents, len(batch), channels, height, width)
        return latents

    def _noise_shape(self, request: GenerationRequest) -> tuple[int, int, int]:
        """(channels, height, width) of one request's unpacked initial noise, as the pipeline's
        ``prepare_latents`` shapes it. The UNet pipelines scale it by ``init_noise_sigma``
        themselves, also when given latents."""
        factor = int(getattr(self.pipe, "vae_scale_factor", 8))
        if isinstance(self.pipe, FluxPipeline):
            channels = int(self.pipe.transformer.config.in_channels) // 4
            return (
                channels,
                2 * (request.height // (factor * 2)),
                2 * (request.width // (factor * 2)),
            )
        channels = int(self.pipe.unet.config.in_channels)
        return channels, request.height // factor, request.width // factor

    def _noise_dtype(self, text_kwargs: dict[str, Any]) -> torch.dtype:
        """The dtype the pipeline draws its noise in: its prompt embeddings' dtype."""
        if isinstance(self.pipe, FluxPipeline):
            embeds = text_kwargs.get("prompt_embeds")
            return embeds.dtype if embeds is not None else self.pipe.text_encoder_2.dtype
        encoder = getattr(self.pipe, "text_encoder", None)  # StableDiffusionPipeline casts to it
        return encoder.dtype if encoder is not None else next(self.denoiser.parameters()).dtype

    def _call_kwargs(self, request: GenerationRequest) -> dict[str, Any]:
        """Guidance arguments: Flux without guidance embedding uses true CFG with the negative."""
        if isinstance(self.pipe, FluxPipeline):
            kwargs: dict[str, Any] = {"max_sequence_length": self._flux_max_sequence_length()}
            if self.pipe.transformer.config.guidance_embeds:
                kwargs["guidance_scale"] = request.guidance
            else:
                kwargs["true_cfg_scale"] = request.guidance
            return kwargs
        return {"guidance_scale": request.guidance}

    def _flux_max_sequence_length(self) -> int:
        return min(512, int(self.pipe.tokenizer_2.model_max_length))

    def _text_kwargs(
        self, prompts: list[str], negative_prompts: list[str], guidance: float
    ) -> dict[str, Any]:
        """Prompts as text, or as cached embeddings when the text-embedding cache is on."""
        cfg = guidance > 1.0  # guidance 1: the pipeline skips the negative branch
        cacheable = isinstance(self.pipe, FluxPipeline | StableDiffusionPipeline)
        if not (self.config.text_embedding_cache and cacheable):
            kwargs: dict[str, Any] = {"prompt": prompts}
            if cfg:
                kwargs["negative_prompt"] = negative_prompts
            return kwargs
        embeddings = self._embed_many(prompts + (negative_prompts if cfg else []))
        kwargs = self._embedding_kwargs("", embeddings[: len(prompts)])
        if cfg:
            kwargs |= self._embedding_kwargs("negative_", embeddings[len(prompts) :])
        return kwargs

    @staticmethod
    def _embedding_kwargs(prefix: str, embeddings: list[_TextEmbedding]) -> dict[str, Any]:
        kwargs = {f"{prefix}prompt_embeds": torch.cat([e.hidden for e in embeddings])}
        pooled = [e.pooled for e in embeddings if e.pooled is not None]
        if pooled:
            kwargs[f"{prefix}pooled_prompt_embeds"] = torch.cat(pooled)
        return kwargs

    def _embed_many(self, texts: list[str]) -> list[_TextEmbedding]:
        """Each text's embeddings, in order: from the cache where it has them (when
        ``text_embedding_cache`` is on), the rest encoded together in one batched call."""
        use_cache = self.config.text_embedding_cache
        found: dict[str, _TextEmbedding | None] = {}
        for text in texts:
            if text in found:
                continue
            cached = self._text_cache.get(text) if use_cache else None
            if cached is not None:
                self._text_cache.move_to_end(text)
            found[text] = cached
        misses = [text for text, e in found.items() if e is None]
        if misses:
            for text, embedding in zip(misses, self._encode(misses), strict=True):
                found[text] = embedding
                if use_cache:
                    self._remember(text, embedding)
        if use_cache:
            self.text_cache_misses += len(misses)
            self.text_cache_hits += len(texts) - len(misses)
        return [found[text] for text in texts]  # type: ignore[misc]

    def _encode(self, texts: list[str]) -> list[_TextEmbedding]:
        """One call to the pipeline's own ``encode_prompt`` for all ``texts``; one embedding
        (batch dimension 1) per text."""
        device = self.pipe._execution_device
        with torch.no_grad():
            if isinstance(self.pipe, FluxPipeline):
                hidden, pooled, _ = self.pipe.encode_prompt(
                    prompt=texts,
                    prompt_2=None,
                    device=device,
                    num_images_per_prompt=1,
                    max_sequence_length=self._flux_max_sequence_length(),
                )
                return [
                    _TextEmbedding(hidden[i : i + 1].clone(), pooled[i : i + 1].clone())
                    for i in range(len(texts))
                ]
            hidden, _ = self.pipe.encode_prompt(texts, device, 1, False)
            return [_TextEmbedding(hidden[i : i + 1].clone()) for i in range(len(texts))]

    def _remember(self, text: str, embedding: _TextEmbedding) -> None:
        """Keep ``embedding``, dropping the least recently used past the cache's limits."""
        self._text_cache[text] = embedding
        self._text_cache_bytes += embedding.nbytes
        while len(self._text_cache) > 1 and (
            len(self._text_cache) > TEXT_CACHE_SIZE or self._text_cache_bytes > TEXT_CACHE_BYTES
        ):
            _, dropped = self._text_cache.popitem(last=False)
            self._text_cache_bytes -= dropped.nbytes
