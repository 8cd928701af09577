"""A throwaway agentloop cluster for fault-injection tests.

Real processes, started the way docker-compose starts them (`agentloop db upgrade`, the API,
a control worker, a generation worker on a threads pool of one, Celery beat), against a
Redis of the test's own (started, flushed, killed and restarted at will) and a database of
its own (a fresh database on the shared PostgreSQL, or a throwaway PostgreSQL server that
can be crashed). Every process runs in its own process group, so a kill takes its children
with it. `Cluster.check_invariants()` is what every fault test ends with.

The shared PostgreSQL and Redis servers are never touched, only a database created on the
shared PostgreSQL for the test.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
HOST = socket.gethostname()
PG_BIN = Path("/usr/lib/postgresql/15/bin")

TERMINAL_GOAL = frozenset({"done", "failed", "cancelled"})
TERMINAL_CANDIDATE = frozenset({"succeeded", "failed", "cancelled"})
MAX_ATTEMPTS = 3

FAST_SETTINGS = {
    # Short enough that every recovery path takes seconds, not minutes.
    "AGENTLOOP_LEASE_SECONDS": "4",
    "AGENTLOOP_SWEEP_INTERVAL_SECONDS": "1",
    "AGENTLOOP_OUTBOX_GRACE_SECONDS": "1",
    "AGENTLOOP_REDISPATCH_AFTER_SECONDS": "5",
    "AGENTLOOP_STALL_AFTER_SECONDS": "3",
    "AGENTLOOP_DB_CONNECT_TIMEOUT": "2",
    "AGENTLOOP_MAX_ATTEMPTS": str(MAX_ATTEMPTS),
    # Workers killed and restarted every few seconds would each compile the denoiser again
    # (test_distributed runs the shipped default, compiling workers).
    "AGENTLOOP_ENGINE_COMPILE": "off",
    # Short, so that a worker stopped by mistake under any fault shows (check_invariants).
    "AGENTLOOP_WORKER_WATCHDOG_SECONDS": "10",
}

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll until `predicate()` is truthy and return it; AssertionError naming `what` if not."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - a service may be down while we poll
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}"
                         + (f" (last error: {last_exc!r})" if last_exc else ""))


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"<unreadable: {exc}>"


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL the process group `p` leads (it was started in a session of its own)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


# Redis -------------------------------------------------------------------------------------


class RedisServer:
    """A non-persistent redis-server on a free port: a kill loses every message."""

    def __init__(self, workdir: Path):
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.starts += 1
        log = open(self.dir / "redis.log", "a")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_for(self._pings, 10, f"redis-server on port {self.port}")

    def _pings(self) -> bool:
        return bool(self.client(timeout=0.5).ping())

    def client(self, timeout: float = 5):  # noqa: ANN201 - redis.Redis
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout,
                           socket_connect_timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: everything it held is gone."""
        if self.proc is not None:
            _kill_group(self.proc)
            self.proc = None

    def restart(self) -> None:
        """Kill and start again on the same port, empty."""
        self.kill()
        self.start()

    def flushall(self) -> None:
        self.client().flushall()

    def pause(self, ms: int) -> None:
        """CLIENT PAUSE ALL from a client of our own: every other client's commands hang."""
        self.client().execute_command("CLIENT", "PAUSE", str(ms), "ALL")

    def stop(self) -> None:
        self.kill()


# PostgreSQL --------------------------------------------------------------------------------


