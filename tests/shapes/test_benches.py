"""The shapes benches run end to end at toy sizes, so they are ready when someone needs figures.

These check that the benches run and report what they claim to, not the figures themselves
(those need the full runs recorded in docs/benchmarks.md).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
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


def test_repair_runs(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("repair").main(["--goals", "1", "--samples", "2", "--seeds", "1",
                                    "--strengths", "1.0", "--steps", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert set(figures["rows"]) == {"repair wrong part @1", "repair CLIP-weakest part @1",
                                    "fresh layout sample"}
    assert 0 <= figures["one_part_wrong"] <= 2 and 0.0 <= figures["layout_right"] <= 1.0
    assert set(figures["gap_sweep"]) == {"0.05", "0.1", "0.15", "0.2", "0.3"}
