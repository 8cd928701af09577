"""Webhook delivery: a goal's events POSTed to the URL it named, signed the way the Standard
Webhooks specification says (`webhook-id`, `webhook-timestamp`, `webhook-signature`), retried
with exponential backoff and jitter, every attempt's outcome recorded.

`deliver_webhooks` is one pass: fan new events out into deliveries, take the due ones, send
them. Celery beat sends it every `webhook_interval_seconds` (task `agentloop.deliver_webhooks`);
the embedded runtime runs it in a thread as often.
"""

from __future__ import annotations

import json
import logging
import random
from datetime import UTC, datetime

import httpx
from standardwebhooks import Webhook

from agentloop.settings import Settings
from agentloop.store import Store, WebhookJob

log = logging.getLogger(__name__)

BATCH = 100
"""Most deliveries one pass takes (the next pass, a second later, takes more)."""


def webhook_body(job: WebhookJob) -> str:
    """The JSON the receiver gets: the event's type, time, and its data with its ids."""
    e = job.event
    return json.dumps({
        "type": e.type,
        "timestamp": e.created_at.replace(tzinfo=UTC).isoformat().replace("+00:00", "Z"),
        "data": {"event_id": e.id, "goal_id": e.goal_id, **e.data},
    }, separators=(",", ":"))


def signed_headers(job: WebhookJob, body: str, now: datetime | None = None) -> dict[str, str]:
    """Standard Webhooks headers: an id stable across retries (the receiver's dedup key), the
    send time, and the HMAC-SHA256 signature of `id.timestamp.body`."""
    msg_id = f"evt_{job.event.id}"
    at = now or datetime.now(UTC)
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": Webhook(job.secret).sign(msg_id, at, body),
        "content-type": "application/json",
    }


def backoff(attempt: int, settings: Settings) -> float:
    """Seconds before the next attempt after `attempt` failed ones: the base doubled each
    attempt up to the cap, with full jitter over its upper half (never a burst at zero)."""
    ceiling = min(settings.webhook_backoff_max_seconds,
                  settings.webhook_backoff_seconds * 2 ** max(attempt - 1, 0))
    return random.uniform(ceiling / 2, ceiling)


def send(job: WebhookJob, http: httpx.Client, settings: Settings) -> tuple[bool, int | None, str | None]:
    """POST one delivery; (delivered, status code, error text)."""
    body = webhook_body(job)
    try:
        answer = http.post(job.url, content=body.encode(), headers=signed_headers(job, body),
                           timeout=settings.webhook_timeout_seconds, follow_redirects=False)
    except httpx.HTTPError as exc:
        return False, None, f"{type(exc).__name__}: {exc}"
    if 200 <= answer.status_code < 300:
        return True, answer.status_code, None
    return False, answer.status_code, f"HTTP {answer.status_code}: {answer.text[:200]}"


def deliver_webhooks(store: Store, settings: Settings, http: httpx.Client) -> int:
    """One pass: fan out new events, then send the due deliveries one by one and record each
    outcome. Returns how many were delivered."""
    store.fan_out_webhooks(limit=1000)  # a larger backlog: the next passes read on
    jobs = store.claim_webhook_deliveries(
        BATCH, settings.webhook_lease_seconds, settings.webhook_max_attempts
    )
    delivered = 0
    for job in jobs:
        ok, code, error = send(job, http, settings)
        status = store.finish_webhook_delivery(
            job.delivery_id, job.token, delivered=ok, status_code=code, error=error,
            retry_after=backoff(job.attempt, settings),
            max_attempts=settings.webhook_max_attempts,
        )
        if ok and status == "delivered":
            delivered += 1
        elif status == "failed":
            log.warning("webhook delivery %s to %s failed after %s attempts: %s",
                        job.delivery_id, job.url, job.attempt, error)
    return delivered


def http_client() -> httpx.Client:
    """The client deliveries go out through (one per process)."""
    return httpx.Client(headers={"user-agent": "agentloop-webhooks"})
