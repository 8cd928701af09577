"""The diffusion engine: model loading, the batched runner, and the CLIP scorer.

Never imports Celery, the database or the API. Importing this package stays light: torch,
diffusers and open_clip load only when ``Runner``, ``Scorer`` or ``load_pipeline`` is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.catalog import (
    ModelLoadError,
    ModelSpec,
    ScorerSpec,
    UnknownModelError,
    is_known_model,
    is_known_scorer,
    known_models,
    known_scorers,
    resolve_model,
    resolve_scorer,
)
from engine.config import EngineConfig, ResolvedEngine
from engine.types import GenerationRequest, GenerationResult, ScoreRequest, ScoreResult

if TYPE_CHECKING:
    from engine.loading import load_pipeline
    from engine.runner import Runner
    from engine.scorer import Scorer

_LAZY = {"Runner": "engine.runner", "Scorer": "engine.scorer", "load_pipeline": "engine.loading"}

__all__ = [
    "EngineConfig",
    "GenerationRequest",
    "GenerationResult",
    "ModelLoadError",
    "ModelSpec",
    "ResolvedEngine",
    "Runner",
    "ScoreRequest",
    "ScoreResult",
    "Scorer",
    "ScorerSpec",
    "UnknownModelError",
    "is_known_model",
    "is_known_scorer",
    "known_models",
    "known_scorers",
    "load_pipeline",
    "resolve_model",
    "resolve_scorer",
]


def __getattr__(name: str) -> Any:
    """Import the heavy parts (torch, diffusers, open_clip) on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
