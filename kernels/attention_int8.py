"""SageAttention-style attention: INT8 Q·K^T, FP16 P·V, online softmax.

The math (Zhang et al., "SageAttention", arXiv 2410.02367), non-causal, layout
(batch, heads, tokens, head_dim) like ``torch.nn.functional.scaled_dot_product_attention``:

1. Smooth K: subtract the mean of K over tokens, per batch item and head. Exact for softmax
   (it shifts every score of a query row by the same ``q·mean``) and it removes the
   channel-wise offset of K that would otherwise eat the INT8 range.
2. Quantize Q (pre-multiplied by ``sm_scale * log2(e)``, so the softmax can use ``exp2``) per
   block of ``Q_BLOCK`` rows and K per block of ``K_BLOCK`` rows to INT8: ``scale = max|x| / 127``
   over the block, ``q8 = round_half_away(x / scale)``.
3. Per tile: ``S = (q8 · k8^T in int32) * q_scale * k_scale``; online softmax in fp32; ``P`` is
   cast to V's dtype (fp16/bf16) for ``P · V`` with an fp32 accumulator.

An optional key padding mask (batch, keys), True = attend, covers the non-causal masks
diffusion models use (padded text tokens). A query row with no key to attend to returns 0
(SDPA returns NaN there). K's mean is taken over all tokens, padded ones included: any
constant vector leaves the softmax unchanged, so this only affects quantization ranges.

The torch reference, :func:`attention_int8_torch`, runs the very same quantized math (same
blocks, same rounding, exact integer products) with a full softmax instead of the online one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._launch import check_launchable

LOG2E = 1.4426950408889634
"""log2(e): folded into Q's multiplier so the kernel's softmax is a base-2 one."""

Q_BLOCK = 128
"""Rows of Q per quantization block, and per attention program (BLOCK_M)."""

K_BLOCK = 64
"""Rows of K per quantization block, and per inner-loop tile (BLOCK_N)."""

HEAD_DIMS = (16, 32, 64, 128)
"""Head dims the kernel is written for (powers of two, tl.dot needs >= 16)."""


@triton.jit
def _quantize_kernel(
    X, MEAN, XQ, SCALE,
    seq_len, multiplier,
    stride_xb, stride_xh, stride_xs, stride_xd,
    stride_mb, stride_mh, stride_md,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_sb, stride_sh, stride_sn,
    HAS_MEAN: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """INT8-quantize one block of BLOCK rows of one (batch, head): ((x - mean) * multiplier)."""
    blk = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM)
    row_ok = (rows < seq_len)[:, None]
    x_ptrs = (
        X + b * stride_xb + h * stride_xh + rows[:, None] * stride_xs + dims[None, :] * stride_xd
    )
    x = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_MEAN:
        mean = tl.load(MEAN + b * stride_mb + h * stride_mh + dims * stride_md)
        x = x - mean[None, :]
    x = tl.where(row_ok, x * multiplier, 0.0)
    amax = tl.max(tl.abs(x))
    scale = tl.where(amax > 0.0, amax / 127.0, 1.0)
    xs = x / scale
    xq = (xs + tl.where(xs >= 0.0, 0.5, -0.5)).to(tl.int8)  # round half away from zero
    q_ptrs = (
        XQ + b * stride_qb + h * stride_qh + rows[:, None] * stride_qs + dims[None, :] * stride_qd
    )
    tl.store(q_ptrs, xq, mask=row_ok)
    tl.store(SCALE + b * stride_sb + h * stride_sh + blk * stride_sn, scale)


@triton.jit
def _attn_int8_kernel(
    Q8, K8, V, QS, KS, KEEP, OUT,
    seq_q, seq_k,
    stride_qb, stride_qh, stride_qs, stride_qd,
    stride_kb, stride_kh, stride_ks, stride_kd,
    stride_vb, stride_vh, stride_vs, stride_vd,
    stride_qsb, stride_qsh, stride_qsn,
    stride_ksb, stride_ksh, stride_ksn,
    stride_mb, stride_ms,
    stride_ob, stride_oh, stride_os, stride_od,
    HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head) against every key, online softmax."""
    start_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    q_ptrs = (
        Q8
        + b * stride_qb
        + h * stride_qh
        + offs_m[:, None] * stride_qs
        + offs_d[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=(offs_m < seq_q)[:, None], other=0)
    q_scale = tl.load(QS + b * stride_qsb + h * stride_qsh + start_m * stride_qsn)
    # K is read transposed, (HEAD_DIM, BLOCK_N), so that tl.dot(q, k) is Q·K^T.
    k_ptrs = (
        K8
        + b * stride_kb
        + h * stride_kh
        + offs_n[None, :] * stride_ks
        + offs_d[:, None] * stride_kd
    )
    v_ptrs = (
        V
        + b * stride_vb
        + h * stride_vh
        + offs_n[:, None] * stride_vs
        + offs_d[None, :] * stride_vd
    )
    ks_ptr = KS + b * stride_ksb + h * stride_ksh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, seq_k, BLOCK_N):
        in_range = (start_n + offs_n) < seq_k
        key_ok = in_range
        k = tl.load(k_ptrs + start_n * stride_ks, mask=in_range[None, :], other=0)
        k_scale = tl.load(ks_ptr + (start_n // BLOCK_N) * stride_ksn)
        s = tl.dot(q, k, out_dtype=tl.int32).to(tl.float32) * q_scale * k_scale
        if HAS_MASK:
            keep = tl.load(
                KEEP + b * stride_mb + (start_n + offs_n) * stride_ms, mask=in_range, other=0
            )
            key_ok = key_ok & (keep != 0)
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no key so far keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptrs + start_n * stride_vs, mask=in_range[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty), v, out_dtype=tl.float32)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = (
        OUT
        + b * stride_ob
        + h * stride_oh
        + offs_m[:, None] * stride_os
        + offs_d[None, :] * stride_od
    )
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=(offs_m < seq_q)[:, None])


