"""A runner and a scorer that do no work, reserved for `bench/queue.py`.

With `AGENTLOOP_ENGINE_NOOP=1` the workers hand out these instead of the real models, so a
benchmark of the queue (API, broker, store, orchestrator, workers) measures the queue and
not the denoiser. `NoopRunner` returns a flat image per request; `NoopScorer` returns a score
derived from a hash of the text and the image's colour. Both are deterministic (same request,
same image, same score) and import neither torch nor diffusers. Never for real goals.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from PIL import Image

from engine.types import (
    GenerationRequest,
    GenerationResult,
    ScoreRequest,
    ScoreResult,
)

NOOP_SIZE_MULTIPLE = 8
"""Width and height must be positive multiples of this, as for the smallest real models."""


def _unit(*parts: object) -> float:
    """A stable number in [0, 1) from a hash of ``parts`` (same in every process)."""
    digest = hashlib.blake2b(repr(parts).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class NoopRunner:
    """Serves one model name without loading it: a flat image per request, in request order."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.load_seconds = 0.0
        self.engine_report: dict[str, object] = {"engine": "noop"}
        """What a real Runner applied (dtype, attention backend, ...); here: nothing."""

    def validate(self, request: GenerationRequest) -> None:
        """Raise ValueError for what no real runner would serve either (so refusals still flow)."""
        problems = request.problems(self.model, NOOP_SIZE_MULTIPLE)
        if problems:
            raise ValueError(f"invalid request {request.prompt!r}: " + "; ".join(problems))

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """One flat image per request, its colour a hash of prompt and seed."""
        for request in requests:
            self.validate(request)
        start = time.perf_counter()
        images = [
            Image.new("RGB", (r.width, r.height), _colour(r.prompt, r.seed)) for r in requests
        ]
        per_image = (time.perf_counter() - start) / max(len(requests), 1)
        timings = {
            "encode_s": 0.0,
            "denoise_s": per_image,
            "batch_size": float(len(requests)),
            "load_s": 0.0,
        }
        return [
            GenerationResult(r, img, dict(timings), skipped={"engine": "noop"})
            for r, img in zip(requests, images, strict=True)
        ]


def _colour(prompt: str, seed: int) -> tuple[int, int, int]:
    value = int(_unit(prompt, seed) * 2**24)
    return (value >> 16) & 0xFF, (value >> 8) & 0xFF, value & 0xFF


class NoopScorer:
    """Judges without a model: a stable score in [0, 2.5] from the text and the image's colour."""

    def __init__(self, name: str) -> None:
        self.name = name

    def score(
        self, images: Sequence[Image.Image], requests: Sequence[ScoreRequest]
    ) -> list[ScoreResult]:
        """Score ``images[i]`` against ``requests[i]``: its text, and each of its parts."""
        if len(images) != len(requests):
            raise ValueError(f"{len(images)} images but {len(requests)} score requests")
        results = []
        for image, request in zip(images, requests, strict=True):
            colour = image.getpixel((0, 0))
            parts = {p: 2.5 * _unit(p, colour) for p in request.parts}
            results.append(ScoreResult(2.5 * _unit(request.text, colour), parts))
        return results
