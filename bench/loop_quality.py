"""Does the loop improve outcomes? Success judged by the exact checker on held-out goals.

For each held-out goal (one-object and two-object) and each budget N:
  (a) a single sample of the goal text,
  (b) best-of-N samples of the goal text, chosen by CLIPScore,
  (c) agentloop's default loop (search reviser, embedded runtime) with budget N,
and the checker (image analysis, no neural network) says whether every requested attribute
holds in the chosen image. Prints a table; the last line is one JSON object.

The budget counts generations (images). A candidate drawn from a layout costs one denoiser
pass per region, so the loop may spend more compute than N plain samples: the table gives
the loop's denoiser passes per goal and (b) again at that compute, best-of-M with M the
loop's mean passes rounded up.

    python bench/loop_quality.py            # full run
    python bench/loop_quality.py --quick    # small run, under 5 minutes
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

from agentloop.domain import GoalRequest, check_goal, split_parts
from agentloop.revisers import derive_seed
from agentloop.settings import Settings
from agentloop.store import Store
from engine.shapes import checker, world
from engine.types import GenerationRequest, ScoreRequest
from workers.embedded import embedded_runtime
from workers.residency import Residency


def sample_baselines(
    residency: Residency, spec, goals: list[world.Goal], n_max: int  # noqa: ANN001
) -> tuple[list[list[Image.Image]], list[list[float]]]:
    """n_max samples of each goal's text with fresh seeds, and their CLIPScores (one batch run)."""
    requests = [
        GenerationRequest(prompt=g.text, seed=derive_seed(gi, 99, k), width=spec.size,
                          height=spec.size, steps=spec.steps, guidance=spec.guidance, model=spec.model)
        for gi, g in enumerate(goals) for k in range(n_max)
    ]
    images = [r.image for r in residency.runner(spec.model).generate(requests)]
    score_reqs = [ScoreRequest(r.prompt, split_parts(r.prompt)) for r in requests]
    scores = [s.clip_score for s in residency.scorer(spec.scorer).score(images, score_reqs)]
    return ([images[i * n_max:(i + 1) * n_max] for i in range(len(goals))],
            [scores[i * n_max:(i + 1) * n_max] for i in range(len(goals))])


def run_loops(store: Store, settings: Settings, residency: Residency, texts: list[str],
              budget: int) -> list[tuple[Image.Image, int, int]]:
    """agentloop's default loop on each goal, all goals side by side in one embedded runtime.

    Returns each goal's best image, the generations it used and their denoiser passes.
    """
    specs = [check_goal(GoalRequest(goal=t, budget=budget, seed=i), settings) for i, t in enumerate(texts)]
    dispatcher, _ctx = embedded_runtime(store, settings, residency)
    try:
        ids = [store.create_goal(spec).id for spec in specs]
        for goal_id in ids:
            dispatcher.advance_goal(goal_id)
        while not all(store.get_goal(g).status.terminal for g in ids):
            if dispatcher.errors:
                raise dispatcher.errors[0]
            time.sleep(0.05)
    finally:
        dispatcher.close()
    out = []
    for goal_id in ids:
        state = store.get_state(goal_id)
        best = next(c for c in state.candidates if c.id == state.goal.best_candidate_id)
        image = Image.open(settings.resolved_artifacts_dir() / best.artifact_uri).convert("RGB")
        passes = sum(max(1, len(c.regions)) * _share(c) for c in state.candidates)
        out.append((image, state.goal.generations_reserved, passes))
    return out


def _share(c) -> float:  # noqa: ANN001 - a CandidateView
    """The share of a full generation's denoiser passes a candidate ran: k/T if its prune
    group cut it after k of T steps, else all of them."""
    if c.pruned_at_step is None:
        return 1.0
    return c.pruned_at_step / int(c.params["steps"])


