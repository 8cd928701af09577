"""The store: the only module that issues SQL.

Every status change is one transaction guarded by the status it expects
(`UPDATE … WHERE status = :expected`), so a duplicate task delivery changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import (
    Engine,
    and_,
    bindparam,
    create_engine,
    delete,
    event,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from agentloop.domain import (
    CandidateStatus,
    CandidateView,
    Decision,
    EventView,
    GoalSpec,
    GoalState,
    GoalStatus,
    GoalView,
    Heartbeat,
    IterationStatus,
    IterationView,
    Webhook,
    WebhookDeliveryView,
    generation_cost,
)
from agentloop.store.models import (
    CandidateRow,
    EventRow,
    GoalRow,
    HeartbeatRow,
    IdempotencyKeyRow,
    IterationRow,
    WebhookDeliveryRow,
    WebhookRow,
)


class Conflict(RuntimeError):
    """A guarded update found a row in another state than expected; the transaction rolled back."""


class BudgetExceeded(Conflict):
    """Reserving generations would exceed the goal's budget."""


class IdempotencyKeyTaken(Conflict):
    """Another request holds this idempotency key (committed first, or at the same time)."""


@dataclass(frozen=True)
class IdempotencyClaim:
    """An `Idempotency-Key` to record in the transaction that does the request's work."""

    scope: str
    key: str
    request_hash: str
    retention_seconds: float


@dataclass(frozen=True)
class IdempotencyRecord:
    """What the store knows of a key: the request it came with, and its answer once given."""

    request_hash: str
    resource_id: str | None
    response_status: int | None
    response_body: Any
    created_at: datetime


ACTIVE_GOAL = (GoalStatus.PENDING.value, GoalStatus.RUNNING.value, GoalStatus.WAITING.value)
"""Goal statuses whose candidates may still be claimed."""
UNFINISHED_CANDIDATE = (CandidateStatus.QUEUED.value, CandidateStatus.RUNNING.value)


@dataclass(frozen=True)
class Outcome:
    """What a worker records for one generated candidate: succeeded with its score, or pruned
    (``clip_score`` None, the preview as its image, ``timings`` holding ``pruned_at_step``
    and ``preview_score``)."""

    candidate_id: str
    clip_score: float | None
    part_scores: dict[str, float]
    artifact_uri: str
    timings: dict[str, float]
    status: CandidateStatus = CandidateStatus.SUCCEEDED


def utcnow() -> datetime:
    """Naive UTC, the one timestamp form stored in every backend."""
    return datetime.now(UTC).replace(tzinfo=None)


def new_id() -> str:
    return uuid.uuid4().hex


def make_engine(url: str, connect_timeout: int = 5) -> Engine:
    """An engine. PostgreSQL: connections checked before use (a restarted server costs one
    failed check, not an error) and a connect timeout, so a database that is down answers
    fast. SQLite: WAL, a busy timeout and write-locking transactions (BEGIN IMMEDIATE)."""
    if not url.startswith("sqlite"):
        args = {"connect_timeout": connect_timeout} if "psycopg" in url or "postgres" in url else {}
        return create_engine(url, pool_pre_ping=True, connect_args=args)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60})

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # One writer at a time: the SQLite equivalent of locking the goal row.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


