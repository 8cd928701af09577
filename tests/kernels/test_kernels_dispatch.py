"""The dispatcher: which path runs where, forcing, and refusing a forced Triton path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import dispatch
from kernels._launch import interpreter_active
from kernels.activations import gelu_torch
from kernels.adaln import adaln_torch
from kernels.attention_int8 import attention_int8_torch

HAS_CUDA = torch.cuda.is_available()
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _fresh_counts():
    dispatch.CALLS.clear()
    yield
    dispatch.CALLS.clear()


def _adaln_inputs(device: str = "cpu", dtype: torch.dtype = torch.float32):
    x = torch.randn(2, 9, 48, device=device, dtype=dtype)
    shift, scale = torch.randn(2, 96, device=device, dtype=dtype).chunk(2, dim=1)
    return x, shift, scale


def test_cpu_runs_the_torch_reference() -> None:
    x, shift, scale = _adaln_inputs()
    assert torch.equal(kernels.adaln(x, shift, scale), adaln_torch(x, shift, scale))
    assert torch.equal(kernels.gelu_tanh(x), gelu_torch(x))
    q = torch.randn(1, 2, 30, 16)
    assert torch.equal(kernels.attention(q, q, q), attention_int8_torch(q, q, q))
    assert dispatch.CALLS == {
        ("adaln", "torch"): 1,
        ("gelu", "torch"): 1,
        ("attention", "torch"): 1,
    }


@pytest.mark.triton
def test_forced_context_routes_every_call() -> None:
    x, shift, scale = _adaln_inputs("cuda" if HAS_CUDA else "cpu")
    with kernels.forced("triton"):
        kernels.adaln(x, shift, scale)
        kernels.geglu(x)
    with kernels.forced("torch"):
        kernels.adaln(x, shift, scale)
    assert dispatch.CALLS == {("adaln", "triton"): 1, ("geglu", "triton"): 1, ("adaln", "torch"): 1}


def test_forced_triton_refuses_instead_of_falling_back() -> None:
    x, shift, scale = _adaln_inputs()
    with pytest.raises(ValueError, match="Triton path forced"):
        kernels.adaln(x, shift[:1], scale[:1], force="triton")  # wrong modulation shape
    with pytest.raises(ValueError, match="Triton path forced"):
        kernels.attention(
            *(torch.randn(1, 1, 8, 24) for _ in range(3)), force="triton"
        )  # head dim 24
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="Triton path forced"):
            kernels.gelu(x.bfloat16(), force="triton")  # the interpreter has no bf16
    with pytest.raises(ValueError, match="force must be one of"):
        kernels.gelu(x, force="cuda")
    with pytest.raises(ValueError):
        with kernels.forced("fast"):
            pass


def test_autograd_takes_the_torch_path() -> None:
    """The kernels are forward-only: with gradients wanted, the reference runs (and is differentiable)."""
    x, shift, scale = _adaln_inputs("cuda" if HAS_CUDA else "cpu")
    x.requires_grad_(True)
    kernels.adaln(x, shift, scale).sum().backward()
    assert x.grad is not None
    assert dispatch.CALLS == {("adaln", "torch"): 1}
    with pytest.raises(ValueError, match="forward-only"):
        kernels.adaln(x, shift, scale, force="triton")


def test_unsupported_shapes_fall_back_without_force() -> None:
    q = torch.randn(1, 2, 20, 24)  # head dim 24: the reference handles it, the kernel does not
    out = kernels.attention(q, q, q)
    assert out.shape == q.shape and dispatch.CALLS == {("attention", "torch"): 1}


def test_a_failing_kernel_falls_back_to_its_reference_once_and_for_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kernel that fails on the automatic path (on a GPU: one that does not compile there)
    is replaced by its torch reference for good, with the reason recorded; a forced Triton
    path still raises. Here the CPU stands in for CUDA as an automatic Triton device and the
    kernel is made to fail, since no GPU is at hand."""
    monkeypatch.setattr(dispatch, "AUTO_TRITON_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(dispatch, "BROKEN", {})
    monkeypatch.setattr(dispatch, "_common_blocker", lambda tensors, dtypes: None)
    attempts = []

    def fails(*args, **kwargs):  # noqa: ANN002,ANN003,ANN202
        attempts.append(1)
        raise RuntimeError("PTX compile failed for sm_90")

    monkeypatch.setattr(dispatch._adaln, "adaln_triton", fails)
    x, shift, scale = _adaln_inputs()
    for _ in range(2):
        assert torch.equal(kernels.adaln(x, shift, scale), adaln_torch(x, shift, scale))
    assert len(attempts) == 1  # tried once, then never again
    assert dispatch.BROKEN == {"adaln": "RuntimeError: PTX compile failed for sm_90"}
    assert dispatch.CALLS == {("adaln", "torch"): 2}
    with pytest.raises(RuntimeError, match="PTX compile failed"):
        kernels.adaln(x, shift, scale, force="triton")


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_picks_triton_when_constraints_hold() -> None:
    x, shift, scale = _adaln_inputs("cuda", torch.float16)
    kernels.adaln(x, shift, scale)
    q = torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.float16)
    kernels.attention(q, q, q)
    kernels.attention(q[..., :96].contiguous(), q[..., :96].contiguous(), q[..., :96].contiguous())
    assert dispatch.CALLS == {
        ("adaln", "triton"): 1,
        ("attention", "triton"): 1,
        ("attention", "torch"): 1,
    }


@pytest.mark.skipif(
    HAS_CUDA or interpreter_active(), reason="the Triton kernel tests run in this process"
)
def test_kernel_suite_in_fresh_process() -> None:
    """This process imported triton before tests/kernels/conftest.py could set TRITON_INTERPRET=1
    (e.g. a whole-suite run where an earlier test imported diffusers): rerun this directory fresh."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE)],
        env=env,
        cwd=HERE.parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
