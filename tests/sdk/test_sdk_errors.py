"""Error mapping (422, 404, 409) and `wait` timing out, for both clients against the real app."""

from __future__ import annotations

import time

import pytest

from agentloop.orchestrator import advance
from agentloop.sdk import AsyncClient, Client, Conflict, InvalidRequest, NotFound
from agentloop.store import Store

MISSING = "0" * 32


def test_sync_errors_name_what_was_wrong(client: Client, store: Store) -> None:
    with pytest.raises(InvalidRequest) as bad:
        client.create_goal("a red circle", budget=0, size=12)
    assert bad.value.status_code == 422
    assert [f for f, _ in bad.value.errors] == ["budget", "size"]
    assert "budget" in str(bad.value)
    with pytest.raises(InvalidRequest) as bad:
        client.create_goal("a red circle", colour="red")
    assert [f for f, _ in bad.value.errors] == ["colour"]
    with pytest.raises(InvalidRequest) as bad:
        client.create_goal("   ")
    assert bad.value.errors[0][0] == "goal"

    for call in (
        lambda: client.get_goal(MISSING),
        lambda: client.candidates(MISSING),
        lambda: client.close_goal(MISSING),
        lambda: client.cancel_goal(MISSING),
        lambda: client.add_iteration(MISSING, ["x"]),
        lambda: client.artifact(f"/v1/artifacts/{MISSING}/{MISSING}.png"),
        lambda: client.get_goal("../healthz"),  # quoted: stays a (missing) goal id
    ):
        with pytest.raises(NotFound) as missing:
            call()
        assert missing.value.status_code == 404

    search = client.create_goal("a red circle", budget=2)
    with pytest.raises(Conflict, match="external"):
        client.add_iteration(search.id, ["mine"])
    with pytest.raises(Conflict):
        client.close_goal(search.id)  # pending, not waiting
    client.cancel_goal(search.id)
    with pytest.raises(Conflict, match="already|cancel|finished|unfinished"):
        client.close_goal(search.id)
    external = client.create_goal("a red circle", reviser="external", budget=2)
    advance(store, external.id)
    with pytest.raises(InvalidRequest) as bad:
        client.add_iteration(external.id, ["ok", ""])
    assert [f for f, _ in bad.value.errors] == ["prompts.1.prompt"]
    with pytest.raises(Conflict, match="2 generations left") as conflict:
        client.add_iteration(external.id, ["a", "b", "c"])
    assert conflict.value.status_code == 409
    assert store.count_candidates(external.id) == 0


@pytest.mark.anyio
async def test_async_errors_name_what_was_wrong(aclient: AsyncClient, store: Store) -> None:
    with pytest.raises(InvalidRequest) as bad:
        await aclient.create_goal("a red circle", fanout=0)
    assert bad.value.errors[0][0] == "fanout"
    with pytest.raises(NotFound):
        await aclient.get_goal(MISSING)
    search = await aclient.create_goal("a red circle")
    with pytest.raises(Conflict):
        await aclient.add_iteration(search, ["mine"])


def test_sync_wait_times_out(client: Client) -> None:
    goal = client.create_goal("a red circle", reviser="external")  # stays pending: nothing runs
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still pending"):
        client.wait(goal.id, timeout=0.3, poll=0.05)
    assert 0.3 <= time.monotonic() - start < 2.0
    with pytest.raises(ValueError):
        client.wait(goal.id, poll=0)


@pytest.mark.anyio
async def test_async_wait_times_out_and_returns_at_once_when_settled(
    aclient: AsyncClient, store: Store
) -> None:
    goal = await aclient.create_goal("a red circle", reviser="external")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="still pending"):
        await aclient.wait(goal.id, timeout=0.3, poll=0.05)
    assert 0.3 <= time.monotonic() - start < 2.0
    advance(store, goal.id)
    assert (await aclient.wait(goal.id, timeout=0)).status == "waiting"
