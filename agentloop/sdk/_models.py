"""The SDK's return types: the API's own wire models, under the names callers use.

They come from `agentloop.models`, which imports pydantic and the standard library only
(through `agentloop.domain`'s text types): never the server, its settings or the engine.
"""

from __future__ import annotations

from agentloop.models import (
    SCORE_SCALE,
    CandidateOut,
    GoalOut,
    IterationAccepted,
    IterationOut,
    ModelsOut,
    PromptIn,
    WebhookDeliveryOut,
)

Goal = GoalOut
Candidate = CandidateOut
Iteration = IterationOut
Prompt = PromptIn
Models = ModelsOut
WebhookDelivery = WebhookDeliveryOut

__all__ = [
    "SCORE_SCALE",
    "Candidate",
    "Goal",
    "Iteration",
    "IterationAccepted",
    "Models",
    "Prompt",
    "WebhookDelivery",
]
