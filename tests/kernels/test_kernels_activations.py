"""Fused GELU / GEGLU kernels vs fp32 references, under the flash-attention error rule."""

from __future__ import annotations

import pytest
import torch

from kernels import dispatch
from kernels.activations import geglu_torch, gelu_torch

pytestmark = pytest.mark.triton

SHAPES = [(113, 96), (2, 37, 200), (5, 3, 7, 130)]


def _x(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    # Wide range, so both tails of GELU (and tanh saturation) are exercised.
    return (torch.randn(shape, generator=gen) * 3).to(device, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_matches_reference(shape, approximate, dtype, device, flash_rule, atol) -> None:
    x = _x(shape, dtype, device)
    out = dispatch.gelu(x, approximate=approximate, force="triton")
    flash_rule(
        out,
        gelu_torch(x, approximate=approximate),
        gelu_torch(x.float(), approximate=approximate),
        atol=atol[dtype],
        what=f"gelu {approximate}",
    )


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_matches_reference(shape, approximate, dtype, device, flash_rule, atol) -> None:
    x = _x(shape, dtype, device)
    out = dispatch.geglu(x, approximate=approximate, force="triton")
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    flash_rule(
        out,
        geglu_torch(x, approximate=approximate),
        geglu_torch(x.float(), approximate=approximate),
        atol=atol[dtype],
        what=f"geglu {approximate}",
    )


def test_gelu_tanh_is_the_tanh_approximation(device) -> None:
    x = _x((7, 96), torch.float32, device)
    out = dispatch.gelu_tanh(x, force="triton")
    torch.testing.assert_close(
        out, torch.nn.functional.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6
    )


def test_geglu_follows_diffusers_convention(device) -> None:
    """diffusers' GEGLU: the first half is the value, the second half goes through exact GELU."""
    from diffusers.models.activations import GEGLU

    torch.manual_seed(0)
    module = GEGLU(24, 48).to(device)
    x = torch.randn(3, 11, 24, device=device)
    with torch.no_grad():
        expected = module(x)
        out = dispatch.geglu(module.proj(x), force="triton")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
