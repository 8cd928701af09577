"""EngineConfig: every optimization is an opt-in switch; defaults are the safe, unoptimized path."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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

    cache_dir: str | None = None
    """Where generated offline files (preset tokenizers) are cached; None: $AGENTLOOP_CACHE_DIR
    or ~/.cache/agentloop."""

    def __post_init__(self) -> None:
        import math

        value = self.cfg_truncation
        if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1):
            raise ValueError(f"cfg_truncation {value!r} is not a number in [0, 1]")

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
