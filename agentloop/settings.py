"""One pydantic-settings `Settings`, read from AGENTLOOP_* environment variables."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

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

    goal_parser: str = "rules"
    """How goals are read into parts and places (`agentloop.parts`): a registered parser's
    name. "rules" (the default) reads joining words, numbers and place phrases; "llm" asks the
    `llm_*` endpoint once per goal, when it is created, and stores its parts with the goal
    (`agentloop.parse_llm`; the rules when it gives no valid answer). A goal that lists its
    own `parts` is read by no parser."""

    extra_models: list[str] = Field(default_factory=list)
    """Hub ids or paths an operator makes available besides the presets (JSON list in the env)."""

    preview_scorers: dict[str, str] = Field(default_factory=dict)
    """Which scorer ranks the x0 previews when a fan-out is pruned mid-denoise, by the scorer
    that judges the finished candidates (JSON object in the env, e.g.
    ``{"shapes-clip": "shapes-clip-preview"}``). A scorer not listed, or whose preview scorer
    does not resolve, ranks its own previews. The finished images are always judged by the
    candidates' own scorer."""

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

    worker_watchdog_seconds: float = Field(default=120.0, ge=0.0)
    """A Celery worker whose queues have held waiting messages for this long, while it had a
    free slot and received none, is taken to have stopped consuming and exits (code 70) for
    its supervisor to restart it (`workers/watchdog.py`). 0: off."""

    engine_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """The denoiser's dtype (`EngineConfig.dtype`). "auto": bfloat16 on CUDA and on CPUs with
    native bfloat16 (AVX512-BF16, AMX), float32 elsewhere (`engine.config.auto_dtype`)."""

    engine_compile: Literal["auto", "on", "off"] = "auto"
    """Regional compilation of the denoiser (`EngineConfig.compile`). "auto": a Celery worker
    compiles on every device (it lives for thousands of generations; the first batches pay
    the compile once, about 40 s on a CPU with Inductor's disk cache cold and a few seconds
    with it warm, and every later batch runs about 1.2x faster on the shipped model,
    docs/benchmarks.md); the embedded runtime and the CLI leave it to the engine (on for
    CUDA, off on a CPU, where a short run would not earn the compile back). "on" / "off":
    everywhere."""

    generation_batch: int = 16
    """Most candidates in one generation task message."""

    gen_coalesce: bool = True
    """A generation worker batches across goals: a running generation task takes the other
    generation messages waiting in its queue and runs all their candidates as one engine
    batch (docs/reliability.md, "Batching across goals"). Off: each message runs alone. (The
    embedded runtime always batches what waits in its process, up to `gen_max_batch`.)"""

    gen_max_batch: int = Field(default=64, ge=1)
    """Most candidates (rows) one generation worker runs in one coalesced batch; also the
    embedded runtime's cap. The engine cuts it into pipeline calls of `EngineConfig.max_batch`."""

    gen_max_wait_ms: float = Field(default=50.0, ge=0.0)
    """How long a generation task waits, from its start, for more messages while its queue is
    empty and its batch not full. Every batch of a lone goal pays it; at 0 a task takes only
    what already waits. Must be shorter than `outbox_grace_seconds` (checked at start-up):
    the candidates of a message taken in are claimed only when the wait ends."""

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

    llm_base_url: str | None = None
    """The `llm` reviser's OpenAI-compatible endpoint, up to `/v1` (vLLM
    `http://127.0.0.1:8000/v1`, llama.cpp `http://127.0.0.1:8080/v1`, Ollama
    `http://127.0.0.1:11434/v1`, or a hosted API). Unset: goals cannot choose reviser `llm`."""

    llm_model: str | None = None
    """The model name the endpoint serves (sent as `model`); required with `llm_base_url`."""

    llm_api_key: str | None = Field(default=None, repr=False)
    """Sent as `Authorization: Bearer <key>` (local servers need none)."""

    llm_timeout_seconds: float = 60.0
    """How long one chat-completions request may take."""

    llm_max_attempts: int = 3
    """Attempts per iteration (timeouts, 5xx, 429, invalid answers are tried again) before the
    iteration falls back to the `search` reviser."""

    llm_max_tokens: int = 2048
    """`max_tokens` of each request: room for the answer's moves."""

    llm_temperature: float = 0.0
    """Sampling temperature (0: the most repeatable answers)."""

    llm_response_format: Literal["auto", "json_schema", "json_object", "none"] = "auto"
    """How to ask for JSON: `auto` sends the answer's JSON schema and steps down to
    `json_object`, then to none, when the server refuses one; or pin one."""

    llm_backoff_seconds: float = 1.0
    """The wait after a failed attempt without Retry-After; it doubles each attempt."""

    llm_max_wait_seconds: float = 30.0
    """The longest wait between attempts; a 429 asking for more falls back at once."""

    @model_validator(mode="after")
    def _llm_endpoint_complete(self) -> Settings:
        if bool(self.llm_base_url) != bool(self.llm_model):
            raise ValueError(
                "llm_base_url and llm_model go together: set both AGENTLOOP_LLM_BASE_URL and "
                "AGENTLOOP_LLM_MODEL for the llm reviser, or neither"
            )
        if self.llm_base_url and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", self.llm_base_url):
            raise ValueError(f"llm_base_url {self.llm_base_url!r} is not an http(s) URL")
        if self.llm_timeout_seconds <= 0 or self.llm_max_attempts < 1 or self.llm_max_tokens < 1:
            raise ValueError("llm_timeout_seconds, llm_max_attempts and llm_max_tokens must be positive")
        if self.llm_backoff_seconds < 0 or self.llm_max_wait_seconds < 0:
            raise ValueError("llm_backoff_seconds and llm_max_wait_seconds must be >= 0")
        if self.goal_parser == "llm" and not self.llm_base_url:
            raise ValueError(
                "goal_parser 'llm' reads goals with the language model endpoint: set "
                "AGENTLOOP_LLM_BASE_URL and AGENTLOOP_LLM_MODEL, or use goal_parser 'rules'"
            )
        return self

    @model_validator(mode="after")
    def _webhook_secret_valid(self) -> Settings:
        from agentloop.domain import webhook_secret_problem

        if self.webhook_secret and (problem := webhook_secret_problem(self.webhook_secret)):
            raise ValueError(f"webhook_secret {problem}")
        return self

    @model_validator(mode="after")
    def _wait_fits_outbox_grace(self) -> Settings:
        if self.gen_coalesce and self.gen_max_wait_ms / 1000 >= self.outbox_grace_seconds:
            raise ValueError(
                f"gen_max_wait_ms ({self.gen_max_wait_ms:g}) must be shorter than "
                f"outbox_grace_seconds ({self.outbox_grace_seconds:g} s): a generation task "
                "holds the messages it takes while it waits, and the sweep would send their "
                "candidates again"
            )
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
