"""`Idempotency-Key` on the routes that create: a retried request answers the first response.

The key's row is inserted in the transaction that creates the goal or iteration (the store's
`claim`), so two concurrent requests with one key cannot both create: the second waits a
moment for the first's answer, then answers 409 `idempotency_in_progress`. Only a success is
recorded as the key's answer; a request that failed for want of the broker drops its key, so
the caller may send it again with the same key.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Header
from fastapi.responses import JSONResponse

from agentloop.api.errors import ApiError
from agentloop.settings import Settings
from agentloop.store import IdempotencyClaim, IdempotencyKeyTaken, Store

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key", min_length=1, max_length=255, pattern=r"^[\x21-\x7e]+$",
        description="Any unique string (a UUID): the same key and body answer the first "
        "response without doing the work again; the same key with another body answers 422 "
        "`idempotency_key_reused`. Keys are kept 24 h, per tenant and route.",
    ),
]

WAIT_FOR_FIRST_SECONDS = 2.0
"""How long a request waits for a concurrent one with its key to answer, before 409."""

REPLAYED_HEADER = "Idempotent-Replayed"


def request_hash(*parts: Any) -> str:
    """A digest of what a request asks (its parsed body and path), to tell a retry from reuse."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def run_once(
    store: Store, settings: Settings, scope: str, key: str | None, digest: str,
    work: Callable[[IdempotencyClaim | None], tuple[int, Any]],
) -> JSONResponse:
    """Answer `work(claim)`'s (status, JSON body) once per key; replays answer the first.

    `work` records the claim in the transaction that creates; an `ApiError` of 5xx from it
    means the creation was undone (or failed), so the key is dropped for a retry."""
    if key is None:
        status, body = work(None)
        return JSONResponse(body, status_code=status)
    claim = IdempotencyClaim(scope, key, digest, settings.idempotency_retention_seconds)
    for _ in range(3):  # a holder that rolled back frees the key: claim it again
        replay = _replay(store, claim)
        if replay is not None:
            return replay
        try:
            status, body = work(claim)
        except IdempotencyKeyTaken:
            continue
        except ApiError as exc:
            if exc.status_code >= 500:
                store.forget_idempotency_key(scope, key)
            raise
        store.answer_idempotency_key(scope, key, status, body)
        return JSONResponse(body, status_code=status)
    raise _in_progress()


def _replay(store: Store, claim: IdempotencyClaim) -> JSONResponse | None:
    """The key's first answer; None when the key is free; waits while its request runs."""
    deadline = time.monotonic() + WAIT_FOR_FIRST_SECONDS
    while True:
        record = store.idempotency_record(claim.scope, claim.key, claim.retention_seconds)
        if record is None:
            return None
        if record.request_hash != claim.request_hash:
            raise ApiError(422, "idempotency_key_reused",
                           "this Idempotency-Key was sent with another request; use a new key",
                           field="Idempotency-Key")
        if record.response_status is not None:
            return JSONResponse(record.response_body, status_code=record.response_status,
                                headers={REPLAYED_HEADER: "true"})
        if time.monotonic() > deadline:
            raise _in_progress()
        time.sleep(0.05)


def _in_progress() -> ApiError:
    return ApiError(409, "idempotency_in_progress",
                    "a request with this Idempotency-Key is still running; retry shortly",
                    field="Idempotency-Key", headers={"Retry-After": "1"})
