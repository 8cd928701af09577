"""The store: the only module that issues SQL.

Every status change is one transaction guarded by the status it expects
(`UPDATE … WHERE status = :expected`), so a duplicate task delivery changes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Engine, create_engine, event, func, select, text, update
from sqlalchemy.orm import Session

from agentloop.domain import (
    CandidateStatus,
    CandidateView,
    Decision,
    GoalSpec,
    GoalState,
    GoalStatus,
    GoalView,
    IterationStatus,
    IterationView,
)
from agentloop.store.models import CandidateRow, GoalRow, IterationRow


class Conflict(RuntimeError):
    """A guarded update found a row in another state than expected; the transaction rolled back."""


class BudgetExceeded(Conflict):
    """Reserving generations would exceed the goal's budget."""


def utcnow() -> datetime:
    """Naive UTC, the one timestamp form stored in every backend."""
    return datetime.now(UTC).replace(tzinfo=None)


def new_id() -> str:
    return uuid.uuid4().hex


def make_engine(url: str) -> Engine:
    """An engine; SQLite gets WAL, a busy timeout and write-locking transactions (BEGIN IMMEDIATE)."""
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True, future=True)
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

    def __init__(self, url: str):
        self.url = url
        self.engine = make_engine(url)
        self.is_sqlite = url.startswith("sqlite")

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    def dispose(self) -> None:
        self.engine.dispose()

    def ping(self) -> bool:
        """True when the database answers."""
        with self._tx() as s:
            return s.execute(text("SELECT 1")).scalar() == 1

    # goals ---------------------------------------------------------------------------

    def create_goal(self, spec: GoalSpec) -> GoalView:
        """Insert a pending goal."""
        now = utcnow()
        row = GoalRow(
            id=new_id(), tenant=spec.tenant, text=spec.goal, spec=spec.to_json(),
            status=GoalStatus.PENDING.value, budget=spec.budget, generations_reserved=0,
            created_at=now, updated_at=now,
        )
        with self._tx() as s:
            s.add(row)
        return _goal_view(row)

    def get_goal(self, goal_id: str) -> GoalView | None:
        with self._tx() as s:
            row = s.get(GoalRow, goal_id)
            return _goal_view(row) if row else None

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

    def decide(self, goal_id: str, decide: Callable[[GoalState], Decision]) -> Decision | None:
        """Lock the goal, let `decide` look at its state, apply the decision, commit.

        Returns None when the goal does not exist. Concurrent calls for one goal run one
        after the other (row lock on PostgreSQL, the write lock on SQLite).
        """
        with self._tx() as s:
            row = s.scalars(
                select(GoalRow).where(GoalRow.id == goal_id).with_for_update()
            ).first()
            if row is None:
                return None
            state = _read_state(s, row)
            decision = decide(state)
            decision.model = state.goal.spec.model
            if not decision.is_noop:
                _apply(s, state, decision)
            return decision

    # generation workers ---------------------------------------------------------------

    def claim_candidates(
        self, ids: Sequence[str], worker: str, lease_seconds: float, max_attempts: int
    ) -> list[CandidateView]:
        """Move queued candidates (or running ones whose lease expired) to running for `worker`.

        Returns only those this call claimed: a duplicate delivery claims nothing.
        """
        now = utcnow()
        stale = now - timedelta(seconds=lease_seconds)
        claimed: list[str] = []
        with self._tx() as s:
            for cid in ids:
                result = s.execute(
                    update(CandidateRow)
                    .where(
                        CandidateRow.id == cid,
                        CandidateRow.attempts < max_attempts,
                        (CandidateRow.status == CandidateStatus.QUEUED.value)
                        | (
                            (CandidateRow.status == CandidateStatus.RUNNING.value)
                            & (CandidateRow.started_at < stale)
                        ),
                    )
                    .values(
                        status=CandidateStatus.RUNNING.value, worker=worker,
                        attempts=CandidateRow.attempts + 1, started_at=now, error=None,
                    )
                )
                if result.rowcount == 1:  # type: ignore[attr-defined]
                    claimed.append(cid)
        return self.get_candidates(claimed)

    def complete_candidate(
        self,
        candidate_id: str,
        worker: str,
        *,
        clip_score: float,
        part_scores: dict[str, float],
        artifact_uri: str,
        timings: dict[str, float],
    ) -> bool:
        """running → succeeded with its score and image; False if it was not ours to finish."""
        with self._tx() as s:
            result = s.execute(
                update(CandidateRow)
                .where(
                    CandidateRow.id == candidate_id,
                    CandidateRow.status == CandidateStatus.RUNNING.value,
                    CandidateRow.worker == worker,
                )
                .values(
                    status=CandidateStatus.SUCCEEDED.value, clip_score=clip_score,
                    part_scores=part_scores, artifact_uri=artifact_uri, timings=timings,
                    finished_at=utcnow(),
                )
            )
            return result.rowcount == 1  # type: ignore[attr-defined]

    def release_candidate(
        self, candidate_id: str, worker: str, error: str, max_attempts: int
    ) -> CandidateStatus | None:
        """After a failed attempt: running → queued to retry, or → failed after max_attempts.

        Returns the new status, or None if the candidate was not ours.
        """
        with self._tx() as s:
            row = s.get(CandidateRow, candidate_id)
            if row is None or row.status != CandidateStatus.RUNNING.value or row.worker != worker:
                return None
            new = (
                CandidateStatus.QUEUED if row.attempts < max_attempts else CandidateStatus.FAILED
            )
            result = s.execute(
                update(CandidateRow)
                .where(
                    CandidateRow.id == candidate_id,
                    CandidateRow.status == CandidateStatus.RUNNING.value,
                    CandidateRow.worker == worker,
                )
                .values(
                    status=new.value, error=error[:4000], queued_at=utcnow(),
                    finished_at=utcnow() if new is CandidateStatus.FAILED else None,
                )
            )
            return new if result.rowcount == 1 else None  # type: ignore[attr-defined]

    def count_candidates(self, goal_id: str) -> int:
        with self._tx() as s:
            return int(
                s.scalar(select(func.count()).where(CandidateRow.goal_id == goal_id)) or 0
            )


