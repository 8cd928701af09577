"""A procedural world of 32x32 images of one to three flat shapes, with captions.

The grammar: each object has a color (8), a shape (5), a size (2) and a position (5); a scene
has one to three objects on a plain background (3); three objects are small, on three sides. Captions come from templates with
paraphrases and varied word order; two-object captions join two object phrases with "and".

Everything is deterministic from a seed. A fixed split holds out 40 of the 200
color x shape x position combinations from training, chosen so that every pair of those
attributes is still seen in training (with some other third attribute): a model that
generalizes compositionally can render them, a model that memorizes cannot.

numpy and PIL only: no torch here, so the checker and tests stay light.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

IMAGE_SIZE = 32
"""Side of every image, in pixels."""

SUPERSAMPLE = 4
"""Shapes are drawn on a 4x finer grid and box-filtered down, for anti-aliased edges."""

COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "orange": (245, 140, 20),
    "yellow": (240, 220, 40),
    "green": (40, 170, 60),
    "cyan": (40, 210, 220),
    "blue": (40, 80, 230),
    "purple": (150, 60, 200),
    "pink": (250, 130, 190),
}
"""Object colors (RGB), well apart from each other and from every background."""

BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (20, 20, 20),
    "gray": (100, 100, 100),
    "white": (235, 235, 235),
}
"""Background colors (RGB)."""

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross", "ring")
"""Shapes that stay distinguishable at 8 pixels across."""

SIZES: dict[str, tuple[float, float]] = {"small": (7.5, 9.0), "large": (13.0, 15.0)}
"""Range of an object's extent (bounding-box side, pixels) per size word."""

SIZE_THRESHOLD = 11.0
"""Extents below this are "small", above are "large" (between the two ranges)."""

POSITIONS: dict[str, tuple[float, float]] = {
    "left": (8.0, 16.0),
    "right": (24.0, 16.0),
    "top": (16.0, 8.0),
    "bottom": (16.0, 24.0),
    "center": (16.0, 16.0),
}
"""Anchor (x, y) of an object's bounding-box center per position word."""

POSITION_JITTER = 1.0
"""Objects are placed within this many pixels of their anchor, in x and in y."""

COLOR_JITTER = 10
"""Per-channel jitter of object and background colors in sampled scenes."""

ATTRIBUTES: tuple[str, ...] = ("color", "shape", "size", "position")
"""Keys of an object's attribute dict."""

COLOR_NAMES: tuple[str, ...] = tuple(COLORS)
POSITION_NAMES: tuple[str, ...] = tuple(POSITIONS)
SIZE_NAMES: tuple[str, ...] = tuple(SIZES)

# Words and phrases that captions draw from; the checker's parser reads them back.
SIZE_WORDS: dict[str, tuple[str, ...]] = {
    "small": ("small", "little", "tiny"),
    "large": ("large", "big"),
}
SHAPE_WORDS: dict[str, tuple[str, ...]] = {
    "circle": ("circle", "disc"),
    "square": ("square", "box"),
    "triangle": ("triangle",),
    "cross": ("cross", "plus sign"),
    "ring": ("ring", "donut"),
}
POSITION_PHRASES: dict[str, tuple[str, ...]] = {
    "left": ("on the left", "at the left", "on the left side", "to the left"),
    "right": ("on the right", "at the right", "on the right side", "to the right"),
    "top": ("at the top", "on top", "near the top", "in the upper part"),
    "bottom": ("at the bottom", "near the bottom", "in the lower part", "on the bottom"),
    "center": ("in the center", "in the middle", "at the center"),
}
PREFIXES: tuple[str, ...] = ("", "", "", "a picture of ", "an image of ", "there is ")


# --------------------------------------------------------------------------------------
# Scenes


