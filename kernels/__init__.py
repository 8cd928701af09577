"""Triton kernels for the diffusion hot path, each beside its torch reference, behind one dispatcher.

- :mod:`kernels.adaln`: fused adaptive LayerNorm/RMSNorm + modulation, fused gated residual.
- :mod:`kernels.activations`: fused GELU (tanh or exact) and GEGLU.
- :mod:`kernels.attention_int8`: SageAttention-style attention (INT8 Q·K^T, FP16 P·V).
- :mod:`kernels.dispatch`: picks the Triton kernel on CUDA when its constraints hold, the
  torch reference everywhere else; ``force=`` / :func:`forced` pin a path for tests.
- :mod:`kernels.flux`: :func:`install` patches a diffusers Flux transformer to use the dispatcher.

See docs/kernels.md for constraints, the error rule the tests apply, and the benchmark.
"""

from kernels.dispatch import (
    CALLS,
    adaln,
    attention,
    forced,
    gated_adaln,
    gated_residual,
    geglu,
    gelu,
    gelu_tanh,
)
from kernels.flux import KernelFluxAttnProcessor, install, uninstall

__all__ = [
    "CALLS",
    "KernelFluxAttnProcessor",
    "adaln",
    "attention",
    "forced",
    "gated_adaln",
    "gated_residual",
    "geglu",
    "gelu",
    "gelu_tanh",
    "install",
    "uninstall",
]
