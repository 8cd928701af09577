"""What every launcher shares: device checks, the interpreter check, block sizes.

Triton decides between compiling and interpreting when ``@triton.jit`` runs, i.e. when a
module is imported, from ``TRITON_INTERPRET``; that includes triton's own library functions
(``tl.sum``, ``tl.max``), decorated when ``triton.language`` is first imported (diffusers
imports it too). So Triton kernels run on CPU tensors only in a process that set
``TRITON_INTERPRET=1`` before anything imported triton; on CUDA they run compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

INTERPRETER_DTYPES = (torch.float16, torch.float32)
"""Dtypes the Triton interpreter (numpy) handles; it has no bfloat16."""


def interpreter_active() -> bool:
    """True when this process imported triton with ``TRITON_INTERPRET=1`` (kernels run on CPU)."""
    return isinstance(tl.sum, InterpretedFunction)


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise ValueError if the tensors cannot go to a Triton kernel together here."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda":
        return
    if device.type != "cpu":
        raise ValueError(f"Triton kernels run on cuda (or interpreted on cpu), not {device}")
    if not interpreter_active():
        raise ValueError(
            "Triton kernels on cpu tensors need TRITON_INTERPRET=1 set before triton is first "
            "imported (this process imported it without)"
        )
    for t in tensors:
        if t.is_floating_point() and t.dtype not in INTERPRETER_DTYPES:
            raise ValueError(f"the Triton interpreter on cpu handles fp16/fp32 only, not {t.dtype}")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (Triton block shapes must be powers of two)."""
    return triton.next_power_of_2(max(int(n), 1))
