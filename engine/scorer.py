"""The CLIP scorer: CLIPScore = 2.5 * max(cos(image, text), 0) (Hessel et al. 2021), in [0, 2.5].

Images are encoded in batches; text embeddings are cached by text, so a goal's prompt and its
parts are encoded once however many candidates are judged against them.

A part that comes with a region (`ScoreRequest.regions`) is judged where it should be: on a
view of the image that keeps that region (the layout's own weights, `engine.regions`) and
fills the rest with the image's background (the median of its border), so the part's object
is seen alone, at its place and size, and an object of another part cannot stand in for it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import open_clip
import torch
from PIL import Image

from engine.catalog import (
    TINY_CLIP,
    ModelLoadError,
    ScorerSpec,
    UnknownModelError,
    default_cache_dir,
    known_scorers,
    preset_seed,
    resolve_scorer,
)
from engine.regions import region_weights
from engine.types import Region, ScoreRequest, ScoreResult

CLIPSCORE_WEIGHT = 2.5
"""Hessel et al.'s w: CLIPScore = w * max(cos, 0)."""

TEXT_CACHE_SIZE = 4096
"""Most texts whose embeddings a Scorer keeps (least recently used are dropped)."""

TINY_CLIP_CONFIG = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
"""open_clip config of the ``tiny-clip`` preset: embed 64, 2-layer width-64 towers, 32x32 images."""


def clip_score(cosine: float) -> float:
    """CLIPScore on the Hessel et al. (2021) scale: 2.5 * max(cos, 0)."""
    return CLIPSCORE_WEIGHT * max(cosine, 0.0)


def background_of(image: Image.Image) -> np.ndarray:
    """An image's background color: the per-channel median of its border pixels (float RGB)."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32)
    border = np.concatenate([arr[0], arr[-1], arr[1:-1, 0], arr[1:-1, -1]])
    return np.median(border, axis=0)


def region_views(image: Image.Image, regions: Sequence[Region]) -> list[Image.Image]:
    """One view of ``image`` per region: the region kept (by its layout weight among
    ``regions``), everything else blended to the background, the per-channel median of the
    image's border pixels. A lone region competes with its mirror image across the center
    (a lone centered one keeps the whole image)."""
    arr = np.asarray(image.convert("RGB"), dtype=np.float32)
    background = background_of(image)
    regions = list(regions)
    n = len(regions)
    if n == 1 and (regions[0].x, regions[0].y) != (0.5, 0.5):
        r = regions[0]
        regions.append(Region("", 1.0 - r.x, 1.0 - r.y, r.scale))
    weights = region_weights(regions, arr.shape[0], arr.shape[1]).numpy()[..., None]
    views = arr[None] * weights + background * (1.0 - weights)
    return [Image.fromarray(np.clip(np.rint(v), 0, 255).astype(np.uint8)) for v in views[:n]]


def _register_config(model_name: str, config_path: str | None) -> None:
    """Make ``model_name`` an open_clip config name (once per process)."""
    if model_name in open_clip.list_models():
        return
    if config_path is None:  # the tiny preset: write its config where open_clip can scan it
        path = default_cache_dir() / "open_clip" / f"{model_name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file():
            path.write_text(json.dumps(TINY_CLIP_CONFIG, indent=2))
        config_path = str(path)
    open_clip.add_model_config(config_path)


def _create(spec: ScorerSpec) -> tuple[torch.nn.Module, Callable[[Image.Image], torch.Tensor]]:
    """The open_clip model (seeded random weights when ``spec.pretrained`` is None) and its eval transform."""
    if spec.model_name == TINY_CLIP or spec.config_path:
        _register_config(spec.model_name, spec.config_path)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(preset_seed(spec.name))  # matters only without pretrained weights
            model, _, preprocess = open_clip.create_model_and_transforms(
                spec.model_name, pretrained=spec.pretrained
            )
    except (OSError, RuntimeError, ValueError) as exc:
        raise ModelLoadError(
            f"could not load scorer {spec.name!r} (open_clip {spec.model_name!r}, "
            f"pretrained={spec.pretrained!r}); tagged weights need the network: {exc}"
        ) from exc
    if spec.overlay is not None:
        _load_overlay(model, spec)
    return model, preprocess


def _load_overlay(model: torch.nn.Module, spec: ScorerSpec) -> None:
    """Load ``spec.overlay`` over the model's weights; every tensor must fit one of them."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(spec.overlay)
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"could not read the weights {spec.overlay!r} of scorer "
                             f"{spec.name!r}: {exc}") from exc  # fmt: skip
    own = model.state_dict()
    wrong = sorted(k for k, v in state.items() if k not in own or own[k].shape != v.shape)
    if wrong or not state:
        raise ModelLoadError(f"the weights {spec.overlay!r} of scorer {spec.name!r} do not fit "
                             f"{spec.model_name!r}: {wrong[:5] or 'no tensors'}")  # fmt: skip
    model.load_state_dict(state, strict=False)


