"""Plain request/result dataclasses: the only things the orchestrator and the engine share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

MAX_REGIONS = 8
"""Most regions one request may lay out (each costs one denoiser pass per step)."""

MAX_REGION_SCALE = 4.0
"""Largest region scale (how far a region reaches, relative to 1)."""


@dataclass(frozen=True)
class Region:
    """One part of a layout: ``prompt`` rules the area of the image nearest its anchor.

    The anchor (``x``, ``y``) is in [0, 1], from the top-left corner: (0.25, 0.5) is the middle
    of the left half. ``scale`` is how far the region reaches: distances from its anchor count
    1/scale as much (a large object's region 1.2, a small one's 0.85; 1 by default).
    """

    prompt: str
    x: float
    y: float
    scale: float = 1.0


@dataclass(frozen=True)
class GenerationRequest:
    """One image to generate. Same request (and same model and config), same image."""

    prompt: str
    seed: int
    negative_prompt: str = ""
    width: int = 32
    height: int = 32
    steps: int = 20
    guidance: float = 1.0
    model: str = "tiny-dit"
    variation_seed: int | None = None
    """Seed of a second noise to blend into this request's initial noise (None: no variation)."""
    variation_strength: float = 0.0
    """How far the initial noise moves from ``seed``'s noise toward ``variation_seed``'s, in
    [0, 1] along a spherical interpolation: 0 is ``seed``'s noise, 1 is ``variation_seed``'s."""
    regions: tuple[Region, ...] = ()
    """A layout: each region's prompt rules the area nearest its anchor (regional prompting).
    Empty: ``prompt`` rules the whole image. With regions, ``prompt`` names the whole image
    (what it is scored against) and is not itself generated from; each denoising step costs
    one denoiser pass per region."""
    prune_group: str | None = None
    """Names a prune group: the requests that carry it run together for ``prune_at_step``
    steps, each one's predicted clean image (x0) is scored by the caller's preview scorer,
    and only the ``prune_keep`` best finish; the others come back pruned with their preview.
    None: the request always finishes. Pruning never changes a kept request's image."""
    prune_keep: int = 0
    """How many of the group finish (every member gives the same value)."""
    prune_at_step: int = 0
    """After how many denoising steps the group is previewed and cut, in [1, steps)."""
    init_image: Image.Image | None = None
    """Image-to-image: the image to start from (converted to RGB, resized to width x height).
    None: text-to-image. With ``mask`` or ``repair_region``, a repair of that area."""
    strength: float = 1.0
    """With ``init_image``: the share of the schedule run again, in (0, 1]. 1 starts the
    edited area from pure noise; lower keeps more of the init image (img2img's strength)."""
    mask: Image.Image | None = None
    """A repair: white where the image is drawn again, black where ``init_image`` is kept
    (grayscale, resized to width x height, read at 0.5). Needs ``init_image``."""
    repair_region: int | None = None
    """A layout repair: draw the area of ``regions[repair_region]`` again from its prompt and
    keep the rest of ``init_image``. Needs ``init_image`` and ``regions``; costs one denoiser
    pass per step, not one per region."""

    @property
    def has_variation(self) -> bool:
        """Whether this request's initial noise differs from the plain noise of its seed."""
        return self.variation_seed is not None and self.variation_strength > 0

    @property
    def kind(self) -> str:
        """"text" (text-to-image), "image" (image-to-image) or "repair" (one area redrawn)."""
        if self.init_image is None:
            return "text"
        return "repair" if self.mask is not None or self.repair_region is not None else "image"

    @property
    def denoiser_passes(self) -> int:
        """Denoiser passes per step (per guidance branch): one, or one per region for a
        text-to-image layout."""
        return max(1, len(self.regions)) if self.kind == "text" else 1

    def problems(self, model: str, size_multiple: int) -> list[str]:
        """What makes this request unservable by any runner of `model` whose image sides
        must be multiples of `size_multiple` (a runner adds what its pipeline cannot do)."""
        problems = []
        if self.model != model:
            problems.append(f"model {self.model!r} but this runner serves {model!r}")
        for side in ("width", "height"):
            value = getattr(self, side)
            if value < size_multiple or value % size_multiple:
                problems.append(f"{side} {value} is not a positive multiple of {size_multiple}")
        if self.steps < 1:
            problems.append(f"steps {self.steps} < 1")
        if not (0 <= self.seed < 2**64):
            problems.append(f"seed {self.seed} outside [0, 2**64)")
        if not math.isfinite(self.guidance) or self.guidance < 0:
            problems.append(f"guidance {self.guidance} is not a finite number >= 0")
        strength = self.variation_strength
        if not (math.isfinite(strength) and 0 <= strength <= 1):
            problems.append(f"variation_strength {strength} is not a finite number in [0, 1]")
        if self.variation_seed is not None and not (0 <= self.variation_seed < 2**64):
            problems.append(f"variation_seed {self.variation_seed} outside [0, 2**64)")
        if len(self.regions) > MAX_REGIONS:
            problems.append(f"{len(self.regions)} regions; at most {MAX_REGIONS}")
        if self.prune_group is not None:
            if self.prune_keep < 1:
                problems.append(f"prune_keep {self.prune_keep} < 1")
            if not 1 <= self.prune_at_step < self.steps:
                problems.append(f"prune_at_step {self.prune_at_step} not in [1, steps {self.steps})")
            if self.init_image is not None:
                problems.append("pruning applies to text-to-image only")
        return problems + self._edit_problems()

    @property
    def prune_key(self) -> tuple[str, int, int] | None:
        """(group, keep, step) for a request of a prune group; None for one that always
        finishes."""
        if self.prune_group is None:
            return None
        return (self.prune_group, self.prune_keep, self.prune_at_step)

    def _edit_problems(self) -> list[str]:
        """What is wrong with this request's image-to-image or repair fields."""
        problems = []
        if not (isinstance(self.strength, int | float) and math.isfinite(self.strength)
                and 0 < self.strength <= 1):
            problems.append(f"strength {self.strength!r} is not a number in (0, 1]")
        if self.init_image is None:
            if self.strength != 1.0:
                problems.append("strength needs an init_image")
            if self.mask is not None or self.repair_region is not None:
                problems.append("a repair (mask or repair_region) needs an init_image")
            return problems
        if not isinstance(self.init_image, Image.Image):
            problems.append(f"init_image is a {type(self.init_image).__name__}, not a PIL image")
        if self.mask is not None and not isinstance(self.mask, Image.Image):
            problems.append(f"mask is a {type(self.mask).__name__}, not a PIL image")
        if self.mask is not None and self.repair_region is not None:
            problems.append("give a mask or a repair_region, not both")
        if self.repair_region is not None and not (
            isinstance(self.repair_region, int) and 0 <= self.repair_region < len(self.regions)
        ):
            problems.append(
                f"repair_region {self.repair_region!r} is not a region index (regions: "
                f"{len(self.regions)})"
            )
        if self.regions and self.repair_region is None:
            problems.append("a layout with an init_image needs a repair_region")
        if self.has_variation:
            problems.append("noise variations apply to text-to-image only")
        return problems

    def batch_key(self) -> tuple[int, int, int, float, str, int, str, float]:
        """Requests with equal keys can run as one batch (variations batch with plain requests;
        layouts batch with layouts of as many regions; image-to-image and repairs batch with
        their own kind at the same strength)."""
        passes = len(self.regions) if self.kind == "text" else 0
        return (self.width, self.height, self.steps, self.guidance, self.model, passes,
                self.kind, float(self.strength))


