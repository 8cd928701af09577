"""The runner's own denoising loop for Flux pipelines: batched CFG, layouts, guidance truncation.

The stock ``FluxPipeline.__call__`` calls the transformer twice per step under true
classifier-free guidance (once for the prompts, once for the negatives). This loop calls it
once, on one batch whose rows are, in this order (a contract others build on):

    [conditional rows: one per request, or one per region of a layout request, request-major;
     unconditional rows: one per request]

and once ``cfg_truncation`` ends the guided steps, the trailing unconditional rows are
dropped: each later step predicts from the prompts alone. While a layout's regions are
blended (the first ``layout_split`` of its steps) they all hold the request's one latent,
and its negative prompt is the same for every region, so one unconditional row per request
serves all its regions. Once the regions go apart (``DenoiseBatch.split``) each region holds
its own latent and the unconditional rows are one per region, in the same order:

    [conditional rows: one per region, request-major; unconditional rows: one per region]

Per step (``FluxDenoiseLoop.run``)::

    velocity = loop.predict(batch, step)            # one transformer call
    batch.latents = scheduler.step(velocity, ...)   # flow-matching Euler (or DPM-Solver++(2M))
    batch = on_step(step, batch) or batch           # e.g. preview x0, drop requests

The state is one ``DenoiseBatch`` (one latent row per request, request ids kept through
``select``), so a caller can drop requests mid-denoise and still map the survivors back.
Everything else (noise, timesteps, Euler step, decoding) is the pipeline's own code, which is
why the images match the stock pipeline's to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from diffusers import FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

from engine.config import SOLVERS

CACHE_CONTEXT = "denoise"
"""Name of the ``cache_context`` every transformer call of the loop runs in (diffusers'
``CacheMixin`` hooks key their state by it)."""


def keeps_leading_rows(transformer: torch.nn.Module) -> bool:
    """Whether the transformer's step cache follows a batch that loses its trailing rows
    (``step_cache="agentloop"`` does; diffusers' caches need a reset)."""
    from engine.step_cache import has_row_cache

    return has_row_cache(transformer)


def guided_steps(steps: int, guidance: float, cfg_truncation: float) -> int:
    """How many leading steps run classifier-free guidance: ``ceil(cfg_truncation * steps)``,
    or none at guidance <= 1 (the unconditional branch would not change the prediction)."""
    if guidance <= 1.0:
        return 0
    return min(steps, math.ceil(cfg_truncation * steps - 1e-9))


@dataclass
class DenoiseBatch:
    """One batch of requests in the loop: their latents and the rows the transformer sees.

    ``latents`` holds one packed latent per request, (B, tokens, channels). ``cond_*`` hold
    one text row per region (B * regions rows, request-major); ``uncond_*`` one per request
    (None without guidance). ``weights`` (B, regions, tokens, 1) blend a layout's regions;
    None when every request is one region. ``ids`` name the requests (positions in the batch
    the runner built), so they can be followed through ``select``.
    """

    latents: torch.Tensor
    cond_hidden: torch.Tensor
    cond_pooled: torch.Tensor
    uncond_hidden: torch.Tensor | None
    uncond_pooled: torch.Tensor | None
    text_ids: torch.Tensor
    image_ids: torch.Tensor
    guidance: float
    weights: torch.Tensor | None = None
    ids: tuple[int, ...] = ()
    history: torch.Tensor | None = None
    """The previous step's clean-latent estimate per request (per region once split), for a
    multistep solver (None before the first step, or for the Euler solver)."""
    region_latents: torch.Tensor | None = None
    """Each region's own latents, (B * regions, tokens, channels), request-major, once a
    layout's regions denoise apart (``split``); ``latents`` is then their blend."""

    def __post_init__(self) -> None:
        if not self.ids:
            self.ids = tuple(range(self.latents.shape[0]))
        n, rows = len(self.ids), self.cond_hidden.shape[0]
        if self.latents.shape[0] != n or rows != n * self.regions:
            raise ValueError(
                f"{n} requests, {self.latents.shape[0]} latents and {rows} conditional rows "
                f"do not fit {self.regions} region(s) per request"
            )
        if self.uncond_hidden is not None and self.uncond_hidden.shape[0] != n:
            raise ValueError(f"{self.uncond_hidden.shape[0]} unconditional rows for {n} requests")
        if self.region_latents is not None and self.region_latents.shape[0] != rows:
            raise ValueError(f"{self.region_latents.shape[0]} region latents for {rows} regions")

    @property
    def regions(self) -> int:
        """Conditional rows per request (1, or a layout's region count)."""
        return 1 if self.weights is None else int(self.weights.shape[1])

    @property
    def size(self) -> int:
        """Requests in the batch."""
        return int(self.latents.shape[0])

    @property
    def is_split(self) -> bool:
        """Whether each region of the batch's layouts holds its own latent."""
        return self.region_latents is not None

    def split(self) -> DenoiseBatch:
        """The batch with each region holding a copy of its request's latent (and history),
        to denoise on its own from here; ``blend`` joins them again."""
        if self.weights is None:
            raise ValueError("only a batch of layouts has regions to split")
        k = self.regions
        history = None if self.history is None else self.history.repeat_interleave(k, dim=0)
        return replace(self, region_latents=self.latents.repeat_interleave(k, dim=0), history=history)

    def blend(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-region rows, (B * regions, ...), joined into one row per request by the
        layout's weights."""
        assert self.weights is not None
        per_request = rows.reshape(self.size, self.regions, *rows.shape[1:])
        return (per_request * self.weights.to(rows.dtype)).sum(dim=1)

    def select(self, keep: Sequence[int]) -> DenoiseBatch:
        """The batch reduced to the requests at positions ``keep`` (in that order)."""
        index = torch.as_tensor(list(keep), dtype=torch.long, device=self.latents.device)
        rows = index[:, None] * self.regions + torch.arange(self.regions, device=index.device)
        rows = rows.flatten()

        def pick(t: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, idx.to(t.device))

        return replace(
            self,
            latents=self.latents.index_select(0, index),
            cond_hidden=self.cond_hidden.index_select(0, rows.to(self.cond_hidden.device)),
            cond_pooled=self.cond_pooled.index_select(0, rows.to(self.cond_pooled.device)),
            uncond_hidden=pick(self.uncond_hidden, index),
            uncond_pooled=pick(self.uncond_pooled, index),
            weights=pick(self.weights, index),
            ids=tuple(self.ids[i] for i in keep),
            history=pick(self.history, rows if self.is_split else index),
            region_latents=pick(self.region_latents, rows),
        )


@dataclass
class DenoiseStep:
    """Where the loop is: filled in before the step's prediction, completed after it."""

    index: int
    steps: int
    timestep: torch.Tensor
    sigma: float
    sigma_next: float
    guided: bool
    """Whether this step runs the unconditional rows (classifier-free guidance)."""
    x_t: torch.Tensor | None = None
    """The latents the step started from, (B, tokens, channels)."""
    velocity: torch.Tensor | None = None
    """The step's (guided) flow-matching prediction, one row per request."""

    def x0(self) -> torch.Tensor:
        """The clean latents this step predicts: x0 = x_t - sigma_t * v (flow matching)."""
        if self.x_t is None or self.velocity is None:
            raise RuntimeError("x0 is known only after the step's prediction")
        return preview_x0(self.x_t, self.velocity, self.sigma)


def dpm_solver_2m(
    x: torch.Tensor,
    x0: torch.Tensor,
    prev_x0: torch.Tensor | None,
    sigma_prev: float | None,
    sigma: float,
    sigma_next: float,
) -> torch.Tensor:
    """One DPM-Solver++(2M) step of a flow-matching model (x_t = (1 - s) x0 + s noise, so
    alpha = 1 - sigma and lambda = log(alpha / sigma)), computed in float32.

    The first-order step ``x' = (s'/s) x + (a' - a s'/s) x0`` is exactly the Euler step of the
    velocity; with the previous step's estimate the data prediction is extrapolated,
    ``D = x0 + (x0 - prev_x0) / (2 r)`` with ``r = h_prev / h`` the ratio of log-SNR steps.
    The last step (sigma' = 0) and a step from sigma = 1 (log-SNR -inf) stay first order,
    as diffusers' ``DPMSolverMultistepScheduler`` does with ``lower_order_final``."""
    if sigma_next <= 0.0:
        return x0
    d = x0.float()
    if prev_x0 is not None and sigma_prev is not None and sigma_prev < 1.0 and sigma < 1.0:

        def lam(s: float) -> float:
            return math.log((1.0 - s) / s)

        h, h_prev = lam(sigma_next) - lam(sigma), lam(sigma) - lam(sigma_prev)
        d = d + (d - prev_x0.float()) * (h / (2.0 * h_prev))
    alpha, alpha_next = 1.0 - sigma, 1.0 - sigma_next
    out = (sigma_next / sigma) * x.float() + (alpha_next - alpha * sigma_next / sigma) * d
    return out.to(x.dtype)


def split_step(steps: int, layout_split: float) -> int | None:
    """The first step a layout's regions denoise apart, for ``layout_split`` (the fraction of
    the steps blended, rounded up); None when every step is blended."""
    at = math.ceil(steps * layout_split - 1e-9)
    return at if at < steps else None


StepCallback = Callable[[DenoiseStep, DenoiseBatch], "DenoiseBatch | None"]
"""Called after every step; may return a new batch (e.g. ``batch.select(keep)``)."""


def preview_x0(x_t: torch.Tensor, velocity: torch.Tensor, sigma: float) -> torch.Tensor:
    """Flow-matching x0 estimate, computed in float32: x_t = (1 - sigma) x0 + sigma noise and
    v = noise - x0 give x0 = x_t - sigma v."""
    return (x_t.float() - sigma * velocity.float()).to(x_t.dtype)


def decode(pipe: FluxPipeline, latents: torch.Tensor, height: int, width: int) -> list[Any]:
    """Packed Flux latents to PIL images, as the pipeline's own last step does."""
    with torch.no_grad():
        unpacked = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        unpacked = unpacked / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(unpacked.to(pipe.vae.device, pipe.vae.dtype), return_dict=False)[0]
    return list(pipe.image_processor.postprocess(image, output_type="pil"))


def decode_x0(pipe: FluxPipeline, step: DenoiseStep, height: int, width: int) -> list[Any]:
    """PIL previews of what the step predicts the finished images to be."""
    return decode(pipe, step.x0(), height, width)


class FluxDenoiseLoop:
    """Denoises ``DenoiseBatch``es on one FluxPipeline's transformer and scheduler."""

    def __init__(
        self, pipe: FluxPipeline, cfg_truncation: float = 1.0, solver: str = "euler",
        layout_split: float = 0.5,
    ) -> None:
        if not isinstance(pipe, FluxPipeline):
            raise TypeError(f"the own denoising loop runs FluxPipelines, not {type(pipe).__name__}")
        if not (math.isfinite(cfg_truncation) and 0.0 <= cfg_truncation <= 1.0):
            raise ValueError(f"cfg_truncation {cfg_truncation!r} is not a number in [0, 1]")
        if solver not in SOLVERS:
            raise ValueError(f"solver {solver!r} is not one of {', '.join(SOLVERS)}")
        if not (math.isfinite(layout_split) and 0.0 <= layout_split <= 1.0):
            raise ValueError(f"layout_split {layout_split!r} is not a number in [0, 1]")
        self.pipe = pipe
        self.layout_split = layout_split
        self.cfg_truncation = cfg_truncation
        self.solver = solver

    @property
    def transformer(self) -> Any:
        """The pipeline's FluxTransformer2DModel (with whatever hooks are registered on it)."""
        return self.pipe.transformer

    def image_ids(self, height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
        """Positions of the packed latent tokens of a ``height`` x ``width`` image."""
        factor = self.pipe.vae_scale_factor * 2
        return FluxPipeline._prepare_latent_image_ids(
            1, height // factor, width // factor, self.pipe._execution_device, dtype
        )

    def schedule(self, steps: int, tokens: int) -> tuple[Any, torch.Tensor]:
        """A fresh copy of the pipeline's scheduler, set for ``steps``, and its timesteps,
        exactly as ``FluxPipeline.__call__`` sets them (sigmas linear from 1 to 1/steps,
        resolution shift ``mu`` where the scheduler shifts dynamically)."""
        scheduler = type(self.pipe.scheduler).from_config(self.pipe.scheduler.config)
        config = scheduler.config
        sigmas: list[float] | None = np.linspace(1.0, 1 / steps, steps).tolist()
        if getattr(config, "use_flow_sigmas", False):
            sigmas = None
        mu = calculate_shift(
            tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        timesteps, _ = retrieve_timesteps(
            scheduler, steps, self.pipe._execution_device, sigmas=sigmas, mu=mu
        )
        scheduler.set_begin_index(0)
        return scheduler, timesteps

    def predict(self, batch: DenoiseBatch, step: DenoiseStep) -> torch.Tensor:
        """The step's flow-matching velocity per request (per region once the batch is
        split): one transformer call on the conditional rows and, on a guided step, the
        unconditional rows after them."""
        latents, k = batch.latents, batch.regions
        if batch.region_latents is not None:
            return self._predict_regions(batch, step)
        x = latents.repeat_interleave(k, dim=0) if k > 1 else latents
        hidden, pooled = batch.cond_hidden, batch.cond_pooled
        if step.guided:
            assert batch.uncond_hidden is not None and batch.uncond_pooled is not None
            x = torch.cat([x, latents])
            hidden = torch.cat([hidden, batch.uncond_hidden])
            pooled = torch.cat([pooled, batch.uncond_pooled])
        out = self._call(batch, step, x, hidden, pooled)
        n = batch.size
        cond = batch.blend(out[: n * k]) if k > 1 else out[: n * k]
        if not step.guided:
            return cond
        uncond = out[n * k :]
        return uncond + batch.guidance * (cond - uncond)

    def _predict_regions(self, batch: DenoiseBatch, step: DenoiseStep) -> torch.Tensor:
        """A split batch's velocity per region: every region on its own latent, guided
        against the negative prompt on that same latent."""
        assert batch.region_latents is not None
        x, k = batch.region_latents, batch.regions
        hidden, pooled = batch.cond_hidden, batch.cond_pooled
        if step.guided:
            assert batch.uncond_hidden is not None and batch.uncond_pooled is not None
            x = torch.cat([x, x])
            hidden = torch.cat([hidden, batch.uncond_hidden.repeat_interleave(k, dim=0)])
            pooled = torch.cat([pooled, batch.uncond_pooled.repeat_interleave(k, dim=0)])
        out = self._call(batch, step, x, hidden, pooled)
        rows = batch.region_latents.shape[0]
        if not step.guided:
            return out
        cond, uncond = out[:rows], out[rows:]
        return uncond + batch.guidance * (cond - uncond)

    def _call(
        self, batch: DenoiseBatch, step: DenoiseStep, x: torch.Tensor, hidden: torch.Tensor,
        pooled: torch.Tensor,
    ) -> torch.Tensor:
        """One transformer call on the rows ``x`` with their text rows."""
        rows = x.shape[0]
        timestep = step.timestep.expand(rows).to(x.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:  # guidance-distilled: guidance is an input
            guidance = torch.full([rows], batch.guidance, device=x.device, dtype=torch.float32)
        with self._cache_context(step):
            out = self.transformer(
                hidden_states=x,
                timestep=timestep / 1000,
                guidance=guidance,
                pooled_projections=pooled,
                encoder_hidden_states=hidden,
                txt_ids=batch.text_ids,
                img_ids=batch.image_ids,
                joint_attention_kwargs={},
                return_dict=False,
            )[0]
        return out

    def _cache_context(self, step: DenoiseStep) -> Any:
        context = getattr(self.transformer, "cache_context", None)
        if context is None:
            from contextlib import nullcontext

            return nullcontext()
        return context(
            CACHE_CONTEXT, step_index=step.index, num_inference_steps=step.steps,
            timestep=step.timestep, sigma=step.sigma,
        )  # fmt: skip

    def guided_steps(self, steps: int, guidance: float) -> int:
        """Leading steps that run the unconditional rows (none for a guidance-distilled
        model, whose guidance embedding replaces classifier-free guidance)."""
        if self.transformer.config.guidance_embeds:
            return 0
        return guided_steps(steps, guidance, self.cfg_truncation)

    def reset_cache(self) -> None:
        """Clear the transformer's stateful hooks (caches): a new batch, or new rows."""
        reset = getattr(self.transformer, "_reset_stateful_cache", None)
        if reset is not None:
            reset()

    @torch.no_grad()
    def run(
        self, batch: DenoiseBatch, steps: int, on_step: StepCallback | None = None
    ) -> DenoiseBatch:
        """Denoise ``batch`` for ``steps`` steps; returns it (or what ``on_step`` made of it)
        holding the final latents."""
        self.reset_cache()
        scheduler, timesteps = self.schedule(steps, batch.latents.shape[1])
        guided = self.guided_steps(steps, batch.guidance)
        if guided and batch.uncond_hidden is None:
            raise ValueError("guidance above 1 needs unconditional text rows")
        sigmas = [float(s) for s in scheduler.sigmas]
        split_at = split_step(steps, self.layout_split) if batch.weights is not None else None
        for i, t in enumerate(timesteps):
            if i == guided and i > 0 and not keeps_leading_rows(self.transformer):
                self.reset_cache()  # the unconditional rows go: cached states no longer fit
            if i == split_at and not batch.is_split:
                batch = batch.split()
                self.reset_cache()  # a row per region from here: cached states no longer fit
            step = DenoiseStep(i, steps, t, sigmas[i], sigmas[i + 1], guided=i < guided)
            x = batch.latents if batch.region_latents is None else batch.region_latents
            velocity = self.predict(batch, step)
            if self.solver == "euler":
                stepped = scheduler.step(velocity, t, x, return_dict=False)[0]
            else:
                x0 = preview_x0(x, velocity, step.sigma)
                stepped = dpm_solver_2m(
                    x, x0, batch.history, sigmas[i - 1] if i else None, step.sigma, step.sigma_next,
                )  # fmt: skip
                batch.history = x0
            if batch.region_latents is None:
                step.x_t, step.velocity, batch.latents = x, velocity, stepped
            else:  # the step as one row per request sees it: the regions' blend (all linear)
                step.x_t, step.velocity = batch.blend(x), batch.blend(velocity)
                batch.region_latents, batch.latents = stepped, batch.blend(stepped)
            if on_step is not None:
                changed = on_step(step, batch)
                if changed is not None:
                    if changed.size != batch.size:
                        self.reset_cache()
                    batch = changed
        return batch
