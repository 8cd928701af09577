"""The shapes benches run end to end at toy sizes, so they are ready when someone needs figures.

These check that the benches run and report what they claim to, not the figures themselves
(those need the full runs recorded in docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_loop_quality_runs_and_lays_out_two_object_goals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "figures.json"
    figures = _load("loop_quality").main(["--goals", "1", "--budgets", "2", "--json-out", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == figures == json.loads(out.read_text())
    one, two = figures["1_object"], figures["2_object"]
    for kind in (one, two):
        assert kind["loop_2_mean_generations"] == 2.0
        for key in ("single", "best_of_2", "loop_2", "best_of_2_at_loop_passes"):
            assert 0.0 <= kind[key] <= 1.0
    assert one["loop_2_mean_passes"] == 2.0  # one object: nothing to lay out
    assert two["loop_2_mean_passes"] == 4.0  # two placed objects: two layout images, 2 regions each
    assert two["loop_2_passes_matched_m"] == 4


def test_layout_mix_runs(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("layout_mix").main(["--goals", "1", "--samples", "2", "--draws", "3"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert set(figures["chosen_right_by_mix"]) == {"2+0", "0+2"}
    assert all(0.0 <= v <= 1.0 for v in figures["chosen_right_by_mix"].values())


def test_engine_bench_runs_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("engine").main(
        ["--goals", "2", "--repeats", "1", "--steps", "3", "--batch", "2", "--caches", "first_block 0.1"]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    rows = figures["rows"]
    assert {"vanilla", "diffusers first_block 0.1", "runner (all off)", "runner + step cache",
            "runner, all on"} <= set(rows)  # fmt: skip
    assert rows["vanilla"]["speedup"] == 1.0 and rows["vanilla"]["work"] == 1.0
    assert rows["vanilla"]["calls_per_image"] == 3 * 2 / 2  # 3 steps x (cond, uncond), 2 images a call
    assert rows["runner (all off)"]["psnr_db"] >= 40  # the same images as vanilla, to rounding
    for row in rows.values():
        assert row["images_per_s"] > 0 and 0 <= row["accuracy"] <= 1 and 0 <= row["clip_score"] <= 2.5
    assert figures["targets"]["diffusers_best"] in (None, "diffusers first_block 0.1")


def test_steps_runs_and_pairs_against_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    steps = _load("steps")
    figures = steps.main(["--goals", "2", "--configs", "2:3:1", "2:1:0.5", "--reference", "2:3:1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    ref, other = figures["rows"]
    assert (ref["config"], other["config"]) == ("2:3:1", "2:1:0.5")
    assert (ref["passes_per_image"], other["passes_per_image"]) == (4, 3)  # one of 2 steps guided
    assert ref["delta_1"] == ref["gained_2"] == ref["lost_2"] == 0
    for k in (1, 2):
        assert 0.0 <= other[f"acc_{k}"] <= 1.0
        assert other[f"gained_{k}"] - other[f"lost_{k}"] == round(2 * other[f"delta_{k}"])
    with pytest.raises(SystemExit):
        steps.main(["--configs", "0:3:1"])