class Store:
    """Goals, iterations and candidates in PostgreSQL or SQLite."""

    def __init__(self, url: str, connect_timeout: int = 5):
        self.url = url
        self.engine = make_engine(url, connect_timeout)
        self.is_sqlite = url.startswith("sqlite")

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    def _now(self, s: Session) -> datetime:
        """The database's clock (naive UTC): leases and sweeps must not depend on how well the
        workers' clocks agree. SQLite is embedded, so this process's clock is the database's."""
        if self.is_sqlite:
            return utcnow()
        return s.execute(text("SELECT (clock_timestamp() AT TIME ZONE 'UTC')")).scalar_one()

    def dispose(self) -> None:
        self.engine.dispose()

    def ping(self) -> bool:
        """True when the database answers."""
        with self._tx() as s:
            return s.execute(text("SELECT 1")).scalar() == 1

    # heartbeats ------------------------------------------------------------------------

    def beat(self, name: str, interval_seconds: float) -> None:
        """Record that periodic job ``name`` (run every ``interval_seconds``) finished a run now."""
        with self._tx() as s:
            now = self._now(s)
            done = s.execute(
                update(HeartbeatRow).where(HeartbeatRow.name == name)
                .values(beat_at=now, interval_seconds=interval_seconds)
            ).rowcount  # fmt: skip
            if not done:
                try:
                    with s.begin_nested():
                        s.add(HeartbeatRow(name=name, beat_at=now, interval_seconds=interval_seconds))
                except IntegrityError:  # a concurrent first beat: it is recorded either way
                    pass

    def heartbeat(self, name: str) -> Heartbeat | None:
        """When periodic job ``name`` last finished a run (None if it never has)."""
        with self._tx() as s:
            row = s.get(HeartbeatRow, name)
            if row is None:
                return None
            age = (self._now(s) - row.beat_at).total_seconds()
            return Heartbeat(name, row.beat_at, max(0.0, age), row.interval_seconds)

    # goals ---------------------------------------------------------------------------

    def create_goal(
        self, spec: GoalSpec, claim: IdempotencyClaim | None = None,
        webhook: Webhook | None = None,
    ) -> GoalView:
        """Insert a pending goal (timestamps on the database clock, which the sweep reads);
        with `claim`, record its key in the same transaction (IdempotencyKeyTaken if held);
        with `webhook`, its subscription, in the same transaction too."""
        with self._tx() as s:
            now = self._now(s)
            row = GoalRow(
                id=new_id(), tenant=spec.tenant, text=spec.goal, spec=spec.to_json(),
                status=GoalStatus.PENDING.value, budget=spec.budget, generations_reserved=0,
                created_at=now, updated_at=now,
            )
            if claim is not None:
                _claim_key(s, claim, now, row.id)
            s.add(row)
            s.flush()  # the event's foreign key needs the goal row
            if webhook is not None:
                s.add(WebhookRow(goal_id=row.id, url=webhook.url, events=list(webhook.events),
                                 secret=webhook.secret, cursor=0, created_at=now))
            _append_events(s, now, [(row.id, "goal.created", {
                "status": row.status, "goal": row.text, "budget": row.budget,
                "model": spec.model, "reviser": spec.reviser, "tenant": row.tenant,
            })])
        return _goal_view(row)

    def get_goal(self, goal_id: str) -> GoalView | None:
        with self._tx() as s:
            row = s.get(GoalRow, goal_id)
            return _goal_view(row) if row else None

    def goal_texts(
        self, goal_ids: Sequence[str]
    ) -> dict[str, tuple[str, tuple[dict[str, Any], ...] | None]]:
        """Each existing goal's text and stored parts (None: parse the text), in one query:
        what its candidates are scored against."""
        with self._tx() as s:
            rows = s.execute(
                select(GoalRow.id, GoalRow.text, GoalRow.spec).where(GoalRow.id.in_(list(goal_ids)))
            )
            return {gid: (text, _stored_parts(spec)) for gid, text, spec in rows}

    def list_goals(self, limit: int = 50, tenant: str | None = None) -> list[GoalView]:
        stmt = select(GoalRow).order_by(GoalRow.created_at.desc()).limit(limit)
        if tenant:
            stmt = stmt.where(GoalRow.tenant == tenant)
        with self._tx() as s:
            return [_goal_view(r) for r in s.scalars(stmt)]

    def get_state(self, goal_id: str) -> GoalState | None:
        """The goal with its iterations and candidates, unlocked (for reading and progress)."""
        with self._tx() as s:
            row = s.get(GoalRow, goal_id)
            return _read_state(s, row) if row else None

    def list_candidates(self, goal_id: str) -> list[CandidateView]:
        with self._tx() as s:
            rows = s.scalars(
                select(CandidateRow)
                .where(CandidateRow.goal_id == goal_id)
                .order_by(CandidateRow.iteration, CandidateRow.ordinal)
            )
            return [_candidate_view(r) for r in rows]

    def get_candidates(self, ids: Sequence[str]) -> list[CandidateView]:
        with self._tx() as s:
            rows = s.scalars(select(CandidateRow).where(CandidateRow.id.in_(list(ids))))
            by_id = {r.id: _candidate_view(r) for r in rows}
        return [by_id[i] for i in ids if i in by_id]

    # the orchestrator's step ----------------------------------------------------------

    def decide(
        self, goal_id: str, decide: Callable[[GoalState], Decision],
        claim: IdempotencyClaim | None = None,
    ) -> Decision | None:
        """Lock the goal, let `decide` look at its state, apply the decision, commit.

        Returns None when the goal does not exist. Concurrent calls for one goal run one
        after the other (row lock on PostgreSQL, the write lock on SQLite). With `claim`,
        its idempotency key is recorded in the same transaction (IdempotencyKeyTaken if held).
        """
        with self._tx() as s:
            # FOR NO KEY UPDATE: the step never changes the goal's key, and so does not block
            # the key-share lock another transaction's event insert takes on the goal row
            row = s.scalars(
                select(GoalRow).where(GoalRow.id == goal_id).with_for_update(key_share=True)
            ).first()
            if row is None:
                return None
            state = _read_state(s, row)
            state.now = self._now(s)
            if claim is not None:
                _claim_key(s, claim, state.now, goal_id)
            decision = decide(state)
            decision.model = state.goal.spec.model
            if not decision.is_noop:
                _apply(s, state, decision)
            return decision

    # generation workers ---------------------------------------------------------------

    def claim_candidates(
        self, ids: Sequence[str], worker: str, lease_seconds: float, max_attempts: int,
        token: str | None = None,
    ) -> list[CandidateView]:
        """Claim candidates for `worker`, in one statement: queued ones, and running ones whose
        lease has expired, of goals that are still active, with attempts left.

        Each claimed candidate carries one new `claim_token` (shared by this call's batch; or
        `token`, to add to a claim already held) and a lease of `lease_seconds` on the database
        clock. Returns only what this call claimed: a duplicate delivery claims nothing.
        """
        if not ids:
            return []
        token = token or new_id()
        with self._tx() as s:
            now = self._now(s)
            active = select(GoalRow.id).where(GoalRow.status.in_(ACTIVE_GOAL))
            rows = s.scalars(
                update(CandidateRow)
                .where(
                    CandidateRow.id.in_(list(ids)),
                    CandidateRow.attempts < max_attempts,
                    (CandidateRow.status == CandidateStatus.QUEUED.value)
                    | (
                        (CandidateRow.status == CandidateStatus.RUNNING.value)
                        & (CandidateRow.lease_expires_at < now)
                    ),
                    CandidateRow.goal_id.in_(active),
                )
                .values(
                    status=CandidateStatus.RUNNING.value, worker=worker, claim_token=token,
                    lease_expires_at=now + timedelta(seconds=lease_seconds),
                    attempts=CandidateRow.attempts + 1, started_at=now, error=None,
                )
                .returning(CandidateRow)
                .execution_options(synchronize_session=False)
            ).all()
            views = {r.id: _candidate_view(r) for r in rows}
            _append_events(s, now, [
                (r.goal_id, "candidate.started", {
                    "candidate_id": r.id, "iteration": r.iteration, "attempt": r.attempts,
                    "worker": worker,
                })
                for r in rows
            ])
        return [views[i] for i in ids if i in views]

    def prune_siblings(self, claimed: Sequence[CandidateView]) -> list[str]:
        """Queued candidates of the prune groups of `claimed` that are not among them: a worker
        that claims part of a group claims the rest too, so that the group is previewed and
        cut as one, however its messages were split or coalesced."""
        groups = {(c.goal_id, c.iteration, c.prune_group) for c in claimed if c.prune_group}
        if not groups:
            return []
        have = {c.id for c in claimed}
        with self._tx() as s:
            rows = s.execute(
                select(CandidateRow.id, CandidateRow.goal_id, CandidateRow.iteration,
                       CandidateRow.params)
                .where(
                    CandidateRow.goal_id.in_({g for g, _, _ in groups}),
                    CandidateRow.iteration.in_({i for _, i, _ in groups}),
                    CandidateRow.status == CandidateStatus.QUEUED.value,
                )
                .order_by(CandidateRow.goal_id, CandidateRow.iteration, CandidateRow.ordinal)
            ).all()
        return [
            cid for cid, goal_id, iteration, params in rows
            if cid not in have and (goal_id, iteration, (params or {}).get("prune_group")) in groups
        ]

    def renew_leases(self, ids: Sequence[str], token: str, lease_seconds: float) -> set[str]:
        """Extend the leases this claim still holds; returns the ids it still holds."""
        if not ids:
            return set()
        with self._tx() as s:
            now = self._now(s)
            held = s.scalars(
                update(CandidateRow)
                .where(
                    CandidateRow.id.in_(list(ids)), CandidateRow.claim_token == token,
                    CandidateRow.status == CandidateStatus.RUNNING.value,
                )
                .values(lease_expires_at=now + timedelta(seconds=lease_seconds))
                .returning(CandidateRow.id)
                .execution_options(synchronize_session=False)
            ).all()
        return set(held)

    def complete_candidates(self, token: str, outcomes: Sequence[Outcome]) -> list[str]:
        """running → succeeded (or → pruned) for each outcome this claim still holds, in one
        transaction.

        Returns the ids completed; a candidate whose claim was lost (lease expired and taken
        back, goal cancelled and the candidate dropped) is left alone.
        """
        if not outcomes:
            return []
        by_id = {o.candidate_id: o for o in outcomes}
        with self._tx() as s:
            now = self._now(s)
            held = _lock_held(s, list(by_id), token)
            if held:  # one statement for the batch, executed once per row (executemany)
                table = CandidateRow.__table__
                s.connection().execute(
                    update(table)
                    .where(table.c.id == bindparam("b_id"))
                    .values(
                        status=bindparam("b_status"), clip_score=bindparam("b_score"),
                        part_scores=bindparam("b_parts"), artifact_uri=bindparam("b_uri"),
                        timings=bindparam("b_timings"), finished_at=now, lease_expires_at=None,
                    ),
                    [
                        {"b_id": cid, "b_status": by_id[cid].status.value,
                         "b_score": by_id[cid].clip_score, "b_parts": by_id[cid].part_scores,
                         "b_uri": by_id[cid].artifact_uri, "b_timings": by_id[cid].timings}
                        for cid in held
                    ],
                )
            events = []
            for cid, h in held.items():
                o = by_id[cid]
                data: dict[str, Any] = {
                    "candidate_id": cid, "iteration": h.iteration, "attempt": h.attempts,
                }
                if o.status is CandidateStatus.PRUNED:
                    data |= {"pruned_at_step": o.timings.get("pruned_at_step"),
                             "preview_score": o.timings.get("preview_score"),
                             "generation_cost": o.timings.get("generation_cost"),
                             "image_url": f"/v1/artifacts/{o.artifact_uri}"}
                    events.append((h.goal_id, "candidate.pruned", data))
                    continue
                data |= {"clip_score": o.clip_score, "part_scores": o.part_scores,
                         "image_url": f"/v1/artifacts/{o.artifact_uri}"}
                if "preview_score" in o.timings:
                    data["preview_score"] = o.timings["preview_score"]
                events.append((h.goal_id, "candidate.succeeded", data))
            _append_events(s, now, events)
        return [cid for cid in by_id if cid in held]

    def complete_candidate(
        self,
        candidate_id: str,
        token: str,
        *,
        clip_score: float,
        part_scores: dict[str, float],
        artifact_uri: str,
        timings: dict[str, float],
    ) -> bool:
        """running → succeeded with its score and image; False if this claim no longer holds it."""
        outcome = Outcome(candidate_id, clip_score, part_scores, artifact_uri, timings)
        return self.complete_candidates(token, [outcome]) == [candidate_id]

    def release_candidates(
        self, token: str, errors: dict[str, str], max_attempts: int
    ) -> dict[str, CandidateStatus]:
        """After failed attempts: running → queued to retry (unsent, so the outbox sends it), or
        → failed once `max_attempts` are spent. Only what this claim still holds; returns the
        new status of each candidate released."""
        if not errors:
            return {}
        released: dict[str, CandidateStatus] = {}
        with self._tx() as s:
            now = self._now(s)
            held = _lock_held(s, list(errors), token)
            events = []
            for cid, h in held.items():
                new = (
                    CandidateStatus.QUEUED if h.attempts < max_attempts
                    else CandidateStatus.FAILED
                )
                s.execute(
                    update(CandidateRow)
                    .where(CandidateRow.id == cid)
                    .values(_release_values(new, errors[cid], now))
                    .execution_options(synchronize_session=False)
                )
                released[cid] = new
                events.append((h.goal_id, "candidate.failed", _failed_data(
                    cid, h.iteration, h.attempts, errors[cid], new is CandidateStatus.QUEUED
                )))
            _append_events(s, now, events)
        return released

    def release_candidate(
        self, candidate_id: str, token: str, error: str, max_attempts: int
    ) -> CandidateStatus | None:
        """One candidate's `release_candidates`; None if this claim no longer holds it."""
        return self.release_candidates(token, {candidate_id: error}, max_attempts).get(candidate_id)

    def mark_dispatched(self, ids: Sequence[str]) -> None:
        """The outbox marker: these queued candidates' generation messages were sent."""
        if not ids:
            return
        with self._tx() as s:
            now = self._now(s)
            s.execute(
                update(CandidateRow)
                .where(
                    CandidateRow.id.in_(list(ids)),
                    CandidateRow.status == CandidateStatus.QUEUED.value,
                )
                .values(dispatched_at=now)
                .execution_options(synchronize_session=False)
            )

    # the reconciler --------------------------------------------------------------------

    def goals_needing_attention(
        self, *, outbox_grace: float, redispatch_after: float, stall_after: float,
        idle_models: Callable[[set[str]], set[str]] | None = None, limit: int = 1000,
    ) -> list[str]:
        """Goals the orchestrator must look at because a message may have been lost, oldest
        first:

        - a running candidate whose lease expired (its worker died);
        - a queued candidate never sent `outbox_grace` after it was queued (a crash between
          commit and send), or sent `redispatch_after` ago and still unclaimed (a lost
          message); or sent `outbox_grace` ago while its model's queue is empty, by
          `idle_models` (which gets the models in question and answers those whose broker
          queue holds nothing), so a flushed broker costs one sweep, not `redispatch_after`;
        - a pending or running goal with nothing unfinished and no change, nor any candidate
          finished, for `stall_after` seconds (its next orchestrator message was lost).
        """
        with self._tx() as s:
            now = self._now(s)
            grace_cut = now - timedelta(seconds=outbox_grace)
            expired = select(CandidateRow.goal_id).where(
                CandidateRow.status == CandidateStatus.RUNNING.value,
                CandidateRow.lease_expires_at < now,
            )
            unsent = select(CandidateRow.goal_id).where(
                CandidateRow.status == CandidateStatus.QUEUED.value,
                (CandidateRow.dispatched_at.is_(None) & (CandidateRow.queued_at < grace_cut))
                | (CandidateRow.dispatched_at < now - timedelta(seconds=redispatch_after)),
            )
            stall_cut = now - timedelta(seconds=stall_after)
            busy = select(CandidateRow.id).where(
                CandidateRow.goal_id == GoalRow.id,
                CandidateRow.status.in_(UNFINISHED_CANDIDATE)
                | (CandidateRow.finished_at >= stall_cut),
            )
            stalled = select(GoalRow.id).where(
                GoalRow.status.in_((GoalStatus.PENDING.value, GoalStatus.RUNNING.value)),
                GoalRow.updated_at < stall_cut,
                ~busy.exists(),
            )
            ids = set(s.scalars(expired.distinct().limit(limit)))
            ids |= set(s.scalars(unsent.distinct().limit(limit)))
            ids |= set(s.scalars(stalled.limit(limit)))
            if idle_models is not None:
                ids |= _goals_waiting_on_idle_queues(s, grace_cut, idle_models, limit)
            if not ids:
                return []
            order = s.execute(
                select(GoalRow.id).where(GoalRow.id.in_(ids)).order_by(GoalRow.updated_at)
            ).scalars()
            return list(order)

    def withdraw_iteration(self, goal_id: str, index: int) -> bool:
        """Undo an iteration no worker has touched (its prompts could not be sent): delete its
        candidates and the iteration, give the budget back, and let the goal wait for prompts
        again. False, and nothing changed, once any of its candidates was claimed."""
        with self._tx() as s:
            goal = s.scalars(
                select(GoalRow).where(GoalRow.id == goal_id).with_for_update(key_share=True)
            ).first()
            iteration = s.scalars(
                select(IterationRow).where(
                    IterationRow.goal_id == goal_id, IterationRow.index == index,
                    IterationRow.status == IterationStatus.OPEN.value,
                )
            ).first()
            if goal is None or iteration is None or goal.status != GoalStatus.RUNNING.value:
                return False
            cands = s.scalars(
                select(CandidateRow).where(CandidateRow.iteration_id == iteration.id)
            ).all()
            if any(c.status != CandidateStatus.QUEUED.value or c.attempts for c in cands):
                return False
            s.execute(delete(CandidateRow).where(CandidateRow.iteration_id == iteration.id))
            s.execute(delete(IterationRow).where(IterationRow.id == iteration.id))
            goal.generations_reserved -= len(cands)
            goal.status = GoalStatus.WAITING.value
            now = goal.updated_at = self._now(s)
            _append_events(s, now, [
                (goal_id, "iteration.withdrawn",
                 {"index": index, "candidate_ids": [c.id for c in cands]}),
                (goal_id, "goal.status", {
                    "from": GoalStatus.RUNNING.value, "to": GoalStatus.WAITING.value,
                    "stop_reason": None,
                }),
            ])
            return True

    # the event log ---------------------------------------------------------------------

    def events_after(self, goal_id: str, after_id: int = 0, limit: int = 500) -> list[EventView]:
        """A goal's events with an id above `after_id`, oldest first, at most `limit`.

        A reader that passes the last id it saw misses nothing: a goal's events are committed
        in id order (`_append_events`)."""
        with self._tx() as s:
            rows = s.scalars(
                select(EventRow)
                .where(EventRow.goal_id == goal_id, EventRow.id > after_id)
                .order_by(EventRow.id)
                .limit(limit)
            )
            return [_event_view(r) for r in rows]

    def finished_event_id(self, goal_id: str) -> int | None:
        """The id of the goal's `goal.finished` event (None while it runs)."""
        with self._tx() as s:
            return s.scalar(
                select(EventRow.id).where(
                    EventRow.goal_id == goal_id, EventRow.type == "goal.finished"
                ).limit(1)
            )

    def count_candidates(self, goal_id: str) -> int:
        with self._tx() as s:
            return int(
                s.scalar(select(func.count()).where(CandidateRow.goal_id == goal_id)) or 0
            )


    # summaries and pages -------------------------------------------------------------

    def list_goals_page(
        self, limit: int, tenant: str | None = None, statuses: Sequence[str] = (),
        after: tuple[datetime, str] | None = None,
    ) -> list[GoalView]:
        """Goals newest first, by (created_at, id) descending, starting after `after`."""
        stmt = select(GoalRow).order_by(GoalRow.created_at.desc(), GoalRow.id.desc()).limit(limit)
        if tenant:
            stmt = stmt.where(GoalRow.tenant == tenant)
        if statuses:
            stmt = stmt.where(GoalRow.status.in_(list(statuses)))
        if after is not None:
            at, gid = after
            stmt = stmt.where(or_(GoalRow.created_at < at,
                                  and_(GoalRow.created_at == at, GoalRow.id < gid)))
        with self._tx() as s:
            return [_goal_view(r) for r in s.scalars(stmt)]

    def goal_summaries(
        self, goals: Sequence[GoalView]
    ) -> dict[str, tuple[int, CandidateView | None, list[IterationView]]]:
        """Per goal: candidates finished, its best candidate, its iterations (three queries
        for the whole page, never one per goal)."""
        ids = [g.id for g in goals]
        best_ids = [g.best_candidate_id for g in goals if g.best_candidate_id]
        with self._tx() as s:
            done = dict(s.execute(
                select(CandidateRow.goal_id, func.count())
                .where(CandidateRow.goal_id.in_(ids),
                       CandidateRow.status.notin_(UNFINISHED_CANDIDATE))
                .group_by(CandidateRow.goal_id)
            ).all())
            best = {r.id: _candidate_view(r) for r in s.scalars(
                select(CandidateRow).where(CandidateRow.id.in_(best_ids)))} if best_ids else {}
            iterations: dict[str, list[IterationView]] = {gid: [] for gid in ids}
            for r in s.scalars(select(IterationRow).where(IterationRow.goal_id.in_(ids))
                               .order_by(IterationRow.goal_id, IterationRow.index)):
                iterations[r.goal_id].append(_iteration_view(r))
        return {g.id: (int(done.get(g.id, 0)), best.get(g.best_candidate_id or ""),
                       iterations[g.id]) for g in goals}

    def list_candidates_page(
        self, goal_id: str, limit: int, iteration: int | None = None,
        statuses: Sequence[str] = (), after: tuple[int, int] | None = None,
    ) -> list[CandidateView]:
        """A goal's candidates by (iteration, ordinal), starting after `after`."""
        stmt = (select(CandidateRow).where(CandidateRow.goal_id == goal_id)
                .order_by(CandidateRow.iteration, CandidateRow.ordinal).limit(limit))
        if iteration is not None:
            stmt = stmt.where(CandidateRow.iteration == iteration)
        if statuses:
            stmt = stmt.where(CandidateRow.status.in_(list(statuses)))
        if after is not None:
            it, ordinal = after
            stmt = stmt.where(or_(CandidateRow.iteration > it,
                                  and_(CandidateRow.iteration == it, CandidateRow.ordinal > ordinal)))
        with self._tx() as s:
            return [_candidate_view(r) for r in s.scalars(stmt)]

    # idempotency keys ------------------------------------------------------------------

    def idempotency_record(
        self, scope: str, key: str, retention_seconds: float
    ) -> IdempotencyRecord | None:
        """The key's record, unless there is none or it is older than the retention."""
        with self._tx() as s:
            row = s.get(IdempotencyKeyRow, (scope, key))
            if row is None or row.created_at < self._now(s) - timedelta(seconds=retention_seconds):
                return None
            return IdempotencyRecord(row.request_hash, row.resource_id, row.response_status,
                                     row.response_body, row.created_at)

    def answer_idempotency_key(self, scope: str, key: str, status: int, body: Any) -> None:
        """Record the response a key's first request answered (what its replays answer)."""
        with self._tx() as s:
            s.execute(update(IdempotencyKeyRow)
                      .where(IdempotencyKeyRow.scope == scope, IdempotencyKeyRow.key == key)
                      .values(response_status=status, response_body=body))

    def forget_idempotency_key(self, scope: str, key: str) -> None:
        """Drop a key whose request failed (the caller may send it again with the same key)."""
        with self._tx() as s:
            s.execute(delete(IdempotencyKeyRow)
                      .where(IdempotencyKeyRow.scope == scope, IdempotencyKeyRow.key == key))

    # webhooks ------------------------------------------------------------------------

    def fan_out_webhooks(self, limit: int = 500) -> int:
        """Turn new events of goals with a webhook into pending deliveries of the types each
        wants, and move each webhook's cursor past what it read, in one transaction; returns
        the deliveries created. A goal's events commit in id order (`_append_events`), so a
        cursor misses none. Webhooks another fan-out holds are skipped (PostgreSQL: SKIP
        LOCKED; SQLite has one writer at a time)."""
        with self._tx() as s:
            now = self._now(s)
            rows = s.execute(
                select(EventRow.id, EventRow.goal_id, EventRow.type, WebhookRow.events,
                       WebhookRow.url)
                .join(WebhookRow, WebhookRow.goal_id == EventRow.goal_id)
                .where(EventRow.id > WebhookRow.cursor)
                .order_by(EventRow.id)
                .limit(limit)
                .with_for_update(of=WebhookRow, skip_locked=True)
            ).all()
            cursors: dict[str, int] = {}
            deliveries = []
            for event_id, goal_id, etype, wanted, url in rows:
                cursors[goal_id] = max(cursors.get(goal_id, 0), event_id)
                if "*" in wanted or etype in wanted:
                    deliveries.append({
                        "goal_id": goal_id, "event_id": event_id, "event_type": etype,
                        "url": url, "status": "pending", "attempts": 0,
                        "next_attempt_at": now, "created_at": now,
                    })
            for goal_id, cursor in cursors.items():
                s.execute(update(WebhookRow).where(WebhookRow.goal_id == goal_id)
                          .values(cursor=cursor).execution_options(synchronize_session=False))
            if deliveries:
                s.execute(insert(WebhookDeliveryRow.__table__), deliveries)
        return len(deliveries)

    def claim_webhook_deliveries(
        self, limit: int, lease_seconds: float, max_attempts: int
    ) -> list[WebhookJob]:
        """Take due deliveries for this sender, in one guarded UPDATE: pending ones whose
        time has come, and delivering ones whose sender's lease ran out. Each taken one gets
        a new claim token, one more attempt, and is due again after `lease_seconds` (should
        this sender die). Two senders never take the same delivery at once. A lapsed one with
        no attempts left is marked failed instead."""
        token = new_id()
        with self._tx() as s:
            now = self._now(s)
            s.execute(
                update(WebhookDeliveryRow)
                .where(WebhookDeliveryRow.status == "delivering",
                       WebhookDeliveryRow.next_attempt_at <= now,
                       WebhookDeliveryRow.attempts >= max_attempts)
                .values(status="failed", claim_token=None, next_attempt_at=None,
                        last_error="the sender's lease expired on the last attempt")
                .execution_options(synchronize_session=False)
            )
            due = (
                select(WebhookDeliveryRow.id)
                .where(WebhookDeliveryRow.status.in_(("pending", "delivering")),
                       WebhookDeliveryRow.next_attempt_at <= now)
                .order_by(WebhookDeliveryRow.next_attempt_at, WebhookDeliveryRow.id)
                .limit(limit)
            )
            if not self.is_sqlite:
                due = due.with_for_update(skip_locked=True)
            ids = list(s.scalars(due))
            if not ids:
                return []
            rows = s.scalars(
                update(WebhookDeliveryRow)
                .where(WebhookDeliveryRow.id.in_(ids),
                       WebhookDeliveryRow.status.in_(("pending", "delivering")),
                       WebhookDeliveryRow.next_attempt_at <= now)
                .values(status="delivering", claim_token=token,
                        attempts=WebhookDeliveryRow.attempts + 1,
                        next_attempt_at=now + timedelta(seconds=lease_seconds))
                .returning(WebhookDeliveryRow)
                .execution_options(synchronize_session=False)
            ).all()
            events = {e.id: e for e in s.scalars(
                select(EventRow).where(EventRow.id.in_([r.event_id for r in rows])))}
            secrets = dict(s.execute(
                select(WebhookRow.goal_id, WebhookRow.secret)
                .where(WebhookRow.goal_id.in_({r.goal_id for r in rows}))).all())
            return [
                WebhookJob(r.id, token, r.url, secrets[r.goal_id], r.attempts,
                           _event_view(events[r.event_id]))
                for r in sorted(rows, key=lambda r: r.id)
            ]

    def finish_webhook_delivery(
        self, delivery_id: int, token: str, *, delivered: bool, status_code: int | None,
        error: str | None, retry_after: float, max_attempts: int,
    ) -> str | None:
        """Record one attempt's outcome, if this sender still holds the delivery: delivered,
        or pending again `retry_after` seconds from now, or failed once `max_attempts` are
        spent. Returns the new status (None: the claim was lost)."""
        with self._tx() as s:
            now = self._now(s)
            attempts = s.scalar(
                select(WebhookDeliveryRow.attempts)
                .where(WebhookDeliveryRow.id == delivery_id,
                       WebhookDeliveryRow.claim_token == token,
                       WebhookDeliveryRow.status == "delivering")
                .with_for_update()
            )
            if attempts is None:
                return None
            values: dict[str, Any] = {"last_status_code": status_code, "claim_token": None,
                                      "last_error": None if error is None else error[:1000]}
            if delivered:
                values |= {"status": "delivered", "delivered_at": now, "next_attempt_at": None}
            elif attempts >= max_attempts:
                values |= {"status": "failed", "next_attempt_at": None}
            else:
                values |= {"status": "pending",
                           "next_attempt_at": now + timedelta(seconds=retry_after)}
            s.execute(update(WebhookDeliveryRow).where(WebhookDeliveryRow.id == delivery_id)
                      .values(values).execution_options(synchronize_session=False))
            return str(values["status"])

    def webhook_deliveries(self, goal_id: str) -> list[WebhookDeliveryView]:
        """A goal's webhook deliveries, oldest event first."""
        with self._tx() as s:
            rows = s.scalars(select(WebhookDeliveryRow)
                             .where(WebhookDeliveryRow.goal_id == goal_id)
                             .order_by(WebhookDeliveryRow.event_id))
            return [WebhookDeliveryView(
                id=r.id, goal_id=r.goal_id, event_id=r.event_id, event_type=r.event_type,
                url=r.url, status=r.status, attempts=r.attempts,
                next_attempt_at=r.next_attempt_at, last_status_code=r.last_status_code,
                last_error=r.last_error, created_at=r.created_at, delivered_at=r.delivered_at,
            ) for r in rows]


