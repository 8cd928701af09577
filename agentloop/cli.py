"""The `agentloop` command line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

# Light: pydantic only. The server side (settings, store, engine) is imported inside the
# commands that need it, so the client install (`pip install agentloop`) runs the rest.
from agentloop.cli_client import call_server, goals_app, part_line, run_remote
from agentloop.domain import GoalInvalid, GoalRequest, GoalStatus, check_goal

if TYPE_CHECKING:
    from agentloop.settings import Settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Agent-driven generation loops.")
db_app = typer.Typer(no_args_is_help=True, help="Database schema (Alembic migrations).")
app.add_typer(db_app, name="db")
app.add_typer(goals_app, name="goals")
err = Console(stderr=True)


def _fail(message: str, code: int = 2) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


SERVER_MODULES = ("pydantic_settings", "sqlalchemy", "alembic", "fastapi", "uvicorn")
"""What the server-side commands import, none of it in the client install."""


def get_settings(engine: bool = False) -> Settings:
    """The settings, for a command that runs the server side (and the engine, if `engine`);
    a clear error naming the extra to install when this is a client-only install."""
    import importlib.util

    needed = SERVER_MODULES + (("torch", "diffusers", "open_clip") if engine else ())
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        extra = "agentloop[server,gpu]" if engine else "agentloop[server]"
        from rich.markup import escape

        _fail(escape(
            f"this command needs the server side, which this install lacks ({', '.join(missing)}): "
            f'pip install "{extra}" (client commands such as `agentloop mcp --url` need no extra)'
        ), 1)
    from pydantic import ValidationError

    from agentloop.settings import get_settings as settings

    try:
        return settings()
    except ValidationError as exc:  # one line naming what is wrong, not a traceback
        from rich.markup import escape

        problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        _fail(escape(f"invalid settings (AGENTLOOP_* environment): {problems}"), 1)
        raise  # unreachable: _fail exits


@app.command()
def run(
    goal: Annotated[str, typer.Argument(help="What to generate, in words.")],
    budget: Annotated[int, typer.Option(help="Most generations to spend.")] = 16,
    fanout: Annotated[int, typer.Option(help="Candidates per iteration.")] = 4,
    max_iterations: Annotated[int, typer.Option(help="Most iterations.")] = 8,
    target_score: Annotated[float | None, typer.Option(help="Stop once the best CLIPScore reaches this.")] = None,
    patience: Annotated[int, typer.Option(help="Stop after this many iterations without improvement.")] = 3,
    model: Annotated[str | None, typer.Option(help="Model preset, folder or registered hub id.")] = None,
    scorer: Annotated[str | None, typer.Option(help="Scorer preset or open_clip 'name:pretrained'.")] = None,
    steps: Annotated[int | None, typer.Option(help="Denoising steps (default: the model's).")] = None,
    size: Annotated[int | None, typer.Option(help="Image side in pixels, a multiple of 8.")] = None,
    guidance: Annotated[float | None, typer.Option(help="Classifier-free guidance scale.")] = None,
    seed: Annotated[int, typer.Option(help="Seed: same seed, same result.")] = 0,
    reviser: Annotated[str, typer.Option(
        help="search (default), external, or llm (needs AGENTLOOP_LLM_BASE_URL and "
        "AGENTLOOP_LLM_MODEL; see docs/revisers.md).")] = "search",
    out: Annotated[Path | None, typer.Option(help="Output folder (default agentloop-out/<goal id>).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object with the result.")] = False,
    url: Annotated[str | None, typer.Option(
        help="Submit to this server and watch it there, instead of running here.",
    )] = None,
    init_image: Annotated[Path | None, typer.Option(
        "--init-image", help="Start from this PNG or JPEG: the first iteration refines it.",
    )] = None,
    strength: Annotated[float | None, typer.Option(
        help="With --init-image: how much of the schedule runs again, in (0, 1] (default 0.6).",
    )] = None,
) -> None:
    """Run one goal to the end and write its gallery (or, with --url, on a server)."""
    image_b64 = None
    if init_image is not None:
        import base64

        try:
            image_b64 = base64.b64encode(init_image.read_bytes()).decode("ascii")
        except OSError as exc:
            _fail(f"cannot read --init-image {init_image}: {exc.strerror or exc}")
    if url:
        options = {
            "goal": goal, "budget": budget, "fanout": fanout, "max_iterations": max_iterations,
            "target_score": target_score, "patience": patience, "model": model,
            "scorer": scorer, "steps": steps, "size": size, "guidance": guidance, "seed": seed,
            "reviser": reviser, "init_image": image_b64, "init_strength": strength,
        }
        run_remote(url, {k: v for k, v in options.items() if v is not None}, as_json)
        return
    settings = get_settings(engine=True)
    try:
        spec = check_goal(
            GoalRequest.model_construct(
                goal=goal, budget=budget, fanout=fanout, max_iterations=max_iterations,
                target_score=target_score, patience=patience, model=model, scorer=scorer,
                steps=steps, size=size, guidance=guidance, seed=seed, negative_prompt="",
                reviser=reviser, tenant="default", webhook=None, init_image=image_b64,
                init_candidate_id=None, init_strength=strength,
            ),
            settings,
        )
    except GoalInvalid as exc:
        _fail(exc.first_line())
    store = _open_store(settings)
    if image_b64 is not None:
        from agentloop.images import InitImageInvalid, resolve_init

        try:
            spec = resolve_init(spec, store, settings, image_b64, None)
        except InitImageInvalid as exc:
            _fail(f"--init-image {init_image}: {exc.message}")
    from agentloop.parse_llm import with_parsed_parts

    spec = with_parsed_parts(spec, settings)
    dispatcher, closer = _dispatcher(store, settings)
    goal_view = store.create_goal(spec)
    dispatcher.advance_goal(goal_view.id)
    try:
        state = _follow(store, goal_view.id, closer, quiet=False)
        if not err.is_terminal:
            err.print()  # end the progress line
    finally:
        if closer is not None:
            closer.close(wait=False)
    from agentloop.gallery import write_output

    folder = out or Path("agentloop-out") / goal_view.id
    data = write_output(state, settings.resolved_artifacts_dir(), folder)
    if as_json:
        data.pop("candidates")
        data.pop("spec")
        print(json.dumps(data))
    else:
        err.print(f"best score {data['best_score']} ({data['score_scale']})", highlight=False)
        err.print(f"best prompt: {data['best_prompt']}", highlight=False)
        if data["best_part_scores"]:
            err.print(f"its parts: {part_line(data['best_part_scores'])}", highlight=False)
        err.print(f"gallery: {folder / 'index.html'}", highlight=False)
    if state.goal.status is not GoalStatus.DONE:
        raise typer.Exit(1)


def _open_store(settings: Settings):  # noqa: ANN202 - agentloop.store.Store
    from agentloop import migrate
    from agentloop.store import Store

    url = settings.resolved_database_url()
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        migrate.upgrade(url)  # the embedded database keeps itself at head
    elif migrate.current(url) != migrate.head():
        _fail("the database schema is not at head: run `agentloop db upgrade` first", 1)
    return Store(url, settings.db_connect_timeout)


def _dispatcher(store, settings: Settings):  # noqa: ANN001,ANN202
    from agentloop.api.app import default_dispatcher

    return default_dispatcher(store, settings)


def _follow(store, goal_id: str, runtime, quiet: bool):  # noqa: ANN001,ANN202
    """Show live progress until the goal stops; return its final state."""
    from rich.live import Live

    start = time.monotonic()
    with Live(console=err, refresh_per_second=4, transient=False, redirect_stderr=False) as live:
        while True:
            state = store.get_state(goal_id)
            goal = state.goal
            done = sum(1 for c in state.candidates if c.status.terminal)
            best = f"{goal.best_score:.3f}" if goal.best_score is not None else "–"
            live.update(
                f"iteration {max(len(state.iterations) - 1, 0)} · candidates {done}/{goal.budget} · "
                f"best CLIPScore {best} · {time.monotonic() - start:.1f}s · {goal.status.value}"
            )
            if goal.status.terminal or goal.status is GoalStatus.WAITING:
                return state
            if runtime is not None and runtime.errors:
                _fail(f"a task failed: {runtime.errors[0]!r}", 1)
            time.sleep(0.25)


@app.command()
def cancel(
    goal_id: Annotated[str, typer.Argument(help="The goal to cancel.")],
    url: Annotated[str | None, typer.Option(
        help="A server to ask (default $AGENTLOOP_URL); without one, the local database.",
    )] = None,
) -> None:
    """Cancel an unfinished goal: nothing more of it is generated."""
    import os

    url = url or os.environ.get("AGENTLOOP_URL")
    if url:
        status = call_server(url, lambda client: client.cancel_goal(goal_id).status)
    else:
        from agentloop.orchestrator import IterationRejected, cancel_goal

        store = _open_store(get_settings())
        try:
            if cancel_goal(store, goal_id) is None:
                _fail(f"goal {goal_id} not found", 1)
            status = store.get_goal(goal_id).status.value
        except IterationRejected as exc:
            _fail(str(exc), 1)
        finally:
            store.dispose()
    err.print(f"goal {goal_id} {status}", highlight=False)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
) -> None:
    """Serve the HTTP API (OpenAPI at /docs) and the MCP tools (at /mcp)."""
    settings = get_settings()
    import uvicorn

    from agentloop.api.app import create_app

    _open_store(settings).dispose()
    uvicorn.run(create_app(settings), host=host, port=port, log_level="info")


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """Migrate the database up to a revision (default head)."""
    from agentloop import migrate

    url = get_settings().resolved_database_url()
    if url.startswith("sqlite"):
        get_settings().data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(url, revision)
    err.print(f"database at {migrate.current(url)}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument()] = "base") -> None:
    """Migrate the database down to a revision (default base: drops everything)."""
    from agentloop import migrate

    url = get_settings().resolved_database_url()
    migrate.downgrade(url, revision)
    err.print(f"database at {migrate.current(url)}")


@db_app.command("current")
def db_current() -> None:
    """Print the database's revision."""
    from agentloop import migrate

    print(migrate.current(get_settings().resolved_database_url()))


