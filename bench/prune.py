"""Pruning losers mid-denoise against best-of-16: checker success per denoiser pass.

For each held-out goal (``engine.shapes.world.heldout_goals``, one-object and two-object),
``--seeds`` candidates are drawn as the search reviser's first iteration draws them (the goal
text, and for a goal whose parts name distinct positions, its layout; seeds
``derive_seed(goal, 0, j)``), and denoised once to the end through the runner's own loop,
recording at every step k in ``--ks`` each candidate's preview: its predicted clean image,
x0 = x_t - sigma_t * v, decoded. Previews and finished images are scored as the reviser
ranks candidates (CLIPScore, or for two parts the mean of it and the weaker part's), and the
exact checker judges every finished image.

One run serves every variant because pruning never changes a kept candidate's image (the
engine test ``tests/engine/test_engine_prune.py`` asserts it bit for bit): a variant
"W candidates, cut at step k, keep m" ranks the previews of the first W seeds, keeps the m
best, and picks the best finished one of those by score. Best-of-N picks the best finished
image of the first N seeds. The bench also runs the recommended variant through the engine's
own pruning path (``Runner.generate(..., preview_scorer=...)``) on the first goals of each
kind and checks it picks what the simulation picks. ``--record FILE`` keeps each collected goal,
so a long run can resume, or be widened with more goals, without generating again.

``--preview-scorer NAME`` (e.g. ``shapes-clip-preview``, or ``shapes-clip:<weights file>``)
scores the previews a second time, with that scorer, in the same run: every pruned variant and
rank correlation is then reported twice, previews ranked by ``--scorer`` and by the preview
scorer, on the same candidates. The finished images are always ranked by ``--scorer``, and the
engine check runs the recommended variant with the preview scorer.

Cost: denoiser passes (transformer rows x steps) relative to best-of-16, W*k + m*(T-k) over
16*T (every candidate of a goal has as many rows per step, so the ratio is the same with
guidance and layouts). Rank correlations (Spearman, mean over goals) between preview score
and final score, and between preview score and checker success, say how well the previews
rank.

    python -m bench.prune                # 30 goals per kind
    python -m bench.prune --quick        # 4 goals per kind
    python -m bench.prune --goals 12 --record /tmp/prune.jsonl
    python -m bench.prune --preview-scorer shapes-clip-preview
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from agentloop.domain import split_parts
from agentloop.revisers.base import objective_of
from engine.config import EngineConfig
from engine.defaults import model_defaults
from engine.runner import Runner
from engine.scorer import Scorer
from engine.shapes import checker, world
from engine.shapes.preview_data import denoise_with_previews, requests_for
from engine.types import GenerationRequest, ScoreRequest
from workers.jobs import preview_scorer

BASELINE = 16
WIDTHS = (16, 20, 24, 32)
KEEPS = (2, 3, 4, 8)
TABLE_MAX_COST = 0.7
"""Pruned variants above this cost are left out of the table (the JSON has them all)."""


@dataclass
class GoalRun:
    """One goal's candidates: preview scores per step, final scores, checker verdicts."""

    goal: world.Goal
    requests: list[GenerationRequest]
    previews: dict[int, list[float]]
    final: list[float]
    ok: list[bool]
    alt: dict[int, list[float]] | None = None
    """Preview scores per step by the ``--preview-scorer``, when one is given."""

    def by(self, alt: bool) -> GoalRun:
        """This run with its previews ranked by the preview scorer (``alt``) or the scorer."""
        if not alt:
            return self
        assert self.alt is not None
        return replace(self, previews=self.alt)