@dataclass(frozen=True)
class WebhookJob:
    """A delivery a sender took: where to POST which event, the secret to sign it with, and
    the claim token its outcome must present."""

    delivery_id: int
    token: str
    url: str
    secret: str = field(repr=False)
    attempt: int
    event: EventView


def _claim_key(s: Session, claim: IdempotencyClaim, now: datetime, resource_id: str) -> None:
    """Insert the key's row in the caller's transaction, first dropping expired keys. A key
    already held raises IdempotencyKeyTaken (on PostgreSQL the insert waits for a concurrent
    holder's transaction to end; SQLite has one writer at a time)."""
    cut = now - timedelta(seconds=claim.retention_seconds)
    s.execute(delete(IdempotencyKeyRow).where(IdempotencyKeyRow.created_at < cut))
    try:
        s.execute(insert(IdempotencyKeyRow).values(
            scope=claim.scope, key=claim.key, request_hash=claim.request_hash,
            resource_id=resource_id, created_at=now,
        ))
    except IntegrityError:
        raise IdempotencyKeyTaken(f"idempotency key {claim.key!r} is held") from None


def _goals_waiting_on_idle_queues(
    s: Session, sent_before: datetime, idle_models: Callable[[set[str]], set[str]], limit: int
) -> set[str]:
    """Goals with a candidate sent before `sent_before`, still unclaimed, whose model's queue
    `idle_models` says is empty: nothing in the broker will ever claim it."""
    waiting = set(
        s.scalars(
            select(CandidateRow.goal_id)
            .where(
                CandidateRow.status == CandidateStatus.QUEUED.value,
                CandidateRow.dispatched_at < sent_before,
            )
            .distinct()
            .limit(limit)
        )
    )
    if not waiting:
        return set()
    model_of = {
        gid: spec["model"]
        for gid, spec in s.execute(select(GoalRow.id, GoalRow.spec).where(GoalRow.id.in_(waiting)))
    }
    idle = idle_models(set(model_of.values()))
    return {gid for gid, model in model_of.items() if model in idle}


