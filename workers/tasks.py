"""Celery tasks: thin wrappers that run the task functions in `workers.jobs`."""

from __future__ import annotations

import threading

from agentloop.settings import get_settings
from agentloop.store import Store
from workers.app import app
from workers.celery_dispatch import CeleryDispatcher
from workers.jobs import WorkerContext, advance_goal_job, generate_job
from workers.residency import Residency

_ctx: WorkerContext | None = None
_ctx_lock = threading.Lock()


def worker_context() -> WorkerContext:
    """This process's context: one store (connection pool) and one model residency."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            settings = get_settings()
            _ctx = WorkerContext(
                store=Store(settings.resolved_database_url()),
                dispatcher=CeleryDispatcher(app),
                settings=settings, residency=Residency.for_settings(settings),
            )
        return _ctx


@app.task(name="agentloop.advance_goal")
def advance_goal(goal_id: str) -> list[str]:
    """The orchestrator's step for one goal (idempotent)."""
    return advance_goal_job(worker_context(), goal_id)


@app.task(name="agentloop.generate")
def generate(candidate_ids: list[str]) -> list[str]:
    """Generate, score and record candidates (idempotent by candidate id)."""
    return generate_job(worker_context(), candidate_ids)
