"""An exact checker for the shapes world, by image analysis (no neural network).

Given an image and the requested objects (each a dict with any of color, shape, size,
position), ``check`` finds the objects in the image and says which requested attributes
hold. How objects are recovered:

1. Background: the per-channel median of the border pixels (the border is mostly background).
2. Foreground: pixels farther than ``FOREGROUND_DISTANCE`` from the background color; 8-connected
   components of it, specks under ``MIN_AREA`` pixels dropped; a component whose core holds
   two palette colors in force is split between them (two objects that touch).
3. Per object: color = nearest palette color to the mean of its core pixels; coverage
   (soft mask) = projection of each pixel onto the background-to-object color line; extent
   and center from the coverage profiles; size = extent against ``world.SIZE_THRESHOLD``;
   position = nearest anchor to the center; shape = the template (the world's own
   anti-aliased shape masks, at the measured center and a few extents) with the highest
   soft IoU against the coverage.

``parse_goal`` reads a goal text back into attribute dicts.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import permutations

import numpy as np
from PIL import Image

from engine.shapes import world

FOREGROUND_DISTANCE = 45.0
"""RGB distance from the background above which a pixel is foreground (colors are >= 100 apart)."""

MIN_AREA = 8.0
"""Components covering fewer pixels than this are noise (the smallest object covers ~30)."""

_PALETTE_NAMES = world.COLOR_NAMES
_PALETTE = np.array([world.COLORS[c] for c in _PALETTE_NAMES], dtype=np.float32)
_ANCHORS = np.array([world.POSITIONS[p] for p in world.POSITION_NAMES], dtype=np.float32)


@dataclass
class DetectedObject:
    """One object found in an image, with its attributes and the measurements behind them."""

    color: str
    shape: str
    size: str
    position: str
    cx: float
    cy: float
    extent: float
    area: float
    rgb: tuple[float, float, float]
    shape_scores: dict[str, float] = field(default_factory=dict)
    """Soft IoU of each shape template with the object's coverage."""

    def attributes(self) -> dict[str, str]:
        """The object's attributes as a dict with keys color, shape, size, position."""
        return {
            "color": self.color,
            "shape": self.shape,
            "size": self.size,
            "position": self.position,
        }


@dataclass
class CheckResult:
    """Which requested attributes hold in an image."""

    objects: list[dict[str, bool]]
    """Per requested object, attribute name -> whether it holds (only requested attributes)."""
    detected: list[DetectedObject]
    count_ok: bool
    """Whether the image holds exactly as many objects as requested."""

    @property
    def all_ok(self) -> bool:
        """Every requested attribute holds and there are no missing or extra objects."""
        return self.count_ok and all(all(o.values()) for o in self.objects)

    def fraction(self) -> float:
        """Share of requested attributes that hold (0 if nothing was requested)."""
        flags = [v for o in self.objects for v in o.values()]
        return sum(flags) / len(flags) if flags else 0.0


# --------------------------------------------------------------------------------------
# Finding objects


def _as_array(image: Image.Image | np.ndarray) -> np.ndarray:
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.dtype != np.uint8:  # floats in [0, 1]
        arr = np.clip(arr * 255.0, 0, 255)
    return arr.astype(np.float32)


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """8-connected components of a boolean mask, as boolean masks."""
    h, w = mask.shape
    seen = np.zeros_like(mask)
    out = []
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if seen[y0, x0]:
            continue
        comp = np.zeros_like(mask)
        queue = deque([(y0, x0)])
        seen[y0, x0] = True
        while queue:
            y, x = queue.popleft()
            comp[y, x] = True
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    ny, nx = y + dy, x + dx
                    if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                        seen[ny, nx] = True
                        queue.append((ny, nx))
        out.append(comp)
    return out