def collect(runner: Runner, scorer: Scorer, goal: world.Goal, requests: list[GenerationRequest],
            ks: list[int], alt: Scorer | None = None) -> GoalRun:  # fmt: skip
    """Denoise ``requests`` to the end once, decoding the x0 previews at every k in ``ks``."""
    previews, images = denoise_with_previews(runner, requests, ks)
    asked = [ScoreRequest(goal.text, split_parts(goal.text))] * len(requests)
    score = preview_scorer(scorer, asked)
    positions = list(range(len(requests)))
    alt_score = None if alt is None else preview_scorer(alt, asked)
    return GoalRun(
        goal, requests, {k: score(positions, p) for k, p in previews.items()},
        score(positions, images), [checker.check(im, goal.objects).all_ok for im in images],
        None if alt_score is None else {k: alt_score(positions, p) for k, p in previews.items()},
    )


def ranks(x: list[float]) -> np.ndarray:
    """Ranks with ties averaged (1-based)."""
    a = np.asarray(x, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(1, len(a) + 1)
    for v in np.unique(a):
        tied = a == v
        r[tied] = r[tied].mean()
    return r


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rho; NaN when either side is constant."""
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def pick(run: GoalRun, width: int, k: int | None, keep: int) -> int:
    """The candidate a variant finishes with: the best final score among the ``keep`` best
    previews at step ``k`` of the first ``width`` (ties: earlier first, as the engine does)."""
    pool = list(range(width))
    if k is not None and keep < width:
        scores = run.previews[k]
        pool = sorted(sorted(pool, key=lambda i: (-scores[i], i))[:keep])
    return max(pool, key=lambda i: (run.final[i], -i))


def cost(width: int, k: int | None, keep: int, steps: int) -> float:
    """Denoiser passes relative to best-of-16."""
    passes = width * steps if k is None else width * k + keep * (steps - k)
    return passes / (BASELINE * steps)


def engine_check(runner: Runner, scorer: Scorer, run: GoalRun, width: int, k: int,
                 keep: int, previewer: Scorer | None = None) -> bool:  # fmt: skip
    """Run the variant through the engine's pruning path (previews ranked by ``previewer``,
    default the scorer); True if it finishes the same candidates and picks the same one as
    the simulation."""
    group = [replace(r, prune_group="bench", prune_keep=keep, prune_at_step=k)
             for r in run.requests[:width]]  # fmt: skip
    asked = [ScoreRequest(run.goal.text, split_parts(run.goal.text))] * width
    results = runner.generate(group, preview_scorer=preview_scorer(previewer or scorer, asked))
    kept = [i for i, r in enumerate(results) if not r.pruned]
    finals = scorer.score([results[i].image for i in kept], [asked[i] for i in kept])
    objective = [objective_of(s.clip_score, s.part_scores, asked[0].parts) for s in finals]
    chosen = kept[max(range(len(kept)), key=lambda j: (objective[j], -j))]
    return chosen == pick(run.by(previewer is not None), width, k, keep) and len(kept) == keep


def main(argv: list[str] | None = None) -> dict:
    """Collect, evaluate every variant, print a table, then one JSON line."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--scorer", default="shapes-clip")
    ap.add_argument("--preview-scorer", default=None,
                    help="also rank the previews with this scorer (the finals stay ranked by "
                         "--scorer); every pruned figure is then reported for both")
    ap.add_argument("--goals", type=int, default=30, help="held-out goals per kind")
    ap.add_argument("--seeds", type=int, default=32, help="candidates per goal (widest fan-out)")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4, 5, 6, 8])
    ap.add_argument("--recommend", default="24:4:4", help="width:k:keep run through the engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="4 goals per kind")
    ap.add_argument("--record", type=Path, default=None,
                    help="a JSON-lines file of collected goals: goals found there are not "
                         "generated again, new ones are appended (a long run can resume)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n_goals = 4 if args.quick else args.goals
    defaults = model_defaults(args.model)
    steps = int(defaults["steps"])
    runner = Runner(args.model, EngineConfig(device="cpu", max_batch=64))
    scorer = Scorer(args.scorer, device="cpu")
    alt = None if args.preview_scorer is None else Scorer(args.preview_scorer, device="cpu")
    rw, rk, rkeep = (int(v) for v in args.recommend.split(":"))
    start = time.perf_counter()
    runs: dict[int, list[GoalRun]] = {}
    agree = []
    recorded = _load(args.record)
    for kind in (1, 2):
        goals = world.heldout_goals(n_goals, objects=kind, seed=args.seed + kind)
        runs[kind] = []
        for gi, goal in enumerate(goals):
            requests = requests_for(goal, gi + 1000 * kind, args.seeds, args.model, defaults)
            key = json.dumps([goal.text, requests[0].seed, args.seeds, args.ks])
            if alt is not None:  # a record holds one preview scorer's scores
                key = json.dumps([goal.text, requests[0].seed, args.seeds, args.ks,
                                  args.preview_scorer])  # fmt: skip
            if key in recorded:
                run = GoalRun(goal, requests, *recorded[key])
            else:
                run = collect(runner, scorer, goal, requests, args.ks, alt)
                _save(args.record, key, run)
            runs[kind].append(run)
            print(f"  {kind}-object goal {gi + 1}/{n_goals}", file=sys.stderr, flush=True)
        agree.append(engine_check(runner, scorer, runs[kind][0], rw, rk, rkeep, alt))
    elapsed = time.perf_counter() - start
    best_of = {n for n in (4, 8, 9, 12, 16, 24, 32) if n <= args.seeds} | {args.seeds}
    variants: list[tuple[int, int | None, int]] = [(n, None, n) for n in sorted(best_of)]
    widths = sorted({w for w in WIDTHS if w <= args.seeds} | {args.seeds})
    variants += [(w, k, m) for w in widths for k in args.ks for m in KEEPS if m < w]
    rows, corr = evaluate(runs, variants, args.ks, min(BASELINE, args.seeds), steps)
    _print(rows, corr, n_goals, args, steps)
    alt_figures = {}
    if alt is not None:
        alt_runs = {kind: [r.by(True) for r in kind_runs] for kind, kind_runs in runs.items()}
        alt_rows, alt_corr = evaluate(alt_runs, variants, args.ks, min(BASELINE, args.seeds),
                                      steps)
        print(f"\n=== previews ranked by the preview scorer {args.preview_scorer} "
              f"(finals by {args.scorer}) ===")  # fmt: skip
        _print(alt_rows, alt_corr, n_goals, args, steps)
        alt_figures = {"preview_scorer": args.preview_scorer, "rows_preview_scorer": _rounded(alt_rows),
                       "spearman_preview_scorer": _rounded_corr(alt_corr)}  # fmt: skip
    print(f"\nengine pruning path ({args.recommend}) picks what the simulation picks: "
          f"{sum(agree)}/{len(agree)} goals")  # fmt: skip
    figures = {
        "bench": "prune", "model": args.model, "scorer": args.scorer, "goals_per_kind": n_goals,
        "seeds": args.seeds, "steps": steps, "seed": args.seed, "seconds": round(elapsed, 1),
        "engine_agrees": f"{sum(agree)}/{len(agree)}",
        "rows": _rounded(rows), "spearman": _rounded_corr(corr), **alt_figures,
    }  # fmt: skip
    print(json.dumps(figures))
    return figures


def _rounded(rows: list[dict]) -> list[dict]:
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]


def _rounded_corr(corr: dict) -> dict:
    return {k: {n: None if math.isnan(v) else round(v, 4) for n, v in d.items()}
            for k, d in corr.items()}  # fmt: skip


def evaluate(runs: dict[int, list[GoalRun]], variants: list[tuple[int, int | None, int]],
             ks: list[int], baseline: int, steps: int) -> tuple[list[dict], dict]:  # fmt: skip
    """Every variant's checker success (per kind, mean, paired +/- against best-of-baseline),
    and the rank correlations of preview scores, from the runs' previews."""
    all_runs = [r for kind in (1, 2) for r in runs[kind]]
    base_ok = [r.ok[pick(r, baseline, None, baseline)] for r in all_runs]
    rows = []
    for w, k, m in variants:
        row: dict = {"label": f"best-of-{w}" if k is None else f"{w}:k{k}:keep{m}",
                     "width": w, "k": k, "keep": m, "cost": cost(w, k, m, steps)}  # fmt: skip
        for kind, kind_runs in runs.items():
            row[f"acc_{kind}"] = sum(r.ok[pick(r, w, k, m)] for r in kind_runs) / len(kind_runs)
        row["acc_mean"] = (row["acc_1"] + row["acc_2"]) / 2
        ok = [r.ok[pick(r, w, k, m)] for r in all_runs]  # paired with best-of-16, goal by goal
        row["gained"] = sum(a and not b for a, b in zip(ok, base_ok, strict=True))
        row["lost"] = sum(b and not a for a, b in zip(ok, base_ok, strict=True))
        rows.append(row)
    base = next(r for r in rows if r["label"] == f"best-of-{baseline}")
    for row in rows:
        row["delta"] = row["acc_mean"] - base["acc_mean"]
    corr = {}
    for kind, kind_runs in runs.items():
        for k in ks:
            f = [spearman(r.previews[k], r.final) for r in kind_runs]
            c = [spearman(r.previews[k], [float(o) for o in r.ok]) for r in kind_runs]
            corr[f"{kind}obj_k{k}"] = {"preview_vs_final": _nanmean(f),
                                       "preview_vs_checker": _nanmean(c)}  # fmt: skip
        corr[f"{kind}obj_final"] = {
            "final_vs_checker": _nanmean([spearman(r.final, [float(o) for o in r.ok])
                                          for r in kind_runs])}  # fmt: skip
    return rows, corr


def _load(path: Path | None) -> dict[str, tuple]:
    """Recorded goals by key: preview scores per step, final scores, checker verdicts, and
    the preview scorer's preview scores (None without one)."""
    out = {}
    if path is not None and path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            previews = {int(k): v for k, v in row["previews"].items()}
            alt = row.get("alt")
            alt = None if alt is None else {int(k): v for k, v in alt.items()}
            out[row["key"]] = (previews, row["final"], row["ok"], alt)
    return out


def _save(path: Path | None, key: str, run: GoalRun) -> None:
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps({"key": key, "previews": run.previews, "final": run.final,
                                "ok": run.ok, "alt": run.alt}) + "\n")  # fmt: skip


