"""Does the loop improve outcomes? Success judged by the exact checker on held-out goals.

For each held-out goal (one-object and two-object) and each budget N:
  (a) a single sample of the goal text,
  (b) best-of-N samples of the goal text, chosen by CLIPScore,
  (c) agentloop's default loop (search reviser, embedded runtime) with budget N,
and the checker (image analysis, no neural network) says whether every requested attribute
holds in the chosen image. Prints a table; the last line is one JSON object.

    python bench/loop_quality.py            # full run
    python bench/loop_quality.py --quick    # small run, under 5 minutes
"""

from __future__ import annotations

import argparse
import json
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
    residency: Residency, spec, goal: world.Goal, n_max: int, goal_seed: int  # noqa: ANN001
) -> tuple[list[Image.Image], list[float]]:
    """n_max samples of the goal text with fresh seeds, and their CLIPScores."""
    requests = [
        GenerationRequest(prompt=goal.text, seed=derive_seed(goal_seed, 99, k), width=spec.size,
                          height=spec.size, steps=spec.steps, guidance=spec.guidance, model=spec.model)
        for k in range(n_max)
    ]
    images = [r.image for r in residency.runner(spec.model).generate(requests)]
    score_req = ScoreRequest(goal.text, split_parts(goal.text))
    scores = [s.clip_score for s in residency.scorer(spec.scorer).score(images, [score_req] * len(images))]
    return images, scores


def run_loop(store: Store, settings: Settings, residency: Residency, text: str, budget: int,
             seed: int) -> tuple[Image.Image, int]:
    """agentloop's default loop on one goal; the best image and the generations it used."""
    spec = check_goal(GoalRequest(goal=text, budget=budget, seed=seed), settings)
    dispatcher, _ctx = embedded_runtime(store, settings, residency)
    try:
        goal = store.create_goal(spec)
        dispatcher.advance_goal(goal.id)
        while True:
            state = store.get_state(goal.id)
            if state.goal.status.terminal:
                break
            if dispatcher.errors:
                raise dispatcher.errors[0]
            time.sleep(0.02)
    finally:
        dispatcher.close()
    best = next(c for c in state.candidates if c.id == state.goal.best_candidate_id)
    image = Image.open(settings.resolved_artifacts_dir() / best.artifact_uri).convert("RGB")
    return image, state.goal.generations_reserved


def evaluate(n_goals: int, objects: int, budgets: list[int], settings: Settings,
             residency: Residency, store: Store, seed: int) -> dict[str, float]:
    goals = world.heldout_goals(n_goals, objects=objects, seed=seed + objects)
    spec0 = check_goal(GoalRequest(goal=goals[0].text), settings)
    hits: dict[str, int] = {}
    used: dict[str, int] = {}
    for gi, goal in enumerate(goals):
        images, scores = sample_baselines(residency, spec0, goal, max(budgets), gi)
        judge = [checker.check(im, goal.objects).all_ok for im in images]
        hits["single"] = hits.get("single", 0) + judge[0]
        for n in budgets:
            best = max(range(n), key=lambda k: scores[k])
            hits[f"best_of_{n}"] = hits.get(f"best_of_{n}", 0) + judge[best]
            image, n_used = run_loop(store, settings, residency, goal.text, n, gi)
            hits[f"loop_{n}"] = hits.get(f"loop_{n}", 0) + checker.check(image, goal.objects).all_ok
            used[f"loop_{n}"] = used.get(f"loop_{n}", 0) + n_used
        print(f"  {objects}-object goal {gi + 1}/{n_goals}: {goal.text}", file=sys.stderr, flush=True)
    out = {k: v / n_goals for k, v in hits.items()}
    out.update({f"{k}_mean_generations": v / n_goals for k, v in used.items()})
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10 goals per kind, budgets 8 and 16")
    parser.add_argument("--goals", type=int, default=50, help="held-out goals per kind")
    parser.add_argument("--budgets", default="8,16")
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--scorer", default="shapes-clip")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    n_goals = 10 if args.quick else args.goals
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
    header = f"{'goal kind':<10} {'N':>3} {'(a) single':>11} {'(b) best-of-N':>14} {'(c) loop':>9} {'(c)-(b)':>8} {'loop gens':>10}"
    print(header)
    print("-" * len(header))
    for kind, r in results.items():
        for n in budgets:
            print(f"{kind:<10} {n:>3} {r['single']:>11.2f} {r[f'best_of_{n}']:>14.2f} "
                  f"{r[f'loop_{n}']:>9.2f} {r[f'loop_{n}'] - r[f'best_of_{n}']:>+8.2f} "
                  f"{r[f'loop_{n}_mean_generations']:>10.1f}")
    figures = {"bench": "loop_quality", "goals_per_kind": n_goals, "budgets": budgets,
               "model": args.model, "scorer": args.scorer, "seconds": round(elapsed, 1), **results}
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
