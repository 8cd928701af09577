"""Request batching, the text-embedding cache and the own denoising loop, against the unoptimized
runner on the same model.

For each model, the same requests (guidance 3, so two guidance branches) run one at a time
through the stock pipeline call (batching off, no cache), batched, batched with the
text-embedding cache, and with the runner's own loop on top (one transformer call per step
for both branches; Flux models only, the others run the stock call whatever the switch);
the table shows seconds per image after a warm-up (wall, and process CPU time, steadier on
a shared machine), the speed-up, and the quality cost as PSNR and max pixel difference against the
unoptimized images (batching and the cache should change nothing: inf dB; the own loop
float rounding at most). Guidance truncation stays off (``cfg_truncation`` 1.0) in every row.

    python -m bench.engine_batching --models tiny-dit tiny-unet --n 16 --steps 10

(``python -m`` from the repository root: run as a file, ``bench/queue.py`` would shadow the
standard library's ``queue`` that torch imports.)

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace

import numpy as np

from engine.config import EngineConfig
from engine.runner import Runner
from engine.types import GenerationRequest, GenerationResult


def _psnr(a: GenerationResult, b: GenerationResult) -> float:
    x = np.asarray(a.image, dtype=np.float64)
    y = np.asarray(b.image, dtype=np.float64)
    mse = float(np.mean((x - y) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _max_diff(a: list[GenerationResult], b: list[GenerationResult]) -> int:
    return max(
        int(np.abs(np.asarray(x.image, np.int16) - np.asarray(y.image, np.int16)).max())
        for x, y in zip(a, b, strict=True)
    )


def _timed(runner: Runner, requests: list[GenerationRequest]) -> tuple[float, float, list]:
    """Wall and process CPU seconds per image (CPU time is steadier on a shared machine)."""
    runner.generate(requests[:2])  # warm-up: first-call allocations, load time billing
    start, cpu = time.perf_counter(), time.process_time()
    results = runner.generate(requests)
    n = len(requests)
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n, results


def bench_model(model: str, base: EngineConfig, n: int, steps: int, size: int) -> list[dict]:
    """Rows for one model: unoptimized, batched, batched + text cache, + own loop."""
    prompts = [f"a {c} {s}" for c in ("red", "blue", "green", "gold") for s in ("circle", "ring")]
    requests = [
        GenerationRequest(prompts[i % len(prompts)], seed=i, width=size, height=size,
                          steps=steps, guidance=3.0, negative_prompt="blurry", model=model)
        for i in range(n)
    ]  # fmt: skip
    variants = {
        "unoptimized": replace(base, batching=False, text_embedding_cache=False, own_loop=False),
        "batched": replace(base, batching=True, text_embedding_cache=False, own_loop=False),
        "batched+text_cache": replace(base, batching=True, text_embedding_cache=True, own_loop=False),
        "+own_loop": replace(base, batching=True, text_embedding_cache=True, own_loop=True),
    }
    rows, reference = [], None
    for name, config in variants.items():
        seconds, cpu_seconds, results = _timed(Runner(model, config), requests)
        reference = reference or (seconds, results, cpu_seconds)
        psnr = min(_psnr(a, b) for a, b in zip(results, reference[1], strict=True))
        rows.append(
            {"model": model, "variant": name, "s_per_image": seconds,
             "speedup": reference[0] / seconds, "cpu_s_per_image": cpu_seconds,
             "cpu_speedup": reference[2] / cpu_seconds, "min_psnr_db": psnr,
             "max_pixel_diff": _max_diff(results, reference[1])}
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print a table, then one JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["tiny-dit", "tiny-unet"])
    ap.add_argument("--n", type=int, default=16, help="requests per variant")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    base = EngineConfig(device=args.device, max_batch=args.max_batch, cfg_truncation=1.0)
    rows = [r for m in args.models for r in bench_model(m, base, args.n, args.steps, args.size)]
    print(f"device {base.resolved_device()}, {args.n} requests, {args.steps} steps, {args.size}px")
    print(
        f"{'model':<12}{'variant':<22}{'s/image':>10}{'speed-up':>10}{'cpu s/img':>10}"
        f"{'cpu x':>8}{'PSNR dB':>10}{'max diff':>10}"
    )
    for r in rows:
        print(
            f"{r['model']:<12}{r['variant']:<22}{r['s_per_image']:>10.4f}{r['speedup']:>10.2f}"
            f"{r['cpu_s_per_image']:>10.4f}{r['cpu_speedup']:>8.2f}"
            f"{r['min_psnr_db']:>10.1f}{r['max_pixel_diff']:>10d}"
        )
    figures = [
        r | {"min_psnr_db": None if math.isinf(r["min_psnr_db"]) else r["min_psnr_db"]}
        for r in rows
    ]
    print(
        json.dumps(
            {"benchmark": "engine_batching", "device": base.resolved_device(), "rows": figures}
        )
    )


if __name__ == "__main__":
    main()