class _Held(NamedTuple):
    attempts: int
    goal_id: str
    iteration: int


def _lock_held(s: Session, ids: list[str], token: str) -> dict[str, _Held]:
    """Lock the candidates among `ids` that the claim `token` still holds."""
    rows = s.execute(
        select(CandidateRow.id, CandidateRow.attempts, CandidateRow.goal_id, CandidateRow.iteration)
        .where(
            CandidateRow.id.in_(ids), CandidateRow.claim_token == token,
            CandidateRow.status == CandidateStatus.RUNNING.value,
        )
        .with_for_update()
    )
    return {cid: _Held(attempts, goal_id, it) for cid, attempts, goal_id, it in rows}


# the event log ------------------------------------------------------------------------

Event = tuple[str, str, dict[str, Any]]
"""An event to append: goal id, type, data."""


def _append_events(s: Session, now: datetime, events: Sequence[Event]) -> None:
    """Append events in this transaction, in one statement (every transition's twin).

    PostgreSQL hands out ids when rows are inserted, not when they commit, so two transactions
    writing events of one goal could commit out of id order and a reader keeping the last id
    it saw would skip the one that committed late. A transaction-scoped advisory lock per goal,
    taken just before the insert and held to commit, keeps each goal's ids in commit order.
    It is taken last, and its holder then only needs the key-share lock of the foreign key
    (which no step blocks: they lock goals FOR NO KEY UPDATE), so it adds no deadlock. SQLite
    has one writer at a time already."""
    if not events:
        return
    conn = s.connection()
    if conn.dialect.name == "postgresql":
        for goal_id in sorted({goal_id for goal_id, _, _ in events}):
            conn.execute(
                text("SELECT pg_advisory_xact_lock(hashtextextended(:goal_id, 7))"),
                {"goal_id": goal_id},
            )
    conn.execute(
        insert(EventRow.__table__),
        [{"goal_id": g, "type": t, "data": d, "created_at": now} for g, t, d in events],
    )


