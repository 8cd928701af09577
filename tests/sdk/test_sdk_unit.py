"""The SDK without a server: requests it builds, errors it raises, twins that match, light import."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import httpx
import pytest

from agentloop.sdk import (
    AgentloopError,
    AsyncClient,
    Candidate,
    Client,
    Conflict,
    InvalidRequest,
    NotFound,
    ServerError,
)

GOAL = {
    "id": "g1", "tenant": "default", "goal": "a red circle", "status": "running",
    "stop_reason": None, "error": None, "spec": {}, "budget": 4, "generations_reserved": 0,
    "generations_done": 0, "best_score": None, "best_candidate": None, "iterations": [],
    "created_at": None, "finished_at": None,
}


def recording(status: int = 200, body: object = GOAL) -> tuple[list[httpx.Request], httpx.MockTransport]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if isinstance(body, bytes):
            return httpx.Response(status, content=body)
        return httpx.Response(status, json=body)

    return seen, httpx.MockTransport(handler)


def test_requests_carry_url_token_and_body() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path.endswith("/iterations"):
            return httpx.Response(201, json={"goal_id": "g1", "iteration": 0, "candidate_ids": []})
        return httpx.Response(200, json=[GOAL] if request.url.path.endswith("/goals") and
                              request.method == "GET" else GOAL)

    transport = httpx.MockTransport(handler)
    with Client("http://host:9/prefix/", token="s3cret", transport=transport) as client:
        assert client.base_url == "http://host:9/prefix"
        client.create_goal("a red circle", budget=4, model="tiny-dit")
        client.get_goal("../x?y")
        client.add_iteration("g1", ["a", {"prompt": "b", "seed": 1}])
        client.list_goals(limit=3, tenant="acme")
    create, get, iterate, listing = seen
    assert (create.method, str(create.url)) == ("POST", "http://host:9/prefix/v1/goals")
    assert json.loads(create.content) == {"goal": "a red circle", "budget": 4, "model": "tiny-dit"}
    assert create.headers["authorization"] == "Bearer s3cret"
    assert create.headers["user-agent"].startswith("agentloop-sdk/")
    assert get.url.raw_path == b"/prefix/v1/goals/%2E%2E%2Fx%3Fy"
    assert json.loads(iterate.content) == {"prompts": [{"prompt": "a"}, {"prompt": "b", "seed": 1}]}
    assert dict(listing.url.params) == {"limit": "3", "tenant": "acme"}


def test_url_and_token_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_URL", "http://from-env:1234")
    monkeypatch.setenv("AGENTLOOP_TOKEN", "tok")
    client = Client()
    assert client.base_url == "http://from-env:1234"
    assert client.headers["Authorization"] == "Bearer tok"
    monkeypatch.delenv("AGENTLOOP_TOKEN")
    monkeypatch.delenv("AGENTLOOP_URL")
    client = Client()
    assert client.base_url == "http://127.0.0.1:8000" and "Authorization" not in client.headers


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (404, {"detail": "goal g1 not found"}, NotFound),
        (409, {"detail": "the previous iteration is still running"}, Conflict),
        (422, {"detail": [{"loc": ["body", "budget"], "msg": "too big", "type": "value_error"}]},
         InvalidRequest),
        (500, b"Internal Server Error", ServerError),
        (503, {"detail": "database unreachable"}, ServerError),
        (401, {"detail": "bad token"}, AgentloopError),
    ],
)
def test_error_statuses_map_to_exceptions(status: int, body: object, error: type) -> None:
    _, transport = recording(status, body)
    with Client("http://host", transport=transport) as client, pytest.raises(error) as raised:
        client.get_goal("g1")
    assert type(raised.value) is error and raised.value.status_code == status
    if error is InvalidRequest:
        assert raised.value.errors == [("budget", "too big")]
    elif isinstance(body, dict):
        assert str(raised.value) == body["detail"]


def test_artifacts_are_fetched_only_from_this_server() -> None:
    seen, transport = recording(body=b"\x89PNG")
    cand = Candidate.model_validate({
        "id": "c1", "iteration": 0, "ordinal": 0, "status": "succeeded", "prompt": "p",
        "negative_prompt": "", "seed": 0, "params": {}, "attempts": 1, "worker": "w",
        "clip_score": 0.3, "part_scores": {}, "artifact_url": "/v1/artifacts/g1/c1.png",
        "timings": {}, "error": None, "parent_id": None, "edit": None, "queued_at": None,
        "started_at": None, "finished_at": None,
    })
    with Client("http://host", token="t", transport=transport) as client:
        assert client.artifact(cand) == b"\x89PNG"
        assert client.artifact("http://host/v1/artifacts/g1/c1.png") == b"\x89PNG"
        with pytest.raises(ValueError, match="not a path or a URL on"):
            client.artifact("http://elsewhere/v1/artifacts/g1/c1.png")  # would leak the token
        with pytest.raises(ValueError, match="no artifact"):
            client.artifact(cand.model_copy(update={"artifact_url": None}))
        with pytest.raises(TypeError):
            client.add_iteration("g1", "one string")  # type: ignore[arg-type]
    assert [str(r.url) for r in seen] == ["http://host/v1/artifacts/g1/c1.png"] * 2


def test_transport_or_http_client_not_both() -> None:
    with pytest.raises(ValueError):
        Client(transport=httpx.MockTransport(lambda r: httpx.Response(200)), http_client=httpx.Client())


def test_the_twins_offer_the_same_methods() -> None:
    def api(cls: type) -> dict[str, list[inspect.Parameter]]:
        return {
            n: list(inspect.signature(f).parameters.values()) for n, f in vars(cls).items()
            if callable(f) and not n.startswith("_") and n not in ("close", "aclose")
        }

    def is_async(f: object) -> bool:
        return inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)

    sync, async_ = api(Client), api(AsyncClient)
    assert sync == async_ and len(sync) == 14
    assert all(is_async(getattr(AsyncClient, n)) for n in async_)
    assert not any(is_async(getattr(Client, n)) for n in sync)
    assert inspect.isasyncgenfunction(AsyncClient.events)
    assert inspect.isasyncgenfunction(AsyncClient.iter_goals)
    assert inspect.isgeneratorfunction(Client.iter_goals) and inspect.isgeneratorfunction(Client.events)


def test_importing_the_sdk_stays_light() -> None:
    code = (
        "import sys; from agentloop import Client, AsyncClient; "
        "heavy = {'torch', 'fastapi', 'starlette', 'sqlalchemy', 'celery', 'diffusers', "
        "'open_clip', 'engine', 'alembic'} & {m.split('.')[0] for m in sys.modules}; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_an_init_image_is_sent_as_base64_from_bytes_or_a_path(tmp_path) -> None:  # noqa: ANN001
    import base64

    png = b"\x89PNG\r\n\x1a\n not really, the server checks"
    (tmp_path / "start.png").write_bytes(png)
    seen, transport = recording(201)
    with Client("http://host:9", transport=transport) as client:
        client.create_goal("a red circle", init_image=png, init_strength=0.5)
        client.create_goal("a red circle", init_image=tmp_path / "start.png")
        client.create_goal("a red circle", init_image="aGVsbG8=")
        client.create_goal("a red circle", init_candidate_id="c1")
        with pytest.raises(TypeError):
            client.create_goal("a red circle", init_image=3.5)
    bodies = [json.loads(r.content) for r in seen]
    encoded = base64.b64encode(png).decode()
    assert bodies[0] == {"goal": "a red circle", "init_image": encoded, "init_strength": 0.5}
    assert bodies[1]["init_image"] == encoded and bodies[2]["init_image"] == "aGVsbG8="
    assert bodies[3] == {"goal": "a red circle", "init_candidate_id": "c1"}
