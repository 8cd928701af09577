"""What the SDK raises when the API answers with an error."""

from __future__ import annotations

from typing import Any


class AgentloopError(Exception):
    """The API answered with an error status. `status_code` and `code` (the server's stable
    error code, e.g. `iteration_open`; see docs/api.md) say which; `field` names the input at
    fault when one is; `detail` is the raw body's `detail`."""

    def __init__(
        self, message: str, *, status_code: int, detail: Any = None, code: str | None = None,
        field: str | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail
        self.code = code
        self.field = field


class NotFound(AgentloopError):
    """404: no such goal or artifact."""


class InvalidRequest(AgentloopError):
    """422: the request was rejected; `errors` holds (field, message) pairs."""

    def __init__(
        self, message: str, *, status_code: int, detail: Any, errors: list[tuple[str, str]],
        code: str | None = None, field: str | None = None,
    ):
        super().__init__(message, status_code=status_code, detail=detail, code=code, field=field)
        self.errors = errors


class Conflict(AgentloopError):
    """409: the goal's state does not allow this now (`code`: not_external, goal_not_waiting,
    iteration_open, budget_exceeded, goal_finished, idempotency_in_progress)."""


class ServerError(AgentloopError):
    """5xx: the server failed; the request may be retried."""
