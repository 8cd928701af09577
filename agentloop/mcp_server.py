"""agentloop's tools for agents, over the Model Context Protocol (the official `mcp` SDK).

Two transports, one set of tools, each tool a call of the Python SDK's `AsyncClient`:

- stdio: `agentloop mcp --url http://server:8000` (a desktop agent client starts it), talking
  to an agentloop server over HTTP; needs only the client install (`pip install agentloop`).
- streamable HTTP at `/mcp` on the API server itself (`mount_mcp`), whose `AsyncClient`
  sends its requests to the same app in-process (`httpx.ASGITransport`), so the tools get
  exactly the REST routes' validation, errors and dispatch, with no second code path.

Scores are CLIPScore = 2.5 * max(cos, 0) (Hessel et al. 2021), from 0 to 2.5.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import httpx
from mcp.server.mcpserver import Context, Image, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from agentloop.models import SCORE_SCALE, PromptIn
from agentloop.sdk import AgentloopError, AsyncClient, Candidate, Goal

if TYPE_CHECKING:
    from starlette.applications import Starlette

T = TypeVar("T")

INSTRUCTIONS = f"""\
agentloop runs generation loops on diffusion models: you state a goal in words, it generates
candidate images, scores each against the goal and revises the prompts until the budget is
spent or a target score is reached. Scores are {SCORE_SCALE}: about 0.5 is unrelated, higher
is closer; compare scores only within one scorer.

Typical use: create_goal, then wait_goal (it blocks and reports progress) until the goal is
done, then get_image on its best candidate. With reviser "external" you write the prompts
yourself: the goal waits (status "waiting") for add_iteration before every iteration; read
the scores with list_candidates, look at images with get_image, send better prompts, and
call close_goal when satisfied. cancel_goal stops any unfinished goal."""

GoalId = Annotated[str, Field(description="the goal's id, as create_goal returned it")]

_READ = ToolAnnotations(read_only_hint=True, idempotent_hint=True, open_world_hint=False)
_WRITE = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)

_NEXT = {
    "pending": "queued; call wait_goal",
    "running": "generating; call wait_goal to block until it settles, get_goal to peek",
    "waiting": "reviser 'external': call add_iteration with the next prompts, or close_goal",
    "done": "finished; call get_image for the best candidate",
    "failed": "failed; see error",
    "cancelled": "cancelled; nothing more is generated",
}


def _candidate(c: Candidate) -> dict[str, Any]:
    return {
        "id": c.id, "iteration": c.iteration, "status": c.status, "prompt": c.prompt,
        "seed": c.seed, "clip_score": c.clip_score, "part_scores": c.part_scores,
        "artifact_url": c.artifact_url, "error": c.error,
    }


def _goal(g: Goal) -> dict[str, Any]:
    """A goal as a model needs it: status, progress, best candidate, what to do next."""
    return {
        "id": g.id, "goal": g.goal, "status": g.status, "stop_reason": g.stop_reason,
        "error": g.error, "reviser": g.spec.get("reviser"), "model": g.spec.get("model"),
        "scorer": g.spec.get("scorer"), "budget": g.budget,
        "generations_reserved": g.generations_reserved, "generations_done": g.generations_done,
        "best_score": g.best_score, "score_scale": SCORE_SCALE,
        "best_candidate": _candidate(g.best_candidate) if g.best_candidate else None,
        "iterations": [
            {"index": i.index, "status": i.status, "best_score": i.best_score}
            for i in g.iterations
        ],
        "next": _NEXT.get(g.status, ""),
    }


async def _call(make: Callable[[], Awaitable[T]], url: str) -> T:
    """Run an SDK call; the server's refusal or an unreachable server becomes a tool error."""
    try:
        return await make()
    except AgentloopError as exc:
        code = getattr(exc, "code", None)  # the stable error code, when the server sends one
        prefix = f"{code}: " if code else ""
        raise ToolError(f"{prefix}{exc} (HTTP {exc.status_code})") from None
    except httpx.HTTPError as exc:
        raise ToolError(f"cannot reach the agentloop server at {url}: {exc!r}") from None


