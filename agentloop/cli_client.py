"""`agentloop goals …` and `agentloop run --url`: the command line as a client of a server.

Only the SDK is imported (lazily, inside each command): no torch, no database, so these
commands start fast and run where only the client is installed."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer
from rich.console import Console

if TYPE_CHECKING:
    from agentloop.sdk import Client, Goal

goals_app = typer.Typer(
    no_args_is_help=True, help="Goals on a server (--url, default $AGENTLOOP_URL)."
)
err = Console(stderr=True)

Url = Annotated[str | None, typer.Option(
    help="The server (default $AGENTLOOP_URL, then http://127.0.0.1:8000).",
)]


T = TypeVar("T")


def _client(url: str | None) -> Client:
    from agentloop.sdk import Client

    return Client(url or os.environ.get("AGENTLOOP_URL"))


def _fail(message: str, code: int = 1) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def part_line(part_scores: dict[str, float]) -> str:
    """Each part's score, weakest first: where a goal of several objects falls short."""
    ranked = sorted(part_scores.items(), key=lambda kv: kv[1])
    return " · ".join(f"{part} {score:.3f}" for part, score in ranked)


def _score(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _calling(action: Any) -> Any:  # noqa: ANN401 - whatever the SDK call returns
    """Run an SDK call; an API or connection error becomes one red line and exit code 1."""
    import httpx

    from agentloop.sdk import AgentloopError

    try:
        return action()
    except (AgentloopError, httpx.TransportError, TimeoutError) as exc:
        _fail(str(exc) or type(exc).__name__)


def call_server(url: str, call: Callable[[Client], T]) -> T:
    """`call(client)` against the server at `url`, for the commands that work either on a
    server or locally; an API or connection error becomes one red line and exit code 1."""
    with _client(url) as client:
        return _calling(lambda: call(client))


@goals_app.command("list")
def list_goals(
    url: Url = None,
    limit: Annotated[int, typer.Option(help="Most goals to show.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON list.")] = False,
) -> None:
    """The most recent goals, newest first."""
    from rich.table import Column, Table

    with _client(url) as client:
        goals = _calling(lambda: client.list_goals(limit=limit))
    if as_json:
        print(json.dumps([g.model_dump(mode="json") for g in goals]))
        return
    table = Table(Column("id", no_wrap=True), "status", "best CLIPScore", "budget", "goal")
    for g in goals:
        table.add_row(g.id, g.status, _score(g.best_score), str(g.budget), g.goal[:60])
    Console().print(table)


@goals_app.command("show")
def show(goal_id: Annotated[str, typer.Argument(help="The goal.")], url: Url = None) -> None:
    """A goal as JSON: status, iterations, best candidate."""
    with _client(url) as client:
        goal = _calling(lambda: client.get_goal(goal_id))
    print(goal.model_dump_json(indent=2))


@goals_app.command("watch")
def watch(
    goal_id: Annotated[str, typer.Argument(help="The goal.")], url: Url = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds.")] = 3600,
) -> None:
    """Follow a goal's events with a progress bar until it ends or waits for prompts."""
    with _client(url) as client:
        goal = watch_goal(client, goal_id, timeout)
    _summary(goal)
    if goal.status not in ("done", "waiting"):
        raise typer.Exit(1)


@goals_app.command("cancel")
def cancel(goal_id: Annotated[str, typer.Argument(help="The goal.")], url: Url = None) -> None:
    """Cancel an unfinished goal: nothing more of it is generated."""
    with _client(url) as client:
        goal = _calling(lambda: client.cancel_goal(goal_id))
    err.print(f"goal {goal_id} {goal.status}", highlight=False)


@goals_app.command("export")
def export(
    goal_id: Annotated[str, typer.Argument(help="The goal.")],
    folder: Annotated[Path, typer.Argument(help="Where to write goal.json and images/.")],
    url: Url = None,
) -> None:
    """Write a goal (goal.json: the goal and every candidate) and its images to a folder."""
    with _client(url) as client:
        goal = _calling(lambda: client.get_goal(goal_id))
        candidates = _calling(lambda: client.candidates(goal))
        images = folder / "images"
        images.mkdir(parents=True, exist_ok=True)
        for c in candidates:
            if c.artifact_url is not None:
                png = _calling(lambda c=c: client.artifact(c))
                (images / f"{c.id}.png").write_bytes(png)
    data = {
        "goal": goal.model_dump(mode="json"),
        "candidates": [c.model_dump(mode="json") for c in candidates],
    }
    (folder / "goal.json").write_text(json.dumps(data, indent=2))
    n = sum(c.artifact_url is not None for c in candidates)
    err.print(f"wrote {folder / 'goal.json'} and {n} images", highlight=False)


def watch_goal(client: Client, goal_id: str, timeout: float) -> Goal:
    """A progress bar driven by the goal's event stream (candidates finished of the budget,
    the best score); returns the goal once it ends or waits for prompts."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from agentloop.sdk import Event

    goal = _calling(lambda: client.get_goal(goal_id))
    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("best CLIPScore {task.fields[best]}"), TimeElapsedColumn(),
    )
    with Progress(*columns, console=err) as bar:
        task = bar.add_task(goal.status, total=goal.budget, best=_score(goal.best_score))

        def progress(event: Event) -> None:
            data = event.data
            finished = event.type in ("candidate.succeeded", "candidate.cancelled") or (
                event.type == "candidate.failed" and not data.get("retry")
            )
            if finished:
                bar.advance(task)
            elif event.type == "candidate.pruned":  # cut mid-denoise: part of a generation
                bar.advance(task, float(data.get("generation_cost") or 0.0))
            elif event.type == "goal.best":
                bar.update(task, best=_score(data.get("score")))
            elif event.type == "goal.status":
                bar.update(task, description=str(data.get("to")))

        goal = _calling(lambda: client.wait(goal_id, timeout=timeout, progress=progress))
        bar.update(task, completed=goal.generations_done, description=goal.status,
                   best=_score(goal.best_score))
    return goal


def _summary(goal: Goal) -> None:
    reason = f" ({goal.stop_reason})" if goal.stop_reason else ""
    err.print(f"goal {goal.id} {goal.status}{reason}", highlight=False)
    if goal.best_candidate is not None:
        err.print(f"best CLIPScore {_score(goal.best_score)} (0 to 2.5): "
                  f"{goal.best_candidate.prompt}", highlight=False)
        if goal.best_candidate.part_scores:
            err.print(f"its parts: {part_line(goal.best_candidate.part_scores)}", highlight=False)
        err.print(f"image: {goal.best_candidate.artifact_url}", highlight=False)
    if goal.error:
        err.print(f"error: {goal.error}", highlight=False)


def run_remote(url: str, options: dict[str, Any], as_json: bool) -> None:
    """`agentloop run --url`: submit the goal to a server and watch it there."""
    with _client(url) as client:
        text = options.pop("goal")
        goal = _calling(lambda: client.create_goal(text, **options))
        err.print(f"goal {goal.id} on {client.base_url}", highlight=False)
        goal = watch_goal(client, goal.id, timeout=24 * 3600)
    if as_json:
        print(json.dumps(goal.model_dump(mode="json")))
    else:
        _summary(goal)
    if goal.status not in ("done", "waiting"):
        raise typer.Exit(1)
