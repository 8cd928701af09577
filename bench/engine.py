"""The optimized engine against vanilla diffusers and diffusers' own step caches, one process.

Every row generates the same images: one per held-out goal of the shapes world
(``world.heldout_goals``, one-object, canonical text), noise seed = goal index, the model's
default steps, guidance (true CFG against the empty prompt) and size.

- ``vanilla``: ``FluxPipeline.from_pretrained(folder)`` called with the list of prompts and
  one generator per request, as a user would (in chunks of ``--batch``).
- ``diffusers <cache>``: the same pipeline with ``transformer.enable_cache(...)``:
  FirstBlockCache at a few thresholds, TaylorSeer, MagCache (the model's calibration,
  ``magcache.json``). ``diffusers best`` names the fastest whose checker accuracy is within
  2 points of vanilla's.
- ``bf16 vanilla``, ``bf16 diffusers <cache>`` (``--vanilla-bf16``): the same, loaded with
  ``torch_dtype=torch.bfloat16``: references beside the targets, which stay against the
  default load (float32, as ``from_pretrained`` gives it).
- ``runner ...``: the engine's runner (``max_batch = --batch``) with every switch off (float32
  included), each switch alone, and all of them together (``ALL``). Rows are ``EngineConfig`` keyword
  arguments (``SWITCHES``); a switch this build's EngineConfig does not have is reported as
  missing and its row skipped, so the table grows as switches land. ``runner, worker
  defaults`` is what a Celery worker runs by default: the engine's defaults plus regional
  compilation (``AGENTLOOP_ENGINE_COMPILE=auto``); its warm-up pays the compile.

Columns: images/s (median over ``--repeats`` interleaved rounds) and its ratio to vanilla;
transformer calls per image and the share of block work done (rows entering the blocks'
attention, against vanilla); PSNR against vanilla's images (mean of per-image PSNR, identical
images counted as 100 dB); checker accuracy ("all" attributes right); mean CLIPScore
(``shapes-clip``, 2.5 * max(cos, 0)).

    python bench/engine.py            # 200 goals, 3 rounds
    python bench/engine.py --quick    # 24 goals, 1 round (under 5 minutes)

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, where this file would stand
# in for the ``engine`` package (and bench/queue.py for the standard library's ``queue``).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field, fields, replace  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.catalog import resolve_model  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.defaults import model_defaults  # noqa: E402
from engine.runner import Runner  # noqa: E402
from engine.scorer import Scorer  # noqa: E402
from engine.shapes import checker, world  # noqa: E402
from engine.step_cache import _blocks, load_mag_ratios, magcache_path  # noqa: E402
from engine.types import GenerationRequest, ScoreRequest  # noqa: E402

OFF: dict[str, Any] = {
    "own_loop": False, "cfg_truncation": 1.0, "text_embedding_cache": False, "step_cache": "none",
    "compile": False, "solver": "euler", "dtype": "float32",
}  # fmt: skip
"""Every switch off: the runner's unoptimized path (fields this build lacks are left out)."""

SWITCHES: dict[str, dict[str, Any]] = {
    "text cache": {"text_embedding_cache": True},
    "own loop": {"own_loop": True},
    "cfg truncation": {"own_loop": True, "cfg_truncation": 0.75},
    "step cache": {"step_cache": "agentloop"},
    "compile": {"compile": True},
    "solver": {"own_loop": True, "solver": "dpm++2m"},
    "bfloat16": {"dtype": "bfloat16"},
}
"""One row per switch (EngineConfig kwargs on top of OFF); add a line for a new switch."""

ALL: dict[str, Any] = {
    k: v
    for name, kwargs in SWITCHES.items()
    if name not in ("compile", "solver")
    for k, v in kwargs.items()
}
"""Every switch on together, but compilation (its own row and the worker defaults row have
it: a step cache's per-step decisions would break the compiled graphs, and the row would
not compare with the earlier all-on figures) and the solver (a step rule, not a speed-up: its
row says what it does to accuracy at the same cost)."""

