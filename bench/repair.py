"""Does repairing the failing part of a layout candidate make it right? Judged by the checker.

Held-out two-object goals of the shapes world (goal seed 11, neither the loop bench's goals
nor the layout-mix bench's). For each goal, ``--samples`` layout candidates are drawn (each
part in its own region, as the search reviser's first iteration draws them); the exact
checker (image analysis, no neural network) says which objects are right. A candidate with
exactly one object wrong is "one part wrong", and each such candidate is repaired:

  (a) the wrong part's region drawn again (``repair_region``, the rest kept), ``--seeds``
      repairs per candidate at each ``--strengths``;
  (b) the part the CLIP scorer ranks weakest repaired instead (what the reviser sees:
      part scores, not the checker), same seeds, first strength;
  (c) for comparison at about the same compute, fresh layout samples of the goal.

Reported: the share of repairs after which the whole image is right, the share of candidates
with at least one right repair among ``--seeds``, the share of repairs that kept the other
(right) part right, how often the weakest part by CLIP is the wrong one, and denoiser passes
per image (a layout costs one per region per step, a repair one per step run).

With ``--loop-goals N`` (or ``--loop-only``), also the loop itself (embedded runtime, budget
``--loop-budget``) on N other held-out two-object goals, with the search reviser's repair and
refine moves both on, repair only, and neither: how often the best image is right.

    python bench/repair.py --threads 1                 # 40 goals
    python bench/repair.py --quick --threads 1         # 4 goals, a few minutes
    python bench/repair.py --loop-only --loop-goals 12 --threads 1

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

# run as a script, this folder comes first on sys.path, and bench/queue.py would stand in
# for the standard library's queue module (torch imports it)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

from agentloop.domain import CandidateStatus, CandidateView, split_parts  # noqa: E402
from agentloop.revisers import SearchReviser, derive_seed  # noqa: E402
from agentloop.revisers.search import failing_part  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.runner import Runner  # noqa: E402
from engine.scorer import Scorer  # noqa: E402
from engine.shapes import checker, world  # noqa: E402
from engine.shapes.evaluate import layout_of  # noqa: E402
from engine.types import GenerationRequest, ScoreRequest  # noqa: E402

GOAL_SEED = 11
GAP_SWEEP = (0.05, 0.1, 0.15, 0.2, 0.3)
"""Part-score gaps (CLIPScore scale) at which the repair rule is evaluated."""


def _view(score) -> CandidateView:  # noqa: ANN001 - engine.types.ScoreResult
    """A scored candidate as the reviser sees it (only its scores matter here)."""
    return CandidateView(
        id="", goal_id="", iteration=0, ordinal=0, prompt="", negative_prompt="", seed=0,
        params={}, status=CandidateStatus.SUCCEEDED, attempts=1, worker=None,
        clip_score=score.clip_score, part_scores=score.part_scores, artifact_uri=None,
        timings={}, error=None, parent_id=None, edit=None, queued_at=None, started_at=None,
        finished_at=None,
    )


def wrong_parts(image, objects) -> list[int]:  # noqa: ANN001 - PIL image
    """Indices of the requested objects the checker finds wrong."""
    result = checker.check(image, objects)
    return [i for i, flags in enumerate(result.objects) if not all(flags.values())]


def loop_success(texts: list[world.Goal], budget: int, reviser: SearchReviser, model: str,
                 scorer: str) -> tuple[float, float]:
    """The default loop with `reviser` on each goal (embedded runtime, all goals side by side):
    the share whose best image the checker finds right, and the mean repairs per goal."""
    import tempfile

    from agentloop import migrate
    from agentloop.domain import GoalRequest, check_goal
    from agentloop.revisers import REVISERS
    from agentloop.settings import Settings
    from agentloop.store import Store
    from workers.embedded import embedded_runtime

    before = REVISERS["search"]
    REVISERS["search"] = reviser
    try:
        with tempfile.TemporaryDirectory() as tmp:
            settings = Settings(data_dir=Path(tmp), default_model=model, default_scorer=scorer,
                                broker_url=None, database_url=None)
            url = settings.resolved_database_url()
            migrate.upgrade(url)
            store = Store(url)
            dispatcher, _ctx = embedded_runtime(store, settings)
            try:
                ids = [store.create_goal(check_goal(GoalRequest(goal=g.text, budget=budget, seed=i),
                                                    settings)).id for i, g in enumerate(texts)]
                for goal_id in ids:
                    dispatcher.advance_goal(goal_id)
                while not all(store.get_goal(g).status.terminal for g in ids):
                    if dispatcher.errors:
                        raise dispatcher.errors[0]
                    time.sleep(0.1)
            finally:
                dispatcher.close()
            right, repairs = 0, 0
            from PIL import Image

            for goal_id, g in zip(ids, texts, strict=True):
                state = store.get_state(goal_id)
                best = next(c for c in state.candidates if c.id == state.goal.best_candidate_id)
                image = Image.open(settings.resolved_artifacts_dir() / best.artifact_uri)
                right += checker.check(image.convert("RGB"), g.objects).all_ok
                repairs += sum((c.edit or "").startswith("repair:") for c in state.candidates)
            store.dispose()
    finally:
        REVISERS["search"] = before
    return right / len(texts), repairs / len(texts)


def compare_loops(args: argparse.Namespace, t0: float) -> dict[str, float]:
    """The loop on other held-out goals with the shipped reviser and with repair and refine
    switched off."""
    loop: dict[str, float] = {}
    loop_goals = world.heldout_goals(args.loop_goals, objects=2, seed=GOAL_SEED + 1)
    arms = (("repair_refine", SearchReviser(repair=True, refine=True)),
            ("repair_only", SearchReviser(repair=True, refine=False)),
            ("neither", SearchReviser(repair=False, refine=False)))
    for name, reviser in arms:
        ok, n_repairs = loop_success(loop_goals, args.loop_budget, reviser, args.model, args.scorer)
        loop[f"{name}_right"], loop[f"{name}_repairs_per_goal"] = ok, n_repairs
        print(f"loop {name}: {ok:.2f} right, {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    return loop


def print_loop(args: argparse.Namespace, loop: dict[str, float]) -> None:
    print(f"\nThe loop (budget {args.loop_budget}) on {args.loop_goals} other held-out "
          f"two-object goals (seed {GOAL_SEED + 1}), best image right by the checker:")
    for arm in ("repair_refine", "repair_only", "neither"):
        print(f"  {arm:<14} {loop[f'{arm}_right']:.2f} "
              f"({loop[f'{arm}_repairs_per_goal']:.1f} repairs a goal)")


def loop_only(args: argparse.Namespace) -> dict:
    """`--loop-only`: the loop comparison alone, its figures as the last line."""
    t0 = time.perf_counter()
    loop = compare_loops(args, t0)
    print_loop(args, loop)
    figures = {"bench": "repair_loop", "goals": args.loop_goals, "budget": args.loop_budget,
               "model": args.model, "scorer": args.scorer,
               **{k: round(v, 3) for k, v in loop.items()},
               "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(figures))
    return figures


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 goals, 4 samples, 1 seed, one strength")
    parser.add_argument("--goals", type=int, default=40)
    parser.add_argument("--samples", type=int, default=6, help="layout candidates per goal")
    parser.add_argument("--seeds", type=int, default=4, help="repairs per candidate and strength")
    parser.add_argument("--strengths", default="1.0,0.8")
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--scorer", default="shapes-clip")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--loop-goals", type=int, default=0,
                        help="also run the loop on this many goals with and without repairs")
    parser.add_argument("--loop-budget", type=int, default=8)
    parser.add_argument("--loop-only", action="store_true", help="only the loop comparison")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.goals, args.samples, args.seeds, args.strengths = 4, 4, 1, "0.7"
    if args.threads:
        torch.set_num_threads(args.threads)
    strengths = [float(s) for s in args.strengths.split(",")]
    if args.loop_only:
        return loop_only(args)
    t0 = time.perf_counter()
    runner = Runner(args.model, EngineConfig(max_batch=16))
    scorer = Scorer(args.scorer)
    goals = world.heldout_goals(args.goals, objects=2, seed=GOAL_SEED)
    steps, guidance = args.steps, 3.0

    def layout(gi: int, g: world.Goal, k: int) -> GenerationRequest:
        return GenerationRequest(g.text, seed=derive_seed(gi, 1, k), steps=steps, guidance=guidance,
                                 model=args.model, regions=layout_of(g.objects))

    requests = [layout(gi, g, k) for gi, g in enumerate(goals) for k in range(args.samples)]
    images = [r.image for r in runner.generate(requests)]
    print(f"{len(images)} layout candidates in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
          flush=True)
    owner = [gi for gi in range(len(goals)) for _ in range(args.samples)]
    right = [checker.check(im, goals[gi].objects).all_ok for im, gi in zip(images, owner, strict=True)]
    one_wrong = [(i, w[0]) for i, (im, gi) in enumerate(zip(images, owner, strict=True))
                 if len(w := wrong_parts(im, goals[gi].objects)) == 1]
    layout_s = time.perf_counter() - t0

    # what the reviser sees: part scores. The weakest part of each one-part-wrong candidate,
    # and which candidates the search reviser's rule (failing_part) would repair
    all_scores = scorer.score(images, [ScoreRequest(goals[gi].text, split_parts(goals[gi].text))
                                       for gi in owner])
    weakest = []
    for i, _ in one_wrong:
        parts, part_scores = split_parts(goals[owner[i]].text), all_scores[i].part_scores
        weakest.append(min(range(len(parts)), key=lambda p, s=part_scores, q=parts: s[q[p]]))
    diagnosis = sum(w == k for (_, k), w in zip(one_wrong, weakest, strict=True)) / max(1, len(one_wrong))
    rule = SearchReviser()
    flagged = [failing_part(_view(all_scores[i]), split_parts(goals[gi].text), rule.repair_gap,
                            rule.pass_score) is not None for i, gi in enumerate(owner)]
    one_wrong_ids = {i for i, _ in one_wrong}

    def gap_of(i: int) -> float:
        ordered = sorted(all_scores[i].part_scores.values())
        return ordered[1] - ordered[0]

    sweep = {}
    for gap in GAP_SWEEP:  # how the rule's gap separates one-part-wrong from right candidates
        hits = [gap_of(i) >= gap for i in range(len(images))]
        sweep[f"{gap:g}"] = {
            "one_part_wrong_flagged": sum(hits[i] for i in one_wrong_ids) / max(1, len(one_wrong)),
            "right_flagged": sum(h and r for h, r in zip(hits, right, strict=True)) / max(1, sum(right)),
        }
    rule_figures = {
        "flagged": sum(flagged),
        "flagged_one_part_wrong": sum(flagged[i] for i in one_wrong_ids),
        "flagged_right": sum(f and r for f, r in zip(flagged, right, strict=True)),
        "one_part_wrong_flagged_share": sum(flagged[i] for i in one_wrong_ids) / max(1, len(one_wrong)),
    }

    def repairs(targets: list[int], strength: float, salt: int) -> tuple[float, float, float]:
        reqs = [replace(requests[i], seed=derive_seed(i, salt, s), init_image=images[i],
                        repair_region=k, strength=strength)
                for (i, _), k in zip(one_wrong, targets, strict=True) for s in range(args.seeds)]
        if not reqs:
            return 0.0, 0.0, 0.0
        out = [r.image for r in runner.generate(reqs)]
        print(f"{len(out)} repairs at strength {strength:g}, {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
        ok, kept = [], []
        for j, im in enumerate(out):
            i, bad = one_wrong[j // args.seeds]
            objects = goals[owner[i]].objects
            ok.append(checker.check(im, objects).all_ok)
            kept.append((1 - bad) not in wrong_parts(im, objects))
        per_candidate = [any(ok[c * args.seeds:(c + 1) * args.seeds]) for c in range(len(one_wrong))]
        return sum(ok) / len(ok), sum(per_candidate) / len(per_candidate), sum(kept) / len(kept)

    rows: dict[str, dict[str, float]] = {}
    for strength in strengths:
        one, any_of, kept = repairs([k for _, k in one_wrong], strength, salt=2)
        rows[f"repair wrong part @{strength:g}"] = {
            "right_per_repair": one, f"right_within_{args.seeds}": any_of, "other_part_kept": kept,
            "passes_per_image": math.ceil(strength * steps) / steps,
        }
    one, any_of, kept = repairs(weakest, strengths[0], salt=2)
    rows[f"repair CLIP-weakest part @{strengths[0]:g}"] = {
        "right_per_repair": one, f"right_within_{args.seeds}": any_of, "other_part_kept": kept,
        "passes_per_image": math.ceil(strengths[0] * steps) / steps,
    }
    # (c) fresh layouts of the same goals, as many per one-wrong candidate as repairs
    fresh = [replace(layout(owner[i], goals[owner[i]], 0), seed=derive_seed(i, 3, s))
             for i, _ in one_wrong for s in range(args.seeds)]
    fresh_ok = [checker.check(r.image, goals[owner[one_wrong[j // args.seeds][0]]].objects).all_ok
                for j, r in enumerate(runner.generate(fresh))] if fresh else []
    per_cand = [any(fresh_ok[c * args.seeds:(c + 1) * args.seeds]) for c in range(len(one_wrong))]
    rows["fresh layout sample"] = {
        "right_per_repair": sum(fresh_ok) / max(1, len(fresh_ok)),
        f"right_within_{args.seeds}": sum(per_cand) / max(1, len(per_cand)),
        "other_part_kept": float("nan"), "passes_per_image": 2.0,
    }
    loop = compare_loops(args, t0) if args.loop_goals else {}
    elapsed = time.perf_counter() - t0

    print(f"\n{len(goals)} held-out two-object goals (seed {GOAL_SEED}), {args.samples} layout "
          f"candidates each: {sum(right)}/{len(right)} right, {len(one_wrong)} with one part wrong. "
          f"Weakest part by {args.scorer} = the wrong part: {diagnosis:.2f}.\n"
          f"The search reviser's repair rule (gap {rule.repair_gap}) flags {rule_figures['flagged']} "
          f"candidates: {rule_figures['flagged_one_part_wrong']} with one part wrong (of "
          f"{len(one_wrong)}), {rule_figures['flagged_right']} right ones.\n")
    print("Repair rule by gap (weakest part at least this far below the other): share flagged")
    for gap, r in sweep.items():
        print(f"  gap {gap:>5}: one part wrong {r['one_part_wrong_flagged']:.2f}, "
              f"right {r['right_flagged']:.2f}")
    print()
    header = (f"{'move on a one-part-wrong candidate':<36} {'right/try':>10} "
              f"{f'right in {args.seeds}':>11} {'other kept':>11} {'passes/img':>11}")
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        kept_text = "-" if math.isnan(r["other_part_kept"]) else f"{r['other_part_kept']:.2f}"
        print(f"{name:<36} {r['right_per_repair']:>10.2f} {r[f'right_within_{args.seeds}']:>11.2f} "
              f"{kept_text:>11} {r['passes_per_image']:>11.2f}")
    print("\npasses/img: denoiser passes per image relative to a plain image of as many steps "
          "(a two-region layout costs 2, a repair at strength s about s).")
    if loop:
        print_loop(args, loop)
    figures = {
        "bench": "repair", "goals": len(goals), "samples": args.samples, "seeds": args.seeds,
        "model": args.model, "scorer": args.scorer, "layout_right": sum(right) / len(right),
        "one_part_wrong": len(one_wrong), "weakest_is_wrong_part": round(diagnosis, 3),
        "repair_rule": rule_figures, "gap_sweep": {
            g: {k: round(v, 3) for k, v in r.items()} for g, r in sweep.items()},
        "rows": {k: {m: (None if isinstance(v, float) and math.isnan(v) else round(v, 3))
                     for m, v in r.items()} for k, r in rows.items()},
        "loop": {"goals": args.loop_goals, "budget": args.loop_budget,
                 **{k: round(v, 3) for k, v in loop.items()}} if loop else None,
        "layout_seconds": round(layout_s, 1), "seconds": round(elapsed, 1),
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
