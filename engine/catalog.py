"""Which model and scorer names the engine knows, and where each comes from.

This module is imported by the API to validate names, so it stays light: no torch,
diffusers or open_clip import here, only the standard library.

Models:
  - presets built from config with seeded random weights: ``tiny-unet``, ``tiny-dit``;
  - ``shapes``: the trained shapes world in ``<models dir>/shapes-dit`` (a FluxPipeline folder);
  - a local directory holding ``model_index.json`` (any diffusers pipeline);
  - a Hugging Face Hub id (``org/name``), known only if an operator registered it.

Scorers:
  - ``tiny-clip``: an open_clip model from a tiny registered config, seeded random weights;
  - ``shapes-clip``: the trained open_clip model in ``<models dir>/shapes-clip``;
  - ``shapes-clip-preview``: shapes-clip with its image tower fine-tuned to rank partly
    denoised x0 previews (`engine.shapes.train_clip_preview`): the image tower's weights in
    ``<models dir>/shapes-clip-preview``, laid over shapes-clip's;
  - ``<open_clip model name>:<pretrained tag or weights file>``, e.g. ``ViT-B-32:laion2b_s34b_b79k``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

MODELS_DIR_ENV = "AGENTLOOP_MODELS_DIR"
"""Environment variable that overrides where trained models (``shapes-dit``, ``shapes-clip``) live."""

CACHE_DIR_ENV = "AGENTLOOP_CACHE_DIR"
"""Environment variable that overrides where generated offline files (tokenizers, configs) go."""

PRESET_MODELS = ("tiny-unet", "tiny-dit")
SHAPES_MODEL = "shapes"
TINY_CLIP = "tiny-clip"
SHAPES_CLIP = "shapes-clip"
SHAPES_CLIP_PREVIEW = "shapes-clip-preview"
SHAPES_CLIP_CONFIG = "shapes-clip.json"
SHAPES_CLIP_WEIGHTS = "open_clip_model.safetensors"
SHAPES_CLIP_PREVIEW_WEIGHTS = "visual.safetensors"


class UnknownModelError(ValueError):
    """A model or scorer name that the catalog cannot resolve."""


class ModelLoadError(RuntimeError):
    """A known model or scorer whose files could not be read (missing, no network, bad weights)."""


def preset_seed(name: str) -> int:
    """The weight-init seed of a preset: a stable hash of its name, equal in every process."""
    return zlib.crc32(name.encode("utf-8"))


class ModelSource(StrEnum):
    """Where a model's weights come from."""

    PRESET = "preset"
    """Built from config with random weights seeded from the preset name."""
    LOCAL = "local"
    """A local diffusers pipeline folder (``model_index.json``)."""
    HUB = "hub"
    """A Hugging Face Hub id registered by an operator; needs the network or a warm HF cache."""


@dataclass(frozen=True)
class ModelSpec:
    """How to obtain one generation model."""

    name: str
    """The name callers use."""
    source: ModelSource
    location: str
    """Preset name, folder path or hub id."""
    pipeline_class: str = "DiffusionPipeline"
    """The diffusers class whose ``from_pretrained`` (or preset builder) makes the pipeline."""


@dataclass(frozen=True)
class ScorerSpec:
    """How to obtain one open_clip scorer."""

    name: str
    """The name callers use."""
    model_name: str
    """The open_clip model (config) name."""
    pretrained: str | None
    """An open_clip pretrained tag, a weights file, or None for seeded random weights."""
    config_path: str | None = None
    """A JSON config to register with ``open_clip.add_model_config`` before creating the model."""
    overlay: str | None = None
    """A safetensors file of some of the model's weights, loaded over ``pretrained`` (every
    tensor in it must name one of the model's)."""


