"""EngineConfig: the engine's switches, and what they resolve to on one device.

Speed-ups that are known winners on a GPU are on by default there and off on the CPU, where
they either do nothing or cost more than they save. ``EngineConfig.resolve()`` turns the
switches into a :class:`ResolvedEngine` for one device, by the tables below (docs/gpu.md
explains each one); :func:`engine.loading.apply_speedups` applies it to a loaded pipeline.
Nothing here imports torch or diffusers at module level: control workers import this module
and never generate.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
"""Values of ``EngineConfig.dtype``."""

@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX-BF16), where
    bfloat16 matmuls run faster than float32 ones; elsewhere they are emulated and slower."""
    try:
        import torch

        caps = torch.cpu.get_capabilities()
    except Exception:  # noqa: BLE001 - an old torch or an unknown CPU: assume not
        return False
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def auto_dtype(device_type: str) -> str:
    """What ``dtype="auto"`` means on a device type: bfloat16 on CUDA and on CPUs with native
    bfloat16 (measured on the shapes model: the same checker accuracy, 1.4-1.5x the images
    per second on such a CPU, docs/benchmarks.md), float32 anywhere else."""
    if device_type == "cuda" or (device_type == "cpu" and cpu_has_native_bf16()):
        return "bfloat16"
    return "float32"


HALF_DTYPES = ("float16", "bfloat16")

SOLVERS = ("euler", "dpm++2m")
"""Step rules of the own loop: "euler" is the pipeline's scheduler step (flow-matching Euler,
the stock pipeline's images); "dpm++2m" is DPM-Solver++(2M), second order from the previous
step's clean estimate, at the same one transformer call per step."""

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


STEP_CACHES = ("none", "first_block", "taylorseer", "magcache", "agentloop")
"""Values of ``EngineConfig.step_cache``."""

ROW_MODES = ("gather", "whole")
"""Values of ``EngineConfig.step_cache_rows`` (ours only)."""

STEP_CACHE_DEFAULTS: dict[str, dict[str, Any]] = {
    "first_block": {"threshold": 0.05},
    "taylorseer": {"max_skips": 2, "warmup": 4},
    "magcache": {"threshold": 0.06, "max_skips": 3, "warmup": 4},
    "agentloop": {"threshold": 0.12, "max_skips": 2, "warmup": 2},
}
"""Per-method defaults for the parameters ``EngineConfig`` leaves at None (chosen on the shapes
model, see docs/engine.md "Step caching")."""

MAGCACHE_FILE = "magcache.json"
"""The calibration file a model folder carries for ``step_cache="magcache"``."""


