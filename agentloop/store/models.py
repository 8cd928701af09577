"""ORM models. The schema itself is created only by the Alembic migrations."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class GoalRow(Base):
    __tablename__ = "goals"
    __table_args__ = (Index("ix_goals_status_updated", "status", "updated_at"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), default="default")
    text: Mapped[str] = mapped_column(Text)
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16), index=True)
    stop_reason: Mapped[str | None] = mapped_column(String(32))
    budget: Mapped[int] = mapped_column(Integer)
    generations_reserved: Mapped[int] = mapped_column(Integer, default=0)
    best_candidate_id: Mapped[str | None] = mapped_column(String(32))
    best_score: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime())
    updated_at: Mapped[datetime] = mapped_column(DateTime())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime())


class IterationRow(Base):
    __tablename__ = "iterations"
    __table_args__ = (UniqueConstraint("goal_id", "index", name="uq_iterations_goal_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    goal_id: Mapped[str] = mapped_column(ForeignKey("goals.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    notes: Mapped[dict[str, Any]] = mapped_column(JSON)
    best_score: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime())
    closed_at: Mapped[datetime | None] = mapped_column(DateTime())


class CandidateRow(Base):
    __tablename__ = "candidates"
    __table_args__ = (
        UniqueConstraint("goal_id", "iteration", "ordinal", name="uq_candidates_goal_iter_ordinal"),
        Index("ix_candidates_goal_status", "goal_id", "status"),
        Index("ix_candidates_status_lease", "status", "lease_expires_at"),
        Index("ix_candidates_status_queued", "status", "queued_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    goal_id: Mapped[str] = mapped_column(ForeignKey("goals.id", ondelete="CASCADE"))
    iteration_id: Mapped[int] = mapped_column(ForeignKey("iterations.id", ondelete="CASCADE"))
    iteration: Mapped[int] = mapped_column(Integer)
    ordinal: Mapped[int] = mapped_column(Integer)
    prompt: Mapped[str] = mapped_column(Text)
    negative_prompt: Mapped[str] = mapped_column(Text, default="")
    seed: Mapped[int] = mapped_column(BigInteger)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(128))
    claim_token: Mapped[str | None] = mapped_column(String(32))
    """Names the claim a worker holds; completion and release must present it."""
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime())
    """While running: when the claim lapses unless renewed (database clock, naive UTC)."""
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime())
    """The outbox marker: when its generation message was last sent (None: not yet sent)."""
    clip_score: Mapped[float | None] = mapped_column(Float)
    part_scores: Mapped[dict[str, float]] = mapped_column(JSON)
    artifact_uri: Mapped[str | None] = mapped_column(Text)
    timings: Mapped[dict[str, float]] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    parent_id: Mapped[str | None] = mapped_column(String(32))
    edit: Mapped[str | None] = mapped_column(Text)
    queued_at: Mapped[datetime | None] = mapped_column(DateTime())
    started_at: Mapped[datetime | None] = mapped_column(DateTime())
    finished_at: Mapped[datetime | None] = mapped_column(DateTime())


class IdempotencyKeyRow(Base):
    """A request made with an `Idempotency-Key`: inserted in the transaction that creates the
    goal or iteration (the primary key makes a concurrent second one fail), then given the
    response it answered. `response_status` None: the first request has not answered yet."""

    __tablename__ = "idempotency_keys"
    __table_args__ = (
        PrimaryKeyConstraint("scope", "key", name="pk_idempotency_keys"),
        Index("ix_idempotency_keys_created", "created_at"),
    )

    scope: Mapped[str] = mapped_column(String(200))
    """The tenant and the route the key belongs to."""
    key: Mapped[str] = mapped_column(String(255))
    request_hash: Mapped[str] = mapped_column(String(64))
    resource_id: Mapped[str | None] = mapped_column(String(32))
    response_status: Mapped[int | None] = mapped_column(Integer)
    response_body: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime())


class EventRow(Base):
    """One transition of a goal, appended in the transaction that made it (the event log).

    `id` only grows (AUTOINCREMENT on SQLite, so a deleted last row's id is never reused), and
    a goal's events are committed in id order (see `store._append_events`): a reader that
    keeps the last id it saw misses nothing."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_goal_id", "goal_id", "id"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    goal_id: Mapped[str] = mapped_column(ForeignKey("goals.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime())
    """The database clock (naive UTC)."""


class WebhookRow(Base):
    """A goal's webhook: where to send which of its events, and the secret that signs them.
    `cursor` is the last of the goal's event ids turned into deliveries (the fan-out's place)."""

    __tablename__ = "webhooks"

    goal_id: Mapped[str] = mapped_column(
        ForeignKey("goals.id", ondelete="CASCADE"), primary_key=True
    )
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(200))
    cursor: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime())


class WebhookDeliveryRow(Base):
    """One event to POST to a goal's webhook: pending → delivering (taken by a sender, with a
    lease: `next_attempt_at` is when it is due again) → delivered, or back to pending with a
    later `next_attempt_at`, or failed once its attempts are spent."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        UniqueConstraint("goal_id", "event_id", name="uq_webhook_deliveries_goal_event"),
        Index("ix_webhook_deliveries_status_due", "status", "next_attempt_at"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    goal_id: Mapped[str] = mapped_column(ForeignKey("goals.id", ondelete="CASCADE"))
    event_id: Mapped[int] = mapped_column(BigInteger)
    event_type: Mapped[str] = mapped_column(String(32))
    url: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(DateTime())
    claim_token: Mapped[str | None] = mapped_column(String(32))
    """Names the sender holding it while delivering; its outcome must present it."""
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime())
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime())


class HeartbeatRow(Base):
    """When a periodic job (the sweep) last finished a run, by the database's clock, and how
    often it promises to run: a job that stopped shows as an old `beat_at`."""

    __tablename__ = "heartbeats"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    beat_at: Mapped[datetime] = mapped_column(DateTime())
    interval_seconds: Mapped[float] = mapped_column(Float)
