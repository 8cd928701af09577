"""Regional prompting: how much each region's prompt rules each latent position.

A layout request is denoised as one batch row per region, all rows starting from the same
noise. For the first part of the schedule (``EngineConfig.layout_split``) the rows are
replaced after every scheduler step by one blend, each position taking its regions' latents
in proportion to these weights (MultiDiffusion, Bar-Tal et al. 2023); then each row goes on
alone, on its own prompt, and the finished rows are blended once with the same weights. For
a deterministic first-order flow-matching step, which is linear in the model output,
blending the stepped latents equals stepping once with the blended prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.types import Region

SOFTNESS = 0.01
"""Squared distance (in image widths) over which a region's weight falls off by e at a
border between two anchors: small enough that each region keeps the area nearest its anchor,
large enough to blend the seam over about one latent position. Used where a region is cut
out of an image (the scorer's region views, a repair's mask); a layout is drawn with a
softer seam (``EngineConfig.layout_softness``)."""


def region_weights(
    regions: Sequence[Region], rows: int, cols: int, softness: float = SOFTNESS
) -> torch.Tensor:
    """(len(regions), rows, cols) weights, summing to 1 over the regions at every position.

    Position (i, j) is the cell centre ((j + 0.5) / cols, (i + 0.5) / rows); each region's
    weight there is a softmax of its anchor's negative squared distance over ``softness``,
    so the nearest anchor dominates and two anchors share the cells on their border. A
    region's ``scale`` divides its distances (scale 1.2 reaches 1.2 times as far), so the
    border between a large and a small object's regions moves toward the small one.
    """
    if not regions:
        raise ValueError("a layout needs at least one region")
    ys = (torch.arange(rows, dtype=torch.float64) + 0.5) / rows
    xs = (torch.arange(cols, dtype=torch.float64) + 0.5) / cols
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    dist = torch.stack([((xx - r.x) ** 2 + (yy - r.y) ** 2) / r.scale**2 for r in regions])
    return torch.softmax(-dist / softness, dim=0).float()