# applying a decision ------------------------------------------------------------------


def _transition_goal(
    s: Session, goal_id: str, expected: str, values: dict[str, Any]
) -> None:
    result = s.execute(
        update(GoalRow)
        .where(GoalRow.id == goal_id, GoalRow.status == expected)
        .values(updated_at=utcnow(), **values)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(f"goal {goal_id} is not {expected}")


def _apply(s: Session, state: GoalState, d: Decision) -> None:
    goal = state.goal
    now = utcnow()
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
    goal_values: dict[str, Any] = {}
    if d.best is not None:
        goal_values.update(best_candidate_id=d.best[0], best_score=d.best[1])
    if d.new_candidates:
        _insert_iteration(s, state, d, now)
    if d.goal_status is not None:
        goal_values["status"] = d.goal_status.value
        if d.goal_status.terminal:
            goal_values.update(finished_at=now, stop_reason=d.stop_reason, error=d.error)
    if goal_values:
        _transition_goal(s, goal.id, goal.status.value, goal_values)
    if d.redispatch:
        s.execute(
            update(CandidateRow)
            .where(
                CandidateRow.id.in_(d.redispatch),
                CandidateRow.status == CandidateStatus.QUEUED.value,
            )
            .values(queued_at=now)
        )
        d.dispatch.extend(d.redispatch)


def _insert_iteration(s: Session, state: GoalState, d: Decision, now: datetime) -> None:
    goal = state.goal
    n = len(d.new_candidates)
    reserved = s.execute(
        update(GoalRow)
        .where(GoalRow.id == goal.id, GoalRow.generations_reserved + n <= GoalRow.budget)
        .values(generations_reserved=GoalRow.generations_reserved + n)
    )
    if reserved.rowcount != 1:  # type: ignore[attr-defined]
        raise BudgetExceeded(f"goal {goal.id}: {n} more generations would exceed its budget")
    index = max((it.index for it in state.iterations), default=-1) + 1
    iteration = IterationRow(
        goal_id=goal.id, index=index, status=IterationStatus.OPEN.value, notes=d.notes,
        created_at=now,
    )
    s.add(iteration)
    s.flush()
    spec = goal.spec
    params = {
        "model": spec.model, "scorer": spec.scorer, "width": spec.size, "height": spec.size,
        "steps": spec.steps, "guidance": spec.guidance,
    }
    for ordinal, draft in enumerate(d.new_candidates):
        cid = new_id()
        s.add(
            CandidateRow(
                id=cid, goal_id=goal.id, iteration_id=iteration.id, iteration=index,
                ordinal=ordinal, prompt=draft.prompt, negative_prompt=draft.negative_prompt,
                seed=draft.seed, params=params | draft.noise_and_layout_params(),
                status=CandidateStatus.QUEUED.value,
                attempts=0, part_scores={}, timings={}, parent_id=draft.parent_id,
                edit=draft.edit, queued_at=now,
            )
        )
        d.dispatch.append(cid)


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
    )
