"""EngineConfig: the engine's switches, and what they resolve to on one device.

Speed-ups that are known winners on a GPU are on by default there and off on the CPU, where
they either do nothing or cost more than they save. ``EngineConfig.resolve()`` turns the
switches into a :class:`ResolvedEngine` for one device, by the tables below (docs/gpu.md
explains each one); :func:`engine.loading.apply_speedups` applies it to a loaded pipeline.
Nothing here imports torch or diffusers at module level: control workers import this module
and never generate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
"""Values of ``EngineConfig.dtype``."""

AUTO_DTYPE: dict[str, str] = {"cuda": "bfloat16"}
"""What ``dtype="auto"`` means per device type; any device type not listed runs float32."""

HALF_DTYPES = ("float16", "bfloat16")

ATTENTION_PREFERENCE: tuple[str, ...] = ("_flash_3", "flash", "native")
"""diffusers attention backends ``attention_backend="auto"`` tries on CUDA, best first; the
first whose requirements hold (capability, dtype, package installed) is chosen. "native" is
torch SDPA, which is always there. Lossy backends ("sage", INT8 Q·K) are never chosen
automatically: ask for them by name."""

BACKEND_NEEDS: dict[str, tuple[tuple[int, int], tuple[int, int] | None, bool]] = {
    "_flash_3": ((9, 0), (9, 9), True),
    "_flash_varlen_3": ((9, 0), (9, 9), True),
    "flash": ((8, 0), None, True),
    "flash_varlen": ((8, 0), None, True),
    "sage": ((8, 0), None, True),
    "sage_varlen": ((8, 0), None, True),
    "_native_cudnn": ((8, 0), None, True),
    "_native_flash": ((8, 0), None, True),
}
"""CUDA needs of the backends that have any: (lowest compute capability, highest or None,
half precision only). FlashAttention-3 is Hopper-only (sm_90)."""

KERNEL_TABLE: dict[tuple[str, bool], dict[str, bool]] = {
    ("cuda", False): {"fused_adaln": True, "fused_activations": True},
    ("cuda", True): {"fused_adaln": False, "fused_activations": False},
}
"""Our Triton kernels for each (device type, denoiser compiled) when their switch is None.
Eager on CUDA: the fused adaLN/gated-residual and GELU/GEGLU kernels replace chains of
memory-bound eager ops (lossless up to rounding). Compiled: Inductor fuses the same ops
itself and the dispatcher has not been traced by dynamo, so they stay off. Any other device:
off (there the dispatcher runs the torch references, which cost a little and save nothing).
``int8_attention`` is lossy and never on unless asked. Not yet measured on a GPU:
``bench/gpu.py`` measures every cell (docs/gpu.md)."""


def probe_attention_backend(name: str) -> str | None:
    """Why diffusers cannot run attention backend ``name`` here (a package missing or too old),
    or None when it can; diffusers' own requirement check. Tests monkeypatch this probe."""
    from diffusers.models.attention_dispatch import (
        AttentionBackendName,
        _check_attention_backend_requirements,
    )

    try:
        _check_attention_backend_requirements(AttentionBackendName(name))
    except (RuntimeError, ImportError) as exc:
        return str(exc)
    return None


def cuda_capability(device: str) -> tuple[int, int]:
    """The compute capability of a CUDA device (monkeypatched by tests on machines without one)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def attention_backend_names() -> tuple[str, ...]:
    """Every backend name diffusers' attention dispatcher knows."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return tuple(member.value for member in AttentionBackendName)


@dataclass(frozen=True)
class ResolvedEngine:
    """What an EngineConfig means on one device: every "auto" and None decided, with why."""

    device: str
    dtype: str
    tf32: bool
    attention_backend: str
    compile: bool
    fused_adaln: bool
    fused_activations: bool
    int8_attention: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    """Why an "auto" went the way it did, or why a request could not be honoured."""

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        return out


