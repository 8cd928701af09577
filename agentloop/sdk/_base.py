"""Everything the two clients share that does no I/O: URLs, headers, requests, answers.

`Client` and `AsyncClient` build a `Call` here, send it their own way, and hand the
response back to `BaseClient._answer`, which raises or parses. Like httpx's `BaseClient`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from agentloop.sdk._errors import AgentloopError, Conflict, InvalidRequest, NotFound, ServerError
from agentloop.sdk._models import Candidate, Goal, IterationAccepted, Models

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "AGENTLOOP_URL"
"""Environment variable read for the server's URL when none is given."""
TOKEN_ENV = "AGENTLOOP_TOKEN"
"""Environment variable read for the bearer token when none is given."""
SETTLED = frozenset({"done", "failed", "cancelled", "waiting"})
"""Goal statuses `wait` returns at: terminal, or waiting for the caller's prompts."""

GoalRef = str | Goal
"""A goal id, or a goal the server returned."""
PromptLike = str | Mapping[str, Any]
"""A prompt, or a mapping with `prompt` and optionally `seed`, `negative_prompt`,
`variation_seed` and `variation_strength`, and `regions` (a layout: a list of mappings with
`prompt`, `x` and `y`); see `POST /v1/goals/{id}/iterations`."""

_CANDIDATES = TypeAdapter(list[Candidate])
_GOALS = TypeAdapter(list[Goal])
_HEALTH = TypeAdapter(dict[str, str])


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API request, built without I/O, and how to read a successful answer to it."""

    method: str
    url: str
    parse: Callable[[httpx.Response], T]
    params: dict[str, Any] | None = None
    json: Any = None


class BaseClient:
    """The server's address, the headers sent with every request, and the API's calls.

    `base_url` defaults to `$AGENTLOOP_URL`, then http://127.0.0.1:8000; `token` (sent as
    `Authorization: Bearer ...`) defaults to `$AGENTLOOP_TOKEN`.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 30.0,
    ):
        self.base_url = (base_url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.headers: dict[str, str] = {"User-Agent": f"agentloop-sdk/{_version()}"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.headers.update(headers or {})
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    # building calls ----------------------------------------------------------------------

    def _url(self, path: str) -> str:
        return self.base_url + path

    def _goal_url(self, goal: GoalRef, suffix: str = "") -> str:
        goal_id = goal.id if isinstance(goal, Goal) else goal
        # Quoted whole, dots included, so an id can never reach another route ("..", "/", "?").
        return self._url(f"/v1/goals/{quote(goal_id, safe='').replace('.', '%2E')}{suffix}")

    def _create_goal(self, goal: str, options: Mapping[str, Any]) -> Call[Goal]:
        return Call("POST", self._url("/v1/goals"), _model(Goal), json={"goal": goal, **options})

    def _get_goal(self, goal: GoalRef) -> Call[Goal]:
        return Call("GET", self._goal_url(goal), _model(Goal))

    def _list_goals(self, limit: int, tenant: str | None) -> Call[list[Goal]]:
        params: dict[str, Any] = {"limit": limit}
        if tenant is not None:
            params["tenant"] = tenant
        return Call("GET", self._url("/v1/goals"), _adapter(_GOALS), params=params)

    def _candidates(self, goal: GoalRef) -> Call[list[Candidate]]:
        return Call("GET", self._goal_url(goal, "/candidates"), _adapter(_CANDIDATES))

    def _add_iteration(
        self, goal: GoalRef, prompts: Sequence[PromptLike]
    ) -> Call[IterationAccepted]:
        if isinstance(prompts, str | bytes):
            raise TypeError("prompts must be a list of prompts, not one string")
        body = [{"prompt": p} if isinstance(p, str) else dict(p) for p in prompts]
        return Call(
            "POST", self._goal_url(goal, "/iterations"), _model(IterationAccepted),
            json={"prompts": body},
        )

    def _close_goal(self, goal: GoalRef) -> Call[Goal]:
        return Call("POST", self._goal_url(goal, "/close"), _model(Goal))

    def _cancel_goal(self, goal: GoalRef) -> Call[Goal]:
        return Call("POST", self._goal_url(goal, "/cancel"), _model(Goal))

    def _artifact(self, ref: str | Candidate) -> Call[bytes]:
        return Call("GET", self._artifact_url(ref), _content)

    def _health(self) -> Call[dict[str, str]]:
        return Call("GET", self._url("/healthz"), _adapter(_HEALTH))

    def _list_models(self) -> Call[Models]:
        return Call("GET", self._url("/v1/models"), _model(Models))

    def _artifact_url(self, ref: str | Candidate) -> str:
        """An artifact's absolute URL; refuses other servers, which would receive our token."""
        if isinstance(ref, Candidate):
            if ref.artifact_url is None:
                raise ValueError(f"candidate {ref.id} has no artifact (status {ref.status})")
            ref = ref.artifact_url
        if ref.startswith("/"):
            return self._url(ref)
        if ref.startswith(self.base_url + "/"):
            return ref
        raise ValueError(f"{ref!r} is not a path or a URL on {self.base_url}")

    # reading answers ---------------------------------------------------------------------

    def _answer(self, call: Call[T], response: httpx.Response) -> T:
        """The parsed body of a successful response; an `AgentloopError` otherwise."""
        if response.status_code >= 400:
            raise error_for(response)
        return call.parse(response)

    @staticmethod
    def _settled(goal: Goal) -> bool:
        return goal.status in SETTLED

    @staticmethod
    def _check_wait(timeout: float, poll: float) -> None:
        if timeout < 0 or poll <= 0:
            raise ValueError("wait needs timeout >= 0 and poll > 0")

    @staticmethod
    def _timed_out(goal: Goal, timeout: float) -> TimeoutError:
        return TimeoutError(f"goal {goal.id} still {goal.status} after {timeout:g} s")


def error_for(response: httpx.Response) -> AgentloopError:
    """The exception for an error response: NotFound, InvalidRequest, Conflict, ServerError."""
    code = response.status_code
    try:
        detail: Any = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = response.text
    if code == 422:
        errors = _field_errors(detail)
        message = "; ".join(f"{f}: {m}" for f, m in errors) or "invalid request"
        return InvalidRequest(message, status_code=code, detail=detail, errors=errors)
    message = detail if isinstance(detail, str) and detail else f"HTTP {code}"
    if code == 404:
        return NotFound(message, status_code=code, detail=detail)
    if code == 409:
        return Conflict(message, status_code=code, detail=detail)
    if code >= 500:
        return ServerError(message, status_code=code, detail=detail)
    return AgentloopError(message, status_code=code, detail=detail)


def _field_errors(detail: Any) -> list[tuple[str, str]]:
    """FastAPI's `detail` list as (field, message) pairs; the field drops the 'body' part."""
    if not isinstance(detail, list):
        return [("body", str(detail))]
    errors = []
    for item in detail:
        loc = [str(p) for p in item.get("loc", ())]
        if len(loc) > 1 and loc[0] in ("body", "query", "path"):
            loc = loc[1:]
        errors.append((".".join(loc) or "body", str(item.get("msg", ""))))
    return errors


def _model(cls: type[T]) -> Callable[[httpx.Response], T]:
    return lambda response: cls.model_validate_json(response.content)  # type: ignore[attr-defined]


def _adapter(adapter: TypeAdapter[T]) -> Callable[[httpx.Response], T]:
    return lambda response: adapter.validate_json(response.content)


def _content(response: httpx.Response) -> bytes:
    return response.content


def _version() -> str:
    from agentloop import __version__

    return __version__
