"""Applying a resolved EngineConfig's speed-ups to a loaded pipeline's denoiser.

``EngineConfig.resolve()`` decides (engine/config.py); this module applies: TF32, our Triton
kernels, the diffusers attention backend, regional compilation. Every piece is guarded: one
that cannot be applied here is recorded in the report's "errors" and the pipeline runs
without it. torch and diffusers only, so ``bench/gpu.py`` can use it on a bare GPU machine.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.config import ResolvedEngine

log = logging.getLogger(__name__)


def denoiser_of(pipe: Any) -> torch.nn.Module:
    """The pipeline's denoising network (``transformer`` or ``unet``)."""
    net = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    if net is None:
        raise TypeError(f"{type(pipe).__name__} has neither a transformer nor a unet")
    return net


def apply_speedups(pipe: Any, resolved: ResolvedEngine) -> dict[str, Any]:
    """Apply a resolved config's speed-ups to a loaded pipeline's denoiser, in place, and say
    what was applied: TF32, our kernels, the attention backend, regional compilation.

    A piece that fails (a backend that will not load, a model without repeated blocks) is
    recorded under "errors" and skipped; the pipeline still runs, on the plain path.
    """
    denoiser = denoiser_of(pipe)
    report: dict[str, Any] = {
        "device": resolved.device,
        "dtype": resolved.dtype,
        "tf32": False,
        "attention_backend": "native",
        "attention_processors": 0,
        "compiled": False,
        "compiled_blocks": 0,
        "kernels": {},
        "notes": list(resolved.notes),
        "errors": {},
    }
    if resolved.tf32:
        # process-wide; float32 matmuls only (bf16/fp16 ones use tensor cores anyway)
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        report["tf32"] = True
    if resolved.fused_adaln or resolved.fused_activations or resolved.int8_attention:
        try:
            report["kernels"] = install_kernels(denoiser, resolved)
        except Exception as exc:  # noqa: BLE001 - a missing triton must not stop serving
            report["errors"]["kernels"] = f"{type(exc).__name__}: {exc}"
    _apply_attention_backend(denoiser, resolved.attention_backend, report)
    if report["kernels"].get("attention"):
        report["notes"].append(
            "int8_attention: the Flux attention processors run our INT8 kernel, "
            "not the attention backend"
        )
    if resolved.compile:
        missing = missing_compiler(resolved.device_type)
        if missing:
            report["errors"]["compile"] = missing
        else:
            _compile_repeated_blocks(denoiser, report)
    if report["errors"]:
        log.warning("engine speed-ups skipped: %s", report["errors"])
    return report


def install_kernels(denoiser: torch.nn.Module, resolved: ResolvedEngine) -> dict[str, int]:
    """Patch the denoiser to call our kernels' dispatcher for the switches that are on."""
    import kernels  # lazily: only an optimized config needs it

    counts = kernels.install(
        denoiser,
        fused_adaln=resolved.fused_adaln,
        fused_activations=resolved.fused_activations,
        int8_attention=resolved.int8_attention,
    )
    return dict(counts or {})


@contextmanager
def _quiet_diffusers() -> Iterator[None]:
    """diffusers warns that attention backends are experimental on every call; once is in the docs."""
    import diffusers.utils.logging as diffusers_logging

    before = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(before)


def set_attention_backend(denoiser: torch.nn.Module, name: str) -> int:
    """Pin every attention processor of ``denoiser`` that goes through diffusers' dispatcher to
    backend ``name``; returns how many were pinned (0 for models whose processors call SDPA
    directly, such as UNet2DConditionModel). diffusers also makes ``name`` its process-wide
    default; that default is restored, so other models in the process are unaffected."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    setter = getattr(denoiser, "set_attention_backend", None)
    if setter is None:
        return 0
    before = _AttentionBackendRegistry._active_backend
    try:
        with _quiet_diffusers():
            setter(name)
    finally:
        _AttentionBackendRegistry.set_active_backend(before)
    return sum(
        1
        for module in denoiser.modules()
        if getattr(getattr(module, "processor", None), "_attention_backend", None) is not None
    )


def _apply_attention_backend(denoiser: torch.nn.Module, name: str, report: dict[str, Any]) -> None:
    try:
        report["attention_processors"] = set_attention_backend(denoiser, name)
        report["attention_backend"] = name
    except Exception as exc:  # noqa: BLE001 - any backend failure: fall back to SDPA
        report["errors"]["attention_backend"] = f"{name}: {type(exc).__name__}: {exc}"
        report["attention_processors"] = set_attention_backend(denoiser, "native")
    if report["attention_processors"] == 0:
        report["notes"].append(
            f"{type(denoiser).__name__}'s attention processors call torch SDPA directly; "
            "the attention backend does not apply"
        )
        report["attention_backend"] = "native"


def missing_compiler(device_type: str) -> str | None:
    """Why Inductor could not build code for ``device_type`` here, or None. On a CPU it
    compiles C++ with ``$CXX`` (default g++); without one, every compiled block would fail on
    its first call and fall back, so compilation is not turned on at all."""
    if device_type != "cpu":
        return None
    import os
    import shutil

    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} not on PATH) for Inductor on the CPU: running eagerly"
    return None


def _compile_repeated_blocks(denoiser: torch.nn.Module, report: dict[str, Any]) -> None:
    """diffusers' regional compilation: each repeated block class is compiled once and the
    compiled code reused by every block of that class. Compilation happens on the first call;
    a block dynamo cannot compile then runs eagerly (``suppress_errors``) instead of failing
    the generation."""
    compile_blocks = getattr(denoiser, "compile_repeated_blocks", None)
    if compile_blocks is None:
        report["errors"]["compile"] = f"{type(denoiser).__name__} has no compile_repeated_blocks"
        return
    try:
        import torch._dynamo

        torch._dynamo.config.suppress_errors = True
        compile_blocks()
    except Exception as exc:  # noqa: BLE001 - no repeated blocks, no compiler: stay eager
        report["errors"]["compile"] = f"{type(exc).__name__}: {exc}"
        return
    names = set(getattr(denoiser, "_repeated_blocks", ()) or ())
    report["compiled"] = True
    report["compiled_blocks"] = sum(1 for m in denoiser.modules() if type(m).__name__ in names)