@dataclass(frozen=True)
class EngineConfig:
    """Switches for the diffusion engine. Each speed-up states its quality cost in a benchmark.

    "auto" and None mean: decided per device by ``resolve()`` (winners on CUDA, off on CPU).
    """

    device: str = "auto"
    """"auto" picks cuda when available, else cpu; or an explicit torch device string."""

    dtype: str = "auto"
    """Weights and activations dtype: "auto" (bfloat16 on CUDA, float32 elsewhere), "float32",
    "float16" or "bfloat16"."""

    tf32: bool = True
    """On CUDA, let float32 matmuls use TF32 tensor cores
    (``torch.set_float32_matmul_precision("high")``, process-wide). No effect elsewhere."""

    attention_backend: str = "auto"
    """diffusers attention backend for the denoiser (``set_attention_backend``): "auto" takes
    the best installed one for the device (``ATTENTION_PREFERENCE``), or a backend name;
    a backend that cannot run here falls back to "native" (torch SDPA) with a note."""

    compile: bool | None = None
    """Regional compilation of the denoiser's repeated blocks (diffusers'
    ``compile_repeated_blocks``); None: on for CUDA, off elsewhere."""

    batching: bool = True
    """Run requests that share shape, steps and guidance as one batch."""

    max_batch: int = 16
    """Largest batch handed to the pipeline at once."""

    text_embedding_cache: bool = False
    """Reuse prompt embeddings across calls (keyed by prompt text)."""

    fused_adaln: bool | None = None
    """Route DiT adaptive LayerNorm (+ modulation, gated residual) through kernels' dispatcher;
    None: by ``KERNEL_TABLE``."""

    fused_activations: bool | None = None
    """Route feed-forward GELU(tanh)/GEGLU through kernels' dispatcher; None: by ``KERNEL_TABLE``."""

    int8_attention: bool = False
    """Route attention through the INT8 Q·K kernel (SageAttention-style) via kernels'
    dispatcher. Lossy, so never on unless asked."""

    cache_dir: str | None = None
    """Where generated offline files (preset tokenizers) are cached; None: $AGENTLOOP_CACHE_DIR
    or ~/.cache/agentloop."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {list(DTYPES)}")
        if not isinstance(self.attention_backend, str) or not self.attention_backend.strip():
            raise ValueError(
                f"attention_backend must be a backend name or 'auto', not {self.attention_backend!r}"
            )

    def resolved_cache_dir(self) -> Path:
        """The folder for generated offline files."""
        if self.cache_dir is not None:
            return Path(self.cache_dir)
        from engine.catalog import default_cache_dir

        return default_cache_dir()

    def resolved_device(self) -> str:
        """The torch device string this config runs on."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, device: str | None = None) -> str:
        """The dtype name this config runs in on ``device`` (default: its resolved device)."""
        if self.dtype != "auto":
            return self.dtype
        device_type = (device or self.resolved_device()).split(":", 1)[0]
        return AUTO_DTYPE.get(device_type, "float32")

    def resolve(self, device: str | None = None) -> ResolvedEngine:
        """Decide every "auto"/None switch for ``device`` (default: the resolved device).

        Raises ValueError for an attention backend name diffusers does not know; a known
        backend that cannot run here falls back to "native" with a note instead.
        """
        device = device or self.resolved_device()
        device_type = device.split(":", 1)[0]
        dtype = self.resolved_dtype(device)
        notes: list[str] = []
        if self.dtype == "auto":
            notes.append(f"dtype auto -> {dtype} on {device_type}")
        compiled = device_type == "cuda" if self.compile is None else bool(self.compile)
        if self.compile is None:
            notes.append(f"compile auto -> {'regional' if compiled else 'off'} on {device_type}")
        backend = self._resolve_attention(device, dtype, notes)
        table = KERNEL_TABLE.get((device_type, compiled), {})
        kernels = {}
        for name in ("fused_adaln", "fused_activations"):
            asked = getattr(self, name)
            kernels[name] = bool(table.get(name, False)) if asked is None else bool(asked)
        auto = [k for k in kernels if getattr(self, k) is None]
        if auto:
            on = [k for k in auto if kernels[k]]
            notes.append(
                f"kernels auto ({device_type}, {'compiled' if compiled else 'eager'}): "
                f"{', '.join(auto)} -> {', '.join(on) if on else 'off'}"
            )
        return ResolvedEngine(
            device=device,
            dtype=dtype,
            tf32=self.tf32 and device_type == "cuda",
            attention_backend=backend,
            compile=compiled,
            fused_adaln=kernels["fused_adaln"],
            fused_activations=kernels["fused_activations"],
            int8_attention=self.int8_attention,
            notes=tuple(notes),
        )

    def _resolve_attention(self, device: str, dtype: str, notes: list[str]) -> str:
        requested = self.attention_backend.strip().lower()
        if requested != "auto" and requested not in attention_backend_names():
            raise ValueError(
                f"unknown attention_backend {requested!r}; expected 'auto' or one of "
                f"{sorted(attention_backend_names())}"
            )
        device_type = device.split(":", 1)[0]
        if device_type != "cuda":
            if requested not in ("auto", "native"):
                notes.append(f"attention {requested}: needs CUDA; using native on {device_type}")
            return "native"
        candidates = ATTENTION_PREFERENCE if requested == "auto" else (requested,)
        capability = cuda_capability(device)
        refused: list[str] = []
        for name in candidates:
            why = attention_backend_blocker(name, capability, dtype)
            if why is None:
                if requested == "auto":
                    notes.append(
                        f"attention auto -> {name}"
                        + (f" ({'; '.join(refused)})" if refused else "")
                    )
                return name
            refused.append(f"{name}: {why}")
        notes.append(f"attention -> native ({'; '.join(refused)})")
        return "native"


def attention_backend_blocker(name: str, capability: tuple[int, int], dtype: str) -> str | None:
    """Why backend ``name`` cannot run on a CUDA device of ``capability`` in ``dtype``."""
    if name == "native":
        return None
    low, high, half_only = BACKEND_NEEDS.get(name, ((0, 0), None, False))
    if capability < low or (high is not None and capability > high):
        return (
            f"needs compute capability {low}"
            + (f" to {high}" if high else "+")
            + f", have {capability}"
        )
    if half_only and dtype not in HALF_DTYPES:
        return f"needs float16/bfloat16, not {dtype}"
    return probe_attention_backend(name)
