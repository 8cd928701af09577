"""Fused GELU and GEGLU for DiT feed-forward layers.

- ``gelu``: GELU, tanh approximation (``approximate="tanh"``, what Flux uses) or exact erf.
- ``geglu``: diffusers' GEGLU convention (``diffusers/models/activations.py``): split the last
  dim in two halves, ``hidden, gate = x.chunk(2, dim=-1)``, return ``hidden * gelu(gate)``,
  exact (erf) GELU by default, as diffusers' ``GEGLU`` does. One read of ``x``, one write of
  the half-width output, instead of a chunk, a GELU and a multiply.

Both kernels view the input as rows x columns (all leading dims flattened into rows, which
is a view for the usual contiguous activations) and compute in fp32, rounding once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._launch import check_launchable, next_pow2

APPROXIMATIONS = ("tanh", "none")
"""``approximate`` values, as in ``torch.nn.functional.gelu``."""


@triton.jit
def _gelu_kernel(
    X, Y,
    n_rows, n_cols,
    stride_xm, stride_xn,
    stride_ym, stride_yn,
    GATED: tl.constexpr, APPROX_TANH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Y = gelu(X) or, GATED, Y = X[:, :n] * gelu(X[:, n:]) with n = n_cols (Y's width)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    row_off = rows.to(tl.int64)[:, None] * stride_xm
    if GATED:
        a = tl.load(X + row_off + cols[None, :] * stride_xn, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + row_off + (cols[None, :] + n_cols) * stride_xn, mask=mask, other=0.0)
    else:
        x = tl.load(X + row_off + cols[None, :] * stride_xn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if APPROX_TANH:
        # 0.5 * x * (1 + tanh(u)), u = sqrt(2/pi) * (x + 0.044715 x^3); tanh from exp(-2|u|),
        # which never overflows (no tanh in the interpreter's tl.math on every version).
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        e = tl.exp(-2.0 * tl.abs(u))
        tanh_abs = (1.0 - e) / (1.0 + e)
        tanh_u = tl.where(u >= 0, tanh_abs, -tanh_abs)
        y = 0.5 * x * (1.0 + tanh_u)
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    if GATED:
        y = a * y
    y_ptrs = Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, *, gated: bool, approximate: str) -> torch.Tensor:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, not {approximate!r}")
    check_launchable(x)
    width = x.shape[-1]
    if gated and width % 2:
        raise ValueError(f"geglu needs an even last dim, got {width}")
    out_width = width // 2 if gated else width
    x2 = x.reshape(-1, width)
    y = torch.empty((*x.shape[:-1], out_width), dtype=x.dtype, device=x.device)
    y2 = y.view(-1, out_width)
    n_rows = x2.shape[0]
    block_n = min(next_pow2(out_width), 1024)
    block_m = max(1, min(64, 4096 // block_n))
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(out_width, block_n))
    _gelu_kernel[grid](
        x2, y2,
        n_rows, out_width,
        x2.stride(0), x2.stride(1),
        y2.stride(0), y2.stride(1),
        GATED=gated, APPROX_TANH=approximate == "tanh",
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return y


def gelu_triton(x: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    """GELU of ``x`` (any shape), tanh approximation by default, in one kernel."""
    return _launch(x, gated=False, approximate=approximate)


def geglu_triton(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """``hidden * gelu(gate)`` with ``hidden, gate = x.chunk(2, -1)``, in one kernel."""
    return _launch(x, gated=True, approximate=approximate)


# ---------------------------------------------------------------------------------------------
# Torch references


def gelu_torch(x: torch.Tensor, *, approximate: str = "tanh") -> torch.Tensor:
    """Reference for :func:`gelu_triton`."""
    return F.gelu(x, approximate=approximate)


def geglu_torch(x: torch.Tensor, *, approximate: str = "none") -> torch.Tensor:
    """Reference for :func:`geglu_triton`: diffusers' ``GEGLU.forward`` after its projection."""
    hidden, gate = x.chunk(2, dim=-1)
    return hidden * F.gelu(gate, approximate=approximate)
