"""The Celery app: `celery -A workers.app worker -Q control`, `-Q gen.<model> --pool threads
-c 1`, and `celery -A workers.app beat` for the sweep and the webhook deliveries.

Configured for long GPU jobs: late acks, one message prefetched at a time, task events on so
Flower shows every task. A message is only a hint: a candidate's lease in the database, not the
broker's visibility timeout, decides when a dead worker's work is taken back, and the sweep
(sent by beat every `sweep_interval_seconds`) resends whatever a lost message left behind.
The visibility timeout must exceed the lease (checked when the settings load).
"""

from __future__ import annotations

from typing import Any

from celery import Celery, signals

from agentloop.settings import get_settings
from workers import broker


def make_app() -> Celery:
    broker.install()  # a worker survives a Redis restart mid-task (see workers/broker.py)
    settings = get_settings()
    app = Celery("agentloop", broker=settings.broker_url or "redis://127.0.0.1:6379/0")
    visibility = {"visibility_timeout": settings.visibility_timeout}
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=dict(visibility),
        result_backend_transport_options=dict(visibility),
        visibility_timeout=settings.visibility_timeout,
        task_ignore_result=True,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue="control",
        task_routes={"agentloop.advance_goal": {"queue": "control"}},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        # a worker whose broker restarted reconnects and keeps consuming
        broker_connection_retry=True,
        broker_connection_max_retries=None,
        beat_schedule={
            "agentloop-sweep": {
                "task": "agentloop.sweep",
                "schedule": settings.sweep_interval_seconds,
                # a sweep that waited a whole interval is stale: the next one replaces it
                "options": {"queue": "control", "expires": settings.sweep_interval_seconds},
            },
            "agentloop-webhooks": {
                "task": "agentloop.deliver_webhooks",
                "schedule": settings.webhook_interval_seconds,
                "options": {"queue": "control", "expires": settings.webhook_interval_seconds},
            },
        },
    )
    return app


@signals.worker_ready.connect
def _watch_consuming(sender: Any, **_: Any) -> None:
    """Every worker stops itself once it has stopped consuming (`workers.watchdog`)."""
    from workers import watchdog

    watchdog.start(sender, get_settings().worker_watchdog_seconds)


app = make_app()
import workers.tasks  # noqa: E402,F401 - registers the tasks on the app