ALL_ON: dict[str, Any] = OFF | ALL

STEPS = "steps"
"""A runner row's own step count (not an EngineConfig field): the ``defaults`` row runs the
model's default steps when ``--steps`` asks the other rows for more (the steps switch)."""

ACCURACY_SLACK = 0.02
"""'Within 2 points': the accuracy a faster row may lose against vanilla."""


@dataclass
class Row:
    """One way of generating the images, and what it measured."""

    name: str
    run: Callable[[int], list[np.ndarray]]
    """Generates the first n images."""
    transformer: torch.nn.Module
    size: int = 0
    """How many images a round makes."""
    seconds: list[float] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)
    calls: int = 0
    work: int = 0


class Meter:
    """Transformer calls and block rows (rows entering each block's attention q projection).

    In compiled blocks a hook would be traced into the graph (and pin the batch size), so
    there every call counts its rows once per block: no cache runs beside compilation in
    these rows, so every block sees every row."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.calls = self.work = 0
        blocks = _blocks(transformer)
        self.compiled = sum(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
        self.blocks = len(blocks)
        transformer.register_forward_pre_hook(self._call, with_kwargs=True)
        if not self.compiled:
            for block in blocks:
                block.attn.to_q.register_forward_pre_hook(self._rows)

    def _call(self, _module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.calls += 1
        if self.compiled:
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            self.work += int(hidden.shape[0]) * self.blocks

    def _rows(self, _module: torch.nn.Module, args: tuple) -> None:
        self.work += int(args[0].shape[0])


def _uint8(images: Any) -> list[np.ndarray]:
    if isinstance(images, np.ndarray):
        return list((np.clip(images, 0, 1) * 255).round().astype(np.uint8))
    return [np.asarray(im.convert("RGB")) for im in images]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 100.0 if mse == 0 else min(100.0, 10 * math.log10(255.0**2 / mse))


def _config(base: EngineConfig, kwargs: dict[str, Any]) -> tuple[EngineConfig, list[str]]:
    """EngineConfig with the kwargs this build knows, and the names it does not know."""
    known = {f.name for f in fields(EngineConfig)}
    missing = [k for k in kwargs if k not in known]
    values = {f.name: getattr(base, f.name) for f in fields(EngineConfig)}
    values.update({k: v for k, v in kwargs.items() if k in known})
    return EngineConfig(**values), missing


BF16 = "bf16 "
"""Name prefix of the reference rows that load vanilla diffusers in bfloat16 (``--vanilla-bf16``)."""


def vanilla_rows(folder: str, prompts: list[str], spec: dict[str, Any], batch: int,
                 caches: dict[str, Any], bf16: bool = False) -> list[Row]:  # fmt: skip
    """Vanilla diffusers, and the same pipeline with each of diffusers' caches (and with
    ``bf16``, all of them again loaded with ``torch_dtype=torch.bfloat16``)."""
    from diffusers import FluxPipeline

    from engine.loading import _quiet_loading

    _quiet_loading()
    rows = []
    kinds = [(name, cache, dtype) for dtype in ([torch.float32, torch.bfloat16] if bf16 else [torch.float32])
             for name, cache in {"vanilla": None, **caches}.items()]  # fmt: skip
    for name, cache, dtype in kinds:
        pipe = FluxPipeline.from_pretrained(folder, torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        if cache is not None:
            pipe.transformer.enable_cache(cache)

        def run(n: int, pipe: Any = pipe) -> list[np.ndarray]:
            out: list[np.ndarray] = []
            for s in range(0, n, batch):
                chunk = prompts[s : min(s + batch, n)]
                out += _uint8(pipe(
                    prompt=chunk, negative_prompt=[""] * len(chunk),
                    true_cfg_scale=spec["guidance"], height=spec["size"], width=spec["size"],
                    num_inference_steps=spec["steps"], max_sequence_length=spec["max_sequence_length"],
                    generator=[torch.Generator().manual_seed(s + i) for i in range(len(chunk))],
                    output_type="np",
                ).images)  # fmt: skip
            return out

        label = (name if cache is None else f"diffusers {name}")
        rows.append(Row(f"{BF16 if dtype == torch.bfloat16 else ''}{label}", run, pipe.transformer, len(prompts)))
    return rows


def runner_rows(model: str, prompts: list[str], spec: dict[str, Any], base: EngineConfig,
                configs: dict[str, dict[str, Any]]) -> tuple[list[Row], list[str]]:  # fmt: skip
    """The runner with each config; configs needing a switch this build lacks are skipped."""
    rows, skipped = [], []
    requests = [
        GenerationRequest(p, seed=i, width=spec["size"], height=spec["size"], steps=spec["steps"],
                          guidance=spec["guidance"], model=model)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    for name, kwargs in configs.items():
        steps = kwargs.get(STEPS)
        kwargs = {k: v for k, v in kwargs.items() if k != STEPS}
        config, missing = _config(base, kwargs)
        lacking = [k for k in missing if k not in OFF or kwargs[k] != OFF[k]]  # switches asked on
        if lacking and kwargs is not ALL_ON:
            skipped.append(f"{name} (EngineConfig has no {', '.join(lacking)})")
            continue
        if lacking:
            skipped.append(f"{name}: without {', '.join(lacking)} (not in this EngineConfig)")
        runner = Runner(model, config)
        mine = requests if steps is None else [replace(r, steps=steps) for r in requests]

        def run(n: int, runner: Runner = runner, mine: list[GenerationRequest] = mine) -> list[np.ndarray]:
            return _uint8([r.image for r in runner.generate(mine[:n])])

        rows.append(Row(name, run, runner.denoiser, len(prompts)))
    return rows, skipped


def diffusers_caches(folder: str, steps: int, magcache_file: str | None = None) -> dict[str, Any]:
    """diffusers' own caches worth trying on this model (MagCache with the calibration in
    ``magcache_file``, default the model folder's ``magcache.json``)."""
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    caches: dict[str, Any] = {
        f"first_block {t}": FirstBlockCacheConfig(threshold=t) for t in (0.05, 0.1, 0.15, 0.2)
    }
    caches["taylorseer 3/4"] = TaylorSeerCacheConfig(
        cache_interval=3, disable_cache_before_step=4, taylor_factors_dtype=torch.float32
    )
    file = Path(magcache_file) if magcache_file else magcache_path(folder)
    if file.is_file():
        ratios = load_mag_ratios(file)
        for t in (0.06, 0.12):
            caches[f"magcache {t}"] = MagCacheConfig(
                threshold=t, max_skip_steps=3, retention_ratio=0.2, num_inference_steps=steps,
                mag_ratios=list(ratios),
            )  # fmt: skip
    return caches


