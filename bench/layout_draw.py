"""How often is one layout sample right? Drawing settings against the exact checker.

For held-out goals of two and three objects, S samples per goal drawn from the goal's planned
layout (`agentloop.layout.plan_layout` over the rule parser's parts) at the model's default
steps and guidance, once per drawing setting, same seeds in every setting. The checker says
whether each image is right (every attribute of every object, and the object count) and
which attribute failed. A setting is ``split:softness``: ``EngineConfig.layout_split`` (the
share of steps the regions are blended; 1 = every step) and ``layout_softness`` (the seam).
The row "each part alone" draws every part's prompt as a plain image (no layout) and checks
that one object: how well the model draws the parts when nothing else is in the picture.

    python bench/layout_draw.py                           # 40 goals per kind, 8 samples
    python bench/layout_draw.py --objects 3 --settings 1:0.01 0.5:0.08 0:0.08
    python bench/layout_draw.py --quick                   # 6 goals, two settings

Prints a table; the last line is one JSON object.
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
from collections import Counter
from dataclasses import replace

import torch

from agentloop.layout import plan_layout
from agentloop.parts import goal_parts
from engine.config import EngineConfig
from engine.defaults import model_defaults
from engine.runner import Runner
from engine.shapes import checker, world
from engine.types import GenerationRequest, Region

ALONE = "alone"
DEFAULT_SETTINGS = ("1:0.01", "1:0.08", "0.5:0.08", "0.5:0.01", "0.625:0.08", "0:0.08", ALONE)
"""Blended on every step with the old seam, the new seam alone, the shipped setting, the split
alone, a later split, apart from the first step, and each part drawn alone."""


def parse_setting(text: str) -> tuple[float, float] | None:
    """``split:softness`` as numbers; None for ``alone``."""
    if text == ALONE:
        return None
    try:
        split, softness = (float(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"{text!r} is not split:softness (e.g. 0.5:0.08) or {ALONE!r}") from None
    EngineConfig(layout_split=split, layout_softness=softness)  # refuses bad values clearly
    return split, softness


def run_setting(runner: Runner, goals: list[world.Goal], samples: int, steps: int,
                guidance: float, alone: bool) -> dict:
    right = n = parts_right = parts = 0
    fails: Counter[str] = Counter()
    start = time.perf_counter()
    for gi, goal in enumerate(goals):
        plan = plan_layout(goal_parts(goal.text))
        assert plan is not None, goal.text  # held-out goals of several objects place them all
        regions = tuple(Region(*r) for r in plan)
        seeds = [90000 + gi * 100 + s for s in range(samples)]
        base = GenerationRequest(goal.text, seed=0, width=32, height=32, steps=steps,
                                 guidance=guidance, model=runner.model)
        if alone:  # each part as a plain image, judged as a one-object goal
            jobs = [(replace(base, prompt=r.prompt), [obj]) for r, obj in zip(regions, goal.objects, strict=True)]
        else:
            jobs = [(replace(base, regions=regions), goal.objects)]
        for request, objects in jobs:
            for result in runner.generate([replace(request, seed=s) for s in seeds]):
                check = checker.check(result.image, objects)
                n += 1
                right += check.all_ok
                fails["count"] += not check.count_ok
                for obj in check.objects:
                    parts += 1
                    parts_right += all(obj.values())
                    fails.update(k for k, ok in obj.items() if not ok)
    return {"right": right / n, "part_right": parts_right / parts, "images": n,
            "fails": dict(fails), "s": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--goals", type=int, default=40, help="held-out goals per kind")
    ap.add_argument("--samples", type=int, default=8, help="samples per goal and setting")
    ap.add_argument("--objects", type=int, nargs="+", default=[2, 3], choices=[2, 3])
    ap.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS),
                    help="split:softness ... or 'alone' (default: %(default)s)")
    ap.add_argument("--goal-seed", type=int, default=11, help="held-out goals' seed")
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="6 goals, 4 samples, two settings")
    args = ap.parse_args(argv)
    if args.quick:
        args.goals, args.samples, args.settings = 6, 4, ["1:0.01", "0.5:0.08"]
    settings = {text: parse_setting(text) for text in args.settings}
    torch.set_num_threads(args.threads)
    defaults = model_defaults(args.model)
    steps, guidance = int(defaults.get("steps", 8)), float(defaults.get("guidance", 3.0))
    rows: dict[str, dict[str, dict]] = {}
    goals = {k: world.heldout_goals(args.goals, objects=k, seed=args.goal_seed) for k in args.objects}
    for text, setting in settings.items():
        split, softness = setting or (1.0, 0.08)
        runner = Runner(args.model, EngineConfig(max_batch=32, layout_split=split,
                                                 layout_softness=softness))
        for n_obj in args.objects:
            row = run_setting(runner, goals[n_obj], args.samples, steps, guidance, setting is None)
            rows.setdefault(text, {})[f"{n_obj}"] = row
            print(f"# {n_obj} objects, {text}: {json.dumps(row)}", flush=True)
    print(f"\n{args.goals} held-out goals per kind (seed {args.goal_seed}), {args.samples} samples "
          f"each, {steps} steps, guidance {guidance:g}\n")
    head = " | ".join(f"{k} objects: sample right / part right" for k in args.objects)
    print(f"| setting (split:softness) | {head} |")
    print("|---|" + "---|" * len(args.objects))
    for text, by_kind in rows.items():
        label = "each part alone (no layout)" if text == ALONE else text
        cells = " | ".join(f"{by_kind[str(k)]['right']:.3f} / {by_kind[str(k)]['part_right']:.3f}"
                           for k in args.objects)
        print(f"| {label} | {cells} |")
    out = {"bench": "layout_draw", "goals": args.goals, "samples": args.samples,
           "goal_seed": args.goal_seed, "steps": steps, "guidance": guidance, "rows": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
