"""INT8 attention: the kernel vs the torch reference of the same quantized math (flash rule),
and the quantized math vs fp32 SDPA (a stated tolerance: the price of INT8 Q·K^T)."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.attention_int8 import (
    K_BLOCK,
    LOG2E,
    Q_BLOCK,
    attention_int8_torch,
    key_mean,
    quantize_per_block_torch,
    quantize_per_block_triton,
    sdpa_torch,
)

pytestmark = pytest.mark.triton

SDPA_REL_L2 = 0.03
"""Stated bound: ||int8 - sdpa_fp32|| / ||sdpa_fp32|| on these inputs (measured ~0.012)."""
SDPA_MAX_ABS = 0.05
"""Stated bound: max |int8 - sdpa_fp32| on these inputs (measured ~0.012-0.016; |out| ~ 1)."""

# (batch, heads, queries, keys, head_dim): odd lengths, q != k lengths, every head dim.
SHAPES = [
    (1, 2, 113, 113, 64),
    (2, 1, 200, 77, 16),
    (1, 2, 64, 130, 32),
    (1, 1, 113, 113, 128),
    (1, 2, 7, 5, 32),  # fewer tokens than one block
]


def _qkv(shape, dtype, device, seed=0, key_offset=3.0):
    """Gaussian q, v; k with a per-channel offset (the outlier that K smoothing removes)."""
    batch, heads, seq_q, seq_k, dim = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, dim, generator=gen)
    k = torch.randn(batch, heads, seq_k, dim, generator=gen) + key_offset * torch.randn(
        dim, generator=gen
    )
    v = torch.randn(batch, heads, seq_k, dim, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v)]


def _f32(*tensors):
    return [t.float() for t in tensors]


def test_quantization_matches_reference(device) -> None:
    q, k, _ = _qkv((2, 3, 200, 150, 64), torch.float16, device)
    q8, q_scales = quantize_per_block_triton(q, Q_BLOCK, multiplier=0.125 * LOG2E)
    q8_ref, q_scales_ref = quantize_per_block_torch(q, Q_BLOCK, multiplier=0.125 * LOG2E)
    k8, k_scales = quantize_per_block_triton(k, K_BLOCK, mean=key_mean(k))
    k8_ref, k_scales_ref = quantize_per_block_torch(k, K_BLOCK, mean=key_mean(k))
    torch.testing.assert_close(q_scales, q_scales_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(k_scales, k_scales_ref, rtol=1e-6, atol=0)
    for got, want in ((q8, q8_ref), (k8, k8_ref)):
        diff = (got.int() - want.int()).abs()
        # Bit-identical in the interpreter; compiled fp32 division may round a tie the other way.
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
        assert got.abs().max() == 127  # every block uses the full INT8 range
    assert k8.abs().max() <= 127 and q8.dtype == torch.int8


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attention_matches_quantized_reference(shape, dtype, device, flash_rule, atol) -> None:
    if dtype == torch.float32 and device == "cuda":
        pytest.skip("the CUDA kernel takes fp16/bf16 (P·V in that dtype)")
    q, k, v = _qkv(shape, dtype, device)
    out = dispatch.attention(q, k, v, force="triton")
    assert out.dtype == dtype and out.shape == q.shape
    torch_out = attention_int8_torch(q, k, v)  # same quantization, P·V in the same dtype
    ref = attention_int8_torch(*_f32(q, k, v), pv_dtype=torch.float32)
    flash_rule(out, torch_out, ref, atol=atol[dtype] / 10, what="int8 attention vs quantized ref")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attention_close_to_fp32_sdpa(shape, low_dtype, device) -> None:
    q, k, v = _qkv(shape, low_dtype, device, seed=1)
    out = dispatch.attention(q, k, v, force="triton").float()
    ref = sdpa_torch(*_f32(q, k, v))
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= SDPA_REL_L2, rel
    assert (out - ref).abs().max().item() <= SDPA_MAX_ABS


def test_key_smoothing_is_what_keeps_int8_accurate(device) -> None:
    """Without subtracting K's mean a channel offset eats the INT8 range; with it, it is harmless."""
    q, k, v = _qkv((1, 2, 113, 113, 64), torch.float32, device, key_offset=20.0)
    ref = sdpa_torch(q, k, v)
    smoothed = attention_int8_torch(q, k, v)
    # The same math with the mean left in: quantize K as is (mean=None) by hand.
    q8, qs = quantize_per_block_torch(q, Q_BLOCK, multiplier=64**-0.5 * LOG2E)
    k8, ks = quantize_per_block_torch(k, K_BLOCK)
    s = (q8.float() @ k8.float().transpose(-1, -2)) * qs.repeat_interleave(Q_BLOCK, -1)[
        ..., :113, None
    ]
    s = s * ks.repeat_interleave(K_BLOCK, -1)[..., None, :113]
    raw = torch.softmax(s / LOG2E, dim=-1) @ v
    err_smoothed = (smoothed - ref).norm() / ref.norm()
    err_raw = (raw - ref).norm() / ref.norm()
    assert err_smoothed < SDPA_REL_L2 < err_raw