class PostgresServer:
    """A throwaway PostgreSQL cluster (trust auth, own port and socket dir) that can crash."""

    def __init__(self) -> None:
        # Not under pytest's tmp_path: the postgres user must be able to reach the folder.
        self.dir = Path(tempfile.mkdtemp(prefix="al-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        shutil.chown(self.dir, "postgres", "postgres")
        self._pg("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")

    def _pg(self, tool: str, *args: str, timeout: float = 60) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(PG_BIN / tool), *args],
                       check=True, timeout=timeout, capture_output=True, cwd=self.dir)

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "postgres.log"),
                 "-o", f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
                 "-w", "start")

    def crash(self) -> None:
        """Stop without a shutdown checkpoint (as a power cut would); start() recovers."""
        self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def create_database(self, name: str = "agentloop") -> str:
        engine = create_engine(self.admin_url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        engine.dispose()
        return self.admin_url.rsplit("/", 1)[0] + f"/{name}"

    def log_tail(self) -> str:
        return _tail(self.dir / "postgres.log")

    def destroy(self) -> None:
        try:
            self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop", timeout=30)
        except subprocess.CalledProcessError:
            pass  # already down
        shutil.rmtree(self.dir, ignore_errors=True)


# the cluster -------------------------------------------------------------------------------


@dataclass
class Proc:
    """One started process: `name` is unique per start (gen1, gen2, ...), `role` is what it is."""

    name: str
    role: str
    popen: subprocess.Popen
    log: Path

    @property
    def celery_name(self) -> str:
        """The Celery node name (`-n`) of a worker, e.g. gen1@host."""
        return f"{self.name}@{HOST}"

    @property
    def worker_label(self) -> str:
        """What the store records as a candidate's worker by default: host:pid."""
        return f"{HOST}:{self.popen.pid}"

    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass
class Cluster:
    """The processes of one test, its broker and its database."""

    db_url: str
    redis: RedisServer
    tmp: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    gen_app: str = "workers.app"
    """The Celery app module generation workers load (a test may inject a fault through one)."""
    procs: dict[str, Proc] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)
    """Processes the test killed (the others must stay up through any fault)."""

    def __post_init__(self) -> None:
        self.logs = self.tmp / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.artifacts = self.tmp / "artifacts"
        self.api_port = free_port()
        self.base = f"http://127.0.0.1:{self.api_port}"
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            "PYTHONUNBUFFERED": "1",
            # One torch thread per process: on a small shared machine two threads per worker
            # oversubscribe the cores and a batch runs 10-30x slower (measured).
            "OMP_NUM_THREADS": "1",
            "AGENTLOOP_DATABASE_URL": self.db_url,
            "AGENTLOOP_BROKER_URL": self.redis.url,
            "AGENTLOOP_DATA_DIR": str(self.tmp / "data"),
            "AGENTLOOP_ARTIFACTS_DIR": str(self.artifacts),
            **FAST_SETTINGS,
            **self.extra_env,
        }
        self.http = httpx.Client(base_url=self.base, timeout=10)
        self._db: Engine | None = None

    # processes -------------------------------------------------------------------------

    def upgrade(self) -> None:
        """`agentloop db upgrade`, before anything else."""
        subprocess.run([str(BIN / "agentloop"), "db", "upgrade"], env=self.env, check=True,
                       timeout=120, cwd=self.tmp, capture_output=True)

    def _command(self, role: str, name: str) -> list[str]:
        celery = str(BIN / "celery")
        commands = {
            "api": [str(BIN / "agentloop"), "serve", "--port", str(self.api_port)],
            "control": [celery, "-A", "workers.app", "worker", "-Q", "control", "-c", "2",
                        "-n", f"{name}@%h", "--loglevel", "INFO"],
            "gen": [celery, "-A", self.gen_app, "worker", "-Q", "gen.tiny-dit",
                    "--pool", "threads", "-c", "1", "-n", f"{name}@%h", "--loglevel", "INFO"],
            "beat": [celery, "-A", "workers.app", "beat", "-s", str(self.tmp / f"{name}-schedule"),
                     "--pidfile", str(self.tmp / f"{name}.pid"), "--loglevel", "INFO"],
        }
        return commands[role]

    def start(self, role: str, wait: bool = True) -> Proc:
        """Start a fresh process of `role` (api, control, gen, beat) under a new name."""
        self.counters[role] = self.counters.get(role, 0) + 1
        name = f"{role}{self.counters[role]}"
        log = self.logs / f"{name}.log"
        popen = subprocess.Popen(
            self._command(role, name), env=self.env, cwd=self.tmp, stdout=open(log, "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        proc = Proc(name, role, popen, log)
        self.procs[name] = proc
        if wait:
            self.wait_ready(proc)
        return proc

    def wait_ready(self, proc: Proc, timeout: float = 120) -> None:
        """API: /healthz answers 200. Worker: it logged `ready.`. Beat: it logged `Starting`."""
        def ready() -> bool:
            if not proc.alive():
                raise AssertionError(f"{proc.name} exited:\n{_tail(proc.log)}")
            if proc.role == "api":
                return self.http.get("/healthz", timeout=2).status_code == 200
            marker = "beat: Starting" if proc.role == "beat" else "ready."
            return marker in proc.log.read_text(errors="replace")

        wait_for(ready, timeout, f"{proc.name} to be ready", interval=0.3)

    def current(self, role: str) -> Proc:
        """The most recently started live process of `role`."""
        live = [p for p in self.procs.values() if p.role == role and p.alive()]
        assert live, f"no live {role} process"
        return live[-1]

    def kill(self, name_or_role: str) -> Proc:
        """SIGKILL a process group, by name (gen1) or the current one of a role (gen)."""
        proc = self.procs.get(name_or_role) or self.current(name_or_role)
        self.killed.add(proc.name)
        _kill_group(proc.popen)
        return proc

    def exited(self) -> dict[str, int | None]:
        """Processes that exited on their own (not killed by the test), with their exit codes:
        a fault must cost a worker a reconnect, never its life."""
        return {name: p.popen.returncode for name, p in self.procs.items()
                if name not in self.killed and not p.alive()}

    def freeze_pool(self, name_or_role: str) -> list[int]:
        """SIGSTOP a worker's pool processes (not its main process, which keeps reserving
        messages and handing them to the frozen pool): a message it takes now stays in hand,
        unacknowledged, until the worker is killed. Returns the frozen pids."""
        proc = self.procs.get(name_or_role) or self.current(name_or_role)
        pids: list[int] = []
        deadline = time.monotonic() + 60  # a worker started moments ago may not have forked yet
        while not pids and time.monotonic() < deadline:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.popen.pid)],
                                 capture_output=True, text=True).stdout
            pids = [int(pid) for pid in out.split()]
            if not pids:
                time.sleep(0.2)
        assert pids, f"{proc.name} has no pool processes after 60 s"
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def freeze(self, name_or_role: str) -> Proc:
        """SIGSTOP a whole process group: alive, holding its claims and sockets, doing nothing."""
        proc = self.procs.get(name_or_role) or self.current(name_or_role)
        os.killpg(proc.popen.pid, signal.SIGSTOP)
        return proc

    def thaw(self, name: str) -> None:
        """SIGCONT a frozen process group."""
        os.killpg(self.procs[name].popen.pid, signal.SIGCONT)

    def restart(self, role: str, wait: bool = True) -> Proc:
        """SIGKILL the current process of `role` and start a new one at once."""
        self.kill(role)
        return self.start(role, wait=wait)

    def start_all(self) -> None:
        """The docker-compose set: beat, control, gen and the API, started side by side."""
        procs = [self.start(role, wait=False) for role in ("control", "gen", "beat", "api")]
        for proc in procs:
            self.wait_ready(proc)

    def close(self) -> None:
        """Kill every process; print the log tails (pytest shows them for failed tests)."""
        for proc in self.procs.values():
            _kill_group(proc.popen)
        self.http.close()
        if self._db is not None:
            self._db.dispose()
        print(self.log_tails())

    def log_tails(self, chars: int = 3000) -> str:
        out = [f"--- {name} log (tail) ---\n{_tail(p.log, chars)}" for name, p in self.procs.items()]
        out.append(f"--- redis log (tail) ---\n{_tail(self.redis.dir / 'redis.log', 1000)}")
        return "\n".join(out)

    def celery(self):  # noqa: ANN201 - celery.Celery
        """A bare Celery app on the test broker, to send tasks and control commands."""
        from celery import Celery

        return Celery("faults", broker=self.redis.url)

    # HTTP ------------------------------------------------------------------------------

    def create_goal(self, timeout: float = 10, **overrides: Any) -> str:
        body = {"goal": "a red circle", "budget": 8, "fanout": 4, "model": "tiny-dit",
                "scorer": "tiny-clip", "steps": 2, **overrides}
        r = self.http.post("/v1/goals", json=body, timeout=timeout)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def goal(self, goal_id: str) -> dict[str, Any]:
        r = self.http.get(f"/v1/goals/{goal_id}")
        r.raise_for_status()
        return r.json()

    def candidates(self, goal_id: str) -> list[dict[str, Any]]:
        r = self.http.get(f"/v1/goals/{goal_id}/candidates")
        r.raise_for_status()
        return r.json()

    def wait_goals_ended(self, goal_ids: Iterable[str], timeout: float) -> dict[str, str]:
        """Wait (reading the database) until every goal is done, failed or cancelled."""
        ids = list(goal_ids)
        last: dict[str, str] = {}

        def ended() -> bool:
            last.update(self.goal_statuses(ids))
            return all(last.get(g) in TERMINAL_GOAL for g in ids)

        try:
            wait_for(ended, timeout, "every goal to end", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; goal statuses: {last}; candidates: "
                                 f"{self.candidate_summary(ids)}; processes that exited on "
                                 f"their own: {self.exited()}") from None
        return last

    # the database ----------------------------------------------------------------------

    @property
    def db(self) -> Engine:
        if self._db is None:
            self._db = create_engine(self.db_url, poolclass=NullPool,
                                     connect_args={"connect_timeout": 3})
        return self._db

    def rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        with self.db.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(text(sql), params)]

    def goal_statuses(self, ids: list[str]) -> dict[str, str]:
        rows = self.rows("SELECT id, status FROM goals")
        return {r["id"]: r["status"] for r in rows if r["id"] in ids}

    def candidate_rows(self, goal_id: str | None = None) -> list[dict[str, Any]]:
        sql = "SELECT * FROM candidates" + (" WHERE goal_id = :g" if goal_id else "")
        return self.rows(sql + " ORDER BY goal_id, iteration, ordinal", g=goal_id)

    def candidate_summary(self, goal_ids: list[str]) -> dict[str, str]:
        summary: dict[str, str] = {}
        for c in self.candidate_rows():
            if c["goal_id"] in goal_ids:
                key = f"{c['status']}/a{c['attempts']}"
                summary.setdefault(c["goal_id"][:8], "")
                summary[c["goal_id"][:8]] += key + " "
        return summary

    def check_invariants(self, settle: float = 15) -> None:
        """What must hold after any fault, for every goal in the database:

        every goal ended (done, failed or cancelled) and no candidate of it is still queued
        or running (allowed `settle` seconds: a cancelled goal's running batch may finish);
        generations_reserved <= budget and equals its candidate rows; no duplicate
        (goal, iteration, ordinal); attempts <= max_attempts; each succeeded candidate has
        its artifact file and exactly one file of its own; no other file in the goal's folder;
        and no process exited on its own (a fault costs a worker a reconnect, not its life).
        """
        def settled() -> bool:
            goals = self.rows("SELECT id, status FROM goals")
            unfinished = self.rows("SELECT goal_id FROM candidates WHERE status IN ('queued', 'running')")
            return all(g["status"] in TERMINAL_GOAL for g in goals) and not unfinished

        try:
            wait_for(settled, settle, "every goal and candidate to end", interval=0.5)
        except AssertionError:
            pass  # reported in detail below
        problems: list[str] = []
        goals = self.rows("SELECT id, status, budget, generations_reserved FROM goals")
        cands = self.candidate_rows()
        for g in goals:
            gid, mine = g["id"], [c for c in cands if c["goal_id"] == g["id"]]
            if g["status"] not in TERMINAL_GOAL:
                problems.append(f"goal {gid} is {g['status']}, not ended")
            if g["generations_reserved"] > g["budget"]:
                problems.append(f"goal {gid} reserved {g['generations_reserved']} > budget {g['budget']}")
            if g["generations_reserved"] != len(mine):
                problems.append(f"goal {gid} reserved {g['generations_reserved']} but has {len(mine)} candidates")
            keys = [(c["iteration"], c["ordinal"]) for c in mine]
            if len(keys) != len(set(keys)):
                problems.append(f"goal {gid} has duplicate (iteration, ordinal): {sorted(keys)}")
            problems += self._artifact_problems(gid, mine)
        for c in cands:
            if c["status"] not in TERMINAL_CANDIDATE:
                problems.append(f"candidate {c['id']} of goal {c['goal_id']} is {c['status']}")
            if c["attempts"] > MAX_ATTEMPTS:
                problems.append(f"candidate {c['id']} took {c['attempts']} attempts > {MAX_ATTEMPTS}")
        for name, code in self.exited().items():
            problems.append(f"{name} exited on its own (code {code}):\n{_tail(self.procs[name].log, 1500)}")
        assert not problems, "invariants violated:\n  " + "\n  ".join(problems)

    def _artifact_problems(self, goal_id: str, cands: list[dict[str, Any]]) -> list[str]:
        folder = self.artifacts / goal_id
        files = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
        problems, expected = [], set()
        for c in cands:
            if c["status"] != "succeeded":
                continue
            uri = c["artifact_uri"] or ""
            name = uri.rsplit("/", 1)[-1]
            expected.add(name)
            if not uri.startswith(f"{goal_id}/") or name not in files:
                problems.append(f"succeeded candidate {c['id']} has no artifact file ({uri!r})")
            own = [f for f in files if f.startswith(c["id"])]
            if len(own) != 1:
                problems.append(f"candidate {c['id']} has {len(own)} artifact files: {sorted(own)}")
        stray = sorted(files - expected)
        if stray:
            problems.append(f"goal {goal_id} has stray artifact files: {stray}")
        return problems

