"""The GPU path, checked on the CPU: how EngineConfig resolves per device, what the Runner
applies and reports, and that bench/gpu.py runs end to end at toy sizes.

There is no GPU here. The CUDA resolution is exercised by naming a "cuda" device and
monkeypatching the two probes that would ask the hardware and the installed packages
(``engine.config.cuda_capability`` and ``engine.config.probe_attention_backend``): a test
double where the real thing cannot exist here. The Runner tests use the real tiny presets
and the real diffusers attention dispatcher.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import engine.config as config_module
from engine.config import ATTENTION_PREFERENCE, KERNEL_TABLE, EngineConfig
from engine.runner import Runner
from engine.speedups import set_attention_backend
from engine.types import GenerationRequest, Region

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def keep_dynamo_config() -> Iterator[None]:
    """Compiling sets dynamo's process-wide ``suppress_errors``; put it back after the test."""
    import torch._dynamo

    before = torch._dynamo.config.suppress_errors
    yield
    torch._dynamo.config.suppress_errors = before


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """A pretend CUDA device: its capability and the installed attention packages are set by
    the test (``state["capability"]``, ``state["installed"]``); the probe records its calls."""
    state: dict[str, object] = {"capability": (9, 0), "installed": set(), "probed": []}

    def probe(name: str) -> str | None:
        state["probed"].append(name)  # type: ignore[union-attr]
        return None if name in state["installed"] else f"{name}: package not installed"  # type: ignore[operator]

    monkeypatch.setattr(config_module, "probe_attention_backend", probe)
    monkeypatch.setattr(config_module, "cuda_capability", lambda device: state["capability"])
    return state


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_dtype_is_bfloat16_on_cuda_and_on_cpus_with_native_bfloat16(
    fake_cuda: dict[str, object], monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    import torch

    caps = dict(torch.cpu.get_capabilities()) | {"avx512_bf16": native_bf16, "amx_bf16": False}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)
    config_module.cpu_has_native_bf16.cache_clear()
    try:
        config = EngineConfig()
        assert config.dtype == "auto"
        cpu = "bfloat16" if native_bf16 else "float32"
        assert config.resolved_dtype("cpu") == cpu and config.resolve("cpu").dtype == cpu
        assert any(f"dtype auto -> {cpu} on cpu" in n for n in config.resolve("cpu").notes)
        assert config.resolved_dtype("cuda:0") == "bfloat16"
        assert config.resolve("cuda").dtype == "bfloat16"
        assert EngineConfig(dtype="float16").resolve("cpu").dtype == "float16"  # explicit wins
        assert EngineConfig(dtype="float32").resolve("cpu").dtype == "float32"
    finally:
        config_module.cpu_has_native_bf16.cache_clear()


