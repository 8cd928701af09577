"""The queue under a burst: many goals from concurrent HTTP clients through the API and real
Celery workers, with the no-op engine, so what is measured is the queue and not the model.

    python bench/queue.py --goals 200 --fanout 16 --clients 16

It starts, as subprocesses on this machine and against a fresh PostgreSQL database and a
private Redis: `agentloop db upgrade`, `agentloop serve`, control workers, generation workers
(`--pool threads -c 1`) and, when `workers.app` has a beat schedule, `celery beat`, all with
AGENTLOOP_ENGINE_NOOP=1 (workers skip denoising and CLIP: a flat image, a hashed score). After
one warm-up goal it fires the burst, waits until every goal ends (bounded), reads the goals
and candidates back through the API, and reports:

- goals/s and candidates/s, from the first submit to the last goal's end;
- p50/p95/p99 submit-to-first-candidate and submit-to-done (client submit time to the
  database's finished_at; one machine, one clock);
- HTTP 5xx and transport errors, goals lost (accepted but not ended by the deadline);
- orchestration overhead per candidate: the CPU seconds the service spent during the burst
  (API, control and generation workers, beat, this database's PostgreSQL backends, the
  private Redis; not this load generator) minus the engine and scorer seconds recorded in the
  candidates' timings, divided by the candidates; beside it the wall seconds per candidate
  (1 / candidates per second). Both against the shapes model's seconds per image, measured
  by this run after the burst (a batch at the model's default steps, after a warm-up, on one
  torch thread): CPU against CPU, wall against wall.

The best set-up on a 2-core machine (docs/benchmarks.md) was
`--control-pool threads --control-concurrency 2 --gen-workers 2 --generation-batch 16`.

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python bench/queue.py` puts bench/ first on sys.path, where this file would shadow the
# standard library's `queue` (imported by httpx, Celery, concurrent.futures)
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PG_ADMIN_URL = os.environ.get(
    "AGENTLOOP_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
TERMINAL = {"done", "failed", "cancelled"}
GOALS_PER_TENANT = 500
"""`GET /v1/goals` returns at most 500 goals, so each 500 goals of a burst get a tenant."""
TARGET_CANDIDATES_PER_S = 200.0
TARGET_OVERHEAD_SHARE = 0.05
"""Targets: 200 candidates/s through the queue; overhead under 5% of a shapes generation."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _epoch(stamp: str | None) -> float | None:
    """A timestamp from the API (naive ISO, UTC) as seconds since the epoch."""
    if stamp is None:
        return None
    t = datetime.fromisoformat(stamp)
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp()


# --- CPU accounting from /proc -------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def _proc_stat(pid: int) -> tuple[int, float] | None:
    """(session id, CPU seconds incl. reaped children) of a live process, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    session = int(fields[3])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return session, (utime + stime + cutime + cstime) / _TICK


def _cpu_by_session(sessions: dict[int, str]) -> dict[str, float]:
    """CPU seconds so far of every process in the given sessions, summed by their names."""
    out = dict.fromkeys(sessions.values(), 0.0)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _proc_stat(int(entry.name))
            if stat is not None and stat[0] in sessions:
                out[sessions[stat[0]]] += stat[1]
    return out


def _cpu_of(pids: set[int]) -> dict[int, float]:
    return {pid: stat[1] for pid in pids if (stat := _proc_stat(pid)) is not None}


# --- the cluster ---------------------------------------------------------------------------


@dataclass
class ClusterConfig:
    """What to start: counts, pools and settings of the service processes."""

    control_workers: int = 1
    control_concurrency: int = 2
    control_pool: str = "prefork"
    gen_workers: int = 1
    model: str = "tiny-dit"
    generation_batch: int | None = None
    beat: str = "auto"  # auto: start `celery beat` when workers.app has a schedule
    redis_url: str | None = None  # None: a private redis-server on a free port
    pg_options: str | None = None  # PGOPTIONS for the service's connections (a diagnostic)
    noop: bool = True  # the no-op engine (False: the real models, as bench/coalesce.py uses)
    extra_env: dict[str, str] = field(default_factory=dict)  # more settings for every process


@dataclass
class Cluster:
    """Running service processes, their logs, and how to reach them."""

    base_url: str
    db_url: str
    broker_url: str
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    beat: bool = False

    def sessions(self) -> dict[int, str]:
        """Session id (each process leads its own) -> group name (api, control, gen, ...)."""
        return {p.pid: name.rstrip("0123456789") for name, p in self.procs.items()}

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text()[-3000:]
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{tail}")


def _create_database(admin_url: str) -> str:
    from sqlalchemy import create_engine, text

    name = f"agentloop_bench_{uuid.uuid4().hex[:12]}"
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


def _drop_database(admin_url: str, url: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)'))
    engine.dispose()


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM every process group, then SIGKILL what is left after 15 s."""
    for p in procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # stragglers of the group (prefork children)
        p.wait()


