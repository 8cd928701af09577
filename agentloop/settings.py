"""One pydantic-settings `Settings`, read from AGENTLOOP_* environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Configuration for every agentloop process (API, workers, CLI)."""

    model_config = SettingsConfigDict(env_prefix="AGENTLOOP_", extra="ignore")

    data_dir: Path = Field(default=Path("agentloop-data"))
    """Folder for the embedded SQLite database and, unless `artifacts_dir` is set, the images."""

    database_url: str | None = None
    """SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db. Unset: SQLite in `data_dir`."""

    broker_url: str | None = None
    """Celery broker (redis://...). Unset: the in-process dispatcher runs tasks in threads."""

    artifacts_dir: Path | None = None
    """Where workers write images and the API serves them from. Default: `data_dir`/artifacts."""

    default_model: str = "shapes"
    """Model used when a goal names none (falls back to tiny-dit if the shapes weights are absent)."""

    default_scorer: str = "shapes-clip"
    """Scorer used when a goal names none (falls back to tiny-clip if absent)."""

    extra_models: list[str] = Field(default_factory=list)
    """Hub ids or paths an operator makes available besides the presets (JSON list in the env)."""

    max_budget: int = 1024
    """Largest budget (generations) one goal may ask for."""

    max_fanout: int = 64
    """Largest number of candidates per iteration."""

    max_goal_chars: int = 1000
    """Longest goal text accepted."""

    max_size: int = 1024
    """Largest image side in pixels."""

    max_steps: int = 200
    """Most denoising steps a goal may ask for."""

    max_attempts: int = 3
    """Attempts per candidate before it is marked failed."""

    lease_seconds: float = 900.0
    """A running candidate whose worker has been silent this long may be claimed again."""

    redispatch_after_seconds: float = 600.0
    """A queued candidate older than this is dispatched again by the orchestrator."""

    visibility_timeout: int = 3600
    """Redis visibility timeout (s); must exceed the longest generation task."""

    generation_batch: int = 8
    """Most candidates in one generation task (they run as one batch on the worker)."""

    worker_name: str | None = None
    """Name recorded on candidates; default hostname:pid."""

    def resolved_database_url(self) -> str:
        """The database URL, defaulting to SQLite inside `data_dir`."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'agentloop.db').resolve()}"

    def resolved_artifacts_dir(self) -> Path:
        """The folder holding generated images."""
        return (self.artifacts_dir or self.data_dir / "artifacts").resolve()

    @property
    def embedded(self) -> bool:
        """True when no broker is configured: tasks run in this process."""
        return not self.broker_url


@lru_cache
def get_settings() -> Settings:
    """Settings from the environment, read once per process."""
    return Settings()