class Scorer:
    """An open_clip model that judges images against texts on the CLIPScore scale."""

    def __init__(self, name: str, device: str = "auto", batch_size: int = 64) -> None:
        """Load scorer ``name`` (a catalog name) on ``device`` ("auto": cuda if available)."""
        spec = resolve_scorer(name)
        if spec is None:
            raise UnknownModelError(
                f"unknown scorer {name!r}; known: {known_scorers()} or '<open_clip model>:<tag|file>'"
            )
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.name, self.device, self.batch_size = name, torch.device(device), batch_size
        model, self.preprocess = _create(spec)
        self.model: Any = model.to(self.device).eval()  # open_clip CLIP/CustomTextCLIP
        self.tokenizer = open_clip.get_tokenizer(spec.model_name)
        self._text_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.text_cache_hits = 0
        self.text_cache_misses = 0

    @torch.inference_mode()
    def score(
        self, images: Sequence[Image.Image], requests: Sequence[ScoreRequest]
    ) -> list[ScoreResult]:
        """Score ``images[i]`` against ``requests[i]``: its text, and each of its parts (on
        the part's region where the request gives one, see `region_views`)."""
        if len(images) != len(requests):
            raise ValueError(f"{len(images)} images but {len(requests)} score requests")
        if not images:
            return []
        views: list[Image.Image] = []
        judged: list[list[tuple[str, str, int | None]]] = []  # (part, text, view index)
        for image, request in zip(images, requests, strict=True):
            regions = request.regions or (None,) * len(request.parts)
            placed = [r for r in regions if r is not None]
            part_views = iter(region_views(image, placed)) if placed else iter(())
            row: list[tuple[str, str, int | None]] = []
            for part, region in zip(request.parts, regions, strict=True):
                if region is None:
                    row.append((part, part, None))
                else:
                    views.append(next(part_views))
                    row.append((part, region.prompt, len(views) - 1))
            judged.append(row)
        image_emb = self._encode_images([*images, *views])
        texts = {r.text for r in requests} | {t for line in judged for _, t, _ in line}
        text_emb = self._encode_texts(sorted(texts))
        results = []
        for k, (request, row) in enumerate(zip(requests, judged, strict=True)):
            whole = image_emb[k]
            parts = {
                part: clip_score(float(
                    (whole if view is None else image_emb[len(images) + view]) @ text_emb[text]
                ))
                for part, text, view in row
            }
            results.append(ScoreResult(clip_score(float(whole @ text_emb[request.text])), parts))
        return results

    def _encode_images(self, images: Sequence[Image.Image]) -> torch.Tensor:
        """Unit-norm image embeddings, ``batch_size`` images per forward, on the CPU."""
        chunks = []
        for start in range(0, len(images), self.batch_size):
            batch = [
                self.preprocess(img.convert("RGB"))
                for img in images[start : start + self.batch_size]
            ]
            pixels = torch.stack(batch).to(self.device)
            chunks.append(self.model.encode_image(pixels, normalize=True).float().cpu())
        return torch.cat(chunks)

    def _encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """Unit-norm text embeddings by text; only texts not in the cache are encoded."""
        missing = [t for t in texts if t not in self._text_cache]
        self.text_cache_hits += len(texts) - len(missing)
        self.text_cache_misses += len(missing)
        if missing:
            tokens = self.tokenizer(missing).to(self.device)
            emb = self.model.encode_text(tokens, normalize=True).float().cpu()
            self._text_cache.update(zip(missing, emb, strict=True))
        found = {}
        for t in texts:
            self._text_cache.move_to_end(t)
            found[t] = self._text_cache[t]
        while len(self._text_cache) > TEXT_CACHE_SIZE:
            self._text_cache.popitem(last=False)
        return found