def evaluate(n_goals: int, objects: int, budgets: list[int], settings: Settings,
             residency: Residency, store: Store, seed: int) -> dict[str, float]:
    goals = world.heldout_goals(n_goals, objects=objects, seed=seed + objects)
    out: dict[str, float] = {}
    for n in budgets:
        loops = run_loops(store, settings, residency, [g.text for g in goals], n)
        out[f"loop_{n}"] = sum(checker.check(im, g.objects).all_ok
                               for (im, _, _), g in zip(loops, goals, strict=True)) / n_goals
        out[f"loop_{n}_mean_generations"] = sum(used for _, used, _ in loops) / n_goals
        out[f"loop_{n}_mean_passes"] = sum(passes for _, _, passes in loops) / n_goals
    matched = {n: max(n, math.ceil(out[f"loop_{n}_mean_passes"] - 1e-9)) for n in budgets}
    spec0 = check_goal(GoalRequest(goal=goals[0].text), settings)
    samples, scores = sample_baselines(residency, spec0, goals, max(matched.values()))
    judged = [[checker.check(im, g.objects).all_ok for im in ims] for g, ims in zip(goals, samples, strict=True)]
    out["single"] = sum(j[0] for j in judged) / n_goals

    def best_of(m: int) -> float:
        picks = [max(range(m), key=lambda k, s=s: s[k]) for s in scores]
        return sum(j[p] for j, p in zip(judged, picks, strict=True)) / n_goals

    for n in budgets:
        out[f"best_of_{n}"] = best_of(n)
        out[f"best_of_{n}_at_loop_passes"] = best_of(matched[n])
        out[f"loop_{n}_passes_matched_m"] = matched[n]
        print(f"  {objects}-object goals, N={n}: {out}", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="6 goals per kind (under 5 minutes)")
    parser.add_argument("--goals", type=int, default=50, help="held-out goals per kind")
    parser.add_argument("--budgets", default="8,16")
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--scorer", default="shapes-clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument(
        "--variation-share", type=float, default=None,
        help="run (c) with SearchReviser(variation_share=X): that share of each later iteration "
             "goes to noise variations of the best candidate (default: the shipped reviser)",
    )
    parser.add_argument("--variation-strength", type=float, default=0.35)
    parser.add_argument(
        "--prune-factor", type=int, default=0,
        help="run (c) with SearchReviser(prune_factor=F): the first iteration previews F times "
             "its fan-out and finishes the best (docs/engine.md, Pruning); 0: off",
    )
    parser.add_argument("--prune-at", type=float, default=0.2, help="share of steps before the cut")
    args = parser.parse_args(argv)
    if args.variation_share is not None or args.prune_factor:
        from agentloop.revisers import REVISERS, SearchReviser

        REVISERS["search"] = SearchReviser(
            args.variation_share or 0.0, args.variation_strength,
            prune_factor=args.prune_factor, prune_at=args.prune_at,
        )
    n_goals = 6 if args.quick else args.goals
    budgets = [int(b) for b in args.budgets.split(",")]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), default_model=args.model, default_scorer=args.scorer)
        from agentloop import migrate

        url = settings.resolved_database_url()
        migrate.upgrade(url)
        store = Store(url)
        residency = Residency()
        results = {
            f"{k}_object": evaluate(n_goals, k, budgets, settings, residency, store, args.seed)
            for k in (1, 2)
        }
        store.dispose()
    elapsed = time.perf_counter() - t0
    print(f"\nSuccess rate judged by the exact checker (all requested attributes right), "
          f"{n_goals} held-out goals per kind, model {args.model}, scorer {args.scorer}\n")
    header = (f"{'goal kind':<10} {'N':>3} {'(a) single':>11} {'(b) best-of-N':>14} {'(c) loop':>9} "
              f"{'(c)-(b)':>8} {'loop gens':>10} {'loop passes':>12} {'(b) best-of-M':>14}")
    print(header)
    print("-" * len(header))
    for kind, r in results.items():
        for n in budgets:
            m = r[f"loop_{n}_passes_matched_m"]
            print(f"{kind:<10} {n:>3} {r['single']:>11.2f} {r[f'best_of_{n}']:>14.2f} "
                  f"{r[f'loop_{n}']:>9.2f} {r[f'loop_{n}'] - r[f'best_of_{n}']:>+8.2f} "
                  f"{r[f'loop_{n}_mean_generations']:>10.1f} {r[f'loop_{n}_mean_passes']:>12.1f} "
                  f"{r[f'best_of_{n}_at_loop_passes']:>9.2f} M={m:<3}")
    print("\nloop passes: denoiser passes per goal (a layout candidate costs one per region); "
          "best-of-M: (b) with M = the loop's passes rounded up, at equal compute.")
    figures = {"bench": "loop_quality", "goals_per_kind": n_goals, "budgets": budgets,
               "variation_share": args.variation_share,
               "variation_strength": args.variation_strength if args.variation_share else None,
               "prune_factor": args.prune_factor, "prune_at": args.prune_at,
               "model": args.model, "scorer": args.scorer, "seconds": round(elapsed, 1), **results}
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