def measure(rows: list[Row], repeats: int, batch: int) -> None:
    """Rounds of every row in turn (interleaved), the first keeping the images and counts."""
    n = rows[0].size
    for row in rows:  # warm-up (first-call allocations, compilation), and the meters
        row.run(min(2, n))
        row.run(min(n, batch))  # a full batch too: a compiled row compiles a second shape
        row.meter = Meter(row.transformer)  # type: ignore[attr-defined]
    for rep in range(repeats):
        for row in rows:
            meter = row.meter  # type: ignore[attr-defined]
            calls, work = meter.calls, meter.work
            start = time.perf_counter()
            images = row.run(n)
            row.seconds.append(time.perf_counter() - start)
            if rep == 0:
                row.images, row.calls, row.work = images, meter.calls - calls, meter.work - work
            print(f"  round {rep + 1} {row.name}: {row.seconds[-1]:.1f} s", flush=True)


def _against_targets(name: str, figures: dict[str, dict[str, Any]], base_acc: float,
                     best: str | None) -> dict[str, Any]:
    """Row ``name`` against the issue's targets: >= 2x vanilla within 2 points of its accuracy,
    and >= 1.25x diffusers' best cache at equal or better accuracy."""
    row = figures[name]
    out: dict[str, Any] = {
        "row": name, "speedup": row["speedup"],
        "accuracy_delta": round(row["accuracy"] - base_acc, 4),
        "met_2x_within_2pts": row["speedup"] >= 2.0 and row["accuracy"] >= base_acc - ACCURACY_SLACK - 1e-9,
    }  # fmt: skip
    if best is not None:
        ratio = row["images_per_s"] / figures[best]["images_per_s"]
        out["vs_diffusers_best"] = round(ratio, 3)
        out["met_1.25x_best_at_equal_accuracy"] = (
            ratio >= 1.25 and row["accuracy"] >= figures[best]["accuracy"] - 1e-9
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the rows, print the table and one JSON line; returns the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--goals", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=25, help="images per pipeline call (both sides)")
    ap.add_argument("--steps", type=int, default=None, help="default: the model's")
    ap.add_argument("--quick", action="store_true", help="24 goals, 1 round, fewer cache rows")
    ap.add_argument("--caches", nargs="*", default=None,
                    help="diffusers cache rows to run, by name (default: all; none: --caches)")
    ap.add_argument("--without", nargs="*", default=[], choices=sorted(SWITCHES),
                    help="leave these switches' own rows out (the all-on row keeps them)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0, help="held-out goal draw")
    ap.add_argument("--vanilla-bf16", action="store_true",
                    help="also vanilla diffusers and its caches loaded in bfloat16 (reference "
                    "rows; the targets stay against the default float32 load)")
    ap.add_argument("--magcache-file", default=None,
                    help="MagCache calibration for the magcache rows (default: the model "
                    "folder's magcache.json; `python -m engine.calibrate_magcache --out`)")
    args = ap.parse_args(argv)
    if args.quick:
        args.goals, args.repeats = min(args.goals, 24), 1
    if args.threads:
        torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model)
    if resolved is None:
        ap.error(f"unknown model {args.model!r}")
    folder = resolved.location
    defaults = model_defaults(args.model)
    spec = {
        "steps": args.steps or int(defaults["steps"]), "guidance": float(defaults["guidance"]),
        "size": int(defaults["size"]), "max_sequence_length": int(defaults.get("max_sequence_length", 32)),
    }  # fmt: skip
    goals = world.heldout_goals(args.goals, objects=1, seed=args.seed)
    prompts = [g.text for g in goals]
    batch = min(args.batch, len(prompts))
    caches = diffusers_caches(folder, spec["steps"], args.magcache_file)
    wanted = args.caches
    if wanted is None and args.quick:
        wanted = ["first_block 0.1", "taylorseer 3/4", "magcache 0.12"]
    if wanted is not None:
        unknown = set(wanted) - set(caches)
        if unknown:
            ap.error(f"unknown cache rows {sorted(unknown)}; known: {sorted(caches)}")
        caches = {k: v for k, v in caches.items() if k in wanted}
    base = EngineConfig(max_batch=batch)
    configs = {"runner (all off)": OFF, **{f"runner + {k}": OFF | v for k, v in SWITCHES.items() if k not in args.without},
               "runner, all on": ALL_ON}  # fmt: skip
    default_steps = int(defaults["steps"])
    if default_steps != spec["steps"]:
        # everything the engine does by default, at the model's default (fewer) steps
        configs[f"runner, defaults ({default_steps} steps)"] = {STEPS: default_steps}
    # what a Celery worker runs by default (AGENTLOOP_ENGINE_COMPILE=auto compiles there)
    configs[f"runner, worker defaults ({default_steps} steps)"] = {STEPS: default_steps, "compile": True}
    start = time.perf_counter()
    rows = vanilla_rows(folder, prompts, spec, batch, caches, bf16=args.vanilla_bf16)
    ours, skipped = runner_rows(args.model, prompts, spec, base, configs)
    rows += ours
    measure(rows, args.repeats, batch)
    scorer = Scorer("shapes-clip")
    from PIL import Image

    vanilla = rows[0]
    figures: dict[str, Any] = {}
    for row in rows:
        ips = len(prompts) / statistics.median(row.seconds)
        clip = scorer.score([Image.fromarray(im) for im in row.images], [ScoreRequest(p) for p in prompts])
        figures[row.name] = {
            "images_per_s": round(ips, 3),
            "calls_per_image": round(row.calls / len(prompts), 2),
            "work": round(row.work / vanilla.work, 3),
            "psnr_db": round(statistics.fmean(_psnr(a, b) for a, b in zip(row.images, vanilla.images, strict=True)), 2),
            "accuracy": round(checker.accuracy(row.images, [g.objects for g in goals])["all"], 4),
            "clip_score": round(statistics.fmean(s.clip_score for s in clip), 4),
            "seconds": [round(s, 2) for s in row.seconds],
        }
    base_ips, base_acc = figures["vanilla"]["images_per_s"], figures["vanilla"]["accuracy"]
    for f in figures.values():
        f["speedup"] = round(f["images_per_s"] / base_ips, 3)
    eligible = [n for n in figures if n.startswith("diffusers ") and figures[n]["accuracy"] >= base_acc - ACCURACY_SLACK - 1e-9]
    best = max(eligible, key=lambda n: figures[n]["images_per_s"], default=None)
    targets: dict[str, Any] = {"diffusers_best": best}
    defaults_row = next((n for n in figures if n.startswith("runner, defaults")), None)
    worker_row = next((n for n in figures if n.startswith("runner, worker defaults")), None)
    bf16_base = figures.get(f"{BF16}vanilla")
    bf16_best = max((n for n in figures if n.startswith(f"{BF16}diffusers ")
                     and bf16_base and figures[n]["accuracy"] >= bf16_base["accuracy"] - ACCURACY_SLACK - 1e-9),
                    key=lambda n: figures[n]["images_per_s"], default=None)  # fmt: skip
    for key, name in (("defaults", defaults_row), ("worker_defaults", worker_row), ("all_on", "runner, all on")):
        if name in figures:
            targets[key] = _against_targets(name, figures, base_acc, best)
            if bf16_base:  # the same rows against diffusers loaded in bfloat16 (reference)
                targets[key]["vs_bf16_vanilla"] = round(figures[name]["images_per_s"] / bf16_base["images_per_s"], 3)
            if bf16_best:
                targets[key]["vs_bf16_diffusers_best"] = round(
                    figures[name]["images_per_s"] / figures[bf16_best]["images_per_s"], 3)

    print(f"\n{args.model}, {len(prompts)} held-out one-object goals, {spec['steps']} steps, "
          f"CFG {spec['guidance']}, {spec['size']}px, batch {batch}, median of {args.repeats} "
          f"round(s), {torch.get_num_threads()} torch threads, device cpu\n")  # fmt: skip
    header = (f"{'row':<36}{'img/s':>8}{'x vanilla':>10}{'calls/img':>10}{'work':>7}"
              f"{'PSNR dB':>9}{'accuracy':>9}{'CLIPScore':>10}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for name, f in figures.items():
        mark = "  <- diffusers best" if name == best else ""
        print(f"{name:<36}{f['images_per_s']:>8.3f}{f['speedup']:>10.2f}{f['calls_per_image']:>10.2f}"
              f"{f['work']:>7.2f}{f['psnr_db']:>9.1f}{f['accuracy']:>9.3f}{f['clip_score']:>10.4f}{mark}")  # fmt: skip
    for note in skipped:
        print(f"skipped: {note}")
    print(f"targets: {json.dumps(targets)}")
    out = {"bench": "engine", "model": args.model, "goals": len(prompts), "repeats": args.repeats,
           "batch": batch, **spec, "seconds": round(time.perf_counter() - start, 1),
           "rows": figures, "skipped": skipped, "targets": targets}  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
