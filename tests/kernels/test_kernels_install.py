"""kernels.install on diffusers' FluxTransformer2DModel: counts, closeness, and the kernels in place."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel

import kernels
from kernels import dispatch
from kernels.attention_int8 import sdpa_torch

REPO = Path(__file__).resolve().parents[2]
SHAPES_DIT = Path(os.environ.get("AGENTLOOP_MODELS_DIR", REPO / "models")) / "shapes-dit"

INT8_PSNR_DB = 40.0
"""Stated bound: the tiny model's output with the INT8 attention reference vs without (~78 dB seen)."""

ALL = {"fused_adaln": True, "fused_activations": True, "int8_attention": True}


def _tiny_flux() -> FluxTransformer2DModel:
    """1 double + 1 single block, 2 heads of dim 16 (rotary axes 4 + 6 + 6 = 16)."""
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    with torch.no_grad():  # larger than default init, so every branch moves the output
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.eval()


def _inputs(batch: int = 2, side: int = 8, text: int = 7) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(side * side, 3)
    img_ids[:, 1] = torch.arange(side * side) // side
    img_ids[:, 2] = torch.arange(side * side) % side
    return {
        "hidden_states": torch.randn(batch, side * side, 16, generator=gen),
        "encoder_hidden_states": torch.randn(batch, text, 32, generator=gen),
        "pooled_projections": torch.randn(batch, 32, generator=gen),
        "timestep": torch.rand(batch, generator=gen),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text, 3),
    }


def _run(model: FluxTransformer2DModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def _psnr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """PSNR of out against ref, peak = ref's range."""
    mse = ((out.float() - ref.float()) ** 2).mean().item()
    peak = (ref.max() - ref.min()).item()
    return float("inf") if mse == 0 else 10 * np.log10(peak**2 / mse)


def test_counts_and_idempotence() -> None:
    model = _tiny_flux()
    expected = {"adaln": 4, "blocks": 2, "activations": 3, "attention": 2}
    # 4 norms: norm1, norm1_context, the single block's norm, norm_out; 3 GELUs: ff, ff_context,
    # act_mlp; 2 attention processors; 2 blocks with fused gated residuals.
    assert kernels.install(model, **ALL) == expected
    assert kernels.install(model, **ALL) == expected
    assert kernels.uninstall(model) == 4 + 2 + 3 + 2
    none = {"fused_adaln": False, "fused_activations": False, "int8_attention": False}
    assert kernels.install(model, **none) == {
        "adaln": 0,
        "blocks": 0,
        "activations": 0,
        "attention": 0,
    }
    assert kernels.install(
        model, fused_adaln=False, fused_activations=True, int8_attention=False
    ) == {
        "adaln": 0,
        "blocks": 0,
        "activations": 3,
        "attention": 0,
    }


def test_install_keeps_outputs_and_uninstall_restores() -> None:
    model, inputs = _tiny_flux(), _inputs()
    ref = _run(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    kernels.install(model, fused_adaln=True, fused_activations=True, int8_attention=False)
    dispatch.CALLS.clear()
    torch.testing.assert_close(_run(model, inputs), ref, rtol=1e-5, atol=1e-5)
    assert dispatch.CALLS[("gated_adaln", "torch")] == 2 and dispatch.CALLS[("gelu", "torch")] == 3

    kernels.install(model, **ALL)
    out = _run(model, inputs)
    assert dispatch.CALLS[("attention", "torch")] == 2
    assert _psnr(out, ref) >= INT8_PSNR_DB

    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    kernels.uninstall(model)
    torch.testing.assert_close(_run(model, inputs), ref, rtol=0, atol=0)


def test_processor_reproduces_flux_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the attention call swapped for plain SDPA, the kernel processor is FluxAttnProcessor
    (projections, QK norms, text+image concat, rotary, output projections) to float rounding."""
    model, inputs = _tiny_flux(), _inputs()
    ref = _run(model, inputs)
    kernels.install(model, fused_adaln=False, fused_activations=False, int8_attention=True)
    monkeypatch.setattr(
        dispatch,
        "attention",
        lambda q, k, v, key_padding_mask=None, scale=None: sdpa_torch(q, k, v),
    )
    torch.testing.assert_close(_run(model, inputs), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.triton
def test_triton_kernels_inside_the_model() -> None:
    """Every patched call forced onto the Triton kernels (interpreted on CPU): same model output
    as the torch references, so the kernels take the real strides and views the blocks pass."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = _tiny_flux().to(device, dtype)
    inputs = {k: v.to(device, dtype) if v.is_floating_point() else v for k, v in _inputs().items()}
    kernels.install(model, **ALL)
    with kernels.forced("torch"):
        ref = _run(model, inputs)
    dispatch.CALLS.clear()
    with kernels.forced("triton"):
        out = _run(model, inputs)
    assert set(dispatch.CALLS) == {
        ("adaln", "triton"),
        ("gated_adaln", "triton"),
        ("gated_residual", "triton"),
        ("gelu", "triton"),
        ("attention", "triton"),
    }
    assert _psnr(out, ref) >= (60.0 if dtype == torch.float32 else 40.0)


def _shapes_image(pipe, seed: int = 0) -> np.ndarray:
    # The model folder's own defaults (agentloop.json), else the shapes world's 32 px, 20 steps.
    meta_file = SHAPES_DIT / "agentloop.json"
    meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    size = int(meta.get("size", 32))
    generator = torch.Generator().manual_seed(seed)
    result = pipe(
        prompt="a red circle on the left",
        height=size,
        width=size,
        num_inference_steps=int(meta.get("steps", 20)),
        generator=generator,
        output_type="np",
    )
    return np.asarray(result.images[0], dtype=np.float64)


@pytest.mark.slow
@pytest.mark.skipif(
    not (SHAPES_DIT / "model_index.json").exists(),
    reason=f"{SHAPES_DIT}/model_index.json does not exist yet: the trained shapes model "
    "(FluxPipeline folder) is not there; this test runs once it is",
)
def test_shapes_model_image_psnr_with_kernel_references() -> None:
    """An image from the shapes model with the kernels' references on vs off: PSNR >= 35 dB."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(SHAPES_DIT, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    plain = _shapes_image(pipe)
    counts = kernels.install(pipe.transformer, **ALL)
    assert counts["adaln"] > 0 and counts["attention"] > 0 and counts["activations"] > 0
    with kernels.forced("torch"):
        fused = _shapes_image(pipe)
    mse = float(np.mean((plain - fused) ** 2))
    psnr = float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)  # images in [0, 1]
    assert psnr >= 35.0, psnr