def _has_beat_schedule(env: dict[str, str]) -> bool:
    code = "from workers.app import app; print(len(app.conf.beat_schedule or {}))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    return out.returncode == 0 and out.stdout.strip().splitlines()[-1:] != ["0"]


@contextlib.contextmanager
def cluster(cfg: ClusterConfig, workdir: Path, admin_url: str = PG_ADMIN_URL) -> Iterator[Cluster]:
    """Start the service on a fresh database and broker; stop it and drop the database after."""
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    db_url = _create_database(admin_url)
    try:
        broker = cfg.redis_url
        if broker is None:
            redis_port = _free_port()
            procs["redis"] = _spawn(
                ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no"],
                dict(os.environ), logs / "redis.log",
            )  # fmt: skip
            broker = f"redis://127.0.0.1:{redis_port}/0"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1",
            "AGENTLOOP_DATABASE_URL": db_url,
            "AGENTLOOP_BROKER_URL": broker,
            "AGENTLOOP_DATA_DIR": str(workdir / "data"),
            "AGENTLOOP_ARTIFACTS_DIR": str(workdir / "artifacts"),
            **({"AGENTLOOP_ENGINE_NOOP": "1"} if cfg.noop else {}),
            **cfg.extra_env,
        }
        if cfg.generation_batch is not None:
            env["AGENTLOOP_GENERATION_BATCH"] = str(cfg.generation_batch)
        if cfg.pg_options is not None:
            env["PGOPTIONS"] = cfg.pg_options
        subprocess.run(
            [str(BIN / "agentloop"), "db", "upgrade"], env=env, check=True, timeout=120,
            capture_output=True,
        )  # fmt: skip
        port = _free_port()
        celery = [str(BIN / "celery"), "-A", "workers.app"]
        procs["api"] = _spawn(
            [str(BIN / "agentloop"), "serve", "--port", str(port)], env, logs / "api.log"
        )
        for i in range(cfg.control_workers):
            procs[f"control{i}"] = _spawn(
                celery + ["worker", "-Q", "control", "--pool", cfg.control_pool,
                          "-c", str(cfg.control_concurrency), "-n", f"control{i}@%h"],
                env, logs / f"control{i}.log",
            )  # fmt: skip
        for i in range(cfg.gen_workers):
            procs[f"gen{i}"] = _spawn(
                celery + ["worker", "-Q", f"gen.{cfg.model}", "--pool", "threads", "-c", "1",
                          "-n", f"gen{i}@%h"],
                env, logs / f"gen{i}.log",
            )  # fmt: skip
        beat = cfg.beat == "on" or (cfg.beat == "auto" and _has_beat_schedule(env))
        if beat:
            procs["beat"] = _spawn(
                celery + ["beat", "-s", str(workdir / "beat-schedule")], env, logs / "beat.log"
            )
        c = Cluster(f"http://127.0.0.1:{port}", db_url, broker, logs, procs, beat)
        _wait_ready(c, cfg.control_workers + cfg.gen_workers)
        yield c
    finally:
        _stop(procs)
        _drop_database(admin_url, db_url)


