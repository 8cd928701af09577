"""Plain request/result dataclasses: the only things the orchestrator and the engine share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image


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

    def batch_key(self) -> tuple[int, int, int, float, str]:
        """Requests with equal keys can run as one batch."""
        return (self.width, self.height, self.steps, self.guidance, self.model)


@dataclass
class GenerationResult:
    """The image for one request, with what it cost and what the engine skipped."""

    request: GenerationRequest
    image: Image.Image
    timings: dict[str, float] = field(default_factory=dict)
    skipped: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreRequest:
    """One image to judge against a text, optionally split into parts."""

    text: str
    parts: tuple[str, ...] = ()


@dataclass
class ScoreResult:
    """CLIPScore on the Hessel et al. (2021) scale, 2.5 * max(cos, 0), in [0, 2.5]."""

    clip_score: float
    part_scores: dict[str, float] = field(default_factory=dict)