@app.command()
def models(
    url: Annotated[str | None, typer.Option(
        help="A server to ask (default $AGENTLOOP_URL); without one, this installation.",
    )] = None,
) -> None:
    """List the models, scorers and revisers this installation (or the server at --url) knows."""
    import os

    url = url or os.environ.get("AGENTLOOP_URL")
    if url:
        known = call_server(url, lambda client: client.list_models())
        print("models:  " + ", ".join(known.models) + f" (default {known.default_model})")
        print("scorers: " + ", ".join(known.scorers) + f" (default {known.default_scorer}), "
              "or any open_clip 'name:pretrained'")
        print("revisers: " + ", ".join(known.revisers))
        return
    from agentloop.domain import available_revisers
    from engine.catalog import known_models, known_scorers

    settings = get_settings()
    print("models:  " + ", ".join(known_models(settings.extra_models)))
    print("scorers: " + ", ".join(known_scorers()) + ", or any open_clip 'name:pretrained'")
    print("revisers: " + ", ".join(available_revisers(settings)))


@app.command("mcp")
def mcp_stdio(
    url: Annotated[str | None, typer.Option(
        help="The agentloop server the tools act on (default $AGENTLOOP_URL, then "
        "http://127.0.0.1:8000).",
    )] = None,
    token: Annotated[str | None, typer.Option(
        help="Bearer token for the server (default $AGENTLOOP_TOKEN).",
    )] = None,
) -> None:
    """Serve agentloop's tools to an agent over MCP on stdin/stdout (see docs/agents.md)."""
    from agentloop.mcp_server import run_stdio

    run_stdio(url, token)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
    sys.exit(0)
