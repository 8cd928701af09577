"""Everything the two clients share that does no I/O: URLs, headers, requests, answers.

`Client` and `AsyncClient` build a `Call` here, send it their own way, and hand the
response back to `BaseClient._answer`, which raises or parses. Like httpx's `BaseClient`.
"""

from __future__ import annotations

import base64
import os
import random
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from pathlib import Path
from time import time as _wall_clock
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter

from agentloop.sdk._errors import AgentloopError, Conflict, InvalidRequest, NotFound, ServerError
from agentloop.sdk._models import Candidate, Goal, IterationAccepted, Models, WebhookDelivery

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

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
"""Answers worth another try: too many requests, and the server's own failures."""
NEXT_CURSOR_HEADER = "X-Next-Cursor"
MAX_RETRY_AFTER = 60.0
"""The longest a `Retry-After` may make the client wait before one retry, in seconds."""


def encode_image(image: str | bytes | os.PathLike[str]) -> str:
    """An init image as the API takes it (base64 text): the bytes of a PNG or JPEG, a path to
    one (`pathlib.Path` or any path-like), or base64 text already (returned as it is)."""
    if isinstance(image, os.PathLike):
        image = Path(image).read_bytes()
    if isinstance(image, bytes | bytearray):
        return base64.b64encode(bytes(image)).decode("ascii")
    if isinstance(image, str):
        return image
    raise TypeError(f"init_image must be bytes, a path or base64 text, not {type(image).__name__}")


class Page(list[T]):
    """One page of a list: the items, and `next_cursor` (None on the last page)."""

    next_cursor: str | None = None


