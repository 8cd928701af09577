"""The Celery app: `celery -A workers.app worker -Q control` / `-Q gen.<model> --pool solo`.

Configured for long GPU jobs: late acks, requeue when a worker dies, one message prefetched
at a time, a Redis visibility timeout longer than any generation (set in all three places
Celery reads it), and task events on so Flower shows every task.
"""

from __future__ import annotations

from celery import Celery

from agentloop.settings import get_settings


def make_app() -> Celery:
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
    )
    return app


app = make_app()
import workers.tasks  # noqa: E402,F401 - registers the tasks on the app
