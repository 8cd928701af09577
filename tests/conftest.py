"""Shared fixtures: SQLite and real PostgreSQL databases migrated by Alembic, settings."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

PG_ADMIN_URL = os.environ.get("AGENTLOOP_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
REDIS_URL = os.environ.get("AGENTLOOP_TEST_REDIS", "redis://127.0.0.1:6379/0")


def _pg_available() -> bool:
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(PG_ADMIN_URL)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def pg_server() -> str:
    """The admin URL of this machine's PostgreSQL (CI starts it; a test fails loudly without)."""
    if not _pg_available():
        pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN_URL}; start it (see .ci/run)")
    return PG_ADMIN_URL


def create_pg_database(admin_url: str) -> str:
    """A new, empty database; returns its URL."""
    from sqlalchemy import create_engine, text

    name = f"agentloop_test_{uuid.uuid4().hex[:12]}"
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return admin_url.rsplit("/", 1)[0] + f"/{name}"


def drop_pg_database(admin_url: str, url: str) -> None:
    from sqlalchemy import create_engine, text

    name = url.rsplit("/", 1)[1]
    engine = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


@pytest.fixture
def pg_empty_url(pg_server: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database (no schema)."""
    url = create_pg_database(pg_server)
    yield url
    drop_pg_database(pg_server, url)


@pytest.fixture
def pg_url(pg_empty_url: str) -> str:
    """A fresh PostgreSQL database at the migrations' head."""
    from agentloop.migrate import upgrade

    upgrade(pg_empty_url)
    return pg_empty_url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh SQLite database at the migrations' head."""
    from agentloop.migrate import upgrade

    url = f"sqlite:///{tmp_path / 'agentloop.db'}"
    upgrade(url)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Each backend in turn, migrated to head."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def settings(tmp_path: Path):  # noqa: ANN201
    """Settings for an embedded run in a temporary data folder, with the tiny offline presets."""
    from agentloop.settings import Settings

    return Settings(
        data_dir=tmp_path / "data", default_model="tiny-dit", default_scorer="tiny-clip",
        broker_url=None, database_url=None,
    )