@dataclass
class GenerationResult:
    """The image for one request, with what it cost and what the engine skipped."""

    request: GenerationRequest
    image: Image.Image
    timings: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, Any] = field(default_factory=dict)
    """What the engine left out, e.g. ``unconditional_steps``; a pruned request has
    ``pruned_at_step`` (the steps it ran) and ``preview_score``, and its ``image`` is its
    preview (the decoded x0 prediction at that step)."""

    @property
    def pruned(self) -> bool:
        """Whether this request was cut from its prune group before finishing."""
        return "pruned_at_step" in self.skipped


@dataclass(frozen=True)
class ScoreRequest:
    """One image to judge against a text, optionally split into parts.

    ``regions``, when given, has one entry per part: where that part should be (its prompt is
    the text judged there), or None to judge the part on the whole image. A part with a region
    is judged on a view of the image that keeps its region and fills the rest with the
    background (`engine.scorer.region_views`)."""

    text: str
    parts: tuple[str, ...] = ()
    regions: tuple[Region | None, ...] = ()

    def __post_init__(self) -> None:
        if self.regions and len(self.regions) != len(self.parts):
            raise ValueError(
                f"{len(self.regions)} part regions for {len(self.parts)} parts; give one per "
                "part (None: the whole image) or none"
            )


@dataclass
class ScoreResult:
    """CLIPScore on the Hessel et al. (2021) scale, 2.5 * max(cos, 0), in [0, 2.5]."""

    clip_score: float
    part_scores: dict[str, float] = field(default_factory=dict)
