"""Running the Alembic migrations from code (`agentloop db ...`, the embedded store)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


def alembic_config(url: str) -> Config:
    """An Alembic Config for the project's migrations against `url`."""
    cfg = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("version_locations", str(MIGRATIONS_DIR / "versions"))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


def check(url: str) -> None:
    """Raise if the ORM and the migrations disagree (alembic check)."""
    command.check(alembic_config(url))


def current(url: str) -> str | None:
    """The revision the database is at, or None for an empty database."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str | None:
    """The newest revision of the migrations."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