def models_dir() -> Path:
    """The folder holding trained models: ``$AGENTLOOP_MODELS_DIR`` or ``<repo>/models``."""
    override = os.environ.get(MODELS_DIR_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "models"


def default_cache_dir() -> Path:
    """Where generated offline files go: ``$AGENTLOOP_CACHE_DIR`` or ``~/.cache/agentloop``."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override)
    return Path.home() / ".cache" / "agentloop"


def _is_pipeline_dir(path: Path) -> bool:
    return (path / "model_index.json").is_file()


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def resolve_model(name: str, extra_models: Iterable[str] = ()) -> ModelSpec | None:
    """Resolve a model name to a spec, or None if it is not known.

    ``extra_models`` lists hub ids an operator registered; any other hub id is unknown.
    """
    if name in PRESET_MODELS:
        cls = "StableDiffusionPipeline" if name == "tiny-unet" else "FluxPipeline"
        return ModelSpec(name, ModelSource.PRESET, name, cls)
    if name == SHAPES_MODEL:
        folder = models_dir() / "shapes-dit"
        if not _is_pipeline_dir(folder):
            return None
        return ModelSpec(name, ModelSource.LOCAL, str(folder), "FluxPipeline")
    if name and _is_pipeline_dir(Path(name).expanduser()):
        return ModelSpec(name, ModelSource.LOCAL, str(Path(name).expanduser()))
    if name in set(extra_models) and _looks_like_hub_id(name):
        return ModelSpec(name, ModelSource.HUB, name)
    return None


LAYOUT_PIPELINES = frozenset({"FluxPipeline"})
"""Pipeline classes the runner can draw layouts (regions) with."""


def draws_layouts(name: str, extra_models: Iterable[str] = ()) -> bool:
    """Whether the runner can draw layouts (``GenerationRequest.regions``) with this model.

    Known without loading it for the presets, ``shapes`` and local folders (from their
    ``model_index.json``); a hub id's pipeline class is unknown until it is downloaded, so
    it counts as False here.
    """
    spec = resolve_model(name, extra_models)
    if spec is None or spec.source is ModelSource.HUB:
        return False
    if spec.source is ModelSource.LOCAL:
        try:
            index = json.loads((Path(spec.location) / "model_index.json").read_text())
        except (OSError, ValueError):
            return False
        return isinstance(index, dict) and index.get("_class_name") in LAYOUT_PIPELINES
    return spec.pipeline_class in LAYOUT_PIPELINES


def is_known_model(name: str, extra_models: Iterable[str] = ()) -> bool:
    """True if ``resolve_model`` would resolve this name."""
    return resolve_model(name, extra_models) is not None


def known_models(extra_models: Iterable[str] = ()) -> list[str]:
    """Names that resolve now: presets, ``shapes`` if shipped, and registered hub ids."""
    extra = list(extra_models)
    names = [*PRESET_MODELS, SHAPES_MODEL, *extra]
    return [n for n in dict.fromkeys(names) if is_known_model(n, extra)]


def _open_clip_config_names() -> set[str]:
    """open_clip's built-in model config names, read from its wheel without importing it."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return set()
    folder = Path(next(iter(spec.submodule_search_locations))) / "model_configs"
    return {p.stem for p in folder.glob("*.json")}


def _resolve_open_clip(name: str) -> ScorerSpec | None:
    model_name, _, pretrained = name.partition(":")
    known_configs = _open_clip_config_names() | {TINY_CLIP}  # tiny-clip:<file>: a trained tiny
    if not model_name or not pretrained or model_name not in known_configs:
        return None
    path = Path(pretrained).expanduser()
    looks_like_path = os.sep in pretrained or pretrained.endswith((".safetensors", ".bin", ".pt"))
    if looks_like_path and not path.is_file():
        return None
    if not looks_like_path and pretrained not in _pretrained_tags(model_name):
        return None
    return ScorerSpec(name, model_name, str(path) if looks_like_path else pretrained)


def _pretrained_tags(model_name: str) -> set[str]:
    """open_clip's published weight tags for a model (imports open_clip, so only when asked)."""
    import open_clip

    return set(open_clip.list_pretrained_tags_by_model(model_name))


def resolve_scorer(name: str) -> ScorerSpec | None:
    """Resolve a scorer name to a spec, or None if it is not known."""
    if name == TINY_CLIP:
        return ScorerSpec(name, TINY_CLIP, None)
    if name in (SHAPES_CLIP, SHAPES_CLIP_PREVIEW):
        folder = models_dir() / SHAPES_CLIP
        config, weights = folder / SHAPES_CLIP_CONFIG, folder / SHAPES_CLIP_WEIGHTS
        if not (config.is_file() and weights.is_file()):
            return None
        if name == SHAPES_CLIP:
            return ScorerSpec(name, config.stem, str(weights), str(config))
        overlay = models_dir() / SHAPES_CLIP_PREVIEW / SHAPES_CLIP_PREVIEW_WEIGHTS
        if not overlay.is_file():
            return None
        return ScorerSpec(name, config.stem, str(weights), str(config), str(overlay))
    return _resolve_open_clip(name)


def is_known_scorer(name: str) -> bool:
    """True if ``resolve_scorer`` would resolve this name."""
    return resolve_scorer(name) is not None


def known_scorers() -> list[str]:
    """Scorer names that resolve now (``<model>:<tag>`` names are open-ended and not listed)."""
    return [n for n in (TINY_CLIP, SHAPES_CLIP, SHAPES_CLIP_PREVIEW) if is_known_scorer(n)]
