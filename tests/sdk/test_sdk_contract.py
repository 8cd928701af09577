"""The SDK on the contract: error codes, retries with backoff for idempotent calls only
(against a server that fails first), Idempotency-Key kept across retries, pages."""

from __future__ import annotations

import json

import httpx
import pytest

from agentloop.sdk import AsyncClient, Client, Conflict, InvalidRequest, NotFound, ServerError
from agentloop.sdk._base import Call
from agentloop.store import Store
from tests.api.test_api_idempotency import GOAL

MISSING = "0" * 32


class FailingFirst:
    """Wraps a transport: the first `n` requests fail (connection refused, or `status`)."""

    def __init__(self, inner: httpx.BaseTransport | httpx.AsyncBaseTransport, n: int,
                 status: int | None = None, retry_after: str | None = None):
        self.inner, self.n, self.status, self.retry_after = inner, n, status, retry_after
        self.seen: list[httpx.Request] = []

    def _fail(self, request: httpx.Request) -> httpx.Response | None:
        self.seen.append(request)
        if len(self.seen) > self.n:
            return None
        if self.status is None:
            raise httpx.ConnectError("connection refused", request=request)
        headers = {"Retry-After": self.retry_after} if self.retry_after else {}
        body = {"error": {"code": "database_unavailable", "message": "down"}, "detail": "down"}
        return httpx.Response(self.status, json=body, headers=headers)


class SyncFailingFirst(FailingFirst, httpx.BaseTransport):
    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self._fail(request) or self.inner.handle_request(request)  # type: ignore[union-attr]


class AsyncFailingFirst(FailingFirst, httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        failed = self._fail(request)
        return failed or await self.inner.handle_async_request(request)  # type: ignore[union-attr]


def sync_client(client: Client, **kw: object) -> tuple[Client, SyncFailingFirst]:
    transport = SyncFailingFirst(client._http._transport, **kw)  # type: ignore[arg-type]
    return Client(client.base_url, transport=transport, retry_backoff=0.001), transport


def test_connection_errors_and_5xx_are_retried_with_the_same_key(
    client: Client, store: Store
) -> None:
    retrying, seen = sync_client(client, n=2)
    goal = retrying.create_goal(GOAL["goal"], budget=4)
    keys = {r.headers["idempotency-key"] for r in seen.seen}
    assert len(seen.seen) == 3 and len(keys) == 1
    retrying, seen = sync_client(client, n=2, status=503, retry_after="0")
    assert retrying.get_goal(goal.id).id == goal.id and len(seen.seen) == 3
    assert len(retrying.list_goals()) == 1  # one goal: the retried create made no second


def test_retries_stop_at_max_retries_and_skip_non_idempotent_calls(client: Client) -> None:
    transport = SyncFailingFirst(client._http._transport, n=10, status=503)  # type: ignore[arg-type]
    with Client(client.base_url, transport=transport, max_retries=2, retry_backoff=0) as c:
        with pytest.raises(ServerError) as down:
            c.get_goal(MISSING)
        assert down.value.code == "database_unavailable" and len(transport.seen) == 3
        transport.seen.clear()
        with pytest.raises(ServerError):
            c.cancel_goal(MISSING)  # no Idempotency-Key: sent once
        assert len(transport.seen) == 1
    transport = SyncFailingFirst(client._http._transport, n=1, status=404)  # type: ignore[arg-type]
    with Client(client.base_url, transport=transport, retry_backoff=0) as c, \
            pytest.raises(NotFound):
        c.get_goal(MISSING)
    assert len(transport.seen) == 1


def test_the_retry_policy_honours_retry_after_and_backs_off() -> None:
    base = Client("http://x", retry_backoff=1.0, max_retries=3)
    get = Call("GET", "http://x/v1/goals", lambda r: r, idempotent=True)
    post = Call("POST", "http://x/v1/goals/a/close", lambda r: r)
    answer = httpx.Response(503, headers={"Retry-After": "7"})
    assert base._retry_delay(get, 0, answer) == 7.0
    assert base._retry_delay(get, 0, httpx.Response(429, headers={"Retry-After": "999"})) == 60.0
    assert all(0 <= base._retry_delay(get, 2, None) <= 4.0 for _ in range(50))  # type: ignore[operator]
    assert base._retry_delay(get, 3, None) is None
    assert base._retry_delay(post, 0, None) is None
    assert base._retry_delay(get, 0, httpx.Response(409)) is None
    base.close()


async def test_async_retries_too(aclient: AsyncClient, app) -> None:  # noqa: ANN001
    transport = AsyncFailingFirst(httpx.ASGITransport(app), n=2)
    async with AsyncClient(aclient.base_url, transport=transport, retry_backoff=0.001) as c:
        goal = await c.create_goal(GOAL["goal"], budget=4)
        assert len(transport.seen) == 3
        assert len({r.headers["idempotency-key"] for r in transport.seen}) == 1
        assert [g.id async for g in c.iter_goals()] == [goal.id]


def test_errors_carry_the_servers_code_and_field(client: Client, store: Store) -> None:
    with pytest.raises(InvalidRequest) as bad:
        client.create_goal("a red circle", budget=0)
    assert bad.value.code == "validation_error" and bad.value.field == "budget"
    assert bad.value.errors[0][0] == "budget"
    client.create_goal("a red circle", idempotency_key="k", budget=4)
    with pytest.raises(InvalidRequest) as reused:
        client.create_goal("a red circle", idempotency_key="k", budget=5)
    assert reused.value.code == "idempotency_key_reused"
    goal = client.create_goal("a red circle", budget=4)
    with pytest.raises(Conflict) as conflict:
        client.add_iteration(goal, ["x"])
    assert conflict.value.code == "not_external" and conflict.value.status_code == 409
    with pytest.raises(NotFound) as missing:
        client.get_goal(MISSING)
    assert missing.value.code == "not_found"


def test_an_older_servers_body_still_reads() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(409, content=json.dumps({"detail": "goal is done"}))

    with Client("http://x", transport=httpx.MockTransport(answer)) as c, \
            pytest.raises(Conflict) as old:
        c.close_goal("g")
    assert str(old.value) == "goal is done" and old.value.code is None


def test_iter_goals_walks_every_page(client: Client) -> None:
    made = [client.create_goal(f"a red circle {i}", budget=2).id for i in range(5)]
    page = client.list_goals(limit=2)
    assert len(page) == 2 and page.next_cursor is not None
    assert [g.id for g in client.iter_goals(page_size=2)] == made[::-1]
    assert [g.id for g in client.iter_goals(status=["done"])] == []
