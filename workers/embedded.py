"""The embedded runtime: the same task functions, run in threads of this process."""

from __future__ import annotations

from agentloop.dispatch import InProcessDispatcher
from agentloop.settings import Settings
from agentloop.store import Store
from workers.jobs import WorkerContext, advance_goal_job, generate_job, reconcile
from workers.residency import Residency
from workers.webhooks import deliver_webhooks, http_client


def embedded_runtime(
    store: Store, settings: Settings, residency: Residency | None = None,
    sweep: bool = True,
) -> tuple[InProcessDispatcher, WorkerContext]:
    """An in-process dispatcher bound to the task functions, and the context they share.

    With `sweep`, the reconciler runs once now (work a previous process left behind: a goal
    whose process was killed resumes when the next one starts) and then every
    `sweep_interval_seconds` in a thread, and webhook deliveries are sent every
    `webhook_interval_seconds` in another.
    """
    dispatcher = InProcessDispatcher(max_coalesce=settings.gen_max_batch)
    ctx = WorkerContext(
        store=store, dispatcher=dispatcher, settings=settings,
        residency=residency or Residency.for_settings(settings),
        worker_name=settings.worker_name or "embedded",
    )
    dispatcher.bind(lambda gid: advance_goal_job(ctx, gid), lambda ids: generate_job(ctx, ids))
    if sweep:
        dispatcher.every(settings.sweep_interval_seconds, lambda: reconcile(ctx))
        http = http_client()
        dispatcher.every(settings.webhook_interval_seconds,
                         lambda: deliver_webhooks(store, settings, http))
    return dispatcher, ctx
