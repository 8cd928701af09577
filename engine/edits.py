"""Image-to-image and repairs: requests that start from an image instead of pure noise.

A request with an ``init_image`` runs on diffusers' own image-to-image or inpainting pipeline,
built once from the runner's loaded pipeline (``from_pipe``: the same modules, no copy):

- image-to-image (no mask): the init image is encoded, noised to the schedule's point
  ``strength`` of the way back to pure noise, and denoised from there with the request's
  prompt (``FluxImg2ImgPipeline``, ``StableDiffusionImg2ImgPipeline``);
- repair (``mask``, or ``repair_region`` of a layout): the same, and after every step the
  area outside the mask is replaced by the init image's latents noised to that step
  ("inpainting-style blending at every step", ``FluxInpaintPipeline``,
  ``StableDiffusionInpaintPipeline`` with the model's own 4-channel UNet). The denoiser sees
  the whole image, so the redrawn area fits what is kept. A layout repair redraws region k
  with region k's prompt, its mask the area where ``engine.regions`` gives region k the most
  weight (the area its prompt ruled when the layout was drawn).

A repair then pastes the init image's own pixels back outside the mask (feathered over about
a pixel): the VAE round trip (and the encoder's sampling) would otherwise blur what the
repair promises to keep.

Same request, same image: each request has its own CPU generator, which draws its encoder
sample and its noise, whatever its batch neighbours are.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from diffusers import (
    DiffusionPipeline,
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    FluxPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
)
from diffusers.utils import logging as diffusers_logging
from PIL import Image, ImageFilter

from engine.regions import region_weights
from engine.types import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from engine.runner import Runner

PASTE_FEATHER = 1.0
"""Gaussian radius (pixels) over which a repair's pasted-back border blends into the redrawn
area: a seam of about one pixel, as the region blend of a layout has about one latent cell."""


def edit_problems(pipe: DiffusionPipeline, request: GenerationRequest) -> list[str]:
    """What a runner of ``pipe`` cannot do for this image-to-image or repair request."""
    if request.kind == "text":
        return []
    if not isinstance(pipe, FluxPipeline | StableDiffusionPipeline):
        return [f"image-to-image is supported for FluxPipeline and StableDiffusionPipeline, "
                f"not {type(pipe).__name__}"]
    unet = getattr(pipe, "unet", None)
    if unet is not None and request.kind == "repair" and int(unet.config.in_channels) != 4:
        return [f"repairs need a 4-channel UNet (this one has {unet.config.in_channels})"]
    return []


def repair_mask(request: GenerationRequest, rows: int, cols: int) -> Image.Image:
    """The request's repair area as a grayscale image of its size: its ``mask``, or where
    ``regions[repair_region]`` has the most weight on a ``rows`` x ``cols`` grid (the grid the
    layout was blended on), white where it is drawn again."""
    if request.mask is not None:
        return request.mask.convert("L").resize((request.width, request.height), Image.Resampling.NEAREST)
    assert request.repair_region is not None  # kind "repair" says one of the two is set
    weights = region_weights(request.regions, rows, cols)
    ruled = weights.argmax(dim=0) == request.repair_region
    grid = Image.fromarray(ruled.to(torch.uint8).mul(255).numpy(), mode="L")
    return grid.resize((request.width, request.height), Image.Resampling.NEAREST)


class Editor:
    """Runs a runner's image-to-image and repair batches on pipelines built from its own."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._pipes: dict[str, DiffusionPipeline] = {}

    def pipeline(self, kind: str) -> DiffusionPipeline:
        """The image-to-image ("image") or inpainting ("repair") pipeline, sharing the
        runner's modules (built on first use)."""
        if kind not in self._pipes:
            pipe = self.runner.pipe
            if isinstance(pipe, FluxPipeline):
                cls: Any = FluxInpaintPipeline if kind == "repair" else FluxImg2ImgPipeline
            else:
                cls = StableDiffusionInpaintPipeline if kind == "repair" else StableDiffusionImg2ImgPipeline
            # from_pipe casts the shared modules to its dtype (float32 unless told): keep the
            # runner's, and keep quiet about the cast, which changes nothing then
            dtype = next(self.runner.denoiser.parameters()).dtype
            verbosity = diffusers_logging.get_verbosity()
            diffusers_logging.set_verbosity_error()
            try:
                edit_pipe = cls.from_pipe(pipe, dtype=dtype)
            finally:
                diffusers_logging.set_verbosity(verbosity)
            edit_pipe.set_progress_bar_config(disable=True)
            self._pipes[kind] = edit_pipe
        return self._pipes[kind]

    def run_batch(self, batch: list[GenerationRequest]) -> list[GenerationResult]:
        """One pipeline call for image-to-image or repair requests that share a batch key."""
        runner, first = self.runner, batch[0]
        kind = first.kind
        prompts = [_drawn_prompt(r) for r in batch]
        start = time.perf_counter()
        text_kwargs = runner._text_kwargs(prompts, [r.negative_prompt for r in batch], first.guidance)
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        size = (first.width, first.height)
        inits = [r.init_image.convert("RGB").resize(size, Image.Resampling.BICUBIC)  # type: ignore[union-attr]
                 for r in batch]
        kwargs: dict[str, Any] = runner._call_kwargs(first) | text_kwargs
        masks: list[Image.Image] = []
        if kind == "repair":
            rows, cols = self._blend_grid(first)
            masks = [repair_mask(r, rows, cols) for r in batch]
            kwargs["mask_image"] = masks
        pipe: Any = self.pipeline(kind)
        images = pipe(
            image=inits,
            strength=first.strength,
            height=first.height,
            width=first.width,
            num_inference_steps=first.steps,
            generator=[torch.Generator("cpu").manual_seed(r.seed) for r in batch],
            output_type="pil",
            **kwargs,
        ).images
        if kind == "repair":
            images = [_paste_kept(img, init, mask) for img, init, mask in zip(images, inits, masks, strict=True)]
        denoise_s = time.perf_counter() - start
        n = len(batch)
        timings = {"encode_s": encode_s / n, "denoise_s": denoise_s / n, "batch_size": float(n),
                   "strength": float(first.strength)}
        return [GenerationResult(r, img, dict(timings)) for r, img in zip(batch, images, strict=True)]

    def _blend_grid(self, request: GenerationRequest) -> tuple[int, int]:
        """The grid a layout of this size is blended on: Flux's packed tokens (2x2 latent
        cells), else the latent cells."""
        _, height, width = self.runner._noise_shape(request)
        if isinstance(self.runner.pipe, FluxPipeline):
            return height // 2, width // 2
        return height, width


def _drawn_prompt(request: GenerationRequest) -> str:
    """What the pipeline draws from: the repaired region's prompt, else the request's."""
    if request.repair_region is not None:
        return request.regions[request.repair_region].prompt
    return request.prompt


def _paste_kept(image: Image.Image, init: Image.Image, mask: Image.Image) -> Image.Image:
    """``image`` inside the mask, ``init`` outside it, blended over a feathered border."""
    hard = np.asarray(mask.convert("L"), dtype=np.float32) / 255.0
    soft = np.asarray(mask.convert("L").filter(ImageFilter.GaussianBlur(PASTE_FEATHER)),
                      dtype=np.float32) / 255.0
    # the blur carries the redrawn image a pixel out of the mask; inside it stays redrawn
    weight = np.maximum(hard, soft)[..., None]
    out = weight * np.asarray(image.convert("RGB"), dtype=np.float32) + (1 - weight) * np.asarray(
        init, dtype=np.float32)
    return Image.fromarray(np.clip(out.round(), 0, 255).astype(np.uint8), mode="RGB")
