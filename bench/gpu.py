"""The engine's GPU speed-ups, compared on the denoisers at realistic sizes (random weights).

One command, under 8 minutes on an H200:

    python bench/gpu.py --out bench-gpu.json     # CUDA: FLUX-size and SDXL-size denoisers
    python bench/gpu.py --toy                    # tiny configs on CPU (the default without CUDA)

What it times is the denoiser alone, built from config with random weights (no download;
no text encoders: random prompt embeddings of the right shapes go straight in):

- a FluxTransformer2DModel with FLUX.1-dev's config (19 double + 38 single blocks, 24 heads
  x 128, joint_attention_dim 4096, in_channels 64) at 1024x1024: 4096 image tokens and 512
  text tokens, batch 1 and 4;
- a UNet2DConditionModel with SDXL's config at 1024x1024 (a 128x128 latent, 77 text tokens
  of width 2048), batch 2 (one image with classifier-free guidance).

Rows, each on the same inputs: eager fp32 (TF32 off), fp32 + TF32, eager bf16 (the
reference for output differences), bf16 with each usable diffusers attention backend,
then on the engine's automatic backend: + regional compilation (``compile_repeated_blocks``),
+ our Triton kernels, + INT8 attention, compile + kernels, and, for Flux, an N-step Euler
loop with and without diffusers' FirstBlockCache. Rows run interleaved (every row once per
round) for ``--reps`` rounds after one warm-up round (which includes compilation, reported
apart); figures are medians. Loop rows (N calls on a warm model) are timed ``--loop-reps``
times without a warm-up. Columns: ms per denoiser call, ms per image at N steps, speed
against eager fp32 and eager bf16, peak GPU memory (the row's own weights + its activation
peak), max |output - eager bf16 output| (for the loops: final latents against the uncached
loop). A piece that fails (a backend missing, compilation failing) becomes a row with its
error. On CUDA ``pytest tests/kernels`` runs first, in a subprocess (pass/fail recorded).
A time budget keeps the whole run under ``--budget-s``: rows that would end past it are
not started and are reported as skipped.

Output: a table on stdout, the figures in ``--out`` (rewritten after every case, so a run cut
short still leaves what it measured), and as the last stdout line one JSON object.
Random weights time like trained ones, but FirstBlockCache's skip decisions depend on the
weights: its speed-up here says what the hook costs and saves on this model, not what a
trained FLUX.1 would skip.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# `python bench/...` puts bench/ first on sys.path, where bench/queue.py would shadow the standard
# library's `queue` (torch imports it); the packages live in the repository root.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from engine.config import EngineConfig, attention_backend_blocker, cuda_capability  # noqa: E402

FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
    guidance_embeds=True, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
"""black-forest-labs/FLUX.1-dev transformer/config.json (out_channels defaults to in_channels)."""

FLUX_TOY = dict(
    patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
    guidance_embeds=True, axes_dims_rope=(4, 6, 6),
)  # fmt: skip

SDXL = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280), transformer_layers_per_block=(1, 2, 10),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(5, 10, 20), cross_attention_dim=2048, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816, norm_num_groups=32,
)  # fmt: skip
"""stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the fields that differ from
UNet2DConditionModel's defaults). 2816 = 1280 (pooled text) + 6 x 256 (time ids)."""

SDXL_TOY = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
    block_out_channels=(16, 32, 32), transformer_layers_per_block=(1, 1, 1),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4, 4), cross_attention_dim=32, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=32 + 6 * 8, norm_num_groups=8,
)  # fmt: skip

SDXL_TEXT_TOKENS = 77
ATTENTION_CANDIDATES = (
    "_native_cudnn",
    "_native_flash",
    "_native_efficient",
    "flash",
    "_flash_3",
    "sage",
)
"""Backends tried as extra rows where usable (the engine's own choice always gets a row)."""


@dataclass
class Case:
    """One denoiser at one size and batch."""

    model: str  # "flux" | "sdxl"
    batch: int
    steps: int
    tokens: int  # flux: image tokens; sdxl: latent side
    text_tokens: int
    full_rows: bool  # every row (first batch of a model) or the core ones

    @property
    def name(self) -> str:
        size = (
            f"{self.tokens} image tokens"
            if self.model == "flux"
            else f"{self.tokens}x{self.tokens} latent"
        )
        return f"{self.model} batch {self.batch} ({size}, {self.text_tokens} text tokens, {self.steps} steps)"


