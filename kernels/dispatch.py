"""One dispatcher for the diffusion hot-path kernels: Triton on CUDA when its constraints hold,
the torch reference everywhere else.

Each public function checks the constraints of its Triton kernel (device, dtype, shapes, no
autograd) and calls either the kernel or its torch reference from the op's module. The two
paths compute the same math, so a model behaves the same on a laptop and on a GPU worker, up
to rounding; for attention that includes the INT8 quantization (its reference quantizes too).

Forcing a path, for tests and benchmarks:

- ``force="triton"`` on a call, or ``with forced("triton"):`` around a model call, runs the
  Triton kernel and raises ValueError if its constraints do not hold (never a silent
  fallback). On CPU tensors that means the Triton interpreter, which needs
  ``TRITON_INTERPRET=1`` set before triton is first imported, and fp16/fp32.
- ``force="torch"`` / ``forced("torch")`` runs the torch reference.

``CALLS`` counts calls per (op, path), so a caller can see which path actually ran.

A kernel that fails on the automatic path (it does not compile for this GPU, say) is not
fatal: the call falls back to the torch reference, the op is recorded in ``BROKEN`` with the
error, a warning is logged once, and later calls of that op go straight to the reference.
A forced Triton path still raises.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

from kernels import activations as _act
from kernels import adaln as _adaln
from kernels import attention_int8 as _attn
from kernels._launch import INTERPRETER_DTYPES, interpreter_active

PATHS = ("triton", "torch")
"""Values of ``force`` and :func:`forced`."""

CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes the compiled element-wise/norm kernels take on CUDA."""

ATTENTION_CUDA_DTYPES = (torch.float16, torch.bfloat16)
"""Dtypes the INT8 attention kernel takes on CUDA (P·V runs in this dtype)."""

ATTENTION_CUDA_HEAD_DIMS = (64, 128)
"""Head dims the INT8 attention kernel takes on CUDA; 16 and 32 run only in the interpreter."""

MAX_NORM_DIM = 8192
"""Widest row the adaLN kernel keeps in registers (one row per program)."""

CALLS: Counter[tuple[str, str]] = Counter()
"""Calls per (op, path) since import; tests and the engine read it, ``CALLS.clear()`` resets.
Calls inside a torch.compile'd region are not counted."""

AUTO_TRITON_DEVICES: tuple[str, ...] = ("cuda",)
"""Device types on which the automatic path picks a Triton kernel whose constraints hold."""

BROKEN: dict[str, str] = {}
"""Ops whose Triton kernel failed on the automatic path, with the error; they run the torch
reference from then on (``BROKEN.clear()`` lets them try again)."""

log = logging.getLogger(__name__)
T = TypeVar("T")

_FORCED: ContextVar[str | None] = ContextVar("kernels_forced_path", default=None)


@contextmanager
def forced(path: str) -> Iterator[None]:
    """Within the block, every dispatcher call takes ``path`` ("triton" or "torch")."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, not {path!r}")
    token = _FORCED.set(path)
    try:
        yield
    finally:
        _FORCED.reset(token)


def _common_blocker(
    tensors: list[torch.Tensor], cuda_dtypes: tuple[torch.dtype, ...]
) -> str | None:
    """Why these tensors cannot go to a Triton kernel (None if they can)."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return "tensors on several devices"
    device = devices.pop()
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(map(str, dtypes))}"
    dtype = dtypes.pop()
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd: the Triton kernels are forward-only"
    if device.type == "cuda":
        return None if dtype in cuda_dtypes else f"dtype {dtype} not in {cuda_dtypes}"
    if device.type == "cpu":
        if not interpreter_active():
            return "cpu tensors and triton imported without TRITON_INTERPRET=1"
        return (
            None if dtype in INTERPRETER_DTYPES else f"interpreter handles fp16/fp32, not {dtype}"
        )
    return f"device {device} is neither cuda nor cpu"