def _wait_ready(c: Cluster, workers: int, timeout: float = 180.0) -> None:
    """Until the API answers /healthz and every worker answers a broadcast ping."""
    from celery import Celery

    probe = Celery("bench-probe", broker=c.broker_url)
    deadline = time.monotonic() + timeout
    healthy, replied = False, 0
    try:
        while time.monotonic() < deadline:
            c.check_alive()
            if not healthy:
                with contextlib.suppress(httpx.HTTPError):
                    healthy = httpx.get(f"{c.base_url}/healthz", timeout=2).status_code == 200
            replied = len(probe.control.ping(timeout=1.0) or [])
            if healthy and replied >= workers:
                return
            time.sleep(0.5)
    finally:
        probe.close()
    raise RuntimeError(f"not ready after {timeout:.0f} s: api healthy={healthy}, "
                       f"{replied}/{workers} workers answered")  # fmt: skip


def _pg_backends(conn: Any, db_name: str) -> set[int]:
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
        (db_name,),
    ).fetchall()
    return {int(r[0]) for r in rows}


# --- the burst -----------------------------------------------------------------------------


@dataclass
class Submission:
    """One POST /v1/goals as the client saw it."""

    index: int
    submitted: float  # time.time() just before the request
    latency: float = 0.0
    status: int | None = None  # None: transport error
    goal_id: str | None = None
    error: str | None = None


def _goal_body(i: int, args: argparse.Namespace) -> dict[str, Any]:
    colours = ("red", "blue", "green", "gold", "purple")
    shapes = ("circle", "square", "ring", "triangle")
    return {
        "goal": f"a {colours[i % 5]} {shapes[i // 5 % 4]} number {i}",
        "budget": args.fanout, "fanout": args.fanout, "model": args.model,
        "scorer": "tiny-clip", "steps": 1, "size": args.size, "seed": i,
        "tenant": f"bench-{i // GOALS_PER_TENANT}",
    }  # fmt: skip


def _fire(base_url: str, args: argparse.Namespace) -> list[Submission]:
    """Every goal, posted by `args.clients` threads as fast as each gets its answers."""
    subs: list[Submission] = []
    lock = threading.Lock()
    start = threading.Barrier(args.clients)

    def client(k: int) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as http:
            start.wait()
            for i in range(k, args.goals, args.clients):
                sub = Submission(i, time.time())
                t0 = time.perf_counter()
                try:
                    r = http.post("/v1/goals", json=_goal_body(i, args))
                    sub.status = r.status_code
                    if r.status_code == 201:
                        sub.goal_id = r.json()["id"]
                    else:
                        sub.error = r.text[:300]
                except httpx.HTTPError as exc:
                    sub.error = f"{type(exc).__name__}: {exc}"
                sub.latency = time.perf_counter() - t0
                with lock:
                    subs.append(sub)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(subs, key=lambda s: s.index)


def _wait_all_ended(
    http: httpx.Client, tenants: list[str], expected: set[str], timeout: float
) -> tuple[dict[str, dict[str, Any]], int]:
    """Poll until no goal of the burst is unfinished (asking only for one unfinished goal per
    tenant, so the bench's own polling costs the API next to nothing) or the deadline passes;
    then read every goal once. Returns the last view of each goal and the 5xx answers seen."""
    errors_5xx = 0
    deadline = time.monotonic() + timeout
    unfinished = {"tenant": "", "limit": 1, "status": ["pending", "running", "waiting"]}
    while time.monotonic() < deadline:
        busy = False
        for tenant in tenants:
            r = http.get("/v1/goals", params={**unfinished, "tenant": tenant})
            if r.status_code >= 500:
                errors_5xx += 1
                busy = True
                continue
            busy = busy or bool(r.json())
        if not busy:
            break
        time.sleep(0.5)
    goals: dict[str, dict[str, Any]] = {}
    for tenant in tenants:
        r = http.get("/v1/goals", params={"tenant": tenant, "limit": GOALS_PER_TENANT})
        if r.status_code >= 500:
            errors_5xx += 1
            continue
        goals.update({g["id"]: g for g in r.json() if g["id"] in expected})
    return goals, errors_5xx