@dataclass
class Row:
    """One variant: which weights, which switches."""

    name: str
    weights: str = "bf16"  # "fp32" | "bf16"
    backend: str = "native"
    tf32: bool = False
    compiled: bool = False
    kernels: dict[str, bool] = field(default_factory=dict)
    loop: bool = False  # an N-step Euler loop rather than one denoiser call
    cache: float | None = None  # FirstBlockCache threshold (loop rows)
    reference: str = "eager bf16"
    engine_default: bool = False
    times: list[float] = field(default_factory=list)
    first_s: float | None = None
    activation_bytes: int = 0
    output: torch.Tensor | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# models and inputs


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def build(model: str, toy: bool, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(fp32, bf16) copies of one random denoiser, built on the device (fast init there);
    the bf16 one is built in bf16 and given the fp32 weights, so peak memory stays 1.5x."""
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel

    cls, config = (
        (FluxTransformer2DModel, FLUX_TOY if toy else FLUX_DEV)
        if model == "flux"
        else (UNet2DConditionModel, SDXL_TOY if toy else SDXL)
    )
    torch.manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        with torch.device(device), _default_dtype(dtype):
            net = cls(**config)
        out.append(net.eval().requires_grad_(False))
    out[1].load_state_dict(out[0].state_dict())
    return out[0], out[1]


def flux_ids(tokens: int, text_tokens: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """img_ids / txt_ids as FluxPipeline makes them: (0, row, col) per packed latent token."""
    side = int(round(tokens**0.5))
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return ids.reshape(-1, 3).to(device), torch.zeros(text_tokens, 3, device=device)


def make_inputs(case: Case, net: torch.nn.Module, device: str) -> dict[str, Any]:
    """Random fp32 inputs of the right shapes (cast per row); the latent is ``x``."""
    g = torch.Generator("cpu").manual_seed(1)
    cfg = net.config
    b = case.batch

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device)

    if case.model == "flux":
        img_ids, txt_ids = flux_ids(case.tokens, case.text_tokens, device)
        return {
            "x": randn(b, case.tokens, cfg.in_channels),
            "encoder_hidden_states": randn(b, case.text_tokens, cfg.joint_attention_dim),
            "pooled_projections": randn(b, cfg.pooled_projection_dim),
            "guidance": torch.full((b,), 3.5, device=device),
            "img_ids": img_ids,
            "txt_ids": txt_ids,
        }
    side = case.tokens
    time_ids = torch.tensor([8.0 * side, 8.0 * side, 0, 0, 8.0 * side, 8.0 * side])
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    return {
        "x": randn(b, cfg.in_channels, side, side),
        "encoder_hidden_states": randn(b, case.text_tokens, cfg.cross_attention_dim),
        "text_embeds": randn(b, pooled),
        "time_ids": time_ids.repeat(b, 1).to(device),
    }


def denoise_call(
    case: Case,
    net: torch.nn.Module,
    inputs: dict[str, Any],
    x: torch.Tensor,
    t: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One denoiser call at noise level ``t`` in (0, 1]."""
    b = case.batch
    if case.model == "flux":
        return net(
            hidden_states=x.to(dtype),
            encoder_hidden_states=inputs["encoder_hidden_states"].to(dtype),
            pooled_projections=inputs["pooled_projections"].to(dtype),
            timestep=torch.full((b,), t, device=x.device, dtype=dtype),
            guidance=inputs["guidance"].to(dtype),
            img_ids=inputs["img_ids"],
            txt_ids=inputs["txt_ids"],
            return_dict=False,
        )[0]
    return net(
        x.to(dtype),
        torch.full((b,), 1000.0 * t, device=x.device),
        encoder_hidden_states=inputs["encoder_hidden_states"].to(dtype),
        added_cond_kwargs={
            "text_embeds": inputs["text_embeds"].to(dtype),
            "time_ids": inputs["time_ids"].to(dtype),
        },
        return_dict=False,
    )[0]


def euler_loop(
    case: Case, net: torch.nn.Module, inputs: dict[str, Any], dtype: torch.dtype, cached: bool
) -> tuple[torch.Tensor, int]:
    """Flow-matching Euler over ``case.steps`` steps, as FluxPipeline runs its transformer (in a
    cache context per call); returns the final latents and how many steps ran every block."""
    x = inputs["x"].to(dtype)
    sigmas = torch.linspace(1.0, 1.0 / case.steps, case.steps).tolist() + [0.0]
    full_steps = 0
    for i in range(case.steps):
        with net.cache_context("cond"):
            v = denoise_call(case, net, inputs, x, sigmas[i], dtype)
            full_steps += _computed_every_block(net) if cached else 1
        x = (x.float() + (sigmas[i + 1] - sigmas[i]) * v.float()).to(dtype)
    if cached:
        net._reset_stateful_cache()
    return x, full_steps


def _computed_every_block(net: torch.nn.Module) -> int:
    """1 when FirstBlockCache decided to run the remaining blocks in the call just made."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.first_block_cache import _FBC_LEADER_BLOCK_HOOK

    for module in net.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = (
            registry.get_hook(_FBC_LEADER_BLOCK_HOOK)
            if isinstance(registry, HookRegistry)
            else None
        )
        if hook is not None:
            return int(hook.state_manager.get_state().should_compute)
    return 1


# --------------------------------------------------------------------------------------------
# switching a row on and off on the shared models


class Switches:
    """Turns rows' switches on and off on the two resident models (weights are not copied)."""

    def __init__(self, nets: dict[str, torch.nn.Module], device: str, compile_backend: str) -> None:
        self.nets, self.device, self.compile_backend = nets, device, compile_backend
        self._compiled: dict[int, dict[torch.nn.Module, Any]] = {}
        self._patches: dict[tuple[int, tuple[str, ...]], list[tuple[Any, ...]]] = {}

    @contextmanager
    def row(self, row: Row) -> Iterator[torch.nn.Module]:
        from engine.speedups import set_attention_backend

        net = self.nets[row.weights]
        if self.device.startswith("cuda"):
            torch.set_float32_matmul_precision("high" if row.tf32 else "highest")
        set_attention_backend(net, row.backend)
        undo: list[Callable[[], None]] = []
        try:
            if any(row.kernels.values()):
                import kernels

                self._install(net, row.kernels)
                undo.append(lambda: kernels.uninstall(net))
            if row.compiled:
                self._compile(net)
                undo.append(lambda: self._uncompile(net))
            if row.cache is not None:
                from diffusers import FirstBlockCacheConfig

                net.enable_cache(FirstBlockCacheConfig(threshold=row.cache))
                undo.append(net.disable_cache)
            yield net
        finally:
            for fn in reversed(undo):
                fn()
            torch.set_float32_matmul_precision("highest")

    def _install(self, net: torch.nn.Module, switches: dict[str, bool]) -> None:
        """``kernels.install``, the first time; afterwards the very same patched forwards and
        processors are put back, so compiled blocks find what they were compiled with (a new
        bound method each round would make dynamo recompile them every round)."""
        import kernels

        key = (id(net), tuple(sorted(k for k, v in switches.items() if v)))
        saved = self._patches.get(key)
        if saved is None:
            kernels.install(
                net,
                fused_adaln=switches.get("fused_adaln", False),
                fused_activations=switches.get("fused_activations", False),
                int8_attention=switches.get("int8_attention", False),
            )
            saved = [
                (
                    m,
                    m.__dict__.get("forward"),
                    getattr(m, kernels.flux._PATCHED, None),
                    getattr(m, "processor", None),
                )
                for m in net.modules()
                if getattr(m, kernels.flux._PATCHED, None) is not None
                or isinstance(getattr(m, "processor", None), kernels.KernelFluxAttnProcessor)
            ]
            self._patches[key] = saved
            return
        for module, forward, kind, processor in saved:
            if forward is not None:
                module.forward = forward
                setattr(module, kernels.flux._PATCHED, kind)
            if isinstance(processor, kernels.KernelFluxAttnProcessor):
                module.set_processor(processor)

    def _compile(self, net: torch.nn.Module) -> None:
        """Regional compilation, compiled once per model and switched on/off afterwards."""
        saved = self._compiled.get(id(net))
        if saved is None:
            net.compile_repeated_blocks(backend=self.compile_backend)
            names = set(net._repeated_blocks)
            saved = {m: m._compiled_call_impl for m in net.modules() if type(m).__name__ in names}
            self._compiled[id(net)] = saved
        for module, impl in saved.items():
            module._compiled_call_impl = impl

    def _uncompile(self, net: torch.nn.Module) -> None:
        for module in self._compiled.get(id(net), {}):
            module._compiled_call_impl = None


# --------------------------------------------------------------------------------------------
# rows


def usable_backends(device: str) -> list[str]:
    """Attention backends that can run here in bf16 (their package installed), besides native."""
    if not device.startswith("cuda"):
        return []
    capability = cuda_capability(device)
    return [
        b
        for b in ATTENTION_CANDIDATES
        if attention_backend_blocker(b, capability, "bfloat16") is None
    ]


def rows_for(case: Case, device: str, engine: Any) -> list[Row]:
    """The rows of one case; ``engine`` is what EngineConfig() resolves to on this device."""
    on_cuda = device.startswith("cuda")
    # UNet2DConditionModel's processors call SDPA directly: no backend applies to it
    best = engine.attention_backend if case.model == "flux" else "native"
    fused = {"fused_adaln": True, "fused_activations": True}
    rows = [Row("eager fp32", weights="fp32")]
    if on_cuda:
        rows.append(Row("fp32 + TF32", weights="fp32", tf32=True))
    rows.append(Row("eager bf16"))
    if case.full_rows and case.model == "flux":
        rows += [
            Row(f"bf16 + attention {b}", backend=b) for b in usable_backends(device) if b != best
        ]
    if best != "native":
        rows.append(Row(f"bf16 + attention {best}", backend=best))
    rows += [
        Row(f"bf16 + {best} + regional compile", backend=best, compiled=True),
        Row(f"bf16 + {best} + our kernels", backend=best, kernels=fused),
    ]
    if case.full_rows and case.model == "flux":
        rows += [
            Row(
                f"bf16 + {best} + kernels + int8 attention",
                backend=best,
                kernels=fused | {"int8_attention": True},
            ),
            Row(f"bf16 + {best} + compile + kernels", backend=best, compiled=True, kernels=fused),
        ]
    if case.model == "flux":
        loop = f"bf16 + {best}, {case.steps}-step loop"
        rows += [
            Row(loop, backend=best, loop=True, reference=loop),
            Row(
                f"{loop} + FirstBlockCache 0.05",
                backend=best,
                loop=True,
                cache=0.05,
                reference=loop,
            ),
        ]
    weights = "fp32" if engine.dtype == "float32" else "bf16"
    for row in rows:  # the first row with the switches EngineConfig() resolves to here
        if (
            row.weights == weights
            and not row.loop
            and not row.tf32
            and row.backend == (best if weights == "bf16" else "native")
            and row.compiled == engine.compile
            and row.kernels.get("fused_adaln", False) == engine.fused_adaln
            and not row.kernels.get("int8_attention", False)
        ):
            row.engine_default = True
            break
    return rows


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def run_case(
    case: Case,
    nets: dict[str, torch.nn.Module],
    device: str,
    switches: Switches,
    engine: Any,
    reps: int,
    loop_reps: int,
    deadline: float,
) -> list[Row]:
    """A warm-up round, then ``reps`` interleaved rounds, each row once per round. Loop rows
    (N denoiser calls each, on an already warm model) need no warm-up: they are timed from
    the first round, ``loop_reps`` times. A row whose next call would end past ``deadline``
    (by its last call, or a guess for a compile) is not started."""
    on_cuda = device.startswith("cuda")
    inputs = make_inputs(case, nets["fp32"], device)
    rows = rows_for(case, device, engine)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for rnd in range(reps + 1):
        for row in rows:
            if row.error is not None or (row.loop and len(row.times) >= loop_reps):
                continue
            if time.monotonic() + _expected_s(row, rows, case, on_cuda) > deadline:
                if not row.times:
                    row.error = "skipped: time budget" + (
                        " (after the warm-up call)" if row.first_s is not None else ""
                    )
                continue
            try:
                _timed_call(case, row, switches, inputs, dtypes[row.weights], on_cuda, rnd)
            except Exception as exc:  # noqa: BLE001 - one failing piece is one row with an error
                row.error = _short(exc)
                if on_cuda:
                    torch.cuda.empty_cache()
            last = (row.times or [row.first_s or 0.0])[-1]
            print(
                f"  [{case.model} b{case.batch}] round {rnd} {row.name}: "
                f"{'error: ' + row.error if row.error else f'{last:.3f} s'}",
                file=sys.stderr,
                flush=True,
            )
    return rows


def _timed_call(
    case: Case,
    row: Row,
    switches: Switches,
    inputs: dict[str, Any],
    dtype: torch.dtype,
    on_cuda: bool,
    rnd: int,
) -> None:
    with switches.row(row) as net, torch.inference_mode():
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        calls = _kernel_calls()
        start = time.perf_counter()
        if row.loop:
            out, full = euler_loop(case, net, inputs, dtype, row.cache is not None)
            row.extra["steps_computing_every_block"] = full
        else:
            out = denoise_call(case, net, inputs, inputs["x"], 0.7, dtype)
        if on_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if on_cuda:
            peak = torch.cuda.max_memory_allocated() - base
            row.activation_bytes = max(row.activation_bytes, peak)
    if row.output is None:  # the first call: outputs to compare, which kernel paths ran
        row.output = out.float()
        row.extra["kernel_calls"] = _kernel_calls(since=calls)
    if rnd == 0 and not row.loop:
        row.first_s = elapsed
    else:
        row.times.append(elapsed)


COMPILE_GUESS_S = 60.0
"""What a first compiled call is assumed to take on CUDA before it has been seen (Inductor
compiling the repeated block classes): a guess, so the budget does not start a compile it
cannot finish; the measured time replaces it once seen."""


def _expected_s(row: Row, rows: list[Row], case: Case, on_cuda: bool) -> float:
    """How long the next call of ``row`` should take, from what has been seen."""
    if row.times or row.first_s is not None:
        return max(row.times or [row.first_s or 0.0])
    if row.compiled and on_cuda:
        return COMPILE_GUESS_S
    if row.loop:
        plain = [
            r for r in rows
            if r.weights == row.weights and r.backend == row.backend
            and not (r.compiled or r.loop or r.kernels) and (r.times or r.first_s)
        ]  # fmt: skip
        return case.steps * min((min(r.times or [r.first_s or 0.0]) for r in plain), default=0.0)
    return 0.0


def _kernel_calls(since: dict[str, int] | None = None) -> dict[str, int]:
    """Our dispatcher's calls per op/path (which path really ran), minus ``since``."""
    kernels = sys.modules.get("kernels")
    calls = {f"{op}/{path}": n for (op, path), n in getattr(kernels, "CALLS", {}).items()}
    if since is None:
        return calls
    return {k: v - since.get(k, 0) for k, v in calls.items() if v - since.get(k, 0)}


def summarize(
    case: Case, rows: list[Row], nets: dict[str, torch.nn.Module], on_cuda: bool
) -> list[dict[str, Any]]:
    """Per-row figures: medians, per-image time at N steps, ratios, memory, output difference."""
    weight_bytes = {
        k: sum(p.numel() * p.element_size() for p in n.parameters()) for k, n in nets.items()
    }
    by_name = {r.name: r for r in rows}

    def per_image_ms(row: Row) -> float | None:
        if not row.times:
            return None
        med = statistics.median(row.times) * 1000
        return med / case.batch if row.loop else med * case.steps / case.batch

    fp32, bf16 = per_image_ms(by_name["eager fp32"]), per_image_ms(by_name["eager bf16"])
    out = []
    for row in rows:
        img = per_image_ms(row)
        ref = by_name.get(row.reference)
        diff = None
        if row.output is not None and ref is not None and ref.output is not None:
            diff = float((row.output - ref.output).abs().max())
        out.append({
            "row": row.name,
            "engine_default": row.engine_default,
            "ms_per_step": (statistics.median(row.times) * 1000 / (case.steps if row.loop else 1)) if row.times else None,
            "ms_per_image": img,
            "speedup_vs_fp32": fp32 / img if img and fp32 else None,
            "speedup_vs_bf16": bf16 / img if img and bf16 else None,
            "first_call_s": row.first_s,
            "peak_gib": (weight_bytes[row.weights] + row.activation_bytes) / 2**30 if on_cuda and row.times else None,
            "max_abs_diff": diff,
            "diff_against": row.reference if diff is not None else None,
            "ref_max_abs": float(ref.output.abs().max()) if ref is not None and ref.output is not None else None,
            "reps": len(row.times),
            "error": row.error,
            **row.extra,
        })  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# kernel tests, table, main


def run_kernel_tests(timeout_s: float, on_cuda: bool) -> dict[str, Any]:
    """``pytest tests/kernels`` in a fresh interpreter; its summary line and exit code."""
    env = dict(os.environ)
    if not on_cuda:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stdout or b"")[-2000:]
        return {
            "passed": False,
            "summary": f"timeout after {timeout_s:.0f} s",
            "rc": None,
            "tail": tail.decode() if isinstance(tail, bytes) else tail,
        }
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-300:]
    result = {
        "passed": proc.returncode == 0,
        "rc": proc.returncode,
        "summary": summary,
        "wall_s": round(time.monotonic() - start, 1),
    }
    if proc.returncode != 0:
        result["tail"] = (proc.stdout + proc.stderr)[-3000:]
    return result