def _nanmean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def _print(rows: list[dict], corr: dict, n: int, args: argparse.Namespace, steps: int) -> None:
    print(f"\nChecker success of the CLIP-picked image, {n} held-out goals per kind, model "
          f"{args.model}, scorer {args.scorer}, {steps} steps; cost = denoiser passes / "
          f"best-of-{BASELINE}'s\n")  # fmt: skip
    head = (f"{'variant':<18}{'cost':>7}{'1-obj':>8}{'2-obj':>8}{'mean':>8}{'Δ vs bo16':>11}"
            f"{'+/-':>8}")  # fmt: skip
    print(head)
    print("-" * len(head))
    for r in sorted(rows, key=lambda r: (r["cost"], r["label"])):
        if r["k"] is not None and r["cost"] > TABLE_MAX_COST:
            continue
        print(f"{r['label']:<18}{r['cost']:>7.3f}{100 * r['acc_1']:>8.1f}{100 * r['acc_2']:>8.1f}"
              f"{100 * r['acc_mean']:>8.1f}{100 * r['delta']:>+11.1f}"
              f"{'+' + str(r['gained']) + '/-' + str(r['lost']):>8}")  # fmt: skip
    print("\nvariant W:kK:keepM: W candidates, previews at step K, the M best finish. +/-: "
          f"goals it gets right and best-of-{BASELINE} wrong / the other way round (paired).")
    print("\nSpearman rank correlation, mean over goals (NaN-free goals only)")
    for key, d in corr.items():
        print(f"  {key:<14}" + "  ".join(f"{n} {v:+.3f}" for n, v in d.items()))


if __name__ == "__main__":
    main()
