"""The SDK's return types: the API's own response bodies, under the names callers use.

`agentloop.api.schemas` imports only pydantic and `agentloop.domain` (which imports
`agentloop.settings`, i.e. pydantic-settings); nothing there pulls FastAPI or the database.
"""

from __future__ import annotations

from agentloop.api.schemas import (
    SCORE_SCALE,
    CandidateOut,
    GoalOut,
    IterationAccepted,
    IterationOut,
    PromptIn,
)

Goal = GoalOut
Candidate = CandidateOut
Iteration = IterationOut
Prompt = PromptIn

__all__ = ["SCORE_SCALE", "Candidate", "Goal", "Iteration", "IterationAccepted", "Prompt"]