def _fmt(value: Any, spec: str) -> str:
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if value is None else format(value, spec)


def table(cases: list[dict[str, Any]]) -> str:
    lines = []
    head = f"{'row':<52} {'ms/call':>9} {'ms/image':>10} {'x fp32':>7} {'x bf16':>7} {'1st s':>7} {'peak GiB':>8} {'max|d|':>9}  note"
    for case in cases:
        lines += ["", f"== {case['case']}", head, "-" * len(head)]
        for r in case["rows"]:
            note = r["error"] or ""
            if r.get("steps_computing_every_block") is not None and "FirstBlockCache" in r["row"]:
                note = note or f"{r['steps_computing_every_block']} steps ran every block"
            mark = "*" if r["engine_default"] else " "
            lines.append(
                f"{mark}{r['row']:<51} {_fmt(r['ms_per_step'], '9.1f')} {_fmt(r['ms_per_image'], '10.1f')} "
                f"{_fmt(r['speedup_vs_fp32'], '7.2f')} {_fmt(r['speedup_vs_bf16'], '7.2f')} "
                f"{_fmt(r['first_call_s'], '7.1f')} {_fmt(r['peak_gib'], '8.2f')} "
                f"{_fmt(r['max_abs_diff'], '9.2e')}  {note}"
            )
    lines.append(
        "\n* = what EngineConfig() resolves to on this device; ms/call of a loop row is per step"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--toy", action="store_true", help="tiny configs on CPU (default without CUDA)"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-gpu.json"))
    parser.add_argument("--models", nargs="+", choices=("flux", "sdxl"), default=["flux", "sdxl"])
    parser.add_argument("--flux-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--sdxl-batch", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per image (flux 28, sdxl 30; toy 4)"
    )
    parser.add_argument("--reps", type=int, default=3, help="timed rounds after the warm-up round")
    parser.add_argument(
        "--loop-reps", type=int, default=1, help="timed N-step loops per loop row (no warm-up)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="the whole run's budget, kernel tests included: rows that would end past it are "
        "not started (CUDA 450, toy 120)",
    )
    parser.add_argument(
        "--kernel-tests",
        choices=("auto", "on", "off"),
        default="auto",
        help="run pytest tests/kernels (auto: on CUDA only)",
    )
    parser.add_argument("--kernel-tests-timeout-s", type=float, default=120)
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (CUDA: inductor; toy: eager, which traces the "
        "blocks with dynamo but generates no code: inductor takes minutes on a CPU)",
    )
    args = parser.parse_args(argv)

    started = time.monotonic()
    toy = args.toy or not torch.cuda.is_available()
    device = "cpu" if toy else "cuda"
    on_cuda = device == "cuda"
    if toy:
        torch.set_num_threads(1)  # toy models run fastest on one thread
    import torch._dynamo as dynamo

    # several rows and batch sizes share the compiled blocks (cache_size_limit: older torch)
    name = "recompile_limit" if hasattr(dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo.config, name, 64)
    engine = EngineConfig().resolve(device)
    deadline = started + (args.budget_s if args.budget_s is not None else (450 if on_cuda else 120))
    jobs = [("flux", b) for b in args.flux_batches[:1]] if "flux" in args.models else []
    jobs += [("sdxl", args.sdxl_batch)] if "sdxl" in args.models else []
    jobs += [("flux", b) for b in args.flux_batches[1:]] if "flux" in args.models else []
    figures: dict[str, Any] = {
        "bench": "gpu",
        "mode": "cuda" if on_cuda else "toy-cpu",
        "device": torch.cuda.get_device_name() if on_cuda else "cpu (toy sizes: not GPU figures)",
        "torch": torch.__version__,
        "engine_defaults": engine.as_dict(),
        "compile_backend": args.compile_backend or ("inductor" if on_cuda else "eager"),
        "cases": [],
    }
    run_tests = args.kernel_tests == "on" or (args.kernel_tests == "auto" and on_cuda)
    figures["kernel_tests"] = (  # first, while the GPU is free and the budget is whole
        run_kernel_tests(args.kernel_tests_timeout_s, on_cuda)
        if run_tests
        else {"passed": None, "summary": "not run (toy run; they run by default on CUDA)"}
    )
    print(f"pytest tests/kernels: {figures['kernel_tests']['summary']}", file=sys.stderr)
    try:
        import diffusers

        figures["diffusers"] = diffusers.__version__
    except ImportError as exc:
        raise SystemExit(f"bench/gpu.py needs diffusers: {exc}") from exc
    switches: Switches | None = None
    nets: dict[str, torch.nn.Module] = {}
    built = None
    seen: set[str] = set()
    for model, batch in jobs:
        if time.monotonic() > deadline:
            figures["cases"].append(
                {"case": f"{model} batch {batch}", "rows": [], "skipped": "time budget"}
            )
            continue
        if built != model:
            switches = None
            _release(nets, on_cuda)
            start = time.monotonic()
            fp32, bf16 = build(model, toy, device)
            nets.update(fp32=fp32, bf16=bf16)
            compile_backend = args.compile_backend or ("inductor" if on_cuda else "eager")
            switches, built = Switches(nets, device, compile_backend), model
            print(
                f"built {model} in {time.monotonic() - start:.1f} s "
                f"({sum(p.numel() for p in fp32.parameters()) / 1e9:.3f} B params)",
                file=sys.stderr,
            )
        steps = args.steps or (4 if toy else (28 if model == "flux" else 30))
        if model == "flux":
            case = Case(
                "flux", batch, steps, 64 if toy else 4096, 8 if toy else 512, model not in seen
            )
        else:
            case = Case(
                "sdxl", batch, steps, 16 if toy else 128, 8 if toy else SDXL_TEXT_TOKENS, True
            )
        seen.add(model)
        assert switches is not None
        rows = run_case(case, nets, device, switches, engine, args.reps, args.loop_reps, deadline)
        figures["cases"].append(
            {
                "case": case.name,
                "model": model,
                "batch": batch,
                "steps": steps,
                "rows": summarize(case, rows, nets, on_cuda),
            }
        )
        _write(args.out, figures, partial=True)
    switches = None
    _release(nets, on_cuda)
    figures["wall_s"] = round(time.monotonic() - started, 1)
    print(table(figures["cases"]))
    kt = figures["kernel_tests"]
    print(f"\npytest tests/kernels: {kt['summary']}")
    figures["partial"] = False
    _write(args.out, figures, partial=False)
    print(json.dumps(figures))
    return figures


def _release(nets: dict[str, torch.nn.Module], on_cuda: bool) -> None:
    """Free the models: the switches' saved compiled blocks and dynamo's compiled code hold
    references to them, so both must go before the memory comes back."""
    import torch._dynamo as dynamo

    nets.clear()
    dynamo.reset()
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()


def _write(path: Path, figures: dict[str, Any], partial: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures | {"partial": partial}, indent=2))


if __name__ == "__main__":
    main()