def _failed_data(
    candidate_id: str, iteration: int, attempt: int, error: str, retry: bool
) -> dict[str, Any]:
    return {"candidate_id": candidate_id, "iteration": iteration, "attempt": attempt,
            "error": error[:1000], "retry": retry}


def _release_values(new: CandidateStatus, error: str, now: datetime) -> dict[str, Any]:
    """Columns of a candidate handed back: requeued unsent (the outbox sends it) or ended."""
    values: dict[str, Any] = {
        "status": new.value, "error": error[:4000], "claim_token": None,
        "lease_expires_at": None,
    }
    if new is CandidateStatus.QUEUED:
        values.update(queued_at=now, dispatched_at=None)
    else:
        values["finished_at"] = now
    return values


# applying a decision ------------------------------------------------------------------


def _transition_goal(
    s: Session, goal_id: str, expected: str, values: dict[str, Any], now: datetime
) -> None:
    result = s.execute(
        update(GoalRow)
        .where(GoalRow.id == goal_id, GoalRow.status == expected)
        .values(updated_at=now, **values)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(f"goal {goal_id} is not {expected}")


def _apply(s: Session, state: GoalState, d: Decision) -> None:
    goal = state.goal
    now = state.now or utcnow()
    events: list[Event] = []
    iteration_of = {c.id: c for c in state.candidates}
    for r in d.reclaim:
        result = s.execute(
            update(CandidateRow)
            .where(
                CandidateRow.id == r.candidate_id, CandidateRow.claim_token == r.claim_token,
                CandidateRow.status == CandidateStatus.RUNNING.value,
                CandidateRow.lease_expires_at < now,
            )
            .values(_release_values(r.status, r.error, now))
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            continue
        if r.status is CandidateStatus.QUEUED:
            d.dispatch.append(r.candidate_id)
        c = iteration_of[r.candidate_id]
        if r.status is CandidateStatus.CANCELLED:
            events.append((goal.id, "candidate.cancelled", {
                "candidate_id": c.id, "iteration": c.iteration, "reason": r.error,
            }))
        else:
            events.append((goal.id, "candidate.failed", _failed_data(
                c.id, c.iteration, c.attempts, r.error, r.status is CandidateStatus.QUEUED
            )))
    if d.close_iteration is not None:
        result = s.execute(
            update(IterationRow)
            .where(
                IterationRow.goal_id == goal.id,
                IterationRow.index == d.close_iteration,
                IterationRow.status == IterationStatus.OPEN.value,
            )
            .values(status=IterationStatus.CLOSED.value, closed_at=now, best_score=d.iteration_best)
        )
        if result.rowcount != 1:  # type: ignore[attr-defined]
            raise Conflict(f"iteration {d.close_iteration} of goal {goal.id} is not open")
        events.append((goal.id, "iteration.closed",
                       {"index": d.close_iteration, "best_score": d.iteration_best}))
    goal_values: dict[str, Any] = {}
    if d.best is not None:
        goal_values.update(best_candidate_id=d.best[0], best_score=d.best[1])
        events.append((goal.id, "goal.best", {"candidate_id": d.best[0], "score": d.best[1]}))
    if d.new_candidates:
        index, ids = _insert_iteration(s, state, d, now)
        events.append((goal.id, "iteration.opened", {"index": index, "candidate_ids": ids}))
    if d.goal_status is not None:
        goal_values["status"] = d.goal_status.value
        if d.goal_status.terminal:
            goal_values.update(finished_at=now, stop_reason=d.stop_reason, error=d.error)
        events.append((goal.id, "goal.status", {
            "from": goal.status.value, "to": d.goal_status.value, "stop_reason": d.stop_reason,
        }))
    if goal_values:
        _transition_goal(s, goal.id, goal.status.value, goal_values, now)
    if d.goal_status is GoalStatus.CANCELLED:
        events.extend(_cancel_unstarted(s, goal.id, now))
    if d.goal_status is not None and d.goal_status.terminal:
        best = d.best or (goal.best_candidate_id, goal.best_score)
        events.append((goal.id, "goal.finished", {  # a goal's last event: streams end here
            "status": d.goal_status.value, "stop_reason": d.stop_reason, "error": d.error,
            "best_candidate_id": best[0], "best_score": best[1],
        }))
    _append_events(s, now, events)
    d.dispatch.extend(d.redispatch)


def _cancel_unstarted(s: Session, goal_id: str, now: datetime) -> list[Event]:
    """A cancelled goal's queued candidates are cancelled and its open iteration closed, in the
    cancel's transaction; running ones may finish, but nothing of the goal is claimed again.
    Returns the events of what it changed."""
    cancelled = s.execute(
        update(CandidateRow)
        .where(
            CandidateRow.goal_id == goal_id,
            CandidateRow.status == CandidateStatus.QUEUED.value,
        )
        .values(status=CandidateStatus.CANCELLED.value, finished_at=now, error="goal cancelled")
        .returning(CandidateRow.id, CandidateRow.iteration)
        .execution_options(synchronize_session=False)
    ).all()
    closed = s.execute(
        update(IterationRow)
        .where(IterationRow.goal_id == goal_id, IterationRow.status == IterationStatus.OPEN.value)
        .values(status=IterationStatus.CLOSED.value, closed_at=now)
        .returning(IterationRow.index)
        .execution_options(synchronize_session=False)
    ).scalars().all()
    events: list[Event] = [
        (goal_id, "candidate.cancelled",
         {"candidate_id": cid, "iteration": it, "reason": "goal cancelled"})
        for cid, it in sorted(cancelled, key=lambda row: (row[1], row[0]))
    ]
    events += [(goal_id, "iteration.closed", {"index": i, "best_score": None}) for i in closed]
    return events


def _insert_iteration(
    s: Session, state: GoalState, d: Decision, now: datetime
) -> tuple[int, list[str]]:
    """Reserve the budget and insert the next iteration with its candidates; its index and
    candidate ids."""
    goal = state.goal
    n = generation_cost(d.new_candidates, goal.spec.steps)
    reserved = s.execute(
        update(GoalRow)
        .where(GoalRow.id == goal.id, GoalRow.generations_reserved + n <= GoalRow.budget)
        .values(generations_reserved=GoalRow.generations_reserved + n, updated_at=now)
    )
    if reserved.rowcount != 1:  # type: ignore[attr-defined]
        raise BudgetExceeded(f"goal {goal.id}: {n} more generations would exceed its budget")
    index = max((it.index for it in state.iterations), default=-1) + 1
    # Core inserts, not ORM objects: one iteration and its candidates are the hot path of
    # every goal, and the unit of work costs more than the statements themselves
    iteration_id = s.execute(
        insert(IterationRow)
        .values(goal_id=goal.id, index=index, status=IterationStatus.OPEN.value,
                notes=d.notes, created_at=now)
        .returning(IterationRow.id)
    ).scalar_one()
    spec = goal.spec
    params = {
        "model": spec.model, "scorer": spec.scorer, "width": spec.size, "height": spec.size,
        "steps": spec.steps, "guidance": spec.guidance,
    }
    rows = [
        {
            "id": new_id(), "goal_id": goal.id, "iteration_id": iteration_id, "iteration": index,
            "ordinal": ordinal, "prompt": draft.prompt, "negative_prompt": draft.negative_prompt,
            "seed": draft.seed,
            "params": params | draft.noise_and_layout_params() | draft.prune_params(),
            "status": CandidateStatus.QUEUED.value, "attempts": 0, "part_scores": {},
            "timings": {}, "parent_id": draft.parent_id, "edit": draft.edit, "queued_at": now,
        }
        for ordinal, draft in enumerate(d.new_candidates)
    ]
    s.connection().execute(insert(CandidateRow.__table__), rows)
    ids = [row["id"] for row in rows]
    d.dispatch.extend(ids)
    return index, ids


# rows → views -------------------------------------------------------------------------


def _read_state(s: Session, row: GoalRow) -> GoalState:
    iterations = s.scalars(
        select(IterationRow).where(IterationRow.goal_id == row.id).order_by(IterationRow.index)
    )
    candidates = s.scalars(
        select(CandidateRow)
        .where(CandidateRow.goal_id == row.id)
        .order_by(CandidateRow.iteration, CandidateRow.ordinal)
    )
    return GoalState(
        goal=_goal_view(row),
        iterations=[_iteration_view(i) for i in iterations],
        candidates=[_candidate_view(c) for c in candidates],
    )


def _goal_view(r: GoalRow) -> GoalView:
    return GoalView(
        id=r.id, tenant=r.tenant, text=r.text, spec=GoalSpec.from_json(r.spec),
        status=GoalStatus(r.status), stop_reason=r.stop_reason, budget=r.budget,
        generations_reserved=r.generations_reserved, best_candidate_id=r.best_candidate_id,
        best_score=r.best_score, error=r.error, created_at=r.created_at,
        updated_at=r.updated_at, finished_at=r.finished_at,
    )


def _iteration_view(r: IterationRow) -> IterationView:
    return IterationView(
        index=r.index, status=IterationStatus(r.status), notes=r.notes or {},
        best_score=r.best_score, created_at=r.created_at, closed_at=r.closed_at,
    )


def _candidate_view(r: CandidateRow) -> CandidateView:
    return CandidateView(
        id=r.id, goal_id=r.goal_id, iteration=r.iteration, ordinal=r.ordinal, prompt=r.prompt,
        negative_prompt=r.negative_prompt, seed=r.seed, params=r.params or {},
        status=CandidateStatus(r.status), attempts=r.attempts, worker=r.worker,
        clip_score=r.clip_score, part_scores=r.part_scores or {}, artifact_uri=r.artifact_uri,
        timings=r.timings or {}, error=r.error, parent_id=r.parent_id, edit=r.edit,
        queued_at=r.queued_at, started_at=r.started_at, finished_at=r.finished_at,
        claim_token=r.claim_token, lease_expires_at=r.lease_expires_at,
        dispatched_at=r.dispatched_at,
    )


def _event_view(r: EventRow) -> EventView:
    return EventView(id=r.id, goal_id=r.goal_id, type=r.type, data=r.data or {},
                     created_at=r.created_at)


def _stored_parts(spec: dict[str, Any] | None) -> tuple[dict[str, Any], ...] | None:
    """The parts a goal's spec JSON stores, if any."""
    parts = (spec or {}).get("parts")
    return tuple(parts) if parts is not None else None
