"""The batched runner: turns GenerationRequests into GenerationResults on one warm pipeline.

Requests that share a ``batch_key()`` run together, up to ``EngineConfig.max_batch`` at a time.
Each request gets its own ``torch.Generator`` seeded with its seed (drawn on the CPU), so an
image depends only on its own request, never on its batch neighbours or on the device.

A request with a variation (``variation_seed`` and a ``variation_strength`` above 0) starts
from a blend of its seed's noise and the variation seed's noise. A batch holding one is given
its initial noise built here, drawn exactly as the pipeline would draw it, so the plain
requests of that batch get the very images they get without it.

A request with ``regions`` (a layout) runs as one pipeline row per region, every row from the
request's own noise; after each step the rows are blended by ``engine.regions`` weights, so
each region's prompt draws the area nearest its anchor. Layouts run on Flux pipelines, whose
flow-matching Euler step is linear in the model output (so blending after the step is
blending the predictions).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline, FluxPipeline, StableDiffusionPipeline

from engine.config import EngineConfig
from engine.edits import Editor, edit_problems
from engine.loading import load_pipeline
from engine.regions import region_weights
from engine.types import GenerationRequest, GenerationResult

TEXT_CACHE_SIZE = 4096
"""Most texts whose embeddings the runner keeps (least recently used are dropped)."""

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


class Runner:
    """One model kept warm; generates batches of requests for it."""

    def __init__(
        self, model: str, config: EngineConfig = EngineConfig(), extra_models: Iterable[str] = ()
    ) -> None:
        """Load ``model`` (a catalog name) and install the kernels the config asks for."""
        self.model = model
        self.config = config
        start = time.perf_counter()
        self.pipe: DiffusionPipeline = load_pipeline(model, config, extra_models)
        self.load_seconds = time.perf_counter() - start
        self._unbilled_load = self.load_seconds
        self._text_cache: OrderedDict[str, _TextEmbedding] = OrderedDict()
        self.text_cache_hits = 0
        self.text_cache_misses = 0
        self.installed_kernels: dict[str, int] = {}
        """What ``kernels.install`` patched, by kind (empty when no kernel switch is on)."""
        self._install_kernels()
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

    def _install_kernels(self) -> None:
        c = self.config
        if not (c.fused_adaln or c.fused_activations or c.int8_attention):
            return
        import kernels  # lazily: only an optimized config needs it

        install = getattr(kernels, "install", None)
        if install is None:
            raise RuntimeError("EngineConfig asks for fused kernels but kernels.install is missing")
        counts = install(
            self.denoiser,
            fused_adaln=c.fused_adaln,
            fused_activations=c.fused_activations,
            int8_attention=c.int8_attention,
        )
        self.installed_kernels = dict(counts or {})

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
        return problems

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate one image per request; results come back in request order."""
        for request in requests:
            self.validate(request)
        results: list[GenerationResult | None] = [None] * len(requests)
        load_share = self._unbilled_load / max(len(requests), 1)
        self._unbilled_load = 0.0 if requests else self._unbilled_load
        for batch in self._batches(requests):
            for i, result in zip(batch, self._run_batch([requests[i] for i in batch]), strict=True):
                result.timings["load_s"] = load_share
                results[i] = result
        return [r for r in results if r is not None]

    def _batches(self, requests: Sequence[GenerationRequest]) -> list[list[int]]:
        """Indices grouped by batch key (first-seen order), cut to at most max_batch pipeline
        rows (a layout takes one row per region)."""
        rows = max(self.config.max_batch, 1) if self.config.batching else 1
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(request.batch_key(), []).append(i)
        out = []
        for idx in groups.values():
            size = max(1, rows // requests[idx[0]].denoiser_passes)
            out += [idx[s : s + size] for s in range(0, len(idx), size)]
        return out

    def _run_batch(self, batch: list[GenerationRequest]) -> list[GenerationResult]:
        """One pipeline call for requests that share a batch key."""
        first = batch[0]
        if first.kind != "text":
            return self.editor.run_batch(batch)
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
        return [
            GenerationResult(r, img, dict(timings)) for r, img in zip(batch, images, strict=True)
        ]

    def _run_layout_batch(self, batch: list[GenerationRequest]) -> list[GenerationResult]:
        """One pipeline call for layouts of as many regions: one row per region, blended after
        every step, and one decode per request."""
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
        _, height, width = self._noise_shape(first)
        rows, cols = height // 2, width // 2  # Flux packs 2x2 latent patches into one token
        weights = torch.stack([region_weights(r.regions, rows, cols) for r in batch])
        weights = weights.reshape(len(batch), k, rows * cols, 1).to(noise.device, noise.dtype)

        def blend(_pipe: Any, _i: int, _t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            latents = tensors["latents"]
            per_request = latents.reshape(len(batch), k, *latents.shape[1:])
            mixed = (per_request * weights.to(latents.dtype)).sum(dim=1)
            return {"latents": mixed.repeat_interleave(k, dim=0)}

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
        images = self._decode_flux(latents, first.height, first.width)
        denoise_s = time.perf_counter() - start
        n = len(batch)
        timings = {
            "encode_s": encode_s / n, "denoise_s": denoise_s / n, "batch_size": float(n),
            "regions": float(k),
        }
        return [
            GenerationResult(r, img, dict(timings)) for r, img in zip(batch, images, strict=True)
        ]

    def _decode_flux(self, latents: torch.Tensor, height: int, width: int) -> list[Any]:
        """Packed Flux latents to PIL images, as the pipeline's own last step does."""
        pipe = self.pipe
        with torch.no_grad():
            unpacked = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
            unpacked = unpacked / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
            image = pipe.vae.decode(unpacked.to(pipe.vae.device, pipe.vae.dtype), return_dict=False)[0]
        return list(pipe.image_processor.postprocess(image, output_type="pil"))

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
        positive = [self._embed(p) for p in prompts]
        kwargs = self._embedding_kwargs("", positive)
        if cfg:
            negative = [self._embed(p) for p in negative_prompts]
            kwargs |= self._embedding_kwargs("negative_", negative)
        return kwargs

    @staticmethod
    def _embedding_kwargs(prefix: str, embeddings: list[_TextEmbedding]) -> dict[str, Any]:
        kwargs = {f"{prefix}prompt_embeds": torch.cat([e.hidden for e in embeddings])}
        pooled = [e.pooled for e in embeddings if e.pooled is not None]
        if pooled:
            kwargs[f"{prefix}pooled_prompt_embeds"] = torch.cat(pooled)
        return kwargs

    def _embed(self, text: str) -> _TextEmbedding:
        """One text's embeddings, from the cache or the pipeline's own ``encode_prompt``."""
        cached = self._text_cache.get(text)
        if cached is not None:
            self._text_cache.move_to_end(text)
            self.text_cache_hits += 1
            return cached
        self.text_cache_misses += 1
        device = self.pipe._execution_device
        with torch.no_grad():
            if isinstance(self.pipe, FluxPipeline):
                hidden, pooled, _ = self.pipe.encode_prompt(
                    prompt=text,
                    prompt_2=None,
                    device=device,
                    num_images_per_prompt=1,
                    max_sequence_length=self._flux_max_sequence_length(),
                )
                embedding = _TextEmbedding(hidden, pooled)
            else:
                hidden, _ = self.pipe.encode_prompt(text, device, 1, False)
                embedding = _TextEmbedding(hidden)
        self._text_cache[text] = embedding
        if len(self._text_cache) > TEXT_CACHE_SIZE:
            self._text_cache.popitem(last=False)
        return embedding
