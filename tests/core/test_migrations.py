"""The schema exists only through Alembic: up, down to base, up again; no drift from the ORM."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect

from agentloop import migrate


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _round_trip(url: str) -> None:
    assert _tables(url) == set()
    migrate.upgrade(url)
    assert _tables(url) == {
        "goals", "iterations", "candidates", "idempotency_keys", "events", "webhooks",
        "webhook_deliveries", "heartbeats",
    }
    assert migrate.current(url) == migrate.head()
    migrate.check(url)  # raises if the ORM and the migrations disagree
    migrate.downgrade(url, "base")
    assert _tables(url) == set()
    assert migrate.current(url) is None
    migrate.upgrade(url)
    assert _tables(url) == {
        "goals", "iterations", "candidates", "idempotency_keys", "events", "webhooks",
        "webhook_deliveries", "heartbeats",
    }
    migrate.check(url)


def test_round_trip_on_empty_postgresql(pg_empty_url: str) -> None:
    _round_trip(pg_empty_url)


def test_round_trip_on_sqlite(tmp_path) -> None:  # noqa: ANN001
    _round_trip(f"sqlite:///{tmp_path / 'fresh.db'}")


def test_create_all_is_not_used_outside_orm_tests() -> None:
    """Application code never creates the schema itself."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = [
        str(p.relative_to(root))
        for pkg in ("agentloop", "workers", "engine", "migrations")
        for p in (root / pkg).rglob("*.py")
        if "create_all(" in p.read_text()
    ]
    assert offenders == []
