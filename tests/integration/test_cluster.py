"""The fault-injection harness itself: its throwaway servers start, lose their data, crash
and come back; its processes start and die; a goal completes through it."""

from __future__ import annotations

import time

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from tests.integration.cluster import Cluster, PostgresServer, RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(60)
def test_throwaway_redis_flushes_and_loses_everything_on_restart(redis_server: RedisServer) -> None:
    r = redis_server.client()
    r.set("k", "v")
    redis_server.flushall()
    assert r.get("k") is None
    r.set("k", "v")
    port = redis_server.port
    redis_server.restart()
    assert redis_server.port == port and redis_server.starts == 2
    assert redis_server.client().get("k") is None  # nothing persisted


@pytest.mark.timeout(60)
def test_throwaway_redis_pause_blocks_other_clients(redis_server: RedisServer) -> None:
    redis_server.pause(1500)
    t0 = time.monotonic()
    assert redis_server.client(timeout=5).get("k") is None
    assert time.monotonic() - t0 > 1.0


@pytest.mark.timeout(120)
def test_throwaway_postgres_crashes_and_recovers(postgres_server: PostgresServer) -> None:
    url = postgres_server.create_database("harness")
    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": 2})
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (x int)"))
        conn.execute(text("INSERT INTO t VALUES (1)"))
    postgres_server.crash()
    with pytest.raises(OperationalError):
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    postgres_server.start()
    with engine.connect() as conn:  # committed rows survive the crash
        assert conn.execute(text("SELECT x FROM t")).scalar() == 1
    engine.dispose()


@pytest.mark.timeout(240)
def test_a_goal_completes_through_the_harness_and_processes_die_on_kill(cluster: Cluster) -> None:
    t0 = time.monotonic()
    goal_id = cluster.create_goal(budget=8, fanout=4, steps=2)
    statuses = cluster.wait_goals_ended([goal_id], timeout=90)
    print(f"goal ended in {time.monotonic() - t0:.1f}s: {statuses}")
    assert statuses[goal_id] == "done"
    cluster.check_invariants()
    assert cluster.goal(goal_id)["generations_reserved"] == 8
    # beat's sweeps run on the control worker every second: /healthz sees them (a loaded
    # machine may delay one past three intervals, so look for a while)
    deadline = time.monotonic() + 30
    while (health := cluster.http.get("/healthz").json())["sweep"] != "ok":
        assert time.monotonic() < deadline, health
        time.sleep(0.5)
    assert health["status"] == "ok" and health["sweep_last"], health
    # with beat dead no sweep runs: after three intervals /healthz says so; a new beat mends it
    cluster.kill("beat")
    deadline = time.monotonic() + 30
    while (health := cluster.http.get("/healthz")).json()["sweep"] != "stale":
        assert time.monotonic() < deadline, health.json()
        time.sleep(0.5)
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    cluster.start("beat")
    deadline = time.monotonic() + 60
    while cluster.http.get("/healthz").json()["sweep"] != "ok":
        assert time.monotonic() < deadline
        time.sleep(0.5)

    api = cluster.kill("api")
    assert not api.alive()
    with pytest.raises(httpx.TransportError):
        cluster.http.get("/healthz", timeout=2)
    new_api = cluster.start("api")
    assert new_api.name == "api2" and cluster.goal(goal_id)["status"] == "done"

    gen = cluster.current("gen")
    replies = cluster.celery().control.ping(destination=[gen.celery_name], timeout=3)
    assert any(gen.celery_name in reply for reply in replies), replies
    cluster.kill(gen.name)
    assert cluster.celery().control.ping(destination=[gen.celery_name], timeout=1) == []
