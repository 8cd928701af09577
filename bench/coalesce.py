"""Batching across goals: candidates per second of ONE generation worker with concurrent goals,
coalescing on against off, with a real model.

    python bench/coalesce.py --goals 8 --fanout 4 --budget 8 --steps 4 --repeats 2

For each mode (off, on, off, on, ... `--repeats` times each, alternating so that drift on a
shared machine hits both alike) it starts the service as `bench/queue.py` does (a fresh
PostgreSQL database, a private Redis, the API, a control worker, ONE generation worker on
`--pool threads -c 1`, beat) with the real `shapes` model and `shapes-clip` scorer (tiny-dit
and tiny-clip when the shapes weights are absent), `AGENTLOOP_GEN_COALESCE` set to the mode.
After two warm-up goals (the model loads; a compiling worker, `--compile`, compiles),
`--goals` clients post one goal each at once
(`--fanout` candidates per iteration, `--budget` candidates in all), and it waits for every
goal to end. It reports, per mode:

- candidates per second, from the first submit to the last candidate finished;
- engine calls (distinct batches recorded in the candidates' timings) and rows per call;
- engine seconds per candidate (each call's wall time over its rows);
- submit-to-done p50 / max.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _queue_bench() -> ModuleType:
    """bench/queue.py (its cluster), loaded by path: `bench` is not a package."""
    spec = importlib.util.spec_from_file_location("bench_queue", ROOT / "bench" / "queue.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


Q = _queue_bench()
COLOURS = ("red", "blue", "green", "gold", "purple", "orange", "pink", "grey")
SHAPES = ("circle", "square", "triangle", "ring")


def _models() -> tuple[str, str]:
    from engine.catalog import is_known_model

    return ("shapes", "shapes-clip") if is_known_model("shapes") else ("tiny-dit", "tiny-clip")


def _body(i: int, args: argparse.Namespace, tenant: str) -> dict[str, Any]:
    return {
        "goal": f"a {COLOURS[i % len(COLOURS)]} {SHAPES[i // len(COLOURS) % len(SHAPES)]}",
        "budget": args.budget, "fanout": args.fanout, "model": args.model,
        "scorer": args.scorer, "steps": args.steps, "size": args.size, "seed": i,
        "tenant": tenant,
    }  # fmt: skip


def _wait_ended(http: httpx.Client, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + timeout
    goals: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        goals = {g: http.get(f"/v1/goals/{g}").json() for g in ids}
        if all(v["status"] in Q.TERMINAL for v in goals.values()):
            return goals
        time.sleep(0.25)
    raise RuntimeError(f"goals not ended after {timeout:.0f} s: "
                       f"{sorted(v['status'] for v in goals.values())}")


def run_mode(coalesce: bool, args: argparse.Namespace) -> dict[str, Any]:
    """One cluster with coalescing on or off: warm up, fire the goals, measure."""
    env = {
        "AGENTLOOP_GEN_COALESCE": "1" if coalesce else "0",
        "AGENTLOOP_GEN_MAX_WAIT_MS": str(args.max_wait_ms),
        "AGENTLOOP_GEN_MAX_BATCH": str(args.max_batch),
        # one torch thread per process: steady figures on a shared CPU (bench/queue.py)
        "OMP_NUM_THREADS": str(args.threads),
        "AGENTLOOP_ENGINE_COMPILE": args.compile,
    }
    cfg = Q.ClusterConfig(gen_workers=1, model=args.model, noop=False, extra_env=env,
                          control_pool="threads", control_concurrency=2)
    workdir = Path(tempfile.mkdtemp(prefix="agentloop-coalesce-bench-"))
    try:
        with Q.cluster(cfg, workdir) as c, httpx.Client(base_url=c.base_url, timeout=60) as http:
            # the model loads; a compiling worker compiles two batch sizes (then dynamo has
            # marked the batch dimension dynamic and compiles no more)
            for fanout in (args.fanout, args.fanout + 2):
                body = _body(0, args, "warm-up") | {"budget": fanout, "fanout": fanout}
                warm = http.post("/v1/goals", json=body)
                warm.raise_for_status()
                _wait_ended(http, [warm.json()["id"]], args.timeout)
            start = threading.Barrier(args.goals)
            submitted: dict[int, tuple[float, str]] = {}

            def client(i: int) -> None:
                with httpx.Client(base_url=c.base_url, timeout=60) as h:
                    start.wait()
                    t = time.time()
                    r = h.post("/v1/goals", json=_body(i, args, "bench"))
                    r.raise_for_status()
                    submitted[i] = (t, r.json()["id"])

            threads = [threading.Thread(target=client, args=(i,)) for i in range(args.goals)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            ids = [submitted[i][1] for i in range(args.goals)]
            goals = _wait_ended(http, ids, args.timeout)
            cands = [x for g in ids for x in http.get(f"/v1/goals/{g}/candidates").json()]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    done = [x for x in cands if x["status"] == "succeeded"]
    t0 = min(t for t, _ in submitted.values())
    t1 = max(Q._epoch(x["finished_at"]) for x in done)
    calls: dict[tuple[str, float], int] = {}
    for x in done:
        key = (x["worker"], x["timings"]["generate_batch_s"])
        calls[key] = calls.get(key, 0) + 1
    to_done = [Q._epoch(goals[g]["finished_at"]) - t for t, g in submitted.values()]
    wall = t1 - t0
    return {
        "coalesce": coalesce, "candidates": len(done),
        "failed": sum(x["status"] == "failed" for x in cands),
        "goals_done": sum(v["status"] == "done" for v in goals.values()),
        "wall_s": round(wall, 3), "candidates_per_s": round(len(done) / wall, 3),
        "engine_calls": len(calls),
        "rows_per_call": round(len(done) / max(len(calls), 1), 2),
        "max_rows_per_call": max(calls.values(), default=0),
        "engine_s_per_candidate": round(sum(k[1] for k in calls) / max(len(done), 1), 4),
        "done_s_p50": round(statistics.median(to_done), 3), "done_s_max": round(max(to_done), 3),
    }  # fmt: skip


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return round(statistics.fmean(r[key] for r in runs), 4)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--goals", type=int, default=8, help="concurrent goals (one client each)")
    ap.add_argument("--fanout", type=int, default=4, help="candidates per iteration")
    ap.add_argument("--budget", type=int, default=8, help="candidates per goal")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=64, help="AGENTLOOP_GEN_MAX_BATCH")
    ap.add_argument("--max-wait-ms", type=float, default=50.0, help="AGENTLOOP_GEN_MAX_WAIT_MS")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating")
    ap.add_argument("--model", default=None, help="default: shapes (tiny-dit if absent)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="AGENTLOOP_ENGINE_COMPILE (auto: a worker compiles)")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    model, scorer = _models()
    args.model = args.model or model
    args.scorer = scorer if args.model == model else "tiny-clip"

    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        for coalesce in (False, True):
            runs.append(run_mode(coalesce, args))
            print(f"coalesce {'on ' if coalesce else 'off'}: {json.dumps(runs[-1])}", flush=True)
    off = [r for r in runs if not r["coalesce"]]
    on = [r for r in runs if r["coalesce"]]
    keys = ("candidates_per_s", "engine_calls", "rows_per_call", "engine_s_per_candidate",
            "done_s_p50", "done_s_max", "wall_s")
    summary = {"off": {k: _mean(off, k) for k in keys}, "on": {k: _mean(on, k) for k in keys}}
    speedup = summary["on"]["candidates_per_s"] / summary["off"]["candidates_per_s"]
    figures = {
        "model": args.model, "scorer": args.scorer, "goals": args.goals, "fanout": args.fanout,
        "budget": args.budget, "steps": args.steps, "size": args.size,
        "max_batch": args.max_batch, "max_wait_ms": args.max_wait_ms, "threads": args.threads,
        "compile": args.compile,
        "repeats": args.repeats, **summary, "speedup": round(speedup, 3), "runs": runs,
        "all_candidates_succeeded": all(r["failed"] == 0 and
                                        r["candidates"] == args.goals * args.budget for r in runs),
    }  # fmt: skip
    rows = [("", "coalescing off", "coalescing on")]
    labels = {"candidates_per_s": "candidates/s", "engine_calls": "engine calls",
              "rows_per_call": "rows per call", "engine_s_per_candidate": "engine s / candidate",
              "done_s_p50": "submit -> done p50 (s)", "done_s_max": "submit -> done max (s)",
              "wall_s": "wall (s)"}
    rows += [(labels[k], f"{summary['off'][k]:g}", f"{summary['on'][k]:g}") for k in keys]
    rows.append(("speed-up (candidates/s)", "1", f"{speedup:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{args.goals} goals x {args.budget} candidates (fanout {args.fanout}), {args.model} "
          f"{args.steps} steps {args.size}px, one generation worker (compile {args.compile}), "
          f"{args.repeats} run(s) each")
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)))
    line = json.dumps(figures)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line)
    return figures


if __name__ == "__main__":
    main()