def _warm_up(base_url: str, args: argparse.Namespace) -> None:
    """One goal through every process first: lazy imports, pools and connections."""
    with httpx.Client(base_url=base_url, timeout=60) as http:
        body = _goal_body(0, args) | {"goal": "a warm-up circle", "tenant": "warm-up"}
        r = http.post("/v1/goals", json=body)
        r.raise_for_status()
        goal_id = r.json()["id"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if http.get(f"/v1/goals/{goal_id}").json()["status"] in TERMINAL:
                return
            time.sleep(0.2)
    raise RuntimeError("the warm-up goal did not end within 120 s")


def run_burst(c: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, fire the burst, wait for it, and compute the queue's figures."""
    import psycopg

    _warm_up(c.base_url, args)
    db_name = c.db_url.rsplit("/", 1)[1]
    dsn = c.db_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(dsn, autocommit=True) as pg:
        backends = _pg_backends(pg, db_name)
        cpu0, pg0 = _cpu_by_session(c.sessions()), _cpu_of(backends)
        subs = _fire(c.base_url, args)
        accepted = {s.goal_id for s in subs if s.goal_id}
        tenants = sorted({f"bench-{i // GOALS_PER_TENANT}" for i in range(args.goals)})
        with httpx.Client(base_url=c.base_url, timeout=60) as http:
            goals, poll_5xx = _wait_all_ended(http, tenants, accepted, args.timeout)
            backends |= _pg_backends(pg, db_name)
            cpu1, pg1 = _cpu_by_session(c.sessions()), _cpu_of(backends)
            cands = {g: http.get(f"/v1/goals/{g}/candidates").json() for g in sorted(accepted)}
    cpu = {name: cpu1.get(name, 0.0) - cpu0.get(name, 0.0) for name in cpu1}
    cpu["postgres"] = sum(pg1[p] - pg0.get(p, 0.0) for p in pg1)
    return _figures(args, c, subs, goals, cands, cpu, poll_5xx)


def _engine_seconds(timings: dict[str, float]) -> float:
    """The engine and scorer seconds a candidate's timings record (its share of the batch)."""
    batch = timings.get("generate_batch_s")
    gen = batch / max(timings.get("batch_size", 1.0), 1.0) if batch is not None else (
        timings.get("encode_s", 0.0) + timings.get("denoise_s", 0.0))  # fmt: skip
    return gen + timings.get("score_s", 0.0)


def _figures(
    args: argparse.Namespace, c: Cluster, subs: list[Submission],
    goals: dict[str, dict[str, Any]], cands: dict[str, list[dict[str, Any]]],
    cpu: dict[str, float], poll_5xx: int,
) -> dict[str, Any]:  # fmt: skip
    by_id = {s.goal_id: s for s in subs if s.goal_id}
    ended = {g: v for g, v in goals.items() if v["status"] in TERMINAL}
    done = [c_ for g in ended for c_ in cands.get(g, []) if c_["status"] == "succeeded"]
    first_cand, to_done = [], []
    for g, view in ended.items():
        finished = [_epoch(x["finished_at"]) for x in cands.get(g, []) if x["finished_at"]]
        if finished:
            first_cand.append(min(f for f in finished if f is not None) - by_id[g].submitted)
        to_done.append((_epoch(view["finished_at"]) or 0.0) - by_id[g].submitted)
    t_first = min(s.submitted for s in subs)
    t_last = max((_epoch(v["finished_at"]) or 0.0) for v in ended.values()) if ended else t_first
    wall = max(t_last - t_first, 1e-9)
    engine_s = sum(_engine_seconds(x["timings"]) for x in done)
    service_cpu = sum(cpu.values())
    n = max(len(done), 1)
    overhead_cpu = (service_cpu - engine_s) / n
    ms = lambda xs, q: None if (v := _percentile(xs, q)) is None else round(1000 * v, 1)  # noqa: E731
    return {
        "goals": args.goals, "fanout": args.fanout, "clients": args.clients,
        "control_workers": args.control_workers, "control_concurrency": args.control_concurrency,
        "control_pool": args.control_pool, "gen_workers": args.gen_workers,
        "generation_batch": args.generation_batch, "beat": c.beat,
        "pg_options": args.pg_options,
        "accepted": len(by_id), "ended": len(ended),
        "done": sum(v["status"] == "done" for v in ended.values()),
        "lost_goals": len(by_id) - len(ended),
        "http_5xx": sum(1 for s in subs if s.status and s.status >= 500) + poll_5xx,
        "http_4xx": sum(1 for s in subs if s.status and 400 <= s.status < 500),
        "transport_errors": sum(1 for s in subs if s.status is None),
        "candidates": len(done),
        "candidates_failed": sum(1 for g in ended for x in cands.get(g, []) if x["status"] == "failed"),
        "wall_s": round(wall, 3),
        "goals_per_s": round(len(ended) / wall, 2),
        "candidates_per_s": round(len(done) / wall, 1),
        "post_ms_p50": ms([s.latency for s in subs], 0.5),
        "post_ms_p99": ms([s.latency for s in subs], 0.99),
        "first_candidate_ms_p50": ms(first_cand, 0.5),
        "first_candidate_ms_p95": ms(first_cand, 0.95),
        "first_candidate_ms_p99": ms(first_cand, 0.99),
        "done_ms_p50": ms(to_done, 0.5), "done_ms_p95": ms(to_done, 0.95),
        "done_ms_p99": ms(to_done, 0.99),
        "cpu_s": {k: round(v, 2) for k, v in sorted(cpu.items())},
        "engine_s": round(engine_s, 3),
        "overhead_cpu_ms_per_candidate": round(1000 * overhead_cpu, 2),
        "wall_ms_per_candidate": round(1000 * wall / n, 2),
    }  # fmt: skip


# --- the shapes model, for scale -----------------------------------------------------------


def shapes_seconds_per_image(n: int, threads: int = 1) -> tuple[float, float] | None:
    """Wall and CPU seconds per image of the real `shapes` runner on ``threads`` torch threads:
    a batch of ``n`` at its default steps, guidance and size, after a warm-up batch of two.
    None when its weights are absent.

    One thread by default: on a CPU shared with other work, two OpenMP threads spin against
    each other and the wall time swings by tens of times; one thread's time is steady."""
    import torch

    from engine.catalog import is_known_model
    from engine.defaults import model_defaults
    from engine.types import GenerationRequest
    from workers.residency import Residency

    if not is_known_model("shapes"):
        return None
    d = model_defaults("shapes")
    requests = [
        GenerationRequest(f"a red circle number {i}", seed=i, width=d["size"], height=d["size"],
                          steps=d["steps"], guidance=d["guidance"], model="shapes")
        for i in range(n)
    ]  # fmt: skip
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = Residency().runner("shapes")
        runner.generate(requests[:2])
        wall, cpu = time.perf_counter(), time.process_time()
        runner.generate(requests)
        return (time.perf_counter() - wall) / n, (time.process_time() - cpu) / n
    finally:
        torch.set_num_threads(before)


# --- the report ----------------------------------------------------------------------------


def _table(f: dict[str, Any]) -> str:
    rows = [
        ("goals accepted / ended / lost", f"{f['accepted']} / {f['ended']} / {f['lost_goals']}"),
        ("HTTP 5xx / 4xx / transport errors",
         f"{f['http_5xx']} / {f['http_4xx']} / {f['transport_errors']}"),
        ("candidates succeeded / failed", f"{f['candidates']} / {f['candidates_failed']}"),
        ("wall (first submit to last done)", f"{f['wall_s']:.2f} s"),
        ("goals/s", f"{f['goals_per_s']:.2f}"),
        ("candidates/s", f"{f['candidates_per_s']:.1f} (target >= {TARGET_CANDIDATES_PER_S:.0f})"),
        ("POST /v1/goals p50 / p99", f"{f['post_ms_p50']} / {f['post_ms_p99']} ms"),
        ("submit -> first candidate p50/p95/p99",
         f"{f['first_candidate_ms_p50']} / {f['first_candidate_ms_p95']} / "
         f"{f['first_candidate_ms_p99']} ms"),
        ("submit -> done p50/p95/p99",
         f"{f['done_ms_p50']} / {f['done_ms_p95']} / {f['done_ms_p99']} ms"),
        ("service CPU by process", ", ".join(f"{k} {v:.1f} s" for k, v in f["cpu_s"].items())),
        ("engine + scorer (candidate timings)", f"{f['engine_s']:.3f} s"),
        ("overhead CPU per candidate", f"{f['overhead_cpu_ms_per_candidate']:.2f} ms"),
        ("wall per candidate", f"{f['wall_ms_per_candidate']:.2f} ms"),
    ]  # fmt: skip
    if f.get("shapes_s_per_image") is not None:
        rows += [
            ("shapes model, 1 thread, per image",
             f"{f['shapes_s_per_image']:.3f} s wall, {f['shapes_cpu_s_per_image']:.3f} s CPU"),
            ("overhead / shapes generation",
             f"{100 * f['overhead_share_of_shapes']:.1f}% (CPU / CPU; target < "
             f"{100 * TARGET_OVERHEAD_SHARE:.0f}%), {100 * f['wall_share_of_shapes']:.1f}% "
             "(wall / wall)"),
        ]  # fmt: skip
    rows.append(("targets met", f"candidates/s {f['met_candidates_per_s']}, "
                                f"overhead {f['met_overhead']}"))  # fmt: skip
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark and print a table, then one JSON line; return the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--goals", type=int, default=200)
    ap.add_argument("--fanout", type=int, default=16, help="candidates per goal (= its budget)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients")
    ap.add_argument("--control-workers", type=int, default=1)
    ap.add_argument("--control-concurrency", type=int, default=2)
    ap.add_argument("--control-pool", default="prefork", choices=["prefork", "threads", "solo"])
    ap.add_argument("--gen-workers", type=int, default=1, help="each --pool threads -c 1")
    ap.add_argument("--generation-batch", type=int, default=None,
                    help="AGENTLOOP_GENERATION_BATCH for the service (default: the settings')")
    ap.add_argument("--model", default="tiny-dit", help="model name (no weights load: no-op)")
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--beat", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--redis-url", default=None, help="default: a private redis-server")
    ap.add_argument("--pg-options", default=None,
                    help="PGOPTIONS for the service, a diagnostic only: e.g. "
                         "'-c synchronous_commit=off' shows what the commits' flushes cost")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the goals to end")
    ap.add_argument("--shapes-n", type=int, default=16, help="shapes images timed (0: skip)")
    ap.add_argument("--quick", action="store_true", help="4 goals x 4, 4 clients, 2 shapes images")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.goals, args.fanout, args.clients, args.shapes_n = 4, 4, 4, min(args.shapes_n, 2)
    args.clients = max(1, min(args.clients, args.goals))
    cfg = ClusterConfig(
        control_workers=args.control_workers, control_concurrency=args.control_concurrency,
        control_pool=args.control_pool, gen_workers=args.gen_workers, model=args.model,
        generation_batch=args.generation_batch, beat=args.beat, redis_url=args.redis_url,
        pg_options=args.pg_options,
    )  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix="agentloop-queue-bench-"))
    try:
        with cluster(cfg, workdir) as c:
            figures = run_burst(c, args)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    shapes = shapes_seconds_per_image(args.shapes_n) if args.shapes_n > 0 else None
    figures["shapes_s_per_image"] = None if shapes is None else round(shapes[0], 4)
    figures["shapes_cpu_s_per_image"] = None if shapes is None else round(shapes[1], 4)
    if shapes:
        figures["overhead_share_of_shapes"] = round(
            figures["overhead_cpu_ms_per_candidate"] / 1000 / shapes[1], 4)  # fmt: skip
        figures["wall_share_of_shapes"] = round(
            figures["wall_ms_per_candidate"] / 1000 / shapes[0], 4)  # fmt: skip
    figures["met_candidates_per_s"] = figures["candidates_per_s"] >= TARGET_CANDIDATES_PER_S
    figures["met_overhead"] = (
        None if not shapes else figures["overhead_share_of_shapes"] < TARGET_OVERHEAD_SHARE
    )
    print(_table(figures))
    line = json.dumps(figures)
    if args.json_out is not None:
        args.json_out.write_text(line + "\n")
    print(line)
    return figures


if __name__ == "__main__":
    main()
