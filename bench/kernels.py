"""The diffusion hot-path Triton kernels against the torch ops they replace.

For each op (fused adaLN, fused gated adaLN, gated residual, GELU tanh, GEGLU, INT8
attention) and each shape/dtype: time of the Triton kernel and of the torch op (eager; SDPA
for attention), the rate (GB/s for memory-bound ops, TFLOP/s for attention), the speed-up,
and the output error of both against an fp32 reference (for attention: fp32 SDPA).

    python bench/kernels.py                 # CUDA: 4096 and 16384 tokens, width 3072 (24 x 128), bf16 + fp16
    python bench/kernels.py --interpret     # CPU, TRITON_INTERPRET=1, toy sizes: correctness only

Without CUDA (or with --interpret) it runs toy sizes through the Triton interpreter on CPU
so the script is verified end to end; those timings are interpreter correctness runs, not
speed. The last line printed is one JSON object with every figure; it is also written to
--json-out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# `python bench/kernels.py` puts bench/ first on sys.path, where this very file would shadow
# the `kernels` package and bench/queue.py the standard library's `queue` (torch imports it);
# look in the repository root instead, before importing torch.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO / "bench"]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

Outputs = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass
class Case:
    """One op at one shape and dtype: how to run each side and what one call moves or computes."""

    op: str
    shape: str
    dtype: torch.dtype
    unit: str
    """"GB/s" (bytes moved, memory-bound ops) or "TFLOP/s" (attention matmul FLOPs)."""
    work: float
    """Bytes (GB/s) or FLOPs (TFLOP/s) per call."""
    triton: Callable[[], Outputs]
    torch_op: Callable[[], Outputs]
    torch_label: str
    reference: Callable[[], Outputs]
    """The fp32 reference both sides are compared with."""
    error_view: Callable[[torch.Tensor], torch.Tensor] = lambda out: out
    """The part of an output the reference covers."""


def _randn(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, std: float = 1.0
) -> torch.Tensor:
    return (torch.randn(shape, generator=gen, device=gen.device) * std).to(dtype)


def _f32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


def _norm_cases(tokens: int, width: int, dtype: torch.dtype, device: str) -> list[Case]:
    """adaLN, gated adaLN and the gated residual on one (1, tokens, width) stream."""
    from kernels import dispatch
    from kernels.adaln import adaln_torch, gated_adaln_torch, gated_residual_torch

    gen = torch.Generator(device=device).manual_seed(0)
    x, residual = _randn(gen, (1, tokens, width), dtype), _randn(gen, (1, tokens, width), dtype)
    shift, scale, gate = _randn(gen, (1, 3 * width), dtype, std=0.5).chunk(3, dim=1)
    moved = tokens * width * x.element_size()  # one read or write of the stream
    shape = f"1x{tokens}x{width}"
    return [
        Case(
            "adaln", shape, dtype, "GB/s", 2 * moved,
            lambda: dispatch.adaln(x, shift, scale, force="triton"),
            lambda: adaln_torch(x, shift, scale), "eager",
            lambda: adaln_torch(*_f32(x, shift, scale)),
        ),
        Case(
            "gated_adaln", shape, dtype, "GB/s", 4 * moved,
            lambda: dispatch.gated_adaln(residual, gate, x, shift, scale, force="triton"),
            lambda: gated_adaln_torch(residual, gate, x, shift, scale), "eager",
            lambda: gated_adaln_torch(*_f32(residual, gate, x, shift, scale)),
        ),
        Case(
            "gated_residual", shape, dtype, "GB/s", 3 * moved,
            lambda: dispatch.gated_residual(residual, gate, x, force="triton"),
            lambda: gated_residual_torch(residual, gate, x), "eager",
            lambda: gated_residual_torch(*_f32(residual, gate, x)),
        ),
    ]  # fmt: skip


def _gelu_case(tokens: int, width: int, dtype: torch.dtype, device: str) -> Case:
    """GELU(tanh) on the feed-forward hidden layer (4 x width)."""
    from kernels import dispatch
    from kernels.activations import gelu_torch

    gen = torch.Generator(device=device).manual_seed(1)
    hidden = _randn(gen, (1, tokens, 4 * width), dtype, std=3.0)
    return Case(
        "gelu_tanh", f"1x{tokens}x{4 * width}", dtype, "GB/s", 2 * hidden.nbytes,
        lambda: dispatch.gelu_tanh(hidden, force="triton"),
        lambda: gelu_torch(hidden), "eager",
        lambda: gelu_torch(hidden.float()),
    )  # fmt: skip


def _geglu_case(tokens: int, width: int, dtype: torch.dtype, device: str) -> Case:
    """GEGLU on a (tokens, 2 x 4 x width) projection: reads it once, writes half."""
    from kernels import dispatch
    from kernels.activations import geglu_torch

    gen = torch.Generator(device=device).manual_seed(2)
    gated = _randn(gen, (1, tokens, 8 * width), dtype, std=3.0)
    return Case(
        "geglu", f"1x{tokens}x{8 * width}", dtype, "GB/s", 1.5 * gated.nbytes,
        lambda: dispatch.geglu(gated, force="triton"),
        lambda: geglu_torch(gated), "eager",
        lambda: geglu_torch(gated.float()),
    )  # fmt: skip


def _attention_case(
    tokens: int, heads: int, head_dim: int, dtype: torch.dtype, device: str, ref_queries: int
) -> Case:
    from kernels import dispatch
    from kernels.attention_int8 import attention_flops, sdpa_torch

    gen = torch.Generator(device=device).manual_seed(3)
    q, k, v = (_randn(gen, (1, heads, tokens, head_dim), dtype) for _ in range(3))
    k = k + _randn(gen, (head_dim,), dtype)  # a K channel offset, as real keys have
    # Errors are measured on the first `rows` queries (query rows are independent), so the
    # fp32 reference stays cheap at 16K tokens.
    rows = min(ref_queries, tokens)
    return Case(
        "attention_int8", f"1x{heads}x{tokens}x{head_dim}", dtype, "TFLOP/s",
        attention_flops(1, heads, tokens, tokens, head_dim),
        lambda: dispatch.attention(q, k, v, force="triton"),
        lambda: sdpa_torch(q, k, v), "sdpa",
        lambda: sdpa_torch(q[:, :, :rows].float(), k.float(), v.float()),
        error_view=lambda out: out[:, :, :rows],
    )  # fmt: skip


def _time_ms(fn: Callable[[], Any], on_cuda: bool) -> float:
    """Median ms per call (triton.testing.do_bench) on CUDA; one timed call in the interpreter."""
    if on_cuda:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # first call pays for the interpreter's AST rewrite
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _max_err(out: Outputs, ref: Outputs, view: Callable[[torch.Tensor], torch.Tensor]) -> float:
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    return max(
        (view(o).float() - r.float()).abs().max().item() for o, r in zip(outs, refs, strict=True)
    )


def run_case(case: Case, on_cuda: bool) -> dict[str, Any]:
    """Time both sides, compare both with the fp32 reference; one result row."""
    view = case.error_view
    ref = case.reference()
    triton_err = _max_err(case.triton(), ref, view)
    torch_err = _max_err(case.torch_op(), ref, view)
    del ref
    triton_ms = _time_ms(case.triton, on_cuda)
    torch_ms = _time_ms(case.torch_op, on_cuda)
    scale = 1e-9 if case.unit == "GB/s" else 1e-12
    return {
        "op": case.op,
        "shape": case.shape,
        "dtype": str(case.dtype).removeprefix("torch."),
        "unit": case.unit,
        "triton_ms": triton_ms,
        "torch_ms": torch_ms,
        "torch_op": case.torch_label,
        "triton_rate": case.work * scale / (triton_ms * 1e-3),
        "torch_rate": case.work * scale / (torch_ms * 1e-3),
        "speedup": torch_ms / triton_ms,
        "triton_max_err_vs_fp32": triton_err,
        "torch_max_err_vs_fp32": torch_err,
    }


def _table(rows: list[dict[str, Any]], interpreted: bool) -> str:
    head = (
        f"{'op':<15} {'shape':<18} {'dtype':<9} {'triton ms':>10} {'torch ms':>10} {'triton':>10} "
        f"{'torch':>10} {'unit':<8} {'speedup':>8} {'err triton':>11} {'err torch':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['op']:<15} {r['shape']:<18} {r['dtype']:<9} {r['triton_ms']:>10.3f} {r['torch_ms']:>10.3f} "
            f"{r['triton_rate']:>10.2f} {r['torch_rate']:>10.2f} {r['unit']:<8} {r['speedup']:>8.2f} "
            f"{r['triton_max_err_vs_fp32']:>11.2e} {r['torch_max_err_vs_fp32']:>10.2e}"
        )
    if interpreted:
        lines.append(
            "INTERPRETER CORRECTNESS RUN (TRITON_INTERPRET=1 on CPU): timings are not speed figures."
        )
    lines.append(
        "torch = eager torch ops (attention: SDPA in the same dtype); errors = max |out - fp32 reference|."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; print the table and, last, the JSON object; return it."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--interpret", action="store_true", help="CPU + Triton interpreter, toy sizes"
    )
    parser.add_argument(
        "--tokens", type=int, nargs="+", default=None, help="token counts (default 4096 16384)"
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=None,
        help="default bfloat16 float16 (interpreter: float16 float32)",
    )
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default 24)")
    parser.add_argument(
        "--head-dim", type=int, default=None, help="attention head dim (default 128)"
    )
    parser.add_argument(
        "--ref-queries",
        type=int,
        default=2048,
        help="query rows the attention error is measured on",
    )
    parser.add_argument(
        "--json-out", type=Path, default=REPO / "agentloop-out" / "bench" / "kernels.json"
    )
    args = parser.parse_args(argv)

    interpreted = args.interpret or not torch.cuda.is_available()
    if interpreted:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit(
                "triton was imported before TRITON_INTERPRET=1 could be set; run this as a script"
            )
        os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton
    device = "cpu" if interpreted else "cuda"
    tokens = args.tokens or ([113, 256] if interpreted else [4096, 16384])
    dtypes = [
        getattr(torch, d)
        for d in (
            args.dtypes or (["float16", "float32"] if interpreted else ["bfloat16", "float16"])
        )
    ]
    heads = args.heads or (2 if interpreted else 24)
    head_dim = args.head_dim or (64 if interpreted else 128)
    width = 96 if interpreted else heads * head_dim

    rows: list[dict[str, Any]] = []
    for dtype in dtypes:
        for n in tokens:
            for case in _norm_cases(n, width, dtype, device):
                rows.append(run_case(case, not interpreted))
            rows.append(run_case(_gelu_case(n, width, dtype, device), not interpreted))
            rows.append(run_case(_geglu_case(n, width, dtype, device), not interpreted))
            rows.append(
                run_case(
                    _attention_case(n, heads, head_dim, dtype, device, args.ref_queries),
                    not interpreted,
                )
            )
            if not interpreted:
                torch.cuda.empty_cache()

    device_name = torch.cuda.get_device_name() if not interpreted else "cpu (Triton interpreter)"
    figures: dict[str, Any] = {
        "bench": "kernels",
        "mode": "interpreter-correctness" if interpreted else "cuda",
        "device": device_name,
        "torch": torch.__version__,
        "note": (
            "interpreter correctness run: timings are not speed" if interpreted
            else "median of triton.testing.do_bench; torch = eager ops, SDPA for attention"
        ),
        "results": rows,
    }  # fmt: skip
    print(_table(rows, interpreted))
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