# ---------------------------------------------------------------------------------------------
# Launchers


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """K's mean over tokens in fp32, (B, H, 1, D): the smoothing both paths subtract."""
    return k.float().mean(dim=2, keepdim=True)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (batch, heads, tokens, head_dim)")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def quantize_per_block_triton(
    x: torch.Tensor, block: int, *, multiplier: float = 1.0, mean: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 of ``(x - mean) * multiplier`` per block of rows: (int8 (B, H, S, D), fp32 scales (B, H, nb))."""
    batch, heads, seq, dim = x.shape
    if dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {dim}")
    check_launchable(x)
    n_blocks = triton.cdiv(seq, block)
    xq = torch.empty((batch, heads, seq, dim), dtype=torch.int8, device=x.device)
    scales = torch.empty((batch, heads, n_blocks), dtype=torch.float32, device=x.device)
    m = mean if mean is not None else scales  # never read without HAS_MEAN
    m_strides = (m.stride(0), m.stride(1), m.stride(3)) if mean is not None else (0, 0, 0)
    _quantize_kernel[(n_blocks, heads, batch)](
        x, m, xq, scales,
        seq, float(multiplier),
        *x.stride(),
        *m_strides,
        *xq.stride(),
        *scales.stride(),
        HAS_MEAN=mean is not None, BLOCK=block, HEAD_DIM=dim, num_warps=4,
    )  # fmt: skip
    return xq, scales


def attention_int8_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """SageAttention-style attention (module docstring), q/k/v (B, H, S, D), any strides.

    The output has q's dtype and memory layout (a (B, S, H, D) buffer viewed as (B, H, S, D)
    when q is such a view, so the caller's transpose back is free).
    """
    _check_qkv(q, k, v)
    batch, heads, seq_q, dim = q.shape
    seq_k = k.shape[2]
    check_launchable(q, k, v)
    sm_scale = dim**-0.5 if scale is None else scale
    q8, q_scales = quantize_per_block_triton(q, Q_BLOCK, multiplier=sm_scale * LOG2E)
    k8, k_scales = quantize_per_block_triton(k, K_BLOCK, mean=key_mean(k))
    out = torch.empty_like(q)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, seq_k):
            raise ValueError(f"key_padding_mask must be (batch, keys) = {(batch, seq_k)}")
        keep = key_padding_mask.to(device=q.device, dtype=torch.int8)
        mask_strides = keep.stride()
    else:
        keep, mask_strides = q8, (0, 0)  # never read without HAS_MASK
    grid = (triton.cdiv(seq_q, Q_BLOCK), heads, batch)
    _attn_int8_kernel[grid](
        q8, k8, v, q_scales, k_scales, keep, out,
        seq_q, seq_k,
        *q8.stride(), *k8.stride(), *v.stride(),
        *q_scales.stride(), *k_scales.stride(),
        *mask_strides,
        *out.stride(),
        HAS_MASK=key_padding_mask is not None, BLOCK_M=Q_BLOCK, BLOCK_N=K_BLOCK, HEAD_DIM=dim,
        num_warps=4 if dim <= 64 else 8, num_stages=3,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# Torch references


def quantize_per_block_torch(
    x: torch.Tensor, block: int, *, multiplier: float = 1.0, mean: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`quantize_per_block_triton` (same rounding, same scales)."""
    batch, heads, seq, dim = x.shape
    xf = x.float()
    if mean is not None:
        xf = xf - mean
    xf = xf * multiplier
    n_blocks = -(-seq // block)
    blocks = F.pad(xf, (0, 0, 0, n_blocks * block - seq)).view(batch, heads, n_blocks, block, dim)
    amax = blocks.abs().amax(dim=(-1, -2))
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    xs = blocks / scales[..., None, None]
    xq = torch.trunc(xs + torch.where(xs >= 0, 0.5, -0.5)).to(torch.int8)
    return xq.view(batch, heads, n_blocks * block, dim)[:, :, :seq], scales


def attention_int8_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    pv_dtype: torch.dtype | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """Reference for :func:`attention_int8_triton`: the same quantized math, full softmax.

    ``pv_dtype`` is the dtype of P and V in P·V (default V's dtype, as in the kernel; pass
    ``torch.float32`` for the fp32 reference of the quantized math). Queries go ``chunk`` rows
    at a time so memory stays O(chunk x keys). Integer products are exact: fp32 on CPU
    (|sum| <= 127 * 127 * 128 < 2**24), fp64 on CUDA (where fp32 matmuls may run as TF32).
    """
    _check_qkv(q, k, v)
    batch, heads, seq_q, dim = q.shape
    seq_k = k.shape[2]
    sm_scale = dim**-0.5 if scale is None else scale
    q8, q_scales = quantize_per_block_torch(q, Q_BLOCK, multiplier=sm_scale * LOG2E)
    k8, k_scales = quantize_per_block_torch(k, K_BLOCK, mean=key_mean(k))
    int_dtype = torch.float64 if q.is_cuda else torch.float32
    k_t = k8.to(int_dtype).transpose(-1, -2)
    q_scale_rows = q_scales.repeat_interleave(Q_BLOCK, dim=-1)[..., :seq_q, None]
    k_scale_cols = k_scales.repeat_interleave(K_BLOCK, dim=-1)[..., None, :seq_k]
    keep = key_padding_mask.bool()[:, None, None, :] if key_padding_mask is not None else None
    pv_dtype = pv_dtype or v.dtype
    v_pv = v.to(pv_dtype)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for start in range(0, seq_q, chunk):
        stop = min(start + chunk, seq_q)
        s = (q8[:, :, start:stop].to(int_dtype) @ k_t).float()
        s = s * q_scale_rows[:, :, start:stop] * k_scale_cols
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        m = s.amax(dim=-1, keepdim=True)
        p = torch.exp2(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
        denom = p.sum(dim=-1, keepdim=True)
        o = (p.to(pv_dtype) @ v_pv).float() / torch.where(denom > 0, denom, torch.ones_like(denom))
        out[:, :, start:stop] = o.to(q.dtype)
    return out


def sdpa_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain ``scaled_dot_product_attention`` with the same mask convention (True = attend)."""
    mask = key_padding_mask.bool()[:, None, None, :] if key_padding_mask is not None else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, dim: int) -> float:
    """Matmul FLOPs of one attention forward (Q·K^T and P·V), as FlashAttention counts them."""
    return 4.0 * batch * heads * seq_q * seq_k * dim
