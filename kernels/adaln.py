"""Fused adaptive LayerNorm for DiT blocks, and the fused gated residual add.

Three ops, each a Triton kernel with its torch reference beside it:

- ``adaln``: ``norm(x) * (1 + scale) + shift``, where ``norm`` is LayerNorm or RMSNorm over the
  last dim (optional elementwise weight/bias), and ``shift``/``scale`` are per batch item,
  broadcast over tokens. What diffusers' AdaLayerNormZero / AdaLayerNormZeroSingle /
  AdaLayerNormContinuous do after their ``linear(silu(emb))``.
- ``gated_adaln``: ``h = residual + gate * y`` then ``adaln(h)``; returns both ``h`` (the new
  residual stream) and the modulated norm: the seam between attention and feed-forward in a
  Flux double block, in one pass over memory instead of four.
- ``gated_residual``: ``residual + gate * y`` alone (the end of a block).

Shapes: ``x``, ``residual``, ``y``: (batch, tokens, dim); ``shift``, ``scale``, ``gate``:
(batch, dim), any strides (they are usually views from ``emb.chunk(6, dim=1)``). The kernels
compute in fp32 and round once into ``x``'s dtype; ``h`` is rounded before it is normalized,
so the normalized value is exactly the norm of the residual that is stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._launch import check_launchable, next_pow2

NORMS = ("layer", "rms")
"""Supported norms: LayerNorm (mean and variance) and RMSNorm (root mean square only)."""


@triton.jit
def _adaln_kernel(
    X, R, G, SHIFT, SCALE, W, B, Y, H,
    n_rows, n_tokens, n_cols, eps,
    stride_xb, stride_xt, stride_xd,
    stride_rb, stride_rt, stride_rd,
    stride_gb, stride_gd,
    stride_shb, stride_shd,
    stride_scb, stride_scd,
    stride_yb, stride_yt, stride_yd,
    stride_hb, stride_ht, stride_hd,
    RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program normalizes BLOCK_ROWS rows (a row is one token of one batch item)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    b = (rows // n_tokens).to(tl.int64)
    t = (rows % n_tokens).to(tl.int64)

    x_ptrs = X + b[:, None] * stride_xb + t[:, None] * stride_xt + cols[None, :] * stride_xd
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = R + b[:, None] * stride_rb + t[:, None] * stride_rt + cols[None, :] * stride_rd
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        g_ptrs = G + b[:, None] * stride_gb + cols[None, :] * stride_gd
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        h = (r + g * x).to(H.dtype.element_ty)
        h_ptrs = H + b[:, None] * stride_hb + t[:, None] * stride_ht + cols[None, :] * stride_hd
        tl.store(h_ptrs, h, mask=mask)
        x = h.to(tl.float32)

    if RMS:
        mean_sq = tl.sum(x * x, axis=1) / n_cols
        x_norm = x * tl.math.rsqrt(mean_sq + eps)[:, None]
    else:
        mean = tl.sum(x, axis=1) / n_cols
        centered = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(centered * centered, axis=1) / n_cols
        x_norm = centered * tl.math.rsqrt(var + eps)[:, None]
    if HAS_WEIGHT:
        x_norm = x_norm * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        x_norm = x_norm + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]

    shift = tl.load(
        SHIFT + b[:, None] * stride_shb + cols[None, :] * stride_shd, mask=mask, other=0.0
    )
    scale = tl.load(
        SCALE + b[:, None] * stride_scb + cols[None, :] * stride_scd, mask=mask, other=0.0
    )
    y = x_norm * (1.0 + scale.to(tl.float32)) + shift.to(tl.float32)
    y_ptrs = Y + b[:, None] * stride_yb + t[:, None] * stride_yt + cols[None, :] * stride_yd
    tl.store(y_ptrs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_residual_kernel(
    R, G, X, OUT,
    n_rows, n_tokens, n_cols,
    stride_rb, stride_rt, stride_rd,
    stride_gb, stride_gd,
    stride_xb, stride_xt, stride_xd,
    stride_ob, stride_ot, stride_od,
    BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """OUT = R + G * X, G broadcast over tokens; a 2-D tile of rows x columns per program."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    b = (rows // n_tokens).to(tl.int64)
    t = (rows % n_tokens).to(tl.int64)
    r = tl.load(R + b[:, None] * stride_rb + t[:, None] * stride_rt + cols[None, :] * stride_rd,
                mask=mask, other=0.0)  # fmt: skip
    x = tl.load(X + b[:, None] * stride_xb + t[:, None] * stride_xt + cols[None, :] * stride_xd,
                mask=mask, other=0.0)  # fmt: skip
    g = tl.load(G + b[:, None] * stride_gb + cols[None, :] * stride_gd, mask=mask, other=0.0)
    out = r.to(tl.float32) + g.to(tl.float32) * x.to(tl.float32)
    tl.store(OUT + b[:, None] * stride_ob + t[:, None] * stride_ot + cols[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=mask)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Launchers


def _rows_and_warps(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_ROWS, num_warps): whole rows per program, ~4K elements per tile."""
    block_d = next_pow2(n_cols)
    block_rows = max(1, min(64, 4096 // block_d))
    num_warps = 8 if block_d >= 2048 else 4
    return block_d, block_rows, num_warps


def _launch_adaln(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm: str,
    eps: float,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    gate: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, not {norm!r}")
    batch, tokens, dim = x.shape
    optional = [t for t in (weight, bias, residual, gate) if t is not None]
    check_launchable(x, shift, scale, *optional)
    y = torch.empty((batch, tokens, dim), dtype=x.dtype, device=x.device)
    h = torch.empty_like(y) if residual is not None else None
    # Unused pointers still need a tensor; pass x (never read: the constexpr flags are off).
    r = residual if residual is not None else x
    g = gate if gate is not None else shift
    hh = h if h is not None else y
    w = weight if weight is not None else x
    bb = bias if bias is not None else x
    block_d, block_rows, num_warps = _rows_and_warps(dim)
    n_rows = batch * tokens
    grid = (triton.cdiv(n_rows, block_rows),)
    _adaln_kernel[grid](
        x, r, g, shift, scale, w, bb, y, hh,
        n_rows, tokens, dim, float(eps),
        x.stride(0), x.stride(1), x.stride(2),
        r.stride(0), r.stride(1), r.stride(2),
        g.stride(0), g.stride(1),
        shift.stride(0), shift.stride(1),
        scale.stride(0), scale.stride(1),
        y.stride(0), y.stride(1), y.stride(2),
        hh.stride(0), hh.stride(1), hh.stride(2),
        RMS=norm == "rms", HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return y, h


def adaln_triton(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm: str = "layer",
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]`` in one kernel; x (B, T, D)."""
    y, _ = _launch_adaln(
        x, shift, scale, norm=norm, eps=eps, weight=weight, bias=bias, residual=None, gate=None
    )
    return y


def gated_adaln_triton(
    residual: torch.Tensor,
    gate: torch.Tensor,
    y: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm: str = "layer",
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate[:, None] * y``; returns ``(h, adaln(h, shift, scale))``, one kernel."""
    out, h = _launch_adaln(
        y, shift, scale, norm=norm, eps=eps, weight=weight, bias=bias, residual=residual, gate=gate
    )
    assert h is not None
    return h, out


def gated_residual_triton(
    residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """``residual + gate[:, None] * y`` in one kernel; residual, y (B, T, D), gate (B, D)."""
    check_launchable(residual, gate, y)
    batch, tokens, dim = residual.shape
    out = torch.empty((batch, tokens, dim), dtype=residual.dtype, device=residual.device)
    block_d = min(next_pow2(dim), 1024)
    block_rows = max(1, min(64, 4096 // block_d))
    n_rows = batch * tokens
    grid = (triton.cdiv(n_rows, block_rows), triton.cdiv(dim, block_d))
    _gated_residual_kernel[grid](
        residual, gate, y, out,
        n_rows, tokens, dim,
        residual.stride(0), residual.stride(1), residual.stride(2),
        gate.stride(0), gate.stride(1),
        y.stride(0), y.stride(1), y.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# Torch references: the same ops as diffusers writes them (eager, in the inputs' dtype).


def _norm_torch(
    x: torch.Tensor, norm: str, eps: float, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    if norm == "layer":
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if norm == "rms":
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
        return out + bias if bias is not None else out
    raise ValueError(f"norm must be one of {NORMS}, not {norm!r}")


def adaln_torch(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm: str = "layer",
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for :func:`adaln_triton`."""
    return _norm_torch(x, norm, eps, weight, bias) * (1 + scale[:, None]) + shift[:, None]


def gated_adaln_torch(
    residual: torch.Tensor,
    gate: torch.Tensor,
    y: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm: str = "layer",
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`gated_adaln_triton`."""
    h = residual + gate[:, None] * y
    return h, adaln_torch(h, shift, scale, norm=norm, eps=eps, weight=weight, bias=bias)


def gated_residual_torch(
    residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Reference for :func:`gated_residual_triton`."""
    return residual + gate[:, None] * y
