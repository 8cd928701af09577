"""`agentloop goals …` and `agentloop run --url` against a real server (uvicorn in a thread,
the orchestrator for real, a fake worker), run as real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentloop.api.app import create_app
from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import threaded_loop
from tests.live import serve_in_thread


@pytest.fixture
def url(sqlite_url: str, settings: Settings) -> Iterator[str]:
    store = Store(sqlite_url)
    loop = threaded_loop(store, settings, score=lambda c: 0.5 + 0.01 * c.ordinal)
    app = create_app(settings.model_copy(update={"events_poll_seconds": 0.02}), store, loop)
    try:
        with serve_in_thread(app) as base:
            yield base
    finally:
        loop.close(wait=True)
        store.dispose()


def cli(*args: str, url: str | None = None) -> subprocess.CompletedProcess[str]:
    env_url = {"AGENTLOOP_URL": url} if url else {}
    import os

    return subprocess.run(
        [sys.executable, "-m", "agentloop.cli", *args], capture_output=True, text=True,
        timeout=120, env={**os.environ, **env_url},
    )


@pytest.mark.slow
def test_run_on_a_server_then_list_show_watch_export(url: str, tmp_path: Path) -> None:
    ran = cli("run", "a red circle", "--budget", "4", "--fanout", "2", "--url", url, "--json")
    assert ran.returncode == 0, ran.stderr
    goal = json.loads(ran.stdout)
    assert goal["status"] == "done" and goal["generations_done"] == 4
    assert "4/4" in ran.stderr and "best CLIPScore 0.510" in ran.stderr  # the progress bar

    listed = cli("goals", "list", "--json", url=url)  # the server from $AGENTLOOP_URL
    assert [g["id"] for g in json.loads(listed.stdout)] == [goal["id"]]
    assert goal["id"] in cli("goals", "list", "--url", url).stdout
    shown = json.loads(cli("goals", "show", goal["id"], "--url", url).stdout)
    assert shown["best_score"] == goal["best_score"]

    watched = cli("goals", "watch", goal["id"], "--url", url)
    assert watched.returncode == 0 and "4/4" in watched.stderr and "done" in watched.stderr

    out = tmp_path / "export"
    assert cli("goals", "export", goal["id"], str(out), "--url", url).returncode == 0
    data = json.loads((out / "goal.json").read_text())
    assert data["goal"]["id"] == goal["id"] and len(data["candidates"]) == 4
    assert sorted(p.stem for p in (out / "images").iterdir()) == sorted(
        c["id"] for c in data["candidates"]
    )


@pytest.mark.slow
def test_cancel_and_watch_a_goal_waiting_for_prompts(url: str) -> None:
    ran = cli("run", "a red circle", "--reviser", "external", "--url", url, "--json")
    assert ran.returncode == 0, ran.stderr  # watch returns at `waiting`
    goal_id = json.loads(ran.stdout)["id"]
    cancelled = cli("goals", "cancel", goal_id, "--url", url)
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stderr
    watched = cli("goals", "watch", goal_id, "--url", url)
    assert watched.returncode == 1 and "cancelled" in watched.stderr
    missing = cli("goals", "show", "0" * 32, "--url", url)
    assert missing.returncode == 1 and "not found" in missing.stderr


def test_client_commands_import_neither_torch_nor_the_database(url: str) -> None:
    code = (
        "import sys\n"
        "from agentloop.cli import app\n"
        f"app(['goals', 'list', '--url', {url!r}], standalone_mode=False)\n"
        "heavy = {'torch', 'sqlalchemy', 'celery', 'diffusers', 'engine', 'alembic', 'fastapi'}"
        " & {m.split('.')[0] for m in sys.modules}\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("args", [["cancel", "0" * 32], ["models"]])
def test_commands_that_may_ask_a_server_say_so_when_it_is_unreachable(args: list[str]) -> None:
    from typer.testing import CliRunner

    from agentloop.cli import app

    result = CliRunner().invoke(app, [*args, "--url", "http://127.0.0.1:1"])
    assert result.exit_code == 1 and "Connection refused" in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
