"""Layouts or plain prompts for two-object goals: which should the loop spend its samples on?

For each held-out two-object goal, S samples drawn from its layout (each object's phrase in
its own region) and S samples of the plain goal text, same seeds. Every image is scored as a
worker scores it (CLIPScore against the goal, and per part) and judged by the exact checker.
Then, for mixes of k layout and S - k plain samples drawn at random from those, how often the
image the loop's objective ranks first is right. Prints a table; the last line is one JSON
object.

    python bench/layout_mix.py             # 40 goals, 8 + 8 samples each (about 6 minutes)
    python bench/layout_mix.py --goals 8   # a quick look
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`, the script's folder comes first on sys.path, where the
# queue bench (bench/queue.py) would shadow the standard library's queue that torch imports.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import json
import random
import time
from dataclasses import replace

from agentloop.domain import split_parts
from agentloop.layout import plan_layout
from engine.config import EngineConfig
from engine.runner import Runner
from engine.scorer import Scorer
from engine.shapes import checker, world
from engine.types import GenerationRequest, Region, ScoreRequest


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--goals", type=int, default=40)
    parser.add_argument("--samples", type=int, default=8, help="samples per kind and goal")
    parser.add_argument("--goal-seed", type=int, default=5, help="not the loop bench's goals (1, 2)")
    parser.add_argument("--draws", type=int, default=200, help="random mixes per goal")
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--scorer", default="shapes-clip")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    runner = Runner(args.model, EngineConfig(max_batch=32))
    scorer = Scorer(args.scorer)
    goals = world.heldout_goals(args.goals, objects=2, seed=args.goal_seed)
    rows: list[tuple[int, str, bool, float]] = []  # goal, kind, right, objective
    for gi, goal in enumerate(goals):
        parts = split_parts(goal.text)
        plan = plan_layout(parts)
        assert plan is not None, goal.text  # held-out two-object goals always place both parts
        base = GenerationRequest(goal.text, seed=0, width=32, height=32, steps=20, guidance=3.0,
                                 model=args.model)
        requests = [
            replace(base, seed=50000 + gi * 100 + s, regions=regions)
            for s in range(args.samples)
            for regions in (tuple(Region(*r) for r in plan), ())
        ]
        results = runner.generate(requests)
        scores = scorer.score([r.image for r in results], [ScoreRequest(goal.text, parts)] * len(results))
        for request, result, score in zip(requests, results, scores, strict=True):
            objective = 0.5 * (score.clip_score + min(score.part_scores[p] for p in parts))
            rows.append((gi, "layout" if request.regions else "plain",
                         checker.check(result.image, goal.objects).all_ok, objective))
    rate = {kind: sum(r[2] for r in rows if r[1] == kind) / (len(rows) / 2) for kind in ("layout", "plain")}
    rng = random.Random(0)
    mixes = {}
    for k in range(args.samples, -1, -2):
        hits = 0
        for gi in range(len(goals)):
            layout = [r for r in rows if r[0] == gi and r[1] == "layout"]
            plain = [r for r in rows if r[0] == gi and r[1] == "plain"]
            for _ in range(args.draws):
                pool = rng.sample(layout, k) + rng.sample(plain, args.samples - k)
                hits += max(pool, key=lambda r: r[3])[2]
        mixes[f"{k}+{args.samples - k}"] = hits / (len(goals) * args.draws)
    seconds = time.perf_counter() - t0
    print(f"\n{len(goals)} two-object held-out goals (goal seed {args.goal_seed}), model {args.model}, "
          f"scorer {args.scorer}")
    print(f"one sample right: layout {rate['layout']:.3f}, plain {rate['plain']:.3f}\n")
    print(f"{'layout + plain samples':>24} | {'objective-chosen image right':>30}")
    for mix, value in mixes.items():
        print(f"{mix:>24} | {value:>30.3f}")
    figures = {"bench": "layout_mix", "goals": len(goals), "samples": args.samples,
               "goal_seed": args.goal_seed, "model": args.model, "scorer": args.scorer,
               "single_layout": round(rate["layout"], 4), "single_plain": round(rate["plain"], 4),
               "chosen_right_by_mix": {k: round(v, 4) for k, v in mixes.items()},
               "seconds": round(seconds, 1)}
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
