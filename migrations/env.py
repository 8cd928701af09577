"""Alembic environment: the URL from agentloop's Settings, the metadata from the ORM."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from agentloop.settings import Settings
from agentloop.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    # A URL set on the Config (tests, `agentloop db` with an explicit store) wins.
    return config.get_main_option("sqlalchemy.url") or Settings().resolved_database_url()


def run_migrations_offline() -> None:
    context.configure(
        url=_url(), target_metadata=target_metadata, literal_binds=True, compare_type=True,
        render_as_batch=_url().startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = _url()
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection, target_metadata=target_metadata, compare_type=True,
            render_as_batch=url.startswith("sqlite"),
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
