"""Per-model generation defaults (steps, guidance, size), without importing torch.

A local model folder may carry an `agentloop.json` with its own defaults, e.g.
`{"steps": 20, "guidance": 1.0, "size": 32}`; the shapes model ships one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.catalog import ModelSource, resolve_model

PRESET_DEFAULTS: dict[str, dict[str, Any]] = {
    "tiny-unet": {"steps": 8, "guidance": 1.0, "size": 32},
    "tiny-dit": {"steps": 8, "guidance": 1.0, "size": 32},
}
GENERIC_DEFAULTS: dict[str, Any] = {"steps": 28, "guidance": 5.0, "size": 512}


def model_defaults(name: str, extra_models: tuple[str, ...] = ()) -> dict[str, Any]:
    """Default steps, guidance and size for a model name (generic ones if it has none)."""
    spec = resolve_model(name, extra_models)
    if spec is None:
        return dict(GENERIC_DEFAULTS)
    if spec.source is ModelSource.PRESET:
        return dict(PRESET_DEFAULTS.get(name, GENERIC_DEFAULTS))
    if spec.source is ModelSource.LOCAL:
        meta = Path(spec.location) / "agentloop.json"
        if meta.is_file():
            return {**GENERIC_DEFAULTS, **json.loads(meta.read_text())}
    return dict(GENERIC_DEFAULTS)
