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

    text_embedding_cache: bool = False
    """Reuse prompt embeddings across calls (keyed by prompt text)."""

    fused_adaln: bool = False
    """Route DiT adaptive LayerNorm (+ modulation, gated residual) through kernels' dispatcher."""

    fused_activations: bool = False
    """Route feed-forward GELU(tanh)/GEGLU through kernels' dispatcher."""

    int8_attention: bool = False
    """Route attention through the INT8 Q·K kernel (SageAttention-style) via kernels' dispatcher."""

    cache_dir: str | None = None
    """Where generated offline files (preset tokenizers) are cached; None: $AGENTLOOP_CACHE_DIR
    or ~/.cache/agentloop."""

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
