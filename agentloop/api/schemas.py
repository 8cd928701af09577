"""Response and request bodies of the HTTP API.

They live in `agentloop.models` (no server imports) so that the SDK shares them without
installing the server; this module keeps the API's import path.
"""

from __future__ import annotations

from agentloop.models import (
    SCORE_SCALE,
    CandidateOut,
    ErrorInfo,
    ErrorOut,
    EventOut,
    FieldError,
    GoalOut,
    IterationAccepted,
    IterationIn,
    IterationOut,
    ModelsOut,
    PromptIn,
    RegionIn,
    UtcDateTime,
    WebhookDeliveryOut,
)

__all__ = [
    "SCORE_SCALE",
    "CandidateOut",
    "EventOut",
    "ErrorInfo",
    "ErrorOut",
    "FieldError",
    "GoalOut",
    "IterationAccepted",
    "IterationIn",
    "IterationOut",
    "ModelsOut",
    "PromptIn",
    "RegionIn",
    "UtcDateTime",
    "WebhookDeliveryOut",
]