_CANDIDATES = TypeAdapter(list[Candidate])
_GOALS = TypeAdapter(list[Goal])
_HEALTH = TypeAdapter(dict[str, str])
_DELIVERIES = TypeAdapter(list[WebhookDelivery])


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API request, built without I/O, and how to read a successful answer to it."""

    method: str
    url: str
    parse: Callable[[httpx.Response], T]
    params: dict[str, Any] | None = None
    json: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    idempotent: bool = False
    """Safe to send again: a GET, or a POST that carries an Idempotency-Key."""


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
        max_retries: int = 3,
        retry_backoff: float = 0.5,
    ):
        if max_retries < 0 or retry_backoff < 0:
            raise ValueError("max_retries and retry_backoff must be >= 0")
        self.max_retries = max_retries
        """How many times an idempotent call is sent again after a connection error, a 429
        or a 5xx (0: never)."""
        self.retry_backoff = retry_backoff
        """The first retry's longest wait in seconds; it doubles each retry (full jitter)."""
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

    def _create_goal(
        self, goal: str, options: Mapping[str, Any], idempotency_key: str | None = None
    ) -> Call[Goal]:
        body = {"goal": goal, **options}
        if body.get("init_image") is not None:
            body["init_image"] = encode_image(body["init_image"])
        return Call("POST", self._url("/v1/goals"), _model(Goal), json=body,
                    headers=_idempotency(idempotency_key), idempotent=True)

    def _get_goal(self, goal: GoalRef) -> Call[Goal]:
        return Call("GET", self._goal_url(goal), _model(Goal), idempotent=True)

    def _list_goals(
        self, limit: int, tenant: str | None, status: str | Iterable[str] | None = None,
        cursor: str | None = None,
    ) -> Call[Page[Goal]]:
        params: dict[str, Any] = {"limit": limit}
        if tenant is not None:
            params["tenant"] = tenant
        params.update(_filters(status=status, cursor=cursor))
        return Call("GET", self._url("/v1/goals"), _page(_GOALS), params=params, idempotent=True)

    def _candidates(
        self, goal: GoalRef, iteration: int | None = None,
        status: str | Iterable[str] | None = None, cursor: str | None = None,
    ) -> Call[Page[Candidate]]:
        params = _filters(iteration=iteration, status=status, cursor=cursor)
        return Call("GET", self._goal_url(goal, "/candidates"), _page(_CANDIDATES),
                    params=params or None, idempotent=True)

    def _add_iteration(
        self, goal: GoalRef, prompts: Sequence[PromptLike], idempotency_key: str | None = None
    ) -> Call[IterationAccepted]:
        if isinstance(prompts, str | bytes):
            raise TypeError("prompts must be a list of prompts, not one string")
        body = [{"prompt": p} if isinstance(p, str) else dict(p) for p in prompts]
        return Call(
            "POST", self._goal_url(goal, "/iterations"), _model(IterationAccepted),
            json={"prompts": body}, headers=_idempotency(idempotency_key), idempotent=True,
        )

    def _close_goal(self, goal: GoalRef) -> Call[Goal]:
        return Call("POST", self._goal_url(goal, "/close"), _model(Goal))

    def _cancel_goal(self, goal: GoalRef) -> Call[Goal]:
        return Call("POST", self._goal_url(goal, "/cancel"), _model(Goal))

    def _artifact(self, ref: str | Candidate) -> Call[bytes]:
        return Call("GET", self._artifact_url(ref), _content, idempotent=True)

    def _health(self) -> Call[dict[str, str]]:
        return Call("GET", self._url("/healthz"), _adapter(_HEALTH), idempotent=True)

    def _list_models(self) -> Call[Models]:
        return Call("GET", self._url("/v1/models"), _model(Models))

    def _webhook_deliveries(self, goal: GoalRef) -> Call[list[WebhookDelivery]]:
        return Call("GET", self._goal_url(goal, "/webhook-deliveries"),
                    _adapter(_DELIVERIES), idempotent=True)

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

    def _headers_for(self, call: Call[Any]) -> dict[str, str]:
        return {**self.headers, **call.headers}

    def _retry_delay(
        self, call: Call[Any], attempt: int, response: httpx.Response | None
    ) -> float | None:
        """Seconds to wait before sending `call` again, or None to stop. Retries only an
        idempotent call, after a connection error (`response` None), a 429 or a 5xx, at most
        `max_retries` times; waits a random time up to `retry_backoff * 2**attempt` (full
        jitter), or what the answer's `Retry-After` says (at most a minute)."""
        if not call.idempotent or attempt >= self.max_retries:
            return None
        if response is not None and response.status_code not in RETRY_STATUSES:
            return None
        after = _retry_after(response) if response is not None else None
        if after is not None:
            return after
        return random.uniform(0, self.retry_backoff * 2**attempt)

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
    """The exception for an error response: NotFound, InvalidRequest, Conflict, ServerError,
    carrying the server's `error.code` and `error.field` (older servers send `detail` only)."""
    status = response.status_code
    try:
        parsed = response.json()
    except ValueError:
        parsed = None
    body: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    detail: Any = body.get("detail", response.text if not body else None)
    found = body.get("error")
    error: dict[str, Any] = found if isinstance(found, dict) else {}
    code, field = error.get("code"), error.get("field")
    message = error.get("message") or (detail if isinstance(detail, str) and detail else None)
    if status == 422:
        listed = error.get("errors")
        errors = ([(str(e.get("field")), str(e.get("message"))) for e in listed]
                  if isinstance(listed, list) else [])
        if not errors:
            errors = _field_errors(detail) if detail is not None else [("body", str(message))]
        message = "; ".join(f"{f}: {m}" for f, m in errors) or "invalid request"
        return InvalidRequest(message, status_code=status, detail=detail, errors=errors,
                              code=code, field=field)
    message = message or f"HTTP {status}"
    kind = {404: NotFound, 409: Conflict}.get(status, ServerError if status >= 500 else None)
    return (kind or AgentloopError)(message, status_code=status, detail=detail, code=code,
                                    field=field)


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


def _idempotency(key: str | None) -> dict[str, str]:
    """The Idempotency-Key header: the caller's key, or a fresh one for this call (kept
    across its retries, so a retried create never makes a second goal)."""
    return {"Idempotency-Key": key or uuid.uuid4().hex}


def _filters(**values: Any) -> dict[str, Any]:
    """Query parameters given (a status may be one or several)."""
    params: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name == "status":
            value = [value] if isinstance(value, str) else list(value)
        params[name] = value
    return params


def _retry_after(response: httpx.Response) -> float | None:
    """The wait a `Retry-After` header asks for (seconds or an HTTP date), capped."""
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - _wall_clock()
        except (TypeError, ValueError):
            return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def _page(adapter: TypeAdapter[list[T]]) -> Callable[[httpx.Response], Page[T]]:
    def parse(response: httpx.Response) -> Page[T]:
        page: Page[T] = Page(adapter.validate_json(response.content))
        page.next_cursor = response.headers.get(NEXT_CURSOR_HEADER)
        return page

    return parse


def _model(cls: type[T]) -> Callable[[httpx.Response], T]:
    return lambda response: cls.model_validate_json(response.content)  # type: ignore[attr-defined]


def _adapter(adapter: TypeAdapter[T]) -> Callable[[httpx.Response], T]:
    return lambda response: adapter.validate_json(response.content)


def _content(response: httpx.Response) -> bytes:
    return response.content


def _version() -> str:
    from agentloop import __version__

    return __version__
