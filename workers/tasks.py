"""Celery tasks: thin wrappers that run the task functions in `workers.jobs`.

A generation task batches across goals: it takes the other generation messages waiting in its
queue and runs their candidates with its own (`workers.coalesce`, settings `gen_coalesce`,
`gen_max_batch`, `gen_max_wait_ms`).

Transient database and broker errors are retried with exponential backoff and jitter
(`autoretry_for`) instead of being acked away; anything a retry cannot fix is left to the
sweep, which finds the work in the database whatever happened to the message.
"""

from __future__ import annotations

import logging
import threading
import time

import httpx

from agentloop.settings import get_settings
from agentloop.store import Store
from workers.app import app
from workers.celery_dispatch import CeleryDispatcher
from workers.coalesce import Coalescer, queue_of
from workers.jobs import (
    WorkerContext,
    advance_goal_job,
    generate_job,
    reconcile,
    transient_errors,
)
from workers.residency import Residency
from workers.webhooks import deliver_webhooks as deliver_webhooks_job
from workers.webhooks import http_client

log = logging.getLogger(__name__)
_ctx: WorkerContext | None = None
_ctx_lock = threading.Lock()
_http: httpx.Client | None = None

RETRY = {
    "autoretry_for": transient_errors(),
    "retry_backoff": 1,  # 1 s, 2 s, 4 s, ... with full jitter
    "retry_backoff_max": 30,
    "retry_jitter": True,
    "max_retries": 8,
}


def worker_context() -> WorkerContext:
    """This process's context: one store (connection pool) and one model residency."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            settings = get_settings()
            _ctx = WorkerContext(
                store=Store(settings.resolved_database_url(), settings.db_connect_timeout),
                dispatcher=CeleryDispatcher(app),
                settings=settings, residency=Residency.for_settings(settings, worker=True),
            )
        return _ctx


@app.task(name="agentloop.advance_goal", **RETRY)
def advance_goal(goal_id: str) -> list[str]:
    """The orchestrator's step for one goal (idempotent)."""
    return advance_goal_job(worker_context(), goal_id)


@app.task(name="agentloop.generate", bind=True, **RETRY)
def generate(self, candidate_ids: list[str]) -> list[str]:  # noqa: ANN001 - the bound task
    """Generate, score and record candidates (idempotent by candidate id), with those of the
    generation messages waiting in the same queue when coalescing is on."""
    ctx = worker_context()
    s = ctx.settings
    if not s.gen_coalesce:
        return generate_job(ctx, candidate_ids)
    coalescer = Coalescer(app, s.gen_max_batch, s.gen_max_wait_ms / 1000)
    started = time.monotonic()
    with coalescer.take(queue_of(self.request.delivery_info), len(candidate_ids)) as taken:
        completed = generate_job(ctx, list(dict.fromkeys([*candidate_ids, *taken.ids])))
    _report_taken(self, taken.task_ids, time.monotonic() - started)
    return completed


def _report_taken(task, task_ids: list[str], runtime: float) -> None:  # noqa: ANN001
    """Task events for the messages a batch took in, so that Flower shows them started and
    succeeded on this worker, with the task that ran them as their result."""
    if not task_ids or not app.conf.worker_send_task_events:
        return
    hostname = task.request.hostname
    try:
        with app.events.default_dispatcher(hostname=hostname) as events:
            for task_id in task_ids:
                events.send("task-started", uuid=task_id)
                events.send("task-succeeded", uuid=task_id, runtime=runtime,
                            result=repr(f"ran in the batch of {task.request.id}"))
    except Exception:  # noqa: BLE001 - monitoring only; the work is recorded
        log.warning("could not send task events for %d coalesced task(s)", len(task_ids),
                    exc_info=True)


@app.task(name="agentloop.sweep", ignore_result=True)
def sweep() -> list[str]:
    """The reconciler, sent by Celery beat every `sweep_interval_seconds`: advances whatever a
    lost message left behind. Not retried: the next sweep comes soon."""
    return reconcile(worker_context())


@app.task(name="agentloop.deliver_webhooks", ignore_result=True)
def deliver_webhooks() -> int:
    """Send due webhook deliveries, sent by Celery beat every `webhook_interval_seconds`. Not
    retried: the next one comes soon, and a delivery's own retries live in the database."""
    global _http
    ctx = worker_context()
    with _ctx_lock:
        if _http is None:
            _http = http_client()
    return deliver_webhooks_job(ctx.store, ctx.settings, _http)
