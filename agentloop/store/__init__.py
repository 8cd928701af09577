"""The store: ORM models and the only module that issues SQL."""

from agentloop.store.store import (
    BudgetExceeded,
    Conflict,
    IdempotencyClaim,
    IdempotencyKeyTaken,
    IdempotencyRecord,
    Outcome,
    Store,
    WebhookJob,
    new_id,
    utcnow,
)

__all__ = [
    "BudgetExceeded",
    "Conflict",
    "IdempotencyClaim",
    "IdempotencyKeyTaken",
    "IdempotencyRecord",
    "Outcome",
    "Store",
    "WebhookJob",
    "new_id",
    "utcnow",
]
