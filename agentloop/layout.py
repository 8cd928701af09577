"""Layout planning: where in the image each part of a goal goes, read off its position words.

"a red circle on the left and a blue square at the top" → the first part anchored at the
middle of the left half (0.25, 0.5), the second at the middle of the top half (0.5, 0.25).
A reviser hands such a plan to the engine as regions (regional prompting), so that each part
is drawn where it belongs instead of hoping one prompt binds every attribute to its object.
"""

from __future__ import annotations

import re

from agentloop.domain import Layout

MAX_REGIONS = 8
"""Most regions a layout may have: the engine's limit (``engine.types.MAX_REGIONS``), kept
here too so that the API and SDK validate without importing the engine."""

Anchor = tuple[float, float]
"""(x, y) in [0, 1] from the top-left corner."""


HORIZONTAL: dict[str, float] = {"left": 0.25, "right": 0.75}
VERTICAL: dict[str, float] = {"top": 0.25, "upper": 0.25, "bottom": 0.75, "lower": 0.75}
CENTER = frozenset({"center", "centre", "middle"})


def anchor_of(part: str) -> Anchor | None:
    """Where a part says it is, or None when it names no position.

    Left/right set x, top/upper/bottom/lower set y ("the top left corner" sets both), and
    center/middle keeps the middle. A part that names two opposite sides is not placed.
    """
    words = set(re.findall(r"[a-z]+", part.lower()))
    xs = {HORIZONTAL[w] for w in words & HORIZONTAL.keys()}
    ys = {VERTICAL[w] for w in words & VERTICAL.keys()}
    if len(xs) > 1 or len(ys) > 1 or not (xs or ys or words & CENTER):
        return None
    return (xs.pop() if xs else 0.5, ys.pop() if ys else 0.5)


def plan_layout(parts: tuple[str, ...]) -> Layout | None:
    """A layout for a goal of two to ``MAX_REGIONS`` parts, each naming its own position;
    else None."""
    if not 2 <= len(parts) <= MAX_REGIONS:
        return None
    anchors = [anchor_of(p) for p in parts]
    if any(a is None for a in anchors) or len(set(anchors)) < len(anchors):
        return None
    return tuple((p, a[0], a[1]) for p, a in zip(parts, anchors, strict=True) if a is not None)
