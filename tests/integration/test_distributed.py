"""Distributed mode, same code: the API and two real Celery worker processes against this
machine's PostgreSQL and Redis complete a goal through HTTP, and the rows tell the story."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentloop.sdk import Client
from agentloop.store import Store
from tests.conftest import REDIS_URL

pytestmark = [pytest.mark.integration, pytest.mark.slow]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _redis_db_url() -> str:
    import redis

    url = REDIS_URL.rsplit("/", 1)[0] + "/7"  # a database of our own on the shared server
    try:
        redis.Redis.from_url(url).flushdb()
    except redis.ConnectionError:
        pytest.fail(f"Redis is not reachable at {url}; start it (see .ci/run)")
    return url


@pytest.fixture
def cluster(pg_empty_url: str, tmp_path: Path) -> Iterator[tuple[str, str, dict[str, str]]]:
    env = {
        **os.environ,
        "AGENTLOOP_DATABASE_URL": pg_empty_url,
        "AGENTLOOP_BROKER_URL": _redis_db_url(),
        "AGENTLOOP_DATA_DIR": str(tmp_path / "data"),
        "AGENTLOOP_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
        "PYTHONUNBUFFERED": "1",
    }
    subprocess.run([str(BIN / "agentloop"), "db", "upgrade"], env=env, check=True, timeout=120)
    port = _free_port()
    logs = tmp_path / "logs"
    logs.mkdir()
    commands = {
        "api": [str(BIN / "agentloop"), "serve", "--port", str(port)],
        "control": [str(BIN / "celery"), "-A", "workers.app", "worker", "-Q", "control",
                    "-c", "1", "-n", "control@%h", "--loglevel", "INFO"],
        "gen": [str(BIN / "celery"), "-A", "workers.app", "worker", "-Q", "gen.tiny-dit",
                "--pool", "threads", "-c", "1", "-n", "gen@%h", "--loglevel", "INFO"],
    }
    procs = {
        name: subprocess.Popen(cmd, env=env, stdout=open(logs / f"{name}.log", "w"),
                               stderr=subprocess.STDOUT, start_new_session=True)
        for name, cmd in commands.items()
    }
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, procs, logs)
        yield base, pg_empty_url, {n: str(p.pid) for n, p in procs.items()}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for name in procs:
            print(f"--- {name} log (tail) ---\n" + (logs / f"{name}.log").read_text()[-3000:])


def _wait_healthy(base: str, procs: dict[str, subprocess.Popen], logs: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited: {(logs / f'{name}.log').read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the API did not become healthy")


LAYOUT = [["a red circle on the left", 0.25, 0.5], ["a blue square on the right", 0.75, 0.5]]


def test_goal_completes_through_http_and_rows_tell_the_story(cluster) -> None:  # noqa: ANN001
    base, db_url, pids = cluster
    body = {"goal": "a red circle on the left and a blue square on the right", "budget": 6,
            "fanout": 3, "model": "tiny-dit", "scorer": "tiny-clip", "steps": 2, "seed": 3}
    created = httpx.post(f"{base}/v1/goals", json=body, timeout=30)
    assert created.status_code == 201, created.text
    goal_id = created.json()["id"]
    # the API's event stream, followed live while the workers (other processes) write events
    streamed: list = []
    follower = threading.Thread(
        target=lambda: streamed.extend(Client(base, timeout=60).events(goal_id)), daemon=True
    )
    follower.start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        goal = httpx.get(f"{base}/v1/goals/{goal_id}", timeout=10).json()
        if goal["status"] in ("done", "failed"):
            break
        time.sleep(1)
    assert goal["status"] == "done", goal
    assert goal["stop_reason"] == "budget_spent" and goal["generations_reserved"] == 6
    assert goal["best_candidate"] is not None and len(goal["iterations"]) == 2

    cands = httpx.get(f"{base}/v1/goals/{goal_id}/candidates", timeout=10).json()
    png = httpx.get(base + cands[0]["artifact_url"], timeout=10)
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"

    store = Store(db_url)
    try:
        state = store.get_state(goal_id)
    finally:
        store.dispose()
    assert state.goal.generations_reserved == len(state.candidates) == 6
    assert [it.status.value for it in state.iterations] == ["closed", "closed"]
    for c in state.candidates:
        assert c.status.value == "succeeded" and c.attempts == 1
        assert c.prompt and c.seed >= 0
        # both parts name their place: the search reviser draws every candidate from the layout
        assert c.params == {"model": "tiny-dit", "scorer": "tiny-clip", "width": 32, "height": 32,
                            "steps": 2, "guidance": 1.0, "regions": LAYOUT}
        assert c.timings["regions"] == 2.0
        assert c.worker is not None and c.worker.endswith(":" + pids["gen"])  # the gen process
        assert c.timings["generate_batch_s"] > 0 and c.timings["score_s"] > 0
        assert 0.0 <= c.clip_score <= 2.5 and len(c.part_scores) == 2
        assert c.artifact_uri and c.queued_at <= c.started_at <= c.finished_at
    assert state.goal.best_candidate_id in {c.id for c in state.candidates}

    follower.join(30)
    assert not follower.is_alive() and streamed[-1].type == "goal.finished"
    assert streamed[-1].data["status"] == "done" and streamed[0].type == "goal.created"
    succeeded = [e.data["candidate_id"] for e in streamed if e.type == "candidate.succeeded"]
    assert sorted(succeeded) == sorted(c.id for c in state.candidates)
    assert [e.id for e in streamed] == sorted({e.id for e in streamed})