def _nearest_palette(rgb: np.ndarray, bg: np.ndarray) -> np.ndarray:
    """Index of the palette color that best explains each row of an (n, 3) array as a blend
    of the background and that color (anti-aliased edges and faint pixels included)."""
    d = _PALETTE - bg  # (k, 3)
    rel = rgb - bg  # (n, 3)
    alpha = np.clip((rel @ d.T) / np.maximum((d * d).sum(1), 1e-6), 0.0, 1.0)  # (n, k)
    residual = ((rel[:, None, :] - alpha[..., None] * d[None]) ** 2).sum(-1)
    return np.argmin(residual, axis=1)


def _split_by_color(
    comp: np.ndarray, arr: np.ndarray, bg: np.ndarray, dist: np.ndarray
) -> list[np.ndarray]:
    """Split a component between two palette colors if its core clearly holds both."""
    core = comp & (dist >= 0.7 * np.percentile(dist[comp], 90))
    labels = _nearest_palette(arr[core], bg)
    counts = np.bincount(labels, minlength=len(_PALETTE))
    top = np.argsort(counts)[::-1][:2]
    if counts[top[1]] < max(8, 0.25 * counts.sum()):
        return [comp]
    ys, xs = np.nonzero(comp)
    pal = _PALETTE[top]
    nearest = np.argmin(((arr[ys, xs][:, None, :] - pal[None]) ** 2).sum(-1), axis=1)
    parts: list[np.ndarray] = []
    for k in range(2):
        part = np.zeros_like(comp)
        part[ys[nearest == k], xs[nearest == k]] = True
        parts.extend(c for c in _components(part) if c.sum() >= MIN_AREA)
    return parts or [comp]


def _template_scores(coverage: np.ndarray, cx: float, cy: float, extent: float) -> dict[str, float]:
    """Best soft IoU of each shape's template (a few extents around ``extent``) with ``coverage``."""
    scores = {}
    for shape in world.SHAPES:
        best = 0.0
        for e in (extent - 1.0, extent - 0.5, extent, extent + 0.5, extent + 1.0):
            t = world.shape_mask(shape, cx, cy, e)
            iou = float(np.minimum(t, coverage).sum() / max(np.maximum(t, coverage).sum(), 1e-6))
            best = max(best, iou)
        scores[shape] = best
    return scores


def _measure(comp: np.ndarray, arr: np.ndarray, bg: np.ndarray, dist: np.ndarray) -> DetectedObject:
    core = comp & (dist >= 0.7 * np.percentile(dist[comp], 90))
    rgb = arr[core].mean(axis=0)
    color = _PALETTE_NAMES[int(_nearest_palette(rgb[None], bg)[0])]
    direction = rgb - bg
    # coverage: how far along the background -> object color line each pixel is
    grown = comp.copy()
    grown[1:] |= comp[:-1]
    grown[:-1] |= comp[1:]
    grown[:, 1:] |= grown[:, :-1].copy()
    grown[:, :-1] |= grown[:, 1:].copy()
    proj = ((arr - bg) @ direction) / max(float(direction @ direction), 1e-6)
    coverage = np.where(grown, np.clip(proj, 0.0, 1.0), 0.0).astype(np.float32)
    col_profile, row_profile = coverage.max(axis=0), coverage.max(axis=1)
    width, height = float(col_profile.sum()), float(row_profile.sum())
    xs = np.arange(coverage.shape[1], dtype=np.float32) + 0.5
    cx = float((col_profile * xs).sum() / max(width, 1e-6))
    cy = float((row_profile * xs[: coverage.shape[0]]).sum() / max(height, 1e-6))
    extent = max(width, height)
    scores = _template_scores(coverage, cx, cy, extent)
    shape = max(scores, key=scores.__getitem__)
    position = world.POSITION_NAMES[int(np.argmin(((_ANCHORS - [cx, cy]) ** 2).sum(1)))]
    size = "small" if extent < world.SIZE_THRESHOLD else "large"
    return DetectedObject(
        color,
        shape,
        size,
        position,
        cx,
        cy,
        extent,
        float(coverage.sum()),
        (float(rgb[0]), float(rgb[1]), float(rgb[2])),
        scores,
    )