def _dispatch(
    op: str,
    force: str | None,
    blocker: str | None,
    device: torch.device,
    triton_fn: Callable[[], T],
    torch_fn: Callable[[], T],
) -> T:
    """Run the forced path (raising if Triton is forced but blocked), else Triton on CUDA when
    its constraints hold and it has not failed before, else the torch reference."""
    path = force or _FORCED.get()
    if path is not None and path not in PATHS:
        raise ValueError(f"force must be one of {PATHS}, not {path!r}")
    if path == "triton" and blocker is not None:
        raise ValueError(f"{op}: Triton path forced but not possible: {blocker}")
    auto = path is None and blocker is None and device.type in AUTO_TRITON_DEVICES
    if path == "triton" or (auto and op not in BROKEN):
        if path == "triton":
            _count(op, "triton")
            return triton_fn()
        try:
            result = triton_fn()
        except Exception as exc:  # noqa: BLE001 - any kernel failure: keep serving on torch
            BROKEN[op] = f"{type(exc).__name__}: {exc}"
            log.warning("Triton kernel %s failed; using its torch reference from now on: %s",
                        op, BROKEN[op])
        else:
            _count(op, "triton")
            return result
    _count(op, "torch")
    return torch_fn()


def _count(op: str, path: str) -> None:
    """Count a call in ``CALLS``, except while torch.compile traces: dynamo would guard on the
    counter's value and recompile the block on every call (and a traced count runs once)."""
    if not torch.compiler.is_compiling():
        CALLS[(op, path)] += 1


