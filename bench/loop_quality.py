"""Does the loop improve outcomes? Success judged by the exact checker on held-out goals.

For each held-out goal and each budget N:
  (a) a single sample of the goal text,
  (b) best-of-N samples of the goal text, chosen by CLIPScore,
  (c) agentloop's loop (the search reviser by default, embedded runtime) with budget N,
and the checker (image analysis, no neural network) says whether every requested attribute
holds in the chosen image. The selection gap is (c)'s oracle, "any of the loop's images is
right", minus (c): what a perfect verifier would have added. Prints a table; the last line is
one JSON object.

Kinds of goals (--kinds): 1, 2 and 3 objects with their places ("a small red circle on the
left and ..."); 2-noplace, two objects without place words (the planner places them);
2-phrased, two placed objects joined by a comma, "with", "plus", "as well as", "together
with" or "alongside" instead of "and"; 2-bare, two placed objects without articles, as
prompts are often typed ("small red circle on the left & blue square on the right"), joined
by "and", "&", "plus" or a semicolon; 2-labels, two placed objects whose places are written
as labels ("left: a red circle, right: a blue square"), side words ("red circle left, blue
square right"), brackets ("a red circle (left) and ...") or two sentences.

Another reviser, or the search reviser with options: --reviser NAME and --reviser-option
KEY=VALUE (repeatable; options the reviser's constructor does not take are reported and left
out, so one command line serves revisers with and without them).

The budget counts generations (images). A candidate drawn from a layout costs one denoiser
pass per region, so the loop may spend more compute than N plain samples: the table gives
the loop's denoiser passes per goal and (b) again at that compute, best-of-M with M the
loop's mean passes rounded up.

    python bench/loop_quality.py            # full run
    python bench/loop_quality.py --quick    # small run
    python bench/loop_quality.py --goals 20 --budgets 16 --no-baselines
    python bench/loop_quality.py --goals 40 --budgets 16 --kinds 3 --no-baselines \
        --record /tmp/loop3.jsonl && python bench/selection.py --objects 3 --replay /tmp/loop3.jsonl
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`, the script's folder comes first on sys.path, where the
# queue bench (bench/queue.py) would shadow the standard library's queue.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import base64
import inspect
import io
import json
import math
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from agentloop.domain import CandidateStatus, GoalRequest, check_goal, split_parts
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


KINDS = ("1", "2", "3", "2-noplace", "2-phrased", "2-bare", "2-labels")
JOINERS = (", ", " with ", " plus ", " as well as ", " together with ", " alongside ")
"""How 2-phrased goals join their two object phrases, in turn."""
BARE_JOINERS = (" and ", " & ", " plus ", "; ")
"""How 2-bare goals join their two article-free object phrases, in turn."""
LABEL_FORMS = ("{p0}: {o0}, {p1}: {o1}", "{b0} {p0}, {b1} {p1}", "{o0} ({p0}) and {o1} ({p1})",
               "{O0} on the {p0}. {O1} on the {p1}.")
"""How 2-labels goals write two placed objects' places, in turn: as labels, as a side word
after each object, in brackets, as two sentences."""
SEED_OFFSETS = {"2-noplace": 10, "2-phrased": 20, "2-bare": 30, "2-labels": 40}


def goals_of(kind: str, n: int, seed: int) -> list[world.Goal]:
    """Held-out goals of a kind (see the module docstring); the same seed, the same goals."""
    if kind in ("1", "2", "3"):
        return world.heldout_goals(n, objects=int(kind), seed=seed + int(kind))
    goals = world.heldout_goals(n, objects=2, seed=seed + SEED_OFFSETS[kind])
    out = []
    for i, g in enumerate(goals):
        if kind == "2-noplace":
            objects = [{k: v for k, v in o.items() if k != "position"} for o in g.objects]
            out.append(world.Goal(" and ".join(world.object_phrase(o) for o in objects), objects))
        elif kind == "2-bare":
            phrases = [re.sub(r"^(?:a|an)\s+", "", world.object_phrase(o)) for o in g.objects]
            out.append(world.Goal(BARE_JOINERS[i % len(BARE_JOINERS)].join(phrases), g.objects))
        elif kind == "2-labels":
            unplaced = [world.object_phrase({k: v for k, v in o.items() if k != "position"})
                        for o in g.objects]
            fields = {}
            for j, (o, phrase) in enumerate(zip(g.objects, unplaced, strict=True)):
                fields |= {f"o{j}": phrase, f"O{j}": phrase[0].upper() + phrase[1:],
                           f"b{j}": re.sub(r"^(?:a|an)\s+", "", phrase), f"p{j}": o["position"]}
            out.append(world.Goal(LABEL_FORMS[i % len(LABEL_FORMS)].format(**fields), g.objects))
        else:
            text = JOINERS[i % len(JOINERS)].join(world.object_phrase(o) for o in g.objects)
            out.append(world.Goal(text, g.objects))
    return out


def _value(text: str) -> Any:
    """A reviser option's value: true/false, an int, a float, or the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def configure_reviser(name: str, options: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Register reviser ``name`` rebuilt with ``options`` (KEY=VALUE); returns the options
    used and the names of those its constructor does not take (left out)."""
    from agentloop.revisers import REVISERS

    if name not in REVISERS:
        raise SystemExit(f"unknown reviser {name!r}; known: {sorted(REVISERS)}")
    kwargs = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep:
            raise SystemExit(f"--reviser-option {option!r}: expected KEY=VALUE")
        kwargs[key.strip().replace("-", "_")] = _value(value.strip())
    if not kwargs:
        return {}, []
    cls = type(REVISERS[name])
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    used = {k: v for k, v in kwargs.items() if takes_any or k in params}
    ignored = sorted(set(kwargs) - set(used))
    if ignored:
        print(f"reviser {name!r} takes no option(s) {ignored}; left out", file=sys.stderr)
    REVISERS[name] = cls(**used)
    return used, ignored


def run_loops(store: Store, settings: Settings, residency: Residency, goals: list[world.Goal],
              budget: int, reviser: str = "search", record: Path | None = None,
              key: str = "") -> list[tuple[Image.Image, int, int, bool]]:
    """The loop on each goal, all goals side by side in one embedded runtime.

    Returns each goal's best image, the generations it used, their denoiser passes, and
    whether any of its images is right by the checker (the oracle). With ``record``, appends
    each laid-out goal's candidates to that JSON lines file (``record_line``).
    """
    texts = [g.text for g in goals]
    specs = [check_goal(GoalRequest(goal=t, budget=budget, seed=i, reviser=reviser), settings)
             for i, t in enumerate(texts)]
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
    root = settings.resolved_artifacts_dir()
    for goal_id, goal in zip(ids, goals, strict=True):
        state = store.get_state(goal_id)
        best = next(c for c in state.candidates if c.id == state.goal.best_candidate_id)
        image = Image.open(root / best.artifact_uri).convert("RGB")
        passes = sum(max(1, len(c.regions)) * _share(c) for c in state.candidates)
        any_right = any(
            checker.check(Image.open(root / c.artifact_uri).convert("RGB"), goal.objects).all_ok
            for c in state.candidates
            if c.status is CandidateStatus.SUCCEEDED and c.artifact_uri
        )
        moves = Counter((c.edit or "seed").split(":", 1)[0] for c in state.candidates)
        out.append((image, state.goal.generations_reserved, passes, any_right, moves))
        if record is not None and best.regions:
            line = record_line(f"{key}/{len(out) - 1}", goal, state.candidates, best, root)
            with record.open("a") as fh:
                fh.write(json.dumps(line) + "\n")
    return out


def _png(image: Image.Image) -> str:
    """An image as base64 PNG text (as bench/selection.py records images)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def record_line(key: str, goal: world.Goal, candidates: list, best, root: Path) -> dict[str, Any]:  # noqa: ANN001
    """One goal's candidates drawn from the layout of its chosen one, as `bench/selection.py`
    records a goal (so ``selection.py --replay`` ranks them by every objective), plus
    ``picked``, the loop's own choice among them."""
    drawn = [c for c in candidates if c.status is CandidateStatus.SUCCEEDED and c.artifact_uri
             and c.regions == best.regions]
    images = [Image.open(root / c.artifact_uri).convert("RGB") for c in drawn]
    checks = [checker.check(im, goal.objects) for im in images]
    return {
        "key": key, "objects_n": len(goal.objects), "text": goal.text, "objects": goal.objects,
        "layout": [list(e) for e in best.regions], "seeds": [c.seed for c in drawn], "steps": 0,
        "right": [c.all_ok for c in checks],
        "objects_ok": [[all(o.values()) for o in c.objects] for c in checks],
        "images": [_png(im) for im in images],
        "picked": next(i for i, c in enumerate(drawn) if c.id == best.id),
    }


