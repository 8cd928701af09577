"""Fused adaLN / gated residual kernels vs fp32 references, under the flash-attention error rule."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.adaln import adaln_torch, gated_adaln_torch, gated_residual_torch

pytestmark = pytest.mark.triton

# Odd token counts and non-power-of-two widths: masked tails in both directions.
SHAPES = [
    (1, 113, 96),
    (2, 37, 200),
    (3, 5, 1000),
    (2, 3, 3072),
]  # 3072: Flux width, one row per program


def _inputs(shape: tuple[int, int, int], dtype: torch.dtype, device: str, seed: int = 0):
    """x, residual (B, T, D) and six (B, D) modulation views chunked from one emb, like diffusers."""
    batch, tokens, dim = shape
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(batch, tokens, dim, generator=gen) * 2 + 0.5).to(device, dtype)
    residual = torch.randn(batch, tokens, dim, generator=gen).to(device, dtype)
    emb = (torch.randn(batch, 6 * dim, generator=gen) * 0.5).to(device, dtype)
    return x, residual, emb.chunk(6, dim=1)


def _f32(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [t.float() if t is not None else None for t in tensors]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
def test_adaln_matches_reference(shape, norm, affine, dtype, device, flash_rule, atol) -> None:
    x, _, (shift, scale, *_) = _inputs(shape, dtype, device)
    dim = shape[-1]
    weight = (1 + 0.1 * torch.randn(dim)).to(device, dtype) if affine else None
    bias = (0.1 * torch.randn(dim)).to(device, dtype) if affine and norm == "layer" else None

    out = dispatch.adaln(
        x, shift, scale, norm=norm, eps=1e-6, weight=weight, bias=bias, force="triton"
    )
    torch_out = adaln_torch(x, shift, scale, norm=norm, eps=1e-6, weight=weight, bias=bias)
    xf, shf, scf, wf, bf = _f32(x, shift, scale, weight, bias)
    ref = adaln_torch(xf, shf, scf, norm=norm, eps=1e-6, weight=wf, bias=bf)
    assert out.dtype == dtype
    flash_rule(out, torch_out, ref, atol=atol[dtype], what=f"adaln {norm}")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gated_adaln_matches_reference(shape, dtype, device, flash_rule, atol) -> None:
    y, residual, (shift, scale, gate, *_) = _inputs(shape, dtype, device, seed=1)
    h, out = dispatch.gated_adaln(residual, gate, y, shift, scale, eps=1e-6, force="triton")
    torch_h, torch_out = gated_adaln_torch(residual, gate, y, shift, scale, eps=1e-6)
    ref_h, ref_out = gated_adaln_torch(*_f32(residual, gate, y, shift, scale), eps=1e-6)
    flash_rule(h, torch_h, ref_h, atol=atol[dtype], what="gated_adaln h")
    flash_rule(out, torch_out, ref_out, atol=atol[dtype], what="gated_adaln out")
    # The normalized value is the norm of the residual that was stored (rounded h), exactly
    # as an unfused norm of h would see it.
    again = dispatch.adaln(h, shift, scale, eps=1e-6, force="triton")
    torch.testing.assert_close(out, again, rtol=0, atol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gated_residual_matches_reference(shape, dtype, device, flash_rule, atol) -> None:
    y, residual, (gate, *_) = _inputs(shape, dtype, device, seed=2)
    out = dispatch.gated_residual(residual, gate, y, force="triton")
    flash_rule(
        out,
        gated_residual_torch(residual, gate, y),
        gated_residual_torch(*_f32(residual, gate, y)),
        atol=atol[dtype],
        what="gated_residual",
    )


def test_adaln_strided_input(device) -> None:
    """Non-contiguous x (a token slice of a wider buffer) goes straight in through its strides."""
    base, _, (shift, scale, *_) = _inputs((2, 50, 96), torch.float32, device)
    x = base[:, 3:40]
    assert not x.is_contiguous()
    out = dispatch.adaln(x, shift, scale, force="triton")
    torch.testing.assert_close(out, adaln_torch(x, shift, scale), rtol=1e-5, atol=1e-5)
