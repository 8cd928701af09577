"""Layout planning: where in the image each part of a goal goes.

"a red circle on the left and a blue square at the top" → the first part anchored at the
middle of the left half (0.25, 0.5), the second at the middle of the top half (0.5, 0.25).
Parts whose place the goal does not state ("a red circle next to a blue square") get free
places: left and right for two, then top, bottom, the center and the corners. A reviser hands
such a plan to the engine as regions (regional prompting), so that each part is drawn where it
belongs instead of hoping one prompt binds every attribute to its object; the scorer judges
each part on its region (`engine.scorer`).
"""

from __future__ import annotations

from collections.abc import Sequence

from agentloop.domain import Layout, LayoutEntry, layout_entry
from agentloop.parts import CENTER, HORIZONTAL, VERTICAL, Anchor, Part, RuleParser, anchor_of

__all__ = [
    "CENTER", "FREE_PLACES", "HORIZONTAL", "MAX_REGION_SCALE", "MAX_REGIONS", "VERTICAL", "Anchor", "anchor_of",
    "place_parts", "plan_layout",
]

MAX_REGIONS = 8
"""Most regions a layout may have: the engine's limit (``engine.types.MAX_REGIONS``), kept
here too so that the API and SDK validate without importing the engine."""

MAX_REGION_SCALE = 4.0
"""Largest region scale: the engine's limit (``engine.types.MAX_REGION_SCALE``)."""

FREE_PLACES: tuple[Anchor, ...] = (
    (0.25, 0.5), (0.75, 0.5), (0.5, 0.25), (0.5, 0.75), (0.5, 0.5),
    (0.25, 0.25), (0.75, 0.25), (0.25, 0.75), (0.75, 0.75),
)
"""Places given, in this order, to parts the goal does not place: left and right for two, a
third on top, a fourth at the bottom, then the center and the corners."""


def place_parts(parts: Sequence[Part]) -> tuple[Part, ...] | None:
    """The parts, each with a place: its own where the goal gives one, else the first free
    place of `FREE_PLACES` (skipping places taken, and the axis a lone placed part uses:
    "a red circle at the top and a blue square" puts the square at the bottom). None when two
    parts name the same place."""
    given = [p.place for p in parts if p.place is not None]
    if len(set(given)) < len(given):
        return None
    free = [a for a in FREE_PLACES if a not in given]
    if len(given) == 1 and len(parts) == 2:  # the other one across from it
        x, y = given[0]
        free.insert(0, (1 - x, 1 - y) if (x, y) != (0.5, 0.5) else (0.25, 0.5))
    out = []
    for p in parts:
        if p.place is None:
            place = free.pop(0)
            while place in given:
                place = free.pop(0)
            given.append(place)
            p = Part(p.text, p.subject, place, p.scale, stated_place=False)
        out.append(p)
    return tuple(out)


def plan_layout(parts: Sequence[Part | str]) -> Layout | None:
    """A layout for a goal of two to ``MAX_REGIONS`` parts: one region per part, in the parts'
    order, at its place (see `place_parts`), scaled by its size word; else None.

    Plain strings are read as one part each (their own place words only)."""
    if not 2 <= len(parts) <= MAX_REGIONS:
        return None
    as_parts = [p if isinstance(p, Part) else _one_part(p) for p in parts]
    placed = place_parts(as_parts)
    if placed is None:
        return None
    return tuple(_entry(p) for p in placed)


def _one_part(text: str) -> Part:
    parsed = RuleParser().parse(text)
    if len(parsed) == 1 and parsed[0].text == text:
        return parsed[0]
    return Part(text, text, anchor_of(text), 1.0, anchor_of(text) is not None)


def _entry(part: Part) -> LayoutEntry:
    assert part.place is not None
    return layout_entry(part.prompt(), part.place[0], part.place[1], part.scale)