@dataclass(frozen=True)
class PlacedObject:
    """One object: its attributes and where exactly it is drawn."""

    color: str
    shape: str
    size: str
    position: str
    cx: float
    """Bounding-box center, x, in pixels (0 = left edge)."""
    cy: float
    """Bounding-box center, y, in pixels (0 = top edge)."""
    extent: float
    """Bounding-box side, in pixels."""
    rgb: tuple[int, int, int]

    def attributes(self) -> dict[str, str]:
        """The object's attributes as a dict with keys color, shape, size, position."""
        return {
            "color": self.color,
            "shape": self.shape,
            "size": self.size,
            "position": self.position,
        }

    def bbox(self) -> tuple[float, float, float, float]:
        """(x0, y0, x1, y1) of the drawn shape."""
        r = self.extent / 2
        return (self.cx - r, self.cy - r, self.cx + r, self.cy + r)


@dataclass(frozen=True)
class Scene:
    """One or two objects on a plain background."""

    objects: tuple[PlacedObject, ...]
    background: str
    background_rgb: tuple[int, int, int]

    def attributes(self) -> list[dict[str, str]]:
        """Attribute dicts of the objects, in drawing order."""
        return [o.attributes() for o in self.objects]


@dataclass(frozen=True)
class Goal:
    """A benchmark goal: its text and the attributes of each object it asks for."""

    text: str
    objects: list[dict[str, str]] = field(default_factory=list)


# --------------------------------------------------------------------------------------
# The split


def is_heldout(color: str, shape: str, position: str) -> bool:
    """Whether a color x shape x position combination is held out of training.

    For color i and shape j, position (i + 2j) mod 5 is held out: 40 of 200 combinations,
    one position per (color, shape), one shape per (color, position), and every
    (shape, position) pair held out for at most two colors.
    """
    i, j = COLOR_NAMES.index(color), SHAPES.index(shape)
    return POSITION_NAMES.index(position) == (i + 2 * j) % len(POSITION_NAMES)


