"""How well does the verifier pick? The selection gap on layout samples of held-out goals.

For each held-out goal of two (or three) objects, N samples drawn from its planned layout
(`agentloop.layout.plan_layout` over the rule parser's parts). The exact checker says which
images are right. Each scorer then ranks the N images by several objectives, and the bench
reports how often the top-ranked image is right ("chosen") against how often any of the N is
("oracle"): the selection gap = oracle - chosen, in points. Objectives:

  whole          the whole-goal CLIPScore alone
  parts-whole    0.5 * (whole + weakest part), parts judged on the whole image (the loop's
                 objective before parts were judged on their regions)
  parts-region   0.5 * (whole + weakest part), each part judged on its region (the loop's
                 objective now: what workers store as part_scores)
  region-min     the weakest part judged on its region, alone

Scorers: the shipped `shapes-clip`, or other weights of the same architecture given with
--weights label=path (e.g. the weights before a fine-tune). Prints a table; the last line is
one JSON object.

    python bench/selection.py                      # 20 goals, 16 samples each
    python bench/selection.py --quick              # 4 goals, 8 samples (a smoke run)
    python bench/selection.py --weights base=runs/shapes-clip-base/open_clip_model.safetensors
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
import time
from dataclasses import replace

from safetensors.torch import load_file

from agentloop.layout import plan_layout
from agentloop.parts import goal_parts, part_regions
from engine.config import EngineConfig
from engine.runner import Runner
from engine.scorer import Scorer
from engine.shapes import checker, world
from engine.types import GenerationRequest, Region, ScoreRequest

OBJECTIVES = ("whole", "parts-whole", "parts-region", "region-min")


def _objectives(whole: float, parts_whole: dict[str, float], parts_region: dict[str, float]
                ) -> dict[str, float]:
    return {
        "whole": whole,
        "parts-whole": 0.5 * (whole + min(parts_whole.values())),
        "parts-region": 0.5 * (whole + min(parts_region.values())),
        "region-min": min(parts_region.values()),
    }


def generate(args: argparse.Namespace) -> tuple[list[world.Goal], list[list], list[list[bool]],
                                                 list[ScoreRequest], list[ScoreRequest]]:
    """The layout samples of every goal, the checker's verdicts, and each goal's two score
    requests (parts on the whole image; parts on their regions)."""
    runner = Runner(args.model, EngineConfig(max_batch=32))
    goals = world.heldout_goals(args.goals, objects=args.objects, seed=args.goal_seed)
    images, right, on_whole, on_region = [], [], [], []
    for gi, goal in enumerate(goals):
        parts = goal_parts(goal.text)
        plan = plan_layout(parts)
        assert plan is not None, goal.text
        regions = tuple(Region(*r) for r in plan)
        if args.no_scale:
            regions = tuple(replace(r, scale=1.0) for r in regions)
        base = GenerationRequest(goal.text, seed=0, width=32, height=32, steps=20, guidance=3.0,
                                 model=args.model, regions=regions)
        results = runner.generate([replace(base, seed=70000 + gi * 100 + s)
                                   for s in range(args.samples)])
        images.append([r.image for r in results])
        right.append([checker.check(r.image, goal.objects).all_ok for r in results])
        texts = tuple(p.text for p in parts)
        on_whole.append(ScoreRequest(goal.text, texts))
        judged = tuple(Region(*r) for r in part_regions(parts, plan))  # type: ignore[misc]
        on_region.append(ScoreRequest(goal.text, texts, judged))
    return goals, images, right, on_whole, on_region


def rank(scorer: Scorer, images: list[list], right: list[list[bool]],
         on_whole: list[ScoreRequest], on_region: list[ScoreRequest]) -> dict[str, float]:
    """Share of goals whose top-ranked image is right, per objective."""
    chosen = dict.fromkeys(OBJECTIVES, 0)
    for ims, ok, req_w, req_r in zip(images, right, on_whole, on_region, strict=True):
        whole = scorer.score(ims, [req_w] * len(ims))
        region = scorer.score(ims, [req_r] * len(ims))
        values = [_objectives(w.clip_score, w.part_scores, r.part_scores)
                  for w, r in zip(whole, region, strict=True)]
        for name in OBJECTIVES:
            top = max(range(len(ims)), key=lambda k, n=name: (values[k][n], -k))
            chosen[name] += ok[top]
    return {name: hits / len(images) for name, hits in chosen.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 goals, 8 samples each")
    parser.add_argument("--goals", type=int, default=20)
    parser.add_argument("--samples", type=int, default=16, help="N: layout samples per goal")
    parser.add_argument("--objects", type=int, default=2, choices=(2, 3))
    parser.add_argument("--goal-seed", type=int, default=7,
                        help="not the loop bench's goals (seeds 1 to 3)")
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--weights", action="append", default=[], metavar="LABEL=PATH",
                        help="also rank with shapes-clip loaded from these weights (repeatable)")
    parser.add_argument("--no-scale", action="store_true",
                        help="draw every region at scale 1 (size words do not shape regions)")
    args = parser.parse_args(argv)
    if args.quick:
        args.goals, args.samples = 4, 8
    t0 = time.perf_counter()
    goals, images, right, on_whole, on_region = generate(args)
    t_gen = time.perf_counter() - t0
    oracle = sum(any(ok) for ok in right) / len(goals)
    one_sample = sum(sum(ok) for ok in right) / (len(goals) * args.samples)
    scorers: dict[str, dict[str, float]] = {}
    for label, path in [("shapes-clip", None), *(w.split("=", 1) for w in args.weights)]:
        scorer = Scorer("shapes-clip")
        if path is not None:
            scorer.model.load_state_dict(load_file(path))
        scorers[label] = rank(scorer, images, right, on_whole, on_region)
    elapsed = time.perf_counter() - t0
    print(f"\nSelection on {len(goals)} held-out {args.objects}-object goals, N = {args.samples} "
          f"layout samples each (model {args.model}); right = the exact checker's all_ok.")
    print(f"one sample right {one_sample:.3f}; oracle (any of N right) {oracle:.3f}\n")
    header = f"{'scorer':<14} {'objective':<13} {'chosen right':>12} {'oracle':>7} {'gap (points)':>13}"
    print(header)
    print("-" * len(header))
    for label, chosen in scorers.items():
        for name in OBJECTIVES:
            print(f"{label:<14} {name:<13} {chosen[name]:>12.3f} {oracle:>7.3f} "
                  f"{100 * (oracle - chosen[name]):>13.1f}")
    figures = {
        "bench": "selection", "goals": len(goals), "objects": args.objects,
        "samples": args.samples, "goal_seed": args.goal_seed, "model": args.model,
        "region_scales": not args.no_scale, "one_sample_right": round(one_sample, 4),
        "oracle": oracle, "chosen": scorers,
        "gap_points": {label: {n: round(100 * (oracle - c[n]), 1) for n in OBJECTIVES}
                       for label, c in scorers.items()},
        "generate_s": round(t_gen, 1), "seconds": round(elapsed, 1),
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
