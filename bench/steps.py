"""Checker accuracy against denoising steps, scheduler shift and guidance truncation.

For each configuration (steps, shift, cfg_truncation), one image per held-out goal
(``engine.shapes.world.heldout_goals``, canonical plain-text goals, one-object and
two-object) is generated through the engine's runner (own loop, true CFG against the empty
prompt at the model's guidance, noise seed = seed + goal index, the same seeds for every
configuration), and the exact checker (``engine.shapes.checker``) says whether every
requested attribute and the object count hold. The table gives accuracy per goal kind, the
change against the reference configuration (the model's shipped defaults unless
``--reference`` says otherwise) with the goals that flipped each way (paired: same goals,
same noise), the denoiser passes per image (transformer rows: two per guided step, one per
unguided step) and seconds per image on this machine.

    python -m bench.steps                       # the default sweep (below)
    python -m bench.steps --quick               # 8 goals per kind, a few configurations
    python -m bench.steps --configs 12:2:1 12:2:0.75 --goals 100
    python -m bench.steps --objects 2 --layout  # two-object goals drawn from layouts

A configuration is ``steps:shift:cfg_truncation``. The default sweep, in this order after
the reference: steps 12, 8, 4, 6, 10, 16, 20 at shift 3 (less the reference's); truncation 0.5 and 0.75 at 12 steps;
shifts 2, 1, 5 at 8 steps and 2, 5 at 12; truncation 0.5 at 20 steps (guidance on every
step elsewhere). ``--time-limit`` starts no configuration after that many minutes (the
table then holds those done). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from engine.config import SOLVERS, EngineConfig
from engine.defaults import model_defaults
from engine.denoise import guided_steps
from engine.runner import Runner
from engine.shapes import checker, world
from engine.shapes.evaluate import layout_of
from engine.types import GenerationRequest

DEFAULT_SWEEP = (
    [(s, 3.0, 1.0) for s in (12, 8, 4, 6, 10, 16, 20)]
    + [(12, 3.0, t) for t in (0.5, 0.75)]
    + [(8, shift, 1.0) for shift in (2.0, 1.0, 5.0)]
    + [(12, shift, 1.0) for shift in (2.0, 5.0)]
    + [(20, 3.0, 0.5)]
)
"""The default configurations, most informative first (``--time-limit`` may cut the tail)."""
QUICK_SWEEP = [(4, 3.0, 1.0), (8, 3.0, 1.0), (20, 3.0, 1.0), (8, 1.0, 1.0), (20, 3.0, 0.5)]


@dataclass(frozen=True)
class Setting:
    """One configuration of the sampler."""

    steps: int
    shift: float
    cfg_truncation: float
    solver: str = "euler"

    @classmethod
    def parse(cls, text: str) -> Setting:
        """``steps:shift:cfg_truncation[:solver]``, e.g. ``12:2:0.75`` or ``8:3:1:dpm++2m``."""
        try:
            steps, shift, truncation, *solver = text.split(":")
            if len(solver) > 1:
                raise ValueError(text)
            setting = cls(int(steps), float(shift), float(truncation), *solver)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not steps:shift:cfg_truncation[:solver] (e.g. 12:2:0.75)"
            ) from None
        if setting.steps < 1 or not setting.shift > 0 or not 0 <= setting.cfg_truncation <= 1:
            raise argparse.ArgumentTypeError(
                f"{text!r}: steps >= 1, shift > 0, truncation in [0, 1]"
            )
        if setting.solver not in SOLVERS:
            raise argparse.ArgumentTypeError(f"{text!r}: solver is one of {', '.join(SOLVERS)}")
        return setting

    @property
    def label(self) -> str:
        label = f"{self.steps}:{self.shift:g}:{self.cfg_truncation:g}"
        return label if self.solver == "euler" else f"{label}:{self.solver}"


def passes_per_image(setting: Setting, guidance: float, regions: int = 1) -> int:
    """Transformer rows one image costs: a row per region per step, plus one unconditional
    row per guided step."""
    guided = guided_steps(setting.steps, guidance, setting.cfg_truncation)
    return regions * setting.steps + guided


class Sweep:
    """One runner per truncation value and solver, the scheduler's shift set per configuration."""

    def __init__(self, model: str, config: EngineConfig) -> None:
        self.model, self.config = model, config
        self.runners: dict[tuple[float, str], Runner] = {}
        self.scheduler_config = self._load(1.0, "euler").pipe.scheduler.config
        """The model's shipped scheduler configuration (shift and all)."""

    def _load(self, truncation: float, solver: str) -> Runner:
        if (truncation, solver) not in self.runners:
            config = replace(self.config, cfg_truncation=truncation, solver=solver)
            self.runners[truncation, solver] = Runner(self.model, config)
        return self.runners[truncation, solver]

    def runner(self, setting: Setting) -> Runner:
        """The runner for ``setting``'s truncation, its scheduler set to ``setting``'s shift."""
        runner = self._load(setting.cfg_truncation, setting.solver)
        if self.scheduler_config.get("_class_name") != "FlowMatchEulerDiscreteScheduler":
            raise TypeError(f"{self.model} does not use a flow-matching Euler scheduler")
        runner.pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            self.scheduler_config, shift=setting.shift
        )
        return runner

    def judge(
        self,
        setting: Setting,
        goals: list[world.Goal],
        guidance: float,
        seed: int,
        layout: bool = False,
    ) -> tuple[list[bool], float]:
        """Whether each goal's image passes the checker, and seconds per image. With
        ``layout``, each object of a goal is drawn in its own region."""
        runner = self.runner(setting)
        requests = [
            GenerationRequest(g.text, seed=seed + i, width=world.IMAGE_SIZE,
                              height=world.IMAGE_SIZE, steps=setting.steps, guidance=guidance,
                              model=self.model, regions=layout_of(g.objects) if layout else ())
            for i, g in enumerate(goals)
        ]  # fmt: skip
        start = time.perf_counter()
        results = runner.generate(requests)
        seconds = (time.perf_counter() - start) / len(goals)
        ok = [checker.check(r.image, g.objects).all_ok for r, g in zip(results, goals, strict=True)]
        return ok, seconds


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep, print a table, then one JSON line."""
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--goals", type=int, default=100, help="held-out goals per kind")
    ap.add_argument("--objects", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    ap.add_argument(
        "--configs",
        type=Setting.parse,
        nargs="+",
        default=None,
        help="steps:shift:cfg_truncation ... (default: the sweep above)",
    )
    ap.add_argument(
        "--reference",
        type=Setting.parse,
        default=None,
        help="configuration the others are compared with (default: the model's "
        "shipped steps and shift, truncation 1)",
    )
    ap.add_argument("--guidance", type=float, default=None, help="default: the model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument(
        "--layout",
        action="store_true",
        help="draw two-object goals as layouts, each object in its own region (as "
        "the search reviser plans them)",
    )
    ap.add_argument("--quick", action="store_true", help="8 goals per kind, 5 configurations")
    ap.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="minutes after which no further configuration is started",
    )
    args = ap.parse_args(argv)  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    defaults = model_defaults(args.model)
    guidance = float(args.guidance if args.guidance is not None else defaults["guidance"])
    sweep = Sweep(args.model, EngineConfig(device=args.device, max_batch=args.max_batch))
    shipped_shift = float(sweep.scheduler_config["shift"])
    reference = args.reference or Setting(int(defaults["steps"]), shipped_shift, 1.0)
    n_goals = 8 if args.quick else args.goals
    settings = [Setting(*c) for c in QUICK_SWEEP] if args.quick else None
    settings = args.configs or settings or [Setting(*c) for c in DEFAULT_SWEEP]
    settings = [reference] + [s for s in dict.fromkeys(settings) if s != reference]
    goals = {k: world.heldout_goals(n_goals, objects=k, seed=args.seed + k) for k in args.objects}
    rows, passed, start = [], [], time.perf_counter()
    for setting in settings:
        if args.time_limit is not None and time.perf_counter() - start > 60 * args.time_limit:
            print(f"  time limit: {setting.label} and later not run", file=sys.stderr)
            break
        row: dict = {"config": setting.label, "steps": setting.steps, "shift": setting.shift,
                     "cfg_truncation": setting.cfg_truncation, "solver": setting.solver,
                     "passes_per_image": passes_per_image(setting, guidance),
                     "passes_per_layout_image": passes_per_image(setting, guidance, 2),
                     "seconds_per_image": 0.0}  # fmt: skip
        passed.append({})
        for k, kind_goals in goals.items():
            layout = args.layout and k == 2
            ok, seconds = sweep.judge(setting, kind_goals, guidance, args.seed, layout)
            passed[-1][k] = ok
            row[f"acc_{k}"] = sum(ok) / len(ok)
            row["seconds_per_image"] += seconds / len(goals)
        rows.append(row)
        accs = " ".join(f"{k}-obj {row[f'acc_{k}']:.3f}" for k in args.objects)
        print(f"  {setting.label}: {accs}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    for row, ok in zip(rows, passed, strict=True):  # rows[0] is the reference
        for k in args.objects:
            pairs = list(zip(ok[k], passed[0][k], strict=True))
            row[f"delta_{k}"] = row[f"acc_{k}"] - rows[0][f"acc_{k}"]
            row[f"gained_{k}"] = sum(a and not b for a, b in pairs)
            row[f"lost_{k}"] = sum(b and not a for a, b in pairs)
        row["acc_mean"] = sum(row[f"acc_{k}"] for k in args.objects) / len(args.objects)
    _print_table(rows, args.objects, n_goals, args.model, guidance, reference, args.layout)
    figures = {
        "bench": "steps", "model": args.model, "goals_per_kind": n_goals,
        "objects": args.objects, "layout": args.layout, "guidance": guidance, "seed": args.seed,
        "reference": reference.label, "device": args.device, "seconds": round(elapsed, 1),
        "not_run": [s.label for s in settings[len(rows):]],
        "rows": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                 for r in rows],
    }  # fmt: skip
    print(json.dumps(figures))
    return figures


def _print_table(
    rows: list[dict],
    objects: list[int],
    n: int,
    model: str,
    guidance: float,
    ref: Setting,
    layout: bool,
) -> None:
    se = max(math.sqrt(0.25 / n), 1e-9)
    print(f"\nChecker accuracy (all attributes and count right), {n} held-out goals per kind, "
          f"model {model}, guidance {guidance:g}, reference {ref.label} "
          f"(binomial s.e. at most {100 * se:.1f} points per kind)\n")  # fmt: skip
    head = f"{'steps:shift:trunc':<18}{'passes':>7}"
    for k in objects:
        head += f"{f'{k}-obj' + ('L' if layout and k == 2 else ''):>8}{'Δ':>7}{'+/-':>8}"
    head += f"{'mean':>8}{'s/img':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        line = f"{r['config']:<18}{r['passes_per_image']:>7}"
        for k in objects:
            flips = f"+{r[f'gained_{k}']}/-{r[f'lost_{k}']}"
            line += f"{100 * r[f'acc_{k}']:>8.1f}{100 * r[f'delta_{k}']:>+7.1f}{flips:>8}"
        line += f"{100 * r['acc_mean']:>8.1f}{r['seconds_per_image']:>8.3f}"
        print(line)
    if layout:
        print(
            "\n2-objL: two-object goals drawn as layouts, one region per object "
            "(passes_per_layout_image in the JSON).",
            end="",
        )
    print(
        "\npasses: transformer rows per plain image; Δ: points against the reference; +/-: goals "
        "that pass here and fail in the reference / the other way round (same noise)."
    )


if __name__ == "__main__":
    main()