def combinations(split: str) -> list[tuple[str, str, str]]:
    """All (color, shape, position) combinations in a split: "train", "heldout" or "all"."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    out = []
    for c in COLOR_NAMES:
        for s in SHAPES:
            for p in POSITION_NAMES:
                held = is_heldout(c, s, p)
                if split == "all" or (split == "heldout") == held:
                    out.append((c, s, p))
    return out


# --------------------------------------------------------------------------------------
# Placing and rendering


def _jitter_rgb(rgb: tuple[int, int, int], rng: random.Random, amount: int) -> tuple[int, int, int]:
    r, g, b = (min(255, max(0, v + rng.randint(-amount, amount))) for v in rgb)
    return (r, g, b)


def _overlaps(a: PlacedObject, b: PlacedObject, gap: float = 1.0) -> bool:
    """Whether two placed objects come within ``gap`` pixels of each other: apart when their
    bounding boxes are; when the boxes meet (two objects near a corner), judged on the shapes
    themselves (each one's coverage grown by one pixel must not meet the other's)."""
    ax0, ay0, ax1, ay1 = a.bbox()
    bx0, by0, bx1, by1 = b.bbox()
    if ax1 + gap <= bx0 or bx1 + gap <= ax0 or ay1 + gap <= by0 or by1 + gap <= ay0:
        return False
    ma = shape_mask(a.shape, a.cx, a.cy, a.extent) > 0.02
    mb = shape_mask(b.shape, b.cx, b.cy, b.extent) > 0.02
    grown = ma.copy()
    grown[1:] |= ma[:-1]
    grown[:-1] |= ma[1:]
    grown[:, 1:] |= grown[:, :-1].copy()
    grown[:, :-1] |= grown[:, 1:].copy()
    return bool((grown & mb).any())


def place(
    objects: Sequence[dict[str, str]],
    rng: random.Random,
    background: str | None = None,
    jitter: bool = True,
) -> Scene:
    """Place objects with given attributes on a background, with random jitter.

    With ``jitter=False`` objects sit exactly at their anchors with the middle extent of their
    size and the palette colors. Raises ValueError if two objects cannot be placed apart.
    """
    bg = background if background is not None else rng.choice(list(BACKGROUNDS))
    bg_rgb = _jitter_rgb(BACKGROUNDS[bg], rng, COLOR_JITTER // 2) if jitter else BACKGROUNDS[bg]
    for _ in range(50):
        placed: list[PlacedObject] = []
        for attrs in objects:
            ax, ay = POSITIONS[attrs["position"]]
            lo, hi = SIZES[attrs["size"]]
            if jitter:
                cx = ax + rng.uniform(-POSITION_JITTER, POSITION_JITTER)
                cy = ay + rng.uniform(-POSITION_JITTER, POSITION_JITTER)
                extent = rng.uniform(lo, hi)
                rgb = _jitter_rgb(COLORS[attrs["color"]], rng, COLOR_JITTER)
            else:
                cx, cy, extent, rgb = ax, ay, (lo + hi) / 2, COLORS[attrs["color"]]
            placed.append(
                PlacedObject(
                    attrs["color"],
                    attrs["shape"],
                    attrs["size"],
                    attrs["position"],
                    cx,
                    cy,
                    extent,
                    rgb,
                )
            )
        if not any(_overlaps(a, b) for k, a in enumerate(placed) for b in placed[k + 1 :]):
            return Scene(tuple(placed), bg, bg_rgb)
        if not jitter:
            break
    raise ValueError(f"cannot place {list(objects)} without overlap")


def fits_together(objects: Sequence[dict[str, str]]) -> bool:
    """Whether objects with these attributes can always be placed without touching."""
    if len({o["position"] for o in objects}) < len(objects):
        return False
    boxes = []
    for o in objects:
        ax, ay = POSITIONS[o["position"]]
        r = SIZES[o["size"]][1] / 2 + POSITION_JITTER
        boxes.append((ax - r, ay - r, ax + r, ay + r))
    for k, a in enumerate(boxes):
        for b in boxes[k + 1 :]:
            if not (a[2] + 1 <= b[0] or b[2] + 1 <= a[0] or a[3] + 1 <= b[1] or b[3] + 1 <= a[1]):
                return False
    return True


def shape_mask(
    shape: str, cx: float, cy: float, extent: float, size: int = IMAGE_SIZE
) -> np.ndarray:
    """Coverage in [0, 1] of each pixel of a size x size image by a shape (anti-aliased)."""
    n = size * SUPERSAMPLE
    coords = (np.arange(n, dtype=np.float32) + 0.5) / SUPERSAMPLE
    dx = coords[None, :] - cx
    dy = coords[:, None] - cy
    r = extent / 2
    if shape == "circle":
        inside = dx * dx + dy * dy <= r * r
    elif shape == "square":
        inside = (np.abs(dx) <= r) & (np.abs(dy) <= r)
    elif shape == "triangle":  # apex up, base at the bottom
        inside = (dy >= -r) & (dy <= r) & (np.abs(dx) <= (dy + r) / 2)
    elif shape == "cross":
        arm = r / 3
        inside = ((np.abs(dx) <= r) & (np.abs(dy) <= arm)) | (
            (np.abs(dy) <= r) & (np.abs(dx) <= arm)
        )
    elif shape == "ring":
        d2 = dx * dx + dy * dy
        inside = (d2 <= r * r) & (d2 >= (0.5 * r) ** 2)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return inside.reshape(size, SUPERSAMPLE, size, SUPERSAMPLE).mean(axis=(1, 3), dtype=np.float32)


def render(scene: Scene) -> np.ndarray:
    """The scene as a uint8 array of shape (32, 32, 3)."""
    img = np.empty((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)
    img[:] = np.asarray(scene.background_rgb, dtype=np.float32)
    for o in scene.objects:
        alpha = shape_mask(o.shape, o.cx, o.cy, o.extent)[..., None]
        img = img * (1 - alpha) + np.asarray(o.rgb, dtype=np.float32) * alpha
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def render_image(scene: Scene) -> Image.Image:
    """The scene as a 32x32 RGB PIL image."""
    return Image.fromarray(render(scene), mode="RGB")


# --------------------------------------------------------------------------------------
# Sampling scenes


THREE_OBJECT_POSITIONS: tuple[tuple[str, str, str], ...] = (
    ("left", "right", "top"), ("left", "right", "bottom"),
    ("top", "bottom", "left"), ("top", "bottom", "right"),
)
"""Where three objects can go in 32 pixels: two opposite sides and a third side, all small
(the center meets every side at these sizes)."""


def sample_objects(
    rng: random.Random, n_objects: int, split: str = "train"
) -> list[dict[str, str]]:
    """Attributes of 1 to 3 objects whose color x shape x position is in ``split``.

    Two objects always have different positions and fit without touching. Three objects are
    small, at one of ``THREE_OBJECT_POSITIONS``, and placeable without touching (placed at
    their anchors; jittered placements are retried by ``place``).
    """
    combos = combinations(split)
    if n_objects == 3:
        return _sample_three(rng, combos)
    while True:
        objs = []
        for _ in range(n_objects):
            c, s, p = rng.choice(combos)
            objs.append({"color": c, "shape": s, "size": rng.choice(SIZE_NAMES), "position": p})
        if n_objects == 1 or fits_together(objs):
            return objs


def _sample_three(rng: random.Random, combos: list[tuple[str, str, str]]) -> list[dict[str, str]]:
    by_position: dict[str, list[tuple[str, str]]] = {p: [] for p in POSITION_NAMES}
    for c, s, p in combos:
        by_position[p].append((c, s))
    while True:
        objs = []
        for p in rng.choice(THREE_OBJECT_POSITIONS):
            c, s = rng.choice(by_position[p])
            objs.append({"color": c, "shape": s, "size": "small", "position": p})
        try:
            place(objs, rng, background="black", jitter=False)
        except ValueError:
            continue
        return objs


def sample_scene(rng: random.Random, n_objects: int = 1, split: str = "train") -> Scene:
    """A random scene of 1 to 3 objects from a split, with jitter and a random background."""
    while True:
        objects = sample_objects(rng, n_objects, split)
        try:
            return place(objects, rng)
        except ValueError:  # three objects whose jittered placements all touched
            if n_objects < 3:
                raise


# --------------------------------------------------------------------------------------
# Captions


def _article(next_word: str) -> str:
    return "an" if next_word[0] in "aeiou" else "a"


def object_phrase(
    attrs: dict[str, str], rng: random.Random | None = None, drop: float = 0.0
) -> str:
    """A phrase naming one object. Without ``rng``, the canonical "a small red circle on the left".

    With ``rng``: synonyms, one of several word orders, and (with probability ``drop`` each)
    size or position left out. Missing keys in ``attrs`` are left out too.
    """
    size_key, color, shape_key, pos_key = (
        attrs.get(k) for k in ("size", "color", "shape", "position")
    )
    if rng is None:
        size = size_key or ""
        shape = shape_key or "shape"
        pos = POSITION_PHRASES[pos_key][0] if pos_key else ""
        words = " ".join(w for w in (size, color or "", shape) if w)
        return f"{_article(words)} {words}" + (f" {pos}" if pos else "")
    size = rng.choice(SIZE_WORDS[size_key]) if size_key and rng.random() >= drop else ""
    shape = rng.choice(SHAPE_WORDS[shape_key]) if shape_key else "shape"
    pos = rng.choice(POSITION_PHRASES[pos_key]) if pos_key and rng.random() >= drop else ""
    color = color or ""
    form = rng.randrange(7) if (size and color) else 0
    if form == 1 and pos:  # on the left, a small red circle
        words = f"{size} {color} {shape}"
        return f"{pos}, {_article(words)} {words}"
    if form == 2 and pos:  # on the left, a red circle, small
        words = f"{color} {shape}"
        return f"{pos}, {_article(words)} {words}, {size}"
    if form == 3:  # a red circle on the left, small
        words = f"{color} {shape}"
        return f"{_article(words)} {words}" + (f" {pos}" if pos else "") + f", {size}"
    if form == 4:  # a small circle on the left, colored red
        words = f"{size} {shape}"
        return f"{_article(words)} {words}" + (f" {pos}" if pos else "") + f", colored {color}"
    if form == 5:  # a small circle in red on the left
        words = f"{size} {shape}"
        return f"{_article(words)} {words} in {color}" + (f" {pos}" if pos else "")
    if form == 6 and pos:  # a red circle that is small, on the left
        words = f"{color} {shape}"
        return f"{_article(words)} {words} that is {size}, {pos}"
    words = " ".join(w for w in (size, color, shape) if w)
    return f"{_article(words)} {words}" + (f" {pos}" if pos else "")


def caption(
    scene: Scene, rng: random.Random, drop: float = 0.1, background_prob: float = 0.2
) -> str:
    """A random caption of a scene: paraphrases, varied order, objects joined with "and"."""
    phrases = [object_phrase(o.attributes(), rng, drop) for o in scene.objects]
    rng.shuffle(phrases)
    prefix = rng.choice(PREFIXES)
    if any(phrases[0].startswith(p) for ps in POSITION_PHRASES.values() for p in ps):
        prefix = ""  # not "an image of on the left, a red circle"
    text = prefix + " and ".join(phrases)
    if rng.random() < background_prob:
        text += f", on a {scene.background} background"
    return text


def canonical_caption(objects: Sequence[dict[str, str]]) -> str:
    """The canonical caption: "a small red circle on the left and a large blue ring at the top"."""
    return " and ".join(object_phrase(o) for o in objects)


def sample(
    seed: int, n: int, split: str = "train", two_object_prob: float = 0.3
) -> tuple[np.ndarray, list[str], list[Scene]]:
    """``n`` random scenes from a split, rendered, with random captions: (uint8 NHWC, captions, scenes)."""
    rng = random.Random(seed)
    images = np.empty((n, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    captions, scenes = [], []
    for k in range(n):
        scene = sample_scene(rng, 2 if rng.random() < two_object_prob else 1, split)
        images[k] = render(scene)
        captions.append(caption(scene, rng))
        scenes.append(scene)
    return images, captions, scenes


def heldout_goals(n: int, objects: int = 1, seed: int = 0, paraphrase: bool = False) -> list[Goal]:
    """``n`` benchmark goals whose every object is a held-out color x shape x position.

    Texts are canonical ("a small red circle on the left") unless ``paraphrase``; the same
    seed gives the same goals. Two-object goals have objects in different positions that fit
    side by side; three-object goals are small objects on three sides.
    """
    if objects not in (1, 2, 3):
        raise ValueError("objects must be 1, 2 or 3")
    rng = random.Random(seed)
    goals = []
    for _ in range(n):
        objs = sample_objects(rng, objects, "heldout")
        if paraphrase:
            text = " and ".join(object_phrase(o, rng) for o in objs)
        else:
            text = canonical_caption(objs)
        goals.append(Goal(text=text, objects=objs))
    return goals


def vocabulary() -> list[str]:
    """Every word a caption can contain (for word-level tokenizers)."""
    words: set[str] = set()
    parts: list[str] = (
        list(COLORS)
        + list(BACKGROUNDS)
        + ["a", "an", "and", "colored", "in", "that", "is", "background", "on", "shape"]
    )
    parts += [w for ws in SIZE_WORDS.values() for w in ws]
    parts += [w for ws in SHAPE_WORDS.values() for w in ws]
    parts += [w for ps in POSITION_PHRASES.values() for w in ps]
    parts += list(PREFIXES)
    for p in parts:
        words.update(p.replace(",", " ").split())
    return sorted(words)
