"""The MCP tools end to end: the official MCP client session over stdio (`agentloop mcp`)
and over streamable HTTP (/mcp on the API server), against a real running server."""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import CallToolResult, ImageContent, TextContent

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOOLS = {"create_goal", "get_goal", "wait_goal", "list_candidates", "get_image",
         "add_iteration", "close_goal", "cancel_goal", "list_models"}
TINY = {"steps": 2, "size": 32}


@asynccontextmanager
async def over_stdio(base: str) -> AsyncIterator[ClientSession]:
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TRITON_INTERPRET": "1"}
    params = StdioServerParameters(command=str(BIN / "agentloop"), args=["mcp", "--url", base],
                                   env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


@asynccontextmanager
async def over_http(base: str) -> AsyncIterator[ClientSession]:
    async with streamable_http_client(f"{base}/mcp") as (read, write), \
            ClientSession(read, write) as session:
        await session.initialize()
        yield session


TRANSPORTS: dict[str, Callable[[str], AbstractAsyncContextManager[ClientSession]]] = {
    "stdio": over_stdio, "http": over_http,
}


def data(result: CallToolResult) -> Any:
    assert not result.is_error, result.content
    if result.structured_content is not None:
        content = result.structured_content
        return content.get("result", content) if set(content) == {"result"} else content
    text = [c.text for c in result.content if isinstance(c, TextContent)]
    return json.loads(text[0])


async def call(session: ClientSession, tool: str, **args: Any) -> Any:
    return data(await session.call_tool(tool, args))


def run(coro_fn: Callable[[], Any]) -> None:
    anyio.run(coro_fn)


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_search_goal_end_to_end(agentloop_server: str, transport: str) -> None:
    async def scenario() -> None:
        async with TRANSPORTS[transport](agentloop_server) as session:
            tools = {t.name: t for t in (await session.list_tools()).tools}
            assert TOOLS <= set(tools)
            assert "2.5" in (tools["create_goal"].description or "")
            assert "add_iteration" in (tools["create_goal"].description or "")

            models = await call(session, "list_models")
            assert "tiny-dit" in models["models"] and "tiny-clip" in models["scorers"]
            assert models["default_model"] == "tiny-dit"

            goal = await call(session, "create_goal", goal="a red circle and a blue square",
                              budget=4, fanout=2, **TINY)
            assert goal["status"] in ("pending", "running") and goal["budget"] == 4

            progress: list[tuple[float, float | None, str | None]] = []

            async def on_progress(done: float, total: float | None, message: str | None) -> None:
                progress.append((done, total, message))

            waited = data(await session.call_tool(
                "wait_goal", {"goal_id": goal["id"], "timeout_s": 120},
                progress_callback=on_progress,
            ))
            assert waited["status"] == "done" and not waited["timed_out"]
            assert progress and progress[-1][0] == 4 and progress[-1][1] == 4
            assert all(m and "images" in m for _, _, m in progress)
            assert 0 <= waited["best_score"] <= 2.5

            cands = await call(session, "list_candidates", goal_id=goal["id"])
            assert len(cands) == 4 and cands[0]["clip_score"] == waited["best_score"]
            first = await call(session, "list_candidates", goal_id=goal["id"], iteration=0,
                               order="created")
            assert [c["iteration"] for c in first] == [0, 0]

            image = await session.call_tool("get_image", {"goal_id": goal["id"]})
            assert not image.is_error
            pictures = [c for c in image.content if isinstance(c, ImageContent)]
            assert len(pictures) == 1 and pictures[0].mime_type == "image/png"
            assert base64.b64decode(pictures[0].data).startswith(PNG_MAGIC)
            other = await session.call_tool(
                "get_image", {"goal_id": goal["id"], "candidate_id": cands[-1]["id"]})
            assert any(isinstance(c, ImageContent) for c in other.content)

            got = await call(session, "get_goal", goal_id=goal["id"])
            assert got["best_candidate"]["id"] == waited["best_candidate"]["id"]

    run(scenario)


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_external_loop_errors_and_cancel(agentloop_server: str, transport: str) -> None:
    async def scenario() -> None:
        async with TRANSPORTS[transport](agentloop_server) as session:
            goal = await call(session, "create_goal", goal="a green triangle", budget=6,
                              fanout=2, reviser="external", **TINY)
            waited = await call(session, "wait_goal", goal_id=goal["id"], timeout_s=120)
            assert waited["status"] == "waiting" and "add_iteration" in waited["next"]

            accepted = await call(session, "add_iteration", goal_id=goal["id"], prompts=[
                {"prompt": "a green triangle, flat colours", "seed": 11},
                {"prompt": "a big green triangle in the middle"},
            ])
            assert accepted["iteration"] == 0 and len(accepted["candidate_ids"]) == 2
            # Sending again while the iteration runs: the server's refusal, as a tool error.
            again = await session.call_tool("add_iteration", {
                "goal_id": goal["id"], "prompts": [{"prompt": "too soon"}]})
            if again.is_error:  # the iteration may already be finished on a fast machine
                assert "HTTP 409" in again.content[0].text

            waited = await call(session, "wait_goal", goal_id=goal["id"], timeout_s=120)
            assert waited["generations_done"] == 2
            seeded = await call(session, "list_candidates", goal_id=goal["id"], iteration=0)
            assert 11 in {c["seed"] for c in seeded}

            cancelled = await call(session, "cancel_goal", goal_id=goal["id"])
            assert cancelled["status"] in ("cancelled", "done")

            missing = await session.call_tool("get_goal", {"goal_id": "0" * 32})
            assert missing.is_error and "not found" in missing.content[0].text
            bad = await session.call_tool("create_goal", {"goal": "x", "model": "no-such"})
            assert bad.is_error and "unknown model" in bad.content[0].text
            wrong = await session.call_tool("add_iteration", {"goal_id": goal["id"],
                                                              "prompts": []})
            assert wrong.is_error

    run(scenario)