@contextmanager
def _root_logging_kept() -> Iterator[None]:
    """Building an MCP server calls `logging.basicConfig` with a Rich handler at INFO on the
    root logger: in the API process every INFO line of every library was then drawn by Rich
    (the queue bench's API doubled its CPU). How a process logs is its host's choice: put
    the root logger back as it was."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def build_server(client: AsyncClient) -> MCPServer:
    """The MCP server whose tools act through `client` (which the caller closes)."""
    with _root_logging_kept():
        server = MCPServer(name="agentloop", instructions=INSTRUCTIONS, version=_version())
    url = client.base_url

    @server.tool(annotations=_WRITE)
    async def create_goal(
        goal: Annotated[str, Field(description="what the image should show, in words")],
        budget: Annotated[int, Field(description="most images to generate (GPU cost)")] = 16,
        fanout: Annotated[int, Field(description="images per iteration")] = 4,
        max_iterations: Annotated[int, Field(description="most iterations")] = 8,
        target_score: Annotated[float | None, Field(
            description="stop once the best CLIPScore reaches this (0..2.5)")] = None,
        reviser: Annotated[Literal["search", "external", "llm"], Field(
            description="'search': agentloop revises the prompts itself; 'external': you "
            "supply every iteration's prompts with add_iteration; 'llm': the server's "
            "language model writes them (when list_models lists it in revisers)")] = "search",
        model: Annotated[str | None, Field(
            description="a name from list_models (default: the server's)")] = None,
        scorer: Annotated[str | None, Field(
            description="a name from list_models (default: the server's)")] = None,
        steps: Annotated[int | None, Field(description="denoising steps")] = None,
        size: Annotated[int | None, Field(description="image side in pixels, a multiple of 8")] = None,
        seed: Annotated[int, Field(description="same seed, same images")] = 0,
        negative_prompt: Annotated[str, Field(description="what the images should not show")] = "",
        init_candidate_id: Annotated[str | None, Field(
            description="start from this earlier candidate's image (from get_goal or "
            "candidates): every image refines it")] = None,
        init_strength: Annotated[float | None, Field(
            description="with init_candidate_id: how much to change it, in (0, 1] "
            "(default 0.6)")] = None,
        parts: Annotated[list[dict[str, Any]] | None, Field(
            description="the goal's objects as you read them, 2 to 8, each {text, place: "
            "[x, y] in 0..1 from the top-left or null, scale: 1}: each is scored on its own "
            "region; omit to let the server parse the goal")] = None,
    ) -> dict[str, Any]:
        """Start a generation loop for a goal; returns at once with the goal's id and status.

        The loop generates `fanout` images per iteration, scores each against the goal
        (CLIPScore, 0..2.5, higher is better) and stops when `budget` images are spent, the
        best score reaches `target_score`, or `max_iterations` pass. Then call wait_goal.
        With reviser 'external' nothing is generated until you call add_iteration: the goal
        waits (status 'waiting') for your prompts before every iteration."""
        options = {
            "budget": budget, "fanout": fanout, "max_iterations": max_iterations,
            "target_score": target_score, "reviser": reviser, "model": model,
            "scorer": scorer, "steps": steps, "size": size, "seed": seed,
            "negative_prompt": negative_prompt, "init_candidate_id": init_candidate_id,
            "init_strength": init_strength, "parts": parts,
        }
        options = {k: v for k, v in options.items() if v is not None}
        return _goal(await _call(lambda: client.create_goal(goal, **options), url))

    @server.tool(annotations=_READ)
    async def get_goal(goal_id: GoalId) -> dict[str, Any]:
        """A goal's status, progress (generations done of budget), best score and candidate,
        and its iterations, at once, without waiting. Use wait_goal to block until it settles."""
        return _goal(await _call(lambda: client.get_goal(goal_id), url))

    @server.tool(annotations=_READ)
    async def wait_goal(
        goal_id: GoalId,
        timeout_s: Annotated[float, Field(
            ge=0, le=3600, description="give up waiting after this many seconds")] = 120,
        ctx: Context | None = None,
    ) -> dict[str, Any]:
        """Block until the goal is done, failed, cancelled or waiting for your prompts
        (reviser 'external'), reporting progress (images finished of the budget) meanwhile.
        Returns the goal; `timed_out` is true when it was still running at `timeout_s`,
        in which case call wait_goal again."""
        deadline = time.monotonic() + timeout_s
        last: tuple[int, str, float | None] | None = None
        while True:
            current = await _call(lambda: client.get_goal(goal_id), url)
            seen = (current.generations_done, current.status, current.best_score)
            if ctx is not None and seen != last:
                best = "none yet" if current.best_score is None else f"{current.best_score:.3f}"
                await ctx.report_progress(
                    current.generations_done, current.budget,
                    f"{current.status}: {current.generations_done}/{current.budget} images, "
                    f"iteration {max(len(current.iterations) - 1, 0)}, best CLIPScore {best}",
                )
                last = seen
            settled = client._settled(current)
            if settled or time.monotonic() >= deadline:
                return {**_goal(current), "timed_out": not settled}
            await asyncio.sleep(min(0.5, max(deadline - time.monotonic(), 0)))

    @server.tool(annotations=_READ)
    async def list_candidates(
        goal_id: GoalId,
        iteration: Annotated[int | None, Field(description="only this iteration")] = None,
        status: Annotated[Literal["queued", "running", "succeeded", "failed", "cancelled",
                                  "pruned"] | None,
                          Field(description="only candidates in this status")] = None,
        order: Annotated[Literal["best", "created"], Field(
            description="'best': highest CLIPScore first; 'created': iteration order")] = "best",
        limit: Annotated[int, Field(ge=1, le=500, description="at most this many")] = 20,
    ) -> list[dict[str, Any]]:
        """A goal's candidates (one per generated image) with prompt, seed, CLIPScore
        (0..2.5, per goal part too) and status; pass an id to get_image to see one."""
        found = await _call(lambda: client.candidates(goal_id), url)
        found = [c for c in found if (iteration is None or c.iteration == iteration)
                 and (status is None or c.status == status)]
        if order == "best":
            found.sort(key=lambda c: -1.0 if c.clip_score is None else c.clip_score, reverse=True)
        return [_candidate(c) for c in found[:limit]]

    @server.tool(annotations=_READ, structured_output=False)  # content blocks, not JSON
    async def get_image(
        goal_id: GoalId,
        candidate_id: Annotated[str | None, Field(
            description="the candidate (default: the goal's best)")] = None,
    ) -> list[Any]:
        """A candidate's image as a PNG you can look at, with its prompt and score."""
        candidate: Candidate | None
        if candidate_id is None:
            goal = await _call(lambda: client.get_goal(goal_id), url)
            candidate = goal.best_candidate
            if candidate is None:
                raise ToolError(f"goal {goal_id} has no scored image yet (status {goal.status})")
        else:
            found = await _call(lambda: client.candidates(goal_id), url)
            candidate = next((c for c in found if c.id == candidate_id), None)
            if candidate is None:
                raise ToolError(f"goal {goal_id} has no candidate {candidate_id}")
        if candidate.artifact_url is None:
            raise ToolError(f"candidate {candidate.id} has no image (status {candidate.status})")
        png = await _call(lambda: client.artifact(candidate), url)
        caption = (f"candidate {candidate.id}, iteration {candidate.iteration}, CLIPScore "
                   f"{candidate.clip_score}: {candidate.prompt}")
        return [caption, Image(data=png, format="png")]

    @server.tool(annotations=_WRITE)
    async def add_iteration(
        goal_id: GoalId,
        prompts: Annotated[list[PromptIn], Field(
            min_length=1, description="one image per prompt; each may fix its seed (same seed, "
            "same composition), add a negative prompt, or a layout of regions")],
    ) -> dict[str, Any]:
        """Supply the next iteration's prompts to a goal with reviser 'external' whose status is
        'waiting'. Each prompt costs one image of the budget. Then call wait_goal, read the
        scores with list_candidates, and repeat, or close_goal when satisfied."""
        body = [p.model_dump(exclude_none=True, exclude_defaults=True) for p in prompts]
        for item, p in zip(body, prompts, strict=True):
            item["prompt"] = p.prompt
        accepted = await _call(lambda: client.add_iteration(goal_id, body), url)
        return accepted.model_dump(mode="json")

    @server.tool(annotations=_WRITE)
    async def close_goal(goal_id: GoalId) -> dict[str, Any]:
        """End a goal with reviser 'external' that is waiting for prompts: it becomes 'done'
        with its best candidate so far."""
        return _goal(await _call(lambda: client.close_goal(goal_id), url))

    @server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=True))
    async def cancel_goal(goal_id: GoalId) -> dict[str, Any]:
        """Cancel an unfinished goal: nothing more of it is generated; images already made
        stay readable. Cancelling a cancelled goal is harmless."""
        return _goal(await _call(lambda: client.cancel_goal(goal_id), url))

    @server.tool(annotations=_READ)
    async def list_models() -> dict[str, Any]:
        """The model and scorer names this server accepts in create_goal, and its defaults."""
        return (await _call(client.list_models, url)).model_dump(mode="json")

    return server


