"""EngineConfig: every optimization is an opt-in switch; defaults are the safe, unoptimized path."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STEP_CACHES = ("none", "first_block", "taylorseer", "magcache", "agentloop")
"""Values of ``EngineConfig.step_cache``."""

ROW_MODES = ("gather", "whole")
"""Values of ``EngineConfig.step_cache_rows`` (ours only)."""

STEP_CACHE_DEFAULTS: dict[str, dict[str, Any]] = {
    "first_block": {"threshold": 0.05},
    "taylorseer": {"max_skips": 2, "warmup": 4},
    "magcache": {"threshold": 0.06, "max_skips": 3, "warmup": 4},
    "agentloop": {"threshold": 0.12, "max_skips": 2, "warmup": 2},
}
"""Per-method defaults for the parameters ``EngineConfig`` leaves at None (chosen on the shapes
model, see docs/engine.md "Step caching")."""

MAGCACHE_FILE = "magcache.json"
"""The calibration file a model folder carries for ``step_cache="magcache"``."""


@dataclass(frozen=True)
class StepCacheSettings:
    """A resolved step-cache choice: the method and its parameters (defaults filled in)."""

    method: str = "none"
    threshold: float = 0.0
    max_skips: int = 0
    warmup: int = 0
    rows: str = "gather"
    magcache_file: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> StepCacheSettings:
        """Read ``step_cache*`` fields off an EngineConfig (missing fields: method "none")."""
        method = getattr(config, "step_cache", "none") or "none"
        if method not in STEP_CACHES:
            raise ValueError(f"unknown step_cache {method!r}; expected one of {STEP_CACHES}")
        defaults = STEP_CACHE_DEFAULTS.get(method, {})

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(config, f"step_cache_{name}", None)
            return defaults.get(name, fallback) if value is None else value

        settings = cls(
            method=method,
            threshold=float(pick("threshold", 0.0)),
            max_skips=int(pick("max_skips", 0)),
            warmup=int(pick("warmup", 0)),
            rows=str(getattr(config, "step_cache_rows", "gather") or "gather"),
            magcache_file=getattr(config, "magcache_file", None),
        )
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ValueError on parameters no method can use."""
        problems = []
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            problems.append(f"step_cache_threshold {self.threshold!r} is not a number >= 0")
        if self.max_skips < 0:
            problems.append(f"step_cache_max_skips {self.max_skips!r} is below 0")
        if self.warmup < 0:
            problems.append(f"step_cache_warmup {self.warmup!r} is below 0")
        if self.rows not in ROW_MODES:
            problems.append(f"step_cache_rows {self.rows!r} is not one of {ROW_MODES}")
        if self.method == "taylorseer" and self.max_skips < 1:
            problems.append("taylorseer needs step_cache_max_skips >= 1 (steps predicted per interval)")
        if problems:
            raise ValueError("invalid step cache settings: " + "; ".join(problems))


@dataclass(frozen=True)
class EngineConfig:
    """Switches for the diffusion engine. Each speed-up states its quality cost in a benchmark."""

    device: str = "auto"
    """"auto" picks cuda when available, else cpu; or an explicit torch device string."""

    dtype: str = "float32"
    """Weights and activations dtype: "float32", "float16" or "bfloat16" (highest precision by default)."""

    batching: bool = True
    """Run requests that share shape, steps and guidance as one batch."""

    max_batch: int = 16
    """Largest batch handed to the pipeline at once."""

    text_embedding_cache: bool = True
    """Reuse prompt embeddings across calls (keyed by prompt text; the runner lives as long as
    its worker keeps the model, so a goal's later iterations find their texts). Texts not in
    the cache are encoded together, one encoder call per batch. Exact: same embeddings."""

    own_loop: bool = True
    """Denoise Flux pipelines with the runner's own loop (``engine.denoise``): the prompts'
    and the negatives' rows in one transformer call per step. Off: the stock pipeline call
    (two calls per step under classifier-free guidance). Same images to float rounding
    (PSNR >= 60 dB). Other pipelines always run the stock call."""

    cfg_truncation: float = 1.0
    """Fraction of the steps, from the first, that run classifier-free guidance; later steps
    drop the negative prompt's rows and predict from the prompt alone. 1.0: guidance on every
    step. Applies to the own loop (Flux); the stock pipeline call always guides every step."""

    fused_adaln: bool = False
    """Route DiT adaptive LayerNorm (+ modulation, gated residual) through kernels' dispatcher."""

    fused_activations: bool = False
    """Route feed-forward GELU(tanh)/GEGLU through kernels' dispatcher."""

    int8_attention: bool = False
    """Route attention through the INT8 Q·K kernel (SageAttention-style) via kernels' dispatcher."""

    step_cache: str = "none"
    """Skip transformer work on steps that barely change (docs/engine.md, "Step caching"):
    "none", "first_block" (diffusers' FirstBlockCache), "taylorseer" (diffusers' TaylorSeer),
    "magcache" (diffusers' MagCache, calibrated per model: ``python -m engine.calibrate_magcache``)
    or "agentloop" (ours: FirstBlockCache's test per batch row, with a cap on skips in a row)."""

    step_cache_threshold: float | None = None
    """first_block / agentloop: relative change of the first block's residual under which a
    step is skipped; magcache: accumulated error allowed. None: the method's default."""

    step_cache_max_skips: int | None = None
    """Most steps skipped in a row (agentloop, magcache; taylorseer: steps predicted between
    two computed ones). None: the method's default."""

    step_cache_warmup: int | None = None
    """Leading steps never skipped (agentloop, magcache, taylorseer). None: the method's default."""

    step_cache_rows: str = "gather"
    """agentloop: "gather" runs the remaining blocks on the rows that compute only; "whole"
    computes the whole batch unless every row may skip (fixed shapes, less saved)."""

    magcache_file: str | None = None
    """MagCache calibration to use; None: ``magcache.json`` in the model's folder."""

    cache_dir: str | None = None
    """Where generated offline files (preset tokenizers) are cached; None: $AGENTLOOP_CACHE_DIR
    or ~/.cache/agentloop."""

    def __post_init__(self) -> None:
        value = self.cfg_truncation
        if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1):
            raise ValueError(f"cfg_truncation {value!r} is not a number in [0, 1]")
        StepCacheSettings.from_config(self)  # a bad step-cache switch fails here, clearly

    def resolved_cache_dir(self) -> Path:
        """The folder for generated offline files."""
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        from engine.catalog import default_cache_dir

        return default_cache_dir()

    def resolved_device(self) -> str:
        """The torch device string this config runs on."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
