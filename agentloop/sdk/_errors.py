"""What the SDK raises when the API answers with an error."""

from __future__ import annotations

from typing import Any


class AgentloopError(Exception):
    """The API answered with an error status; `status_code` and `detail` say which."""

    def __init__(self, message: str, *, status_code: int, detail: Any = None):
        super().__init__(message)
        self.status_code = status_code
        self.detail = detail


class NotFound(AgentloopError):
    """404: no such goal or artifact."""


class InvalidRequest(AgentloopError):
    """422: the request was rejected; `errors` holds (field, message) pairs."""

    def __init__(self, message: str, *, status_code: int, detail: Any, errors: list[tuple[str, str]]):
        super().__init__(message, status_code=status_code, detail=detail)
        self.errors = errors


class Conflict(AgentloopError):
    """409: the goal's state does not allow this now (not waiting, iteration open, budget)."""


class ServerError(AgentloopError):
    """5xx: the server failed; the request may be retried."""
