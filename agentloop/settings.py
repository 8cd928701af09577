"""One pydantic-settings `Settings`, read from AGENTLOOP_* environment variables."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, model_validator
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

    lease_seconds: float = 30.0
    """How long a claim on a running candidate lasts without renewal (database clock). The
    generation worker renews it every third of this while it works; once it expires the
    orchestrator takes the candidate back (requeued, or failed on its last attempt)."""

    sweep_interval_seconds: float = 10.0
    """How often the reconciler sweeps for lost work (Celery beat distributed, a thread of
    the runtime embedded). A lost message costs at most about one interval."""

    outbox_grace_seconds: float = 5.0
    """A queued candidate whose message was never marked sent this long after it was queued
    (a crash between commit and send) is sent by the sweep."""

    redispatch_after_seconds: float = 60.0
    """A queued candidate sent this long ago and still not claimed is sent again by the sweep,
    even while its queue holds other messages (with an empty queue: after the outbox grace)."""

    stall_after_seconds: float = 10.0
    """A pending or running goal with nothing unfinished, and no change nor any candidate
    finished for this long (its next orchestrator message lost), is advanced by the sweep."""

    visibility_timeout: int = 3600
    """Redis visibility timeout (s); must exceed `lease_seconds` (checked at start-up)."""

    db_connect_timeout: int = 5
    """Seconds to wait for a PostgreSQL connection before answering 503 / retrying a task."""

    engine_noop: bool = False
    """Reserved for `bench/queue.py`: workers skip denoising and CLIP (a flat image, a score
    derived from the prompt), so the queue itself is what is measured. Never for real goals."""

    generation_batch: int = 16
    """Most candidates in one generation task (they run as one batch on the worker)."""

    worker_name: str | None = None
    """Name recorded on candidates; default hostname:pid."""

    max_body_bytes: int = 1024 * 1024
    """Largest request body the API reads (413 above it). 1 MiB holds any goal and an
    iteration of a few hundred prompts (the largest iteration the schema allows, 256 prompts
    with 8 regions and every text at its longest, does not fit: 413)."""

    max_init_image_bytes: int = 512 * 1024
    """Largest image a goal may start from (`init_image`, decoded; 413 above it). Its base64
    in a JSON body must also fit `max_body_bytes`."""

    max_init_image_side: int = 2048
    """Widest or tallest image a goal may start from, in pixels (422 above it); it is resized
    to the goal's size anyway."""

    mcp_allowed_hosts: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:*", "localhost:*", "[::1]:*", "testserver"]
    )
    """Host headers the MCP endpoint (/mcp) accepts, `host:port` patterns (DNS-rebinding
    protection): this machine by default; add the server's public name when agents reach it
    from elsewhere, or `["*"]` to accept any (JSON list in the env)."""

    idempotency_retention_seconds: float = 24 * 3600
    """How long an `Idempotency-Key` answers with its first response; an older key is
    forgotten (a request with it runs again)."""

    events_ping_seconds: float = 15.0
    """How often `GET /v1/goals/{id}/events` sends a keep-alive comment while nothing happens
    (proxies close connections that stay silent)."""

    events_poll_seconds: float = 0.25
    """How often an open event stream reads the events table for new rows (the one place that
    polls: events written by workers in other processes reach every API process this way)."""

    webhook_secret: str | None = Field(default=None, repr=False)
    """The secret (`whsec_<base64>`) signing the webhooks of goals that name none of their own.
    Unset: a goal with a webhook must bring its secret."""

    webhook_interval_seconds: float = 1.0
    """How often pending webhook deliveries are sent (Celery beat, or a thread embedded)."""

    webhook_timeout_seconds: float = 10.0
    """How long one webhook POST may take."""

    webhook_max_attempts: int = 8
    """Attempts per webhook delivery before it is marked failed."""

    webhook_backoff_seconds: float = 1.0
    """The wait after a delivery's first failed attempt; it doubles each attempt, with jitter."""

    webhook_backoff_max_seconds: float = 300.0
    """The longest wait between two attempts of a delivery."""

    webhook_lease_seconds: float = 60.0
    """A delivery being sent is due again this long after it was taken (its sender died)."""

    @model_validator(mode="after")
    def _webhook_secret_valid(self) -> Settings:
        from agentloop.domain import webhook_secret_problem

        if self.webhook_secret and (problem := webhook_secret_problem(self.webhook_secret)):
            raise ValueError(f"webhook_secret {problem}")
        return self

    @model_validator(mode="after")
    def _lease_fits_visibility(self) -> Settings:
        if self.lease_seconds <= 0 or self.lease_seconds >= self.visibility_timeout:
            raise ValueError(
                f"lease_seconds ({self.lease_seconds}) must be positive and shorter than "
                f"visibility_timeout ({self.visibility_timeout}): the database must take back a "
                "lost worker's candidate before the broker hands its message back"
            )
        return self

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