def _adaln_blocker(
    x: torch.Tensor,
    mods: list[torch.Tensor],
    norm: str,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> str | None:
    if norm not in _adaln.NORMS:
        return f"norm {norm!r}"
    if x.dim() != 3:
        return "x must be (batch, tokens, dim)"
    batch, _, dim = x.shape
    if dim > MAX_NORM_DIM:
        return f"dim {dim} > {MAX_NORM_DIM}"
    if any(m.shape != (batch, dim) for m in mods):
        return "shift/scale/gate must be (batch, dim)"
    if any(p is not None and p.shape != (dim,) for p in (weight, bias)):
        return "weight/bias must be (dim,)"
    affine = [p for p in (weight, bias) if p is not None]
    return _common_blocker([x, *mods, *affine], CUDA_DTYPES)


def adaln(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    *,
    norm: str = "layer",
    eps: float = 1e-6,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    force: str | None = None,
) -> torch.Tensor:
    """``norm(x) * (1 + scale[:, None]) + shift[:, None]``; x (B, T, D), shift/scale (B, D).

    ``norm`` is "layer" (LayerNorm) or "rms" (RMSNorm), over the last dim, with optional
    elementwise ``weight``/``bias`` (D,).
    """
    blocker = _adaln_blocker(x, [shift, scale], norm, weight, bias)
    return _dispatch(
        "adaln", force, blocker, x.device,
        lambda: _adaln.adaln_triton(x, shift, scale, norm=norm, eps=eps, weight=weight, bias=bias),
        lambda: _adaln.adaln_torch(x, shift, scale, norm=norm, eps=eps, weight=weight, bias=bias),
    )


def gated_adaln(
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
    force: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = residual + gate[:, None] * y``; returns ``(h, adaln(h, shift, scale, ...))``."""
    blocker = _adaln_blocker(y, [gate, shift, scale], norm, weight, bias)
    if blocker is None and residual.shape != y.shape:
        blocker = "residual and y differ in shape"
    blocker = blocker or _common_blocker([residual, y], CUDA_DTYPES)
    return _dispatch(
        "gated_adaln", force, blocker, y.device,
        lambda: _adaln.gated_adaln_triton(residual, gate, y, shift, scale, norm=norm, eps=eps, weight=weight, bias=bias),
        lambda: _adaln.gated_adaln_torch(residual, gate, y, shift, scale, norm=norm, eps=eps, weight=weight, bias=bias),
    )


def gated_residual(
    residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, *, force: str | None = None
) -> torch.Tensor:
    """``residual + gate[:, None] * y``; residual, y (B, T, D), gate (B, D)."""
    if residual.dim() != 3 or residual.shape != y.shape:
        blocker: str | None = "residual and y must be the same (batch, tokens, dim)"
    elif gate.shape != (residual.shape[0], residual.shape[2]):
        blocker = "gate must be (batch, dim)"
    else:
        blocker = _common_blocker([residual, gate, y], CUDA_DTYPES)
    return _dispatch(
        "gated_residual", force, blocker, residual.device,
        lambda: _adaln.gated_residual_triton(residual, gate, y),
        lambda: _adaln.gated_residual_torch(residual, gate, y),
    )


def _activation_blocker(x: torch.Tensor, approximate: str, gated: bool) -> str | None:
    if approximate not in _act.APPROXIMATIONS:
        return f"approximate {approximate!r}"
    if x.dim() == 0 or x.numel() == 0:
        return "empty or 0-d input"
    if gated and x.shape[-1] % 2:
        return "odd last dim"
    return _common_blocker([x], CUDA_DTYPES)


def gelu(x: torch.Tensor, *, approximate: str = "tanh", force: str | None = None) -> torch.Tensor:
    """GELU, ``approximate`` "tanh" (default) or "none" (exact erf), any shape."""
    blocker = _activation_blocker(x, approximate, gated=False)
    return _dispatch(
        "gelu", force, blocker, x.device,
        lambda: _act.gelu_triton(x, approximate=approximate),
        lambda: _act.gelu_torch(x, approximate=approximate),
    )


def gelu_tanh(x: torch.Tensor, *, force: str | None = None) -> torch.Tensor:
    """GELU with the tanh approximation (``F.gelu(x, approximate="tanh")``), as Flux uses."""
    return gelu(x, approximate="tanh", force=force)


def geglu(x: torch.Tensor, *, approximate: str = "none", force: str | None = None) -> torch.Tensor:
    """diffusers' GEGLU after its projection: ``hidden * gelu(gate)``, ``hidden, gate = x.chunk(2, -1)``."""
    blocker = _activation_blocker(x, approximate, gated=True)
    return _dispatch(
        "geglu", force, blocker, x.device,
        lambda: _act.geglu_triton(x, approximate=approximate),
        lambda: _act.geglu_torch(x, approximate=approximate),
    )


def _attention_blocker(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> str | None:
    if q.dim() != 4 or k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        return "q, k, v must be (batch, heads, tokens, head_dim) with matching dims"
    dim = q.shape[3]
    if key_padding_mask is not None and key_padding_mask.shape != (q.shape[0], k.shape[2]):
        return "key_padding_mask must be (batch, keys)"
    if q.device.type == "cuda":
        if dim not in ATTENTION_CUDA_HEAD_DIMS:
            return f"head_dim {dim} not in {ATTENTION_CUDA_HEAD_DIMS}"
        if torch.cuda.get_device_capability(q.device) < (8, 0):
            return "INT8 tensor-core dot needs compute capability >= 8.0"
        return _common_blocker([q, k, v], ATTENTION_CUDA_DTYPES)
    if dim not in _attn.HEAD_DIMS:
        return f"head_dim {dim} not in {_attn.HEAD_DIMS}"
    return _common_blocker([q, k, v], ATTENTION_CUDA_DTYPES)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    force: str | None = None,
) -> torch.Tensor:
    """SageAttention-style INT8 attention, non-causal; q/k/v (B, H, S, D) like SDPA.

    ``key_padding_mask`` (B, keys), True = attend. ``scale`` defaults to ``head_dim**-0.5``.
    The torch path runs the same quantized math (``attention_int8_torch``), not plain SDPA.
    """
    blocker = _attention_blocker(q, k, v, key_padding_mask)
    return _dispatch(
        "attention", force, blocker, q.device,
        lambda: _attn.attention_int8_triton(q, k, v, key_padding_mask=key_padding_mask, scale=scale),
        lambda: _attn.attention_int8_torch(q, k, v, key_padding_mask=key_padding_mask, scale=scale),
    )
