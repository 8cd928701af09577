"""The Python SDK: `Client` and `AsyncClient` over agentloop's HTTP API.

    from agentloop import Client

    with Client("http://127.0.0.1:8000") as client:
        goal = client.create_goal("a red circle and a blue square", budget=8)
        goal = client.wait(goal.id)
        png = client.artifact(goal.best_candidate)

Light by design: httpx and pydantic only, never torch, FastAPI or the database.
Scores are CLIPScore = 2.5 * max(cos, 0) (Hessel et al. 2021), from 0 to 2.5.
"""

from agentloop.sdk._async import AsyncClient
from agentloop.sdk._base import SETTLED, BaseClient, Page
from agentloop.sdk._client import Client
from agentloop.sdk._errors import AgentloopError, Conflict, InvalidRequest, NotFound, ServerError
from agentloop.sdk._events import Event
from agentloop.sdk._models import (
    SCORE_SCALE,
    Candidate,
    Goal,
    Iteration,
    IterationAccepted,
    Models,
    Prompt,
    WebhookDelivery,
)

__all__ = [
    "SCORE_SCALE",
    "SETTLED",
    "AgentloopError",
    "AsyncClient",
    "BaseClient",
    "Candidate",
    "Client",
    "Conflict",
    "Event",
    "Goal",
    "InvalidRequest",
    "Iteration",
    "IterationAccepted",
    "Models",
    "NotFound",
    "Page",
    "Prompt",
    "ServerError",
    "WebhookDelivery",
]