def _share(c) -> float:  # noqa: ANN001 - a CandidateView
    """The share of a full generation's denoiser passes a candidate ran: k/T if its prune
    group cut it after k of T steps; its strength if it started from an image (a repair or a
    refinement runs that share of the schedule again); else all of them."""
    if c.pruned_at_step is not None:
        return c.pruned_at_step / int(c.params["steps"])
    if c.params.get("init_image"):
        return float(c.params.get("strength", 1.0))
    return 1.0


def evaluate(n_goals: int, kind: str, budgets: list[int], settings: Settings,
             residency: Residency, store: Store, seed: int, reviser: str = "search",
             baselines: bool = True, record: Path | None = None) -> dict[str, float]:
    goals = goals_of(kind, n_goals, seed)
    out: dict[str, float] = {}
    for n in budgets:
        loops = run_loops(store, settings, residency, goals, n, reviser, record,
                          f"{kind}/{seed}/{n}")
        out[f"loop_{n}"] = sum(checker.check(im, g.objects).all_ok
                               for (im, *_), g in zip(loops, goals, strict=True)) / n_goals
        out[f"loop_{n}_oracle"] = sum(any_right for _, _, _, any_right, _ in loops) / n_goals
        out[f"loop_{n}_selection_gap"] = out[f"loop_{n}_oracle"] - out[f"loop_{n}"]
        out[f"loop_{n}_mean_generations"] = sum(used for _, used, *_ in loops) / n_goals
        out[f"loop_{n}_mean_passes"] = sum(passes for _, _, passes, *_ in loops) / n_goals
        moves = sum((m for *_, m in loops), Counter())
        out[f"loop_{n}_moves_per_goal"] = {k: round(v / n_goals, 2) for k, v in sorted(moves.items())}
        print(f"  {kind} goals, N={n}: {out}", file=sys.stderr, flush=True)
    if not baselines:
        return out
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
        print(f"  {kind} goals, N={n}: {out}", file=sys.stderr, flush=True)
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
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 when two runs share 2 cores)")
    parser.add_argument("--record", type=Path, default=None, metavar="FILE",
                        help="append each laid-out goal's candidates to FILE (JSON lines, the "
                             "format bench/selection.py --replay reads)")
    parser.add_argument(
        "--variation-share", type=float, default=None,
        help="run (c) with SearchReviser(variation_share=X): that share of each later iteration "
             "goes to noise variations of the best candidate (default: the shipped reviser)",
    )
    parser.add_argument("--variation-strength", type=float, default=0.35)
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"goal kinds to run, comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--reviser", default="search", help="the goals' reviser (registered name)")
    parser.add_argument("--reviser-option", action="append", default=[], metavar="KEY=VALUE",
                        help="rebuild the reviser with this constructor option (repeatable), "
                             "e.g. repair=true; options it does not take are left out")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip (a) and (b): only the loop, its oracle and selection gap")
    parser.add_argument(
        "--prune-factor", type=int, default=0,
        help="run (c) with SearchReviser(prune_factor=F): the first iteration previews F times "
             "its fan-out and finishes the best (docs/engine.md, Pruning); 0: off",
    )
    parser.add_argument("--prune-at", type=float, default=0.2, help="share of steps before the cut")
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.prune_factor:
        args.reviser_option = [f"prune_factor={args.prune_factor}", f"prune_at={args.prune_at}",
                               *args.reviser_option]
    if args.variation_share is not None:
        args.reviser_option = [f"variation_share={args.variation_share}",
                               f"variation_strength={args.variation_strength}",
                               *args.reviser_option]
    from agentloop.revisers import REVISERS

    registered = dict(REVISERS)
    options, ignored = configure_reviser(args.reviser, args.reviser_option)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := [k for k in kinds if k not in KINDS]:
        raise SystemExit(f"unknown goal kind(s) {unknown}; known: {', '.join(KINDS)}")
    n_goals = 6 if args.quick else args.goals
    budgets = [int(b) for b in args.budgets.split(",")]
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # a long lease: on a loaded machine a batch can outlast the default 30 s lease and
            # be taken back and generated again; this bench measures quality, not recovery
            settings = Settings(data_dir=Path(tmp), default_model=args.model,
                                default_scorer=args.scorer, lease_seconds=3000,
                                visibility_timeout=3600)
            from agentloop import migrate

            url = settings.resolved_database_url()
            migrate.upgrade(url)
            store = Store(url)
            residency = Residency()
            results = {
                _label(k): evaluate(n_goals, k, budgets, settings, residency, store, args.seed,
                                    args.reviser, not args.no_baselines, args.record)
                for k in kinds
            }
            store.dispose()
    finally:  # leave the registry as it was for whoever runs next in this process
        REVISERS.clear()
        REVISERS.update(registered)
    elapsed = time.perf_counter() - t0
    _print_table(results, budgets, n_goals, args)
    figures = {"bench": "loop_quality", "goals_per_kind": n_goals, "budgets": budgets,
               "kinds": kinds, "reviser": args.reviser, "reviser_options": options,
               "reviser_options_left_out": ignored,
               "variation_share": args.variation_share,
               "variation_strength": args.variation_strength if args.variation_share else None,
               "prune_factor": args.prune_factor, "prune_at": args.prune_at,
               "model": args.model, "scorer": args.scorer, "seconds": round(elapsed, 1), **results}
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return figures


