"""Fixtures for the fault-injection tests: a throwaway Redis and a cluster of real processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cluster import Cluster, PostgresServer, RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, non-persistent, on a free port."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own, which the test may crash and start again."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        print(f"--- postgres log (tail) ---\n{server.log_tail()}")
        server.destroy()


def make_cluster(
    db_url: str, redis: RedisServer, tmp: Path, extra_env: dict[str, str] | None = None,
    gen_app: str = "workers.app",
) -> Iterator[Cluster]:
    cluster = Cluster(db_url=db_url, redis=redis, tmp=tmp, extra_env=extra_env or {},
                      gen_app=gen_app)
    try:
        cluster.upgrade()
        cluster.start_all()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def cluster(pg_empty_url: str, redis_server: RedisServer, tmp_path: Path) -> Iterator[Cluster]:
    """API, control worker, generation worker and beat on a fresh database of the shared
    PostgreSQL and this test's own Redis."""
    yield from make_cluster(pg_empty_url, redis_server, tmp_path)


@pytest.fixture
def pg_cluster(postgres_server: PostgresServer, redis_server: RedisServer,
               tmp_path: Path) -> Iterator[Cluster]:
    """The same processes on a throwaway PostgreSQL (`postgres_server`) that may crash."""
    yield from make_cluster(postgres_server.create_database(), redis_server, tmp_path)


@pytest.fixture
def default_cluster(
    pg_empty_url: str, redis_server: RedisServer, tmp_path: Path
) -> Iterator[Cluster]:
    """The same processes with the shipped lease and sweep settings, not the test's short ones:
    what a deployment gets."""
    from agentloop.settings import Settings

    shipped = Settings()
    env = {
        "AGENTLOOP_LEASE_SECONDS": str(shipped.lease_seconds),
        "AGENTLOOP_SWEEP_INTERVAL_SECONDS": str(shipped.sweep_interval_seconds),
        "AGENTLOOP_OUTBOX_GRACE_SECONDS": str(shipped.outbox_grace_seconds),
        "AGENTLOOP_REDISPATCH_AFTER_SECONDS": str(shipped.redispatch_after_seconds),
        "AGENTLOOP_STALL_AFTER_SECONDS": str(shipped.stall_after_seconds),
    }
    yield from make_cluster(pg_empty_url, redis_server, tmp_path, env)