def run_stdio(url: str | None = None, token: str | None = None) -> None:
    """Serve the tools over stdio, against the agentloop server at `url`."""
    client = AsyncClient(url, token=token)
    server = build_server(client)

    async def main() -> None:
        try:
            await server.run_stdio_async()
        finally:
            await client.aclose()

    asyncio.run(main())


def mount_mcp(app: Starlette, path: str = "/mcp", allowed_hosts: list[str] | None = None
              ) -> Callable[[], Any]:
    """Serve the tools over streamable HTTP at `path` on `app`, calling `app` in-process.

    Returns the context manager factory the app's lifespan must enter (it runs the MCP
    session manager, which a route added to another app does not start by itself).
    `allowed_hosts` (`host:port` patterns) are the Host headers accepted (DNS-rebinding
    protection); `["*"]` accepts any."""
    from mcp.server.transport_security import TransportSecuritySettings

    client = AsyncClient("http://agentloop.internal", transport=httpx.ASGITransport(app=app))
    server = build_server(client)
    hosts = allowed_hosts if allowed_hosts is not None else LOCAL_HOSTS
    security = TransportSecuritySettings(
        enable_dns_rebinding_protection="*" not in hosts, allowed_hosts=hosts,
        allowed_origins=[f"http://{h}" for h in hosts] + [f"https://{h}" for h in hosts],
    )
    mcp_app = server.streamable_http_app(streamable_http_path=path, transport_security=security)
    app.router.routes.extend(mcp_app.routes)

    @asynccontextmanager
    async def running() -> AsyncIterator[None]:
        async with server.session_manager.run():
            try:
                yield
            finally:
                await client.aclose()

    return running


LOCAL_HOSTS = ["127.0.0.1:*", "localhost:*", "[::1]:*"]
"""Host headers the HTTP endpoint accepts by default: this machine only."""


def _version() -> str:
    from agentloop import __version__

    return __version__
