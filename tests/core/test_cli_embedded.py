"""The embedded default end to end: `agentloop run` with no services, SQLite, in-process workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentloop.cli import app
from agentloop.settings import get_settings

TINY = ["--model", "tiny-dit", "--scorer", "tiny-clip", "--steps", "2"]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AGENTLOOP_DATA_DIR", str(tmp_path / "data"))
    for var in ("AGENTLOOP_DATABASE_URL", "AGENTLOOP_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def invoke(*args: str):  # noqa: ANN201
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


@pytest.mark.slow
def test_run_writes_gallery_and_json(env: Path) -> None:
    out = env / "out"
    result = invoke("run", "a red circle on the left and a blue square", "--budget", "6",
                    "--fanout", "3", *TINY, "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data["status"] == "done" and data["stop_reason"] == "budget_spent"
    assert data["generations_used"] == 6
    assert len(data["iteration_best_scores"]) == 2
    assert 0.0 <= data["best_score"] <= 2.5 and "Hessel" in data["score_scale"]
    assert Path(data["best_image"]).is_file()
    summary = json.loads((out / "summary.json").read_text())
    images = [c["image"] for c in summary["candidates"]]
    assert len(images) == 6 and all((out / i).is_file() for i in images)
    for c in summary["candidates"]:
        assert set(c["part_scores"]) == {"a red circle on the left", "a blue square"}
    # the best candidate's part scores are in the summary with its score
    assert data["best_part_scores"] in [c["part_scores"] for c in summary["candidates"]
                                        if c["clip_score"] == data["best_score"]]
    page = (out / "index.html").read_text()
    assert page.count("<img") == 6 and "a red circle on the left" in page


@pytest.mark.slow
def test_same_seed_same_result(env: Path) -> None:
    runs = []
    for i in range(2):
        out = env / f"out{i}"
        assert invoke("run", "a green triangle at the top", "--budget", "4", "--fanout", "2",
                      *TINY, "--seed", "7", "--out", str(out)).exit_code == 0
        summary = json.loads((out / "summary.json").read_text())
        runs.append([(c["prompt"], c["seed"], c["clip_score"]) for c in summary["candidates"]])
        assert [(out / c["image"]).read_bytes() for c in summary["candidates"]]
    assert runs[0] == runs[1]
    first = sorted((env / "out0").glob("*.png"))
    second = sorted((env / "out1").glob("*.png"))
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]


BAD = [
    (["run", ""], "goal"),
    (["run", "   "], "goal"),
    (["run", "x" * 5000], "goal"),
    (["run", "a red circle", "--budget", "0"], "budget"),
    (["run", "a red circle", "--budget", "-3"], "budget"),
    (["run", "a red circle", "--budget", "100000"], "budget"),
    (["run", "a red circle", "--fanout", "0"], "fanout"),
    (["run", "a red circle", "--model", "no-such-model"], "model"),
    (["run", "a red circle", "--scorer", "no-such-scorer"], "scorer"),
    (["run", "a red circle", "--size", "30"], "size"),
    (["run", "a red circle", "--size", "4096"], "size"),
    (["run", "a red circle", "--steps", "0"], "steps"),
    (["run", "a red circle", "--reviser", "telepathy"], "reviser"),
]


@pytest.mark.parametrize(("args", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_exits_2_naming_the_field_and_writes_nothing(env: Path, args: list[str], field: str) -> None:
    result = CliRunner().invoke(app, [*args, "--out", str(env / "out")])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0], result.stderr
    assert not (env / "data").exists() and not (env / "out").exists()


@pytest.mark.slow
def test_console_script_runs(tmp_path: Path) -> None:
    """The installed `agentloop` entry point, as a user runs it."""
    exe = Path(sys.executable).with_name("agentloop")
    env = {**os.environ, "AGENTLOOP_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.run(
        [str(exe), "run", "a blue ring", "--budget", "2", "--fanout", "2", *TINY, "--json",
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["generations_used"] == 2


def test_cancel_from_the_command_line(env: Path) -> None:
    from agentloop import migrate
    from agentloop.store import Store
    from tests.core.helpers import make_goal

    settings = get_settings()
    settings.data_dir.mkdir(parents=True)
    url = settings.resolved_database_url()
    migrate.upgrade(url)
    store = Store(url)
    goal_id = make_goal(store, settings.model_copy(update={"default_model": "tiny-dit",
                                                           "default_scorer": "tiny-clip"}))
    result = invoke("cancel", goal_id)
    assert result.exit_code == 0 and f"goal {goal_id} cancelled" in result.output
    assert store.get_goal(goal_id).status.value == "cancelled"
    assert invoke("cancel", goal_id).exit_code == 0  # again: still cancelled
    missing = invoke("cancel", "0" * 32)
    assert missing.exit_code == 1 and "not found" in missing.output
    store.dispose()


def test_run_refuses_an_init_image_it_cannot_use(env: Path) -> None:
    missing = invoke("run", "a red circle", "--init-image", str(env / "nope.png"), *TINY)
    assert missing.exit_code == 2 and "cannot read --init-image" in " ".join(missing.output.split())
    (env / "notes.png").write_text("not an image")
    bad = invoke("run", "a red circle", "--init-image", str(env / "notes.png"), *TINY)
    assert bad.exit_code == 2 and "not a readable PNG or JPEG" in " ".join(bad.output.split())
    strength = invoke("run", "a red circle", "--strength", "0.5", *TINY)
    assert strength.exit_code == 2 and "init_strength" in strength.output


@pytest.mark.slow
def test_run_refines_an_init_image(env: Path) -> None:
    from PIL import Image

    Image.new("RGB", (48, 48), (200, 30, 30)).save(env / "start.png")
    out = env / "out"
    result = invoke("run", "a red circle", "--init-image", str(env / "start.png"), "--strength",
                    "0.5", "--budget", "2", "--fanout", "2", *TINY, "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert [c["edit"] for c in summary["candidates"]] == ["refine", "refine"]