def test_cpu_bfloat16_detection_survives_a_torch_without_capabilities(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    def broken() -> dict:
        raise RuntimeError("no cpuinfo")

    monkeypatch.setattr(torch.cpu, "get_capabilities", broken)
    config_module.cpu_has_native_bf16.cache_clear()
    try:
        assert EngineConfig().resolved_dtype("cpu") == "float32"
    finally:
        config_module.cpu_has_native_bf16.cache_clear()


def test_cpu_resolution_turns_every_gpu_speedup_off(fake_cuda: dict[str, object]) -> None:
    fake_cuda["installed"] = {"flash", "_flash_3", "sage"}  # installed or not: not on a CPU
    resolved = EngineConfig().resolve("cpu")
    assert (resolved.tf32, resolved.compile, resolved.attention_backend) == (False, False, "native")
    assert (resolved.fused_adaln, resolved.fused_activations, resolved.int8_attention) == (
        False,
    ) * 3
    assert fake_cuda["probed"] == []  # no package probing on a CPU


def test_cuda_resolution_turns_the_winners_on(fake_cuda: dict[str, object]) -> None:
    fake_cuda["installed"] = {"flash", "_flash_3"}
    resolved = EngineConfig().resolve("cuda")
    assert resolved.tf32 and resolved.compile
    assert resolved.attention_backend == "_flash_3"  # the first of ATTENTION_PREFERENCE that holds
    # compiled: Inductor fuses the norms itself, the table keeps our kernels off
    assert KERNEL_TABLE[("cuda", True)] == {"fused_adaln": False, "fused_activations": False}
    assert (
        not resolved.fused_adaln and not resolved.fused_activations and not resolved.int8_attention
    )
    eager = EngineConfig(compile=False).resolve("cuda")
    assert eager.fused_adaln and eager.fused_activations and not eager.int8_attention


def test_backend_choice_falls_back_to_native_when_packages_are_missing(
    fake_cuda: dict[str, object],
) -> None:
    fake_cuda["installed"] = set()
    resolved = EngineConfig().resolve("cuda")
    assert resolved.attention_backend == "native"
    assert set(fake_cuda["probed"]) == set(ATTENTION_PREFERENCE) - {"native"}  # type: ignore[arg-type]
    assert any("package not installed" in note for note in resolved.notes)
    # an explicitly asked backend that is missing falls back too, it does not fail
    assert EngineConfig(attention_backend="sage").resolve("cuda").attention_backend == "native"


def test_backend_choice_respects_capability_and_dtype(fake_cuda: dict[str, object]) -> None:
    fake_cuda["installed"] = {"flash", "_flash_3"}
    fake_cuda["capability"] = (8, 0)  # Ampere: FlashAttention-3 is Hopper-only
    assert EngineConfig().resolve("cuda").attention_backend == "flash"
    fake_cuda["capability"] = (9, 0)
    # flash kernels take half precision only: fp32 on CUDA stays on SDPA
    assert EngineConfig(dtype="float32").resolve("cuda").attention_backend == "native"
    fake_cuda["capability"] = (7, 5)
    assert EngineConfig().resolve("cuda").attention_backend == "native"


def test_bad_switch_values_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        EngineConfig(dtype="float8")
    with pytest.raises(ValueError, match="unknown attention_backend 'flsh'"):
        EngineConfig(attention_backend="flsh").resolve("cpu")
    with pytest.raises(ValueError, match="attention_backend must be"):
        EngineConfig(attention_backend="")


def test_runner_reports_what_it_chose(cpu_config: EngineConfig) -> None:
    runner = Runner("tiny-dit", cpu_config)
    report = runner.engine_report
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert runner.denoiser.dtype == torch.float32
    assert report["tf32"] is False and report["compiled"] is False and report["kernels"] == {}
    assert report["attention_backend"] == "native"
    # every attention processor of the Flux transformer is pinned to the backend (1 + 1 blocks)
    assert report["attention_processors"] == 2
    pinned = {
        str(getattr(m.processor, "_attention_backend", None))
        for m in runner.denoiser.modules()
        if hasattr(m, "processor")
    }
    assert pinned == {"AttentionBackendName.NATIVE"}
    assert report["errors"] == {}
    assert not any(note.startswith("dtype auto") for note in report["notes"])  # pinned
    json.dumps(report)  # plain data: benches and the API can show it as is


def test_runner_report_for_a_unet_and_for_asked_switches(
    cpu_config: EngineConfig, keep_dynamo_config: None
) -> None:
    unet = Runner("tiny-unet", cpu_config)
    assert unet.engine_report["attention_processors"] == 0  # UNet processors call SDPA directly
    assert any("SDPA directly" in note for note in unet.engine_report["notes"])
    asked = Runner(
        "tiny-dit",
        replace(cpu_config, attention_backend="flash", fused_adaln=True, compile=True),
    )
    report = asked.engine_report
    assert report["attention_backend"] == "native"  # flash needs CUDA: a note, not a failure
    assert any("needs CUDA" in note for note in report["notes"])
    assert report["kernels"]["adaln"] > 0 and asked.installed_kernels == report["kernels"]
    assert report["compiled"] and report["compiled_blocks"] == 2  # 1 double + 1 single block


def test_a_failing_backend_becomes_an_error_entry_not_a_crash(
    cpu_config: EngineConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine import speedups

    real = speedups.set_attention_backend

    def broken(denoiser: torch.nn.Module, name: str) -> int:
        if name != "native":
            raise RuntimeError("kernel hub unreachable")
        return real(denoiser, name)

    monkeypatch.setattr(speedups, "set_attention_backend", broken)
    pipe = Runner("tiny-dit", cpu_config).pipe
    resolved = replace(cpu_config.resolve(), attention_backend="flash_hub")
    report = speedups.apply_speedups(pipe, resolved)
    assert report["attention_backend"] == "native" and report["attention_processors"] == 2
    assert "kernel hub unreachable" in report["errors"]["attention_backend"]


def test_set_attention_backend_leaves_the_process_default_alone(cpu_config: EngineConfig) -> None:
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    runner = Runner("tiny-dit", cpu_config)
    before = _AttentionBackendRegistry._active_backend
    assert set_attention_backend(runner.denoiser, "_native_math") == 2
    assert _AttentionBackendRegistry._active_backend == before


def test_compiled_runner_generates_the_same_image(
    cpu_config: EngineConfig, keep_dynamo_config: None
) -> None:
    """Regional compilation through dynamo's eager backend (no code generation, so it runs in
    seconds on a CPU) gives the image of the uncompiled runner."""
    plain = Runner("tiny-dit", cpu_config)
    compiled = Runner("tiny-dit", replace(cpu_config, compile=True))
    assert compiled.engine_report["compiled"]
    for block in compiled.denoiser.modules():  # swap Inductor for dynamo's eager backend
        if getattr(block, "_compiled_call_impl", None) is not None:
            block._compiled_call_impl = torch.compile(block._call_impl, backend="eager")
    request = GenerationRequest(prompt="a red circle", seed=3, width=32, height=32, steps=2,
                                model="tiny-dit")  # fmt: skip
    a = np.asarray(plain.generate([request])[0].image, dtype=np.int16)
    b = np.asarray(compiled.generate([request])[0].image, dtype=np.int16)
    assert np.abs(a - b).max() <= 1


def test_compile_without_a_cxx_compiler_stays_eager_with_an_error_entry(
    cpu_config: EngineConfig, keep_dynamo_config: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor needs a C++ compiler on a CPU; without one compilation is not turned on at
    all (every compiled block would fail on its first call), and the runner still generates."""
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    runner = Runner("tiny-dit", replace(cpu_config, compile=True))
    report = runner.engine_report
    assert not report["compiled"] and "no-such-compiler-here" in report["errors"]["compile"]
    assert not any(getattr(m, "_compiled_call_impl", None) for m in runner.denoiser.modules())
    request = GenerationRequest(prompt="a red circle", seed=3, width=32, height=32, steps=2,
                                model="tiny-dit")  # fmt: skip
    assert runner.generate([request])[0].image.size == (32, 32)


@pytest.mark.slow
def test_inductor_compiled_shapes_model_matches_eager_across_batch_sizes(
    cpu_config: EngineConfig, keep_dynamo_config: None
) -> None:
    """The worker default on a CPU (AGENTLOOP_ENGINE_COMPILE=auto): the shipped model's
    blocks compiled by Inductor give the eager images, for a first batch and for batches of
    other sizes (layouts included: more rows), which dynamo serves from one dynamic graph."""
    plain = Runner("shapes", cpu_config)
    compiled = Runner("shapes", replace(cpu_config, compile=True))
    assert compiled.engine_report["compiled"] and compiled.engine_report["errors"] == {}
    requests = [
        GenerationRequest(prompt=f"a small {c} circle on the left", seed=i, model="shapes",
                          steps=8, guidance=3.0)
        for i, c in enumerate(["red", "blue", "green", "yellow", "purple"])
    ]  # fmt: skip
    layout = GenerationRequest(
        prompt="a red circle on the left and a blue square on the right", seed=9, model="shapes",
        steps=8, guidance=3.0,
        regions=(Region("a red circle on the left", 0.25, 0.5),
                 Region("a blue square on the right", 0.75, 0.5)),
    )  # fmt: skip
    for batch in (requests[:4], requests[4:], [layout, *requests[:2]]):
        for a, b in zip(plain.generate(batch), compiled.generate(batch), strict=True):
            diff = np.abs(np.asarray(a.image, np.int16) - np.asarray(b.image, np.int16))
            assert diff.max() <= 2 and diff.mean() < 0.05


def test_compiled_blocks_with_kernels_compile_once(
    cpu_config: EngineConfig, keep_dynamo_config: None
) -> None:
    """Our kernels inside compiled blocks: dynamo traces the patched forwards once and reuses
    the graphs (the dispatcher's call counter is not touched while tracing; when it was,
    dynamo guarded on its value and recompiled every block on every call)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    config = replace(cpu_config, fused_adaln=True, fused_activations=True, compile=True)
    runner = Runner("tiny-dit", config)
    assert runner.engine_report["compiled"] and runner.installed_kernels["adaln"] > 0
    for block in runner.denoiser.modules():
        if getattr(block, "_compiled_call_impl", None) is not None:
            block._compiled_call_impl = torch.compile(block._call_impl, backend="eager")
    request = GenerationRequest(prompt="a blue square", seed=5, steps=2, model="tiny-dit")
    runner.generate([request])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    runner.generate([request])
    assert counters["stats"]["unique_graphs"] == graphs


def _load_bench() -> Any:
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def test_bench_rows_on_cuda_follow_the_engine_choice(
    fake_cuda: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows a CUDA run would take (no GPU here: the probes are faked as above)."""
    bench = _load_bench()
    monkeypatch.setattr(bench, "cuda_capability", config_module.cuda_capability)
    fake_cuda["installed"] = {"_flash_3", "_native_cudnn", "_native_flash", "_native_efficient"}
    engine = EngineConfig().resolve("cuda")
    first = bench.rows_for(bench.Case("flux", 1, 28, 4096, 512, True), "cuda", engine)
    names = [row.name for row in first]
    assert names[:3] == ["eager fp32", "fp32 + TF32", "eager bf16"]
    assert {"bf16 + attention _native_cudnn", "bf16 + attention _flash_3"} <= set(names)
    (default,) = [row for row in first if row.engine_default]
    assert default.name == "bf16 + _flash_3 + regional compile"  # what EngineConfig() runs
    assert default.compiled and default.backend == "_flash_3" and not default.kernels
    cached = [row for row in first if row.cache is not None]
    assert len(cached) == 1 and cached[0].loop and cached[0].reference in names
    later = bench.rows_for(bench.Case("flux", 4, 28, 4096, 512, False), "cuda", engine)
    assert len(later) < len(first) and not any("int8" in row.name for row in later)
    sdxl = bench.rows_for(bench.Case("sdxl", 2, 30, 128, 77, True), "cuda", engine)
    assert not any(row.loop for row in sdxl)  # FirstBlockCache is for the Flux transformer
    assert {row.backend for row in sdxl} == {"native"}  # UNet attention bypasses the dispatcher
    assert [row.name for row in sdxl if row.engine_default] == ["bf16 + native + regional compile"]


@pytest.mark.slow
def test_bench_gpu_toy_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench-gpu.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu.py", "--toy", "--reps", "1", "--flux-batches", "1",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    saved = json.loads(out.read_text())
    assert last == saved  # the last stdout line is the figures file
    assert saved["partial"] is False and saved["mode"] == "toy-cpu"
    assert [c["model"] for c in saved["cases"]] == ["flux", "sdxl"]
    for case in saved["cases"]:
        rows = {r["row"]: r for r in case["rows"]}
        assert rows["eager bf16"]["max_abs_diff"] == 0.0
        for row in case["rows"]:
            assert row["error"] is None, row
            assert row["ms_per_image"] > 0 and row["reps"] == 1
        assert sum(r["engine_default"] for r in case["rows"]) == 1
        # on a CPU the engine runs eager, in bf16 where the CPU has native bf16
        eager = "eager bf16" if EngineConfig().resolved_dtype("cpu") == "bfloat16" else "eager fp32"
        assert rows[eager]["engine_default"]
    flux = {r["row"]: r for r in saved["cases"][0]["rows"]}
    assert any("compile" in name for name in flux)
    assert any("FirstBlockCache" in name for name in flux)
    assert (
        flux["bf16 + native + kernels + int8 attention"]["max_abs_diff"] > 0
    )  # lossy, and measured
    assert "eager fp32" in proc.stdout and "ms/image" in proc.stdout
