"""Kernel tests: the Triton kernels run compiled on CUDA, under the Triton interpreter on CPU.

Why the environment is set here, and how: Triton decides "compile or interpret" when a
function is decorated with ``@triton.jit``, which for triton's own library (``tl.sum``,
``tl.max``, ...) happens when ``triton.language`` is first imported, from
``TRITON_INTERPRET``. So without CUDA this conftest, at import time, sets
``TRITON_INTERPRET=1`` and imports ``triton.language``; the variable stays set for the rest
of the process (triton reads it again later and asserts it agrees). Only where there is no
CUDA: there, nothing else in the suite can run a compiled Triton kernel anyway.

pytest imports this file when it starts collecting ``tests/kernels``. That is early enough
for ``pytest tests/kernels``, and for a whole-suite run as long as nothing collected before
imported triton (diffusers does). If something did, the in-process Triton tests skip with
that reason and ``test_kernel_suite_in_fresh_process`` reruns this directory in a fresh
interpreter, so a combined run still verifies the kernels. On a CUDA machine nothing is
set: the same tests run the compiled kernels on the GPU, bf16 included.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA and "triton" not in sys.modules:
    # Stays set for the rest of this process: triton reads it again lazily (e.g. when it
    # first imports its gluon frontend while specializing arguments) and asserts it agrees.
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language  # noqa: F401  (decorates triton's library in interpret mode)

from kernels._launch import interpreter_active  # noqa: E402

TRITON_RUNS_HERE = HAS_CUDA or interpreter_active()
"""Whether this process can run the Triton kernels (compiled on CUDA or interpreted on CPU)."""

NOT_HERE_REASON = (
    "triton was imported in this process before tests/kernels/conftest.py could set "
    "TRITON_INTERPRET=1; test_kernel_suite_in_fresh_process reruns these tests in a fresh process"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``triton`` (they launch kernels) when this process cannot run them."""
    if TRITON_RUNS_HERE:
        return
    skip = pytest.mark.skip(reason=NOT_HERE_REASON)
    for item in items:
        if "triton" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton: launches a Triton kernel (compiled or interpreted)")


DEVICE = "cuda" if HAS_CUDA else "cpu"
"""Where the kernel tests put their tensors."""

LOW_DTYPES = [torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float16]
"""Low precisions under test; the interpreter has no bfloat16."""


def assert_flash_rule(
    out: torch.Tensor,
    torch_out: torch.Tensor,
    ref: torch.Tensor,
    *,
    atol: float,
    factor: float = 2.0,
    what: str = "",
) -> None:
    """flash-attention's rule: max|out - ref| <= factor * max|torch_out - ref| + atol.

    ``ref`` is the fp32 reference; ``torch_out`` the torch op in the same precision as ``out``.
    """
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out.float() - ref.float()).abs().max().item()
    torch_err = (torch_out.float() - ref.float()).abs().max().item()
    bound = factor * torch_err + atol
    assert err <= bound, (
        f"{what}: kernel error {err:.3g} > {factor} x torch error {torch_err:.3g} + {atol:g}"
    )


@pytest.fixture
def flash_rule() -> Callable[..., None]:
    """:func:`assert_flash_rule`, as a fixture (conftest modules are not importable by name)."""
    return assert_flash_rule


@pytest.fixture
def device() -> str:
    """The device kernel tests use: cuda when there is a GPU, else cpu (the interpreter)."""
    return DEVICE


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``low_dtype``: fp16 (+ bf16 on CUDA); ``dtype``: fp32 and the low ones."""
    if "low_dtype" in metafunc.fixturenames:
        metafunc.parametrize("low_dtype", LOW_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize(
            "dtype", [torch.float32, *LOW_DTYPES], ids=lambda d: str(d).removeprefix("torch.")
        )


ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""Small absolute slack of the error rule, per dtype (outputs here are O(1)-O(10))."""


@pytest.fixture
def atol() -> dict[torch.dtype, float]:
    """:data:`ATOL`."""
    return ATOL