def detect(image: Image.Image | np.ndarray) -> list[DetectedObject]:
    """All objects in an image (PIL, uint8 HWC, or float HWC in [0, 1]), largest first."""
    arr = _as_array(image)
    border = np.concatenate([arr[0], arr[-1], arr[1:-1, 0], arr[1:-1, -1]])
    bg = np.median(border, axis=0)
    dist = np.sqrt(((arr - bg) ** 2).sum(-1))
    mask = dist > FOREGROUND_DISTANCE
    objects = []
    for comp in _components(mask):
        if comp.sum() < MIN_AREA:
            continue
        for part in _split_by_color(comp, arr, bg, dist):
            objects.append(_measure(part, arr, bg, dist))
    return sorted(objects, key=lambda o: -o.area)


# --------------------------------------------------------------------------------------
# Checking


def check(image: Image.Image | np.ndarray, requested: Sequence[dict[str, str]]) -> CheckResult:
    """Which requested attributes hold: each requested object is matched to the detected object
    that satisfies most of its attributes (jointly over objects, each detected object used once)."""
    detected = detect(image)
    best: list[dict[str, bool]] | None = None
    best_score = -1
    slots: list[DetectedObject | None] = list(detected) + [None] * len(requested)
    for perm in permutations(range(len(slots)), len(requested)):
        flags = []
        for req, k in zip(requested, perm, strict=True):
            obj = slots[k]
            got = obj.attributes() if obj is not None else {}
            flags.append({a: got.get(a) == v for a, v in req.items() if a in world.ATTRIBUTES})
        score = sum(sum(f.values()) for f in flags)
        if score > best_score:
            best, best_score = flags, score
    return CheckResult(
        objects=best or [], detected=detected, count_ok=len(detected) == len(requested)
    )


def accuracy(
    images: Sequence[Image.Image | np.ndarray], requested: Sequence[Sequence[dict[str, str]]]
) -> dict[str, float]:
    """Per-attribute accuracy over all requested objects, "count" (right number of objects)
    and "all" (every requested attribute holds and the count is right), over images."""
    totals = {a: 0 for a in world.ATTRIBUTES}
    hits = {a: 0 for a in world.ATTRIBUTES}
    all_ok = count_ok = 0
    for image, req in zip(images, requested, strict=True):
        result = check(image, req)
        for flags in result.objects:
            for a, ok in flags.items():
                totals[a] += 1
                hits[a] += ok
        all_ok += result.all_ok
        count_ok += result.count_ok
    out = {a: hits[a] / totals[a] for a in world.ATTRIBUTES if totals[a]}
    out["count"] = count_ok / max(len(images), 1)
    out["all"] = all_ok / max(len(images), 1)
    return out


# --------------------------------------------------------------------------------------
# Parsing goal text

_WORDS: dict[str, tuple[str, str]] = {}
for _c in world.COLOR_NAMES:
    _WORDS[_c] = ("color", _c)
for _s, _ws in world.SHAPE_WORDS.items():
    for _w in _ws:
        _WORDS[_w.split()[0]] = ("shape", _s)  # "plus sign" -> "plus"
for _z, _ws in world.SIZE_WORDS.items():
    for _w in _ws:
        _WORDS[_w] = ("size", _z)
_WORDS.update(
    {
        "left": ("position", "left"),
        "right": ("position", "right"),
        "top": ("position", "top"),
        "upper": ("position", "top"),
        "bottom": ("position", "bottom"),
        "lower": ("position", "bottom"),
        "center": ("position", "center"),
        "centre": ("position", "center"),
        "middle": ("position", "center"),
    }
)


def parse_goal(text: str) -> list[dict[str, str]]:
    """Attribute dicts of the objects a goal text asks for ("... and ..." makes two objects).

    Only attributes named in the text appear; background words are ignored; parts of the text
    that name no attribute are dropped.
    """
    out = []
    for part in re.split(r"\band\b", text.lower()):
        attrs: dict[str, str] = {}
        for word in re.findall(r"[a-z]+", part):
            if word in _WORDS:
                key, value = _WORDS[word]
                attrs.setdefault(key, value)
        if attrs:
            out.append(attrs)
    return out
