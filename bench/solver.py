"""How close each solver of the own loop lands to the converged image, per steps and guidance.

For held-out one-object goals (``engine.shapes.world.heldout_goals``), noise seed = goal index,
every solver in ``engine.config.SOLVERS`` runs each step count at each guidance, and each image
is compared with the image of the same goal and noise after ``--reference-steps`` Euler steps
(the converged ODE solution, near enough): mean PSNR in dB, higher is closer. Accuracy lives
in ``bench/steps.py`` (``--configs 8:3:1:dpm++2m``); this says why a solver does or does not pay.

    python -m bench.solver                       # 24 goals, steps 4 6 8 12, guidance 1 and 3
    python -m bench.solver --quick               # 4 goals, steps 4 8, guidance 3

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import numpy as np
import torch

from engine.config import SOLVERS, EngineConfig
from engine.runner import Runner
from engine.shapes import world
from engine.types import GenerationRequest


def psnr(a: object, b: object) -> float:
    """PSNR of two 8-bit images in dB (99 when identical)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    mse = float(np.mean((x - y) ** 2))
    return 99.0 if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--goals", type=int, default=24)
    ap.add_argument("--steps", type=int, nargs="+", default=[4, 6, 8, 12])
    ap.add_argument("--guidance", type=float, nargs="+", default=[1.0, 3.0])
    ap.add_argument("--reference-steps", type=int, default=64)
    ap.add_argument("--seed", type=int, default=3, help="held-out goal draw")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 goals, steps 4 and 8, guidance 3")
    args = ap.parse_args(argv)
    if args.quick:
        args.goals, args.steps, args.guidance = 4, [4, 8], [3.0]
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    runners = {s: Runner(args.model, EngineConfig(device="cpu", solver=s)) for s in SOLVERS}
    goals = world.heldout_goals(args.goals, objects=1, seed=args.seed)
    rows = []
    for guidance in args.guidance:
        base = [GenerationRequest(g.text, seed=i, steps=args.reference_steps, guidance=guidance,
                                  width=world.IMAGE_SIZE, height=world.IMAGE_SIZE, model=args.model)
                for i, g in enumerate(goals)]  # fmt: skip
        reference = runners["euler"].generate(base)
        for steps in args.steps:
            row: dict = {"guidance": guidance, "steps": steps}
            for solver, runner in runners.items():
                images = runner.generate([replace(r, steps=steps) for r in base])
                row[solver] = round(float(np.mean(
                    [psnr(a.image, b.image) for a, b in zip(images, reference, strict=True)])), 2)
            rows.append(row)
    print(f"mean PSNR (dB) against {args.reference_steps} Euler steps, {args.goals} goals")
    print(f"{'guidance':>8} {'steps':>5} " + " ".join(f"{s:>9}" for s in SOLVERS))
    for row in rows:
        print(f"{row['guidance']:>8g} {row['steps']:>5} "
              + " ".join(f"{row[s]:>9.2f}" for s in SOLVERS))  # fmt: skip
    figures = {"bench": "solver", "model": args.model, "goals": args.goals,
               "reference_steps": args.reference_steps, "rows": rows,
               "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