def _label(kind: str) -> str:
    return f"{kind}_object" if kind.isdigit() else kind.replace("-", "_")


def _print_table(results: dict[str, dict[str, float]], budgets: list[int], n_goals: int,
                 args: argparse.Namespace) -> None:
    def cell(r: dict[str, float], key: str, width: int, sign: str = "") -> str:
        return f"{r[key]:>{sign}{width}.2f}" if key in r else f"{'-':>{width}}"

    print(f"\nSuccess rate judged by the exact checker (all requested attributes right), "
          f"{n_goals} held-out goals per kind, model {args.model}, scorer {args.scorer}, "
          f"reviser {args.reviser}\n")
    header = (f"{'goal kind':<11} {'N':>3} {'(a) single':>11} {'(b) best-of-N':>14} "
              f"{'(c) loop':>9} {'oracle':>7} {'gap':>6} {'(c)-(b)':>8} {'loop gens':>10} "
              f"{'loop passes':>12} {'(b) best-of-M':>14}")
    print(header)
    print("-" * len(header))
    for kind, r in results.items():
        for n in budgets:
            diff = {"d": r[f"loop_{n}"] - r[f"best_of_{n}"]} if f"best_of_{n}" in r else {}
            m = r.get(f"loop_{n}_passes_matched_m")
            print(f"{kind:<11} {n:>3} {cell(r, 'single', 11)} {cell(r, f'best_of_{n}', 14)} "
                  f"{cell(r, f'loop_{n}', 9)} {cell(r, f'loop_{n}_oracle', 7)} "
                  f"{cell(r, f'loop_{n}_selection_gap', 6)} {cell(diff, 'd', 8, '+')} "
                  f"{r[f'loop_{n}_mean_generations']:>10.1f} {r[f'loop_{n}_mean_passes']:>12.1f} "
                  f"{cell(r, f'best_of_{n}_at_loop_passes', 9)} M={m if m is not None else '-'}")
    print("\noracle: any of the loop's images right; gap: oracle - (c), what a perfect verifier "
          "would add. loop passes: denoiser passes per goal (a layout candidate costs one per "
          "region); best-of-M: (b) with M = the loop's passes rounded up, at equal compute.")


if __name__ == "__main__":
    main()