def test_key_padding_mask(low_dtype, device, flash_rule, atol) -> None:
    shape = (2, 2, 113, 90, 64)
    q, k, v = _qkv(shape, low_dtype, device, seed=2)
    keep = torch.rand(2, 90, generator=torch.Generator().manual_seed(3)) > 0.4
    keep[1, 70:] = False  # a padded tail, as padded text tokens give
    keep[0, :64] = False  # a whole first K block masked: the online softmax starts at -inf
    keep = keep.to(device)
    out = dispatch.attention(q, k, v, key_padding_mask=keep, force="triton")
    torch_out = attention_int8_torch(q, k, v, key_padding_mask=keep)
    ref = attention_int8_torch(*_f32(q, k, v), key_padding_mask=keep, pv_dtype=torch.float32)
    flash_rule(out, torch_out, ref, atol=atol[low_dtype] / 10, what="masked int8 attention")
    sdpa = sdpa_torch(*_f32(q, k, v), key_padding_mask=keep)
    assert ((out.float() - sdpa).norm() / sdpa.norm()).item() <= SDPA_REL_L2


def test_fully_masked_rows_are_zero(device) -> None:
    q, k, v = _qkv((2, 1, 40, 70, 32), torch.float16, device)
    keep = torch.ones(2, 70, dtype=torch.bool, device=device)
    keep[0] = False
    out = dispatch.attention(q, k, v, key_padding_mask=keep, force="triton")
    ref = attention_int8_torch(q, k, v, key_padding_mask=keep)
    assert (out[0] == 0).all() and (ref[0] == 0).all()
    assert out[1].abs().sum() > 0


def test_strided_bshd_views(device) -> None:
    """(B, S, H, D) buffers viewed as (B, H, S, D), the Flux processor's layout, need no copy."""
    q, k, v = _qkv((2, 3, 113, 113, 32), torch.float16, device, seed=4)
    views = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not views[0].is_contiguous()
    out_views = dispatch.attention(*views, force="triton")
    out = dispatch.attention(q, k, v, force="triton")
    torch.testing.assert_close(out_views, out, rtol=0, atol=0)
    # The output keeps q's layout, so transposing back to (B, S, H, D) is free.
    assert out_views.transpose(1, 2).is_contiguous()


@pytest.mark.slow
def test_attention_1023_tokens(device, flash_rule, atol) -> None:
    q, k, v = _qkv((1, 2, 1023, 1023, 64), torch.float16, device, seed=5)
    out = dispatch.attention(q, k, v, force="triton")
    torch_out = attention_int8_torch(q, k, v)
    ref = attention_int8_torch(*_f32(q, k, v), pv_dtype=torch.float32)
    flash_rule(out, torch_out, ref, atol=atol[torch.float16] / 10, what="int8 attention 1023")
    sdpa = sdpa_torch(*_f32(q, k, v))
    assert ((out.float() - sdpa).norm() / sdpa.norm()).item() <= SDPA_REL_L2