@dataclass(frozen=True)
class StepCacheSettings:
    """A resolved step-cache choice: the method and its parameters (defaults filled in)."""

    method: str = "none"
    threshold: float = 0.0
    max_skips: int = 0
    warmup: int = 0
    rows: str = "gather"
    magcache_file: str | None = None

    @classmethod
    def from_config(cls, config: Any) -> StepCacheSettings:
        """Read ``step_cache*`` fields off an EngineConfig (missing fields: method "none")."""
        method = getattr(config, "step_cache", "none") or "none"
        if method not in STEP_CACHES:
            raise ValueError(f"unknown step_cache {method!r}; expected one of {STEP_CACHES}")
        defaults = STEP_CACHE_DEFAULTS.get(method, {})

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(config, f"step_cache_{name}", None)
            return defaults.get(name, fallback) if value is None else value

        settings = cls(
            method=method,
            threshold=float(pick("threshold", 0.0)),
            max_skips=int(pick("max_skips", 0)),
            warmup=int(pick("warmup", 0)),
            rows=str(getattr(config, "step_cache_rows", "gather") or "gather"),
            magcache_file=getattr(config, "magcache_file", None),
        )
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ValueError on parameters no method can use."""
        problems = []
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            problems.append(f"step_cache_threshold {self.threshold!r} is not a number >= 0")
        if self.max_skips < 0:
            problems.append(f"step_cache_max_skips {self.max_skips!r} is below 0")
        if self.warmup < 0:
            problems.append(f"step_cache_warmup {self.warmup!r} is below 0")
        if self.rows not in ROW_MODES:
            problems.append(f"step_cache_rows {self.rows!r} is not one of {ROW_MODES}")
        if self.method == "taylorseer" and self.max_skips < 1:
            problems.append("taylorseer needs step_cache_max_skips >= 1 (steps predicted per interval)")
        if problems:
            raise ValueError("invalid step cache settings: " + "; ".join(problems))


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

    "auto" and None mean: decided per device by ``resolve()`` (winners on CUDA; on a CPU off,
    but for bfloat16 where the CPU computes it natively).
    """

    device: str = "auto"
    """"auto" picks cuda when available, else cpu; or an explicit torch device string."""

    dtype: str = "auto"
    """Weights and activations dtype: "auto" (bfloat16 on CUDA and on CPUs with native
    bfloat16, float32 elsewhere: `auto_dtype`), "float32", "float16" or "bfloat16"."""

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

    text_embedding_cache: bool = True
    """Reuse prompt embeddings across calls (keyed by prompt text; the runner lives as long as
    its worker keeps the model, so a goal's later iterations find their texts). Texts not in
    the cache are encoded together, one encoder call per batch. Exact: same embeddings."""

    own_loop: bool = True
    """Denoise Flux pipelines with the runner's own loop (``engine.denoise``): the prompts'
    and the negatives' rows in one transformer call per step. Off: the stock pipeline call
    (two calls per step under classifier-free guidance). Same images to float rounding
    (PSNR >= 60 dB). Other pipelines always run the stock call."""

    cfg_truncation: float = 1.0
    """Fraction of the steps, from the first, that run classifier-free guidance; later steps
    drop the negative prompt's rows and predict from the prompt alone. 1.0: guidance on every
    step. Applies to the own loop (Flux); the stock pipeline call always guides every step."""

    layout_split: float = 0.5
    """Fraction of a layout's steps, from the first, denoised as one image (the regions'
    rows blended after every step); the rest each region denoises alone on its own prompt,
    and the finished rows are blended once (``engine.regions``). The shared steps settle the
    background and where each object goes; apart, no region's object is drawn while the
    transformer sees the others, which a model trained on scenes of one or two objects reads
    poorly. 1.0: blended on every step (MultiDiffusion). Apart, a guided step runs one
    negative row per region instead of one per request."""

    layout_softness: float = 0.08
    """How soft a layout's seams are when it is drawn: squared distance, in image widths,
    over which a region's weight falls off by e at the border between two anchors
    (``engine.regions.region_weights``; cut-outs such as the scorer's region views use
    ``regions.SOFTNESS``, 0.01). 0.08 shares a seam over two to three latent positions, so an
    object drawn a little past its region's border is kept whole instead of cut (held-out
    three-object goals of the shapes world, regions apart for the second half of the steps:
    0.69 of samples right against 0.62 at 0.06 and 0.66 at 0.11; docs/layouts.md)."""


    fused_adaln: bool | None = None
    """Route DiT adaptive LayerNorm (+ modulation, gated residual) through kernels' dispatcher;
    None: by ``KERNEL_TABLE``."""

    fused_activations: bool | None = None
    """Route feed-forward GELU(tanh)/GEGLU through kernels' dispatcher; None: by ``KERNEL_TABLE``."""

    int8_attention: bool = False
    """Route attention through the INT8 Q·K kernel (SageAttention-style) via kernels'
    dispatcher. Lossy, so never on unless asked."""

    solver: str = "euler"
    """Step rule of the own loop (Flux): "euler", the scheduler's flow-matching Euler step
    (the stock pipeline's images), or "dpm++2m", DPM-Solver++(2M): second order from the
    previous step's clean estimate, the same one transformer call per step
    (``engine.denoise.dpm_solver_2m``)."""

    step_cache: str = "none"
    """Skip transformer work on steps that barely change (docs/engine.md, "Step caching"):
    "none", "first_block" (diffusers' FirstBlockCache), "taylorseer" (diffusers' TaylorSeer),
    "magcache" (diffusers' MagCache, calibrated per model: ``python -m engine.calibrate_magcache``)
    or "agentloop" (ours: FirstBlockCache's test per batch row, with a cap on skips in a row)."""

    step_cache_threshold: float | None = None
    """first_block / agentloop: relative change of the first block's residual under which a
    step is skipped; magcache: accumulated error allowed. None: the method's default."""

    step_cache_max_skips: int | None = None
    """Most steps skipped in a row (agentloop, magcache; taylorseer: steps predicted between
    two computed ones). None: the method's default."""

    step_cache_warmup: int | None = None
    """Leading steps never skipped (agentloop, magcache, taylorseer). None: the method's default."""

    step_cache_rows: str = "gather"
    """agentloop: "gather" runs the remaining blocks on the rows that compute only; "whole"
    computes the whole batch unless every row may skip (fixed shapes, less saved)."""

    magcache_file: str | None = None
    """MagCache calibration to use; None: ``magcache.json`` in the model's folder."""

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
        value = self.cfg_truncation
        if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1):
            raise ValueError(f"cfg_truncation {value!r} is not a number in [0, 1]")
        if self.solver not in SOLVERS:
            raise ValueError(f"solver {self.solver!r} is not one of {', '.join(SOLVERS)}")
        value = self.layout_split
        if not (isinstance(value, int | float) and math.isfinite(value) and 0 <= value <= 1):
            raise ValueError(f"layout_split {value!r} is not a number in [0, 1]")
        value = self.layout_softness
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"layout_softness {value!r} is not a positive number")
        StepCacheSettings.from_config(self)  # a bad step-cache switch fails here, clearly

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
        return auto_dtype(device_type)

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
