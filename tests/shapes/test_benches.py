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
    figures = _load("loop_quality").main(["--goals", "1", "--budgets", "2", "--kinds", "1,2",
                                          "--json-out", str(out)])
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
    for kind in (one, two):
        assert kind["loop_2"] <= kind["loop_2_oracle"]
        assert kind["loop_2_selection_gap"] == pytest.approx(kind["loop_2_oracle"] - kind["loop_2"])


def test_loop_quality_lays_out_three_objects_placeless_and_phrased_goals(
    capsys: pytest.CaptureFixture[str]
) -> None:
    figures = _load("loop_quality").main([
        "--goals", "1", "--budgets", "2", "--kinds", "3,2-noplace,2-phrased", "--no-baselines",
        "--reviser-option", "layout_share=1", "--reviser-option", "no_such_toggle=true"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert figures["reviser_options"] == {"layout_share": 1}
    assert figures["reviser_options_left_out"] == ["no_such_toggle"]
    assert figures["3_object"]["loop_2_mean_passes"] == 6.0  # three regions per image
    assert figures["2_noplace"]["loop_2_mean_passes"] == 4.0  # the planner placed both
    assert figures["2_phrased"]["loop_2_mean_passes"] == 4.0  # "with", "plus", ... split
    for kind in ("3_object", "2_noplace", "2_phrased"):
        assert "single" not in figures[kind]  # --no-baselines
        assert 0.0 <= figures[kind]["loop_2"] <= figures[kind]["loop_2_oracle"] <= 1.0


def test_selection_runs(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("selection").main(["--goals", "1", "--samples", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert set(figures["chosen"]["shapes-clip"]) == {"whole", "parts-whole", "parts-region",
                                                     "region-min"}
    for name, chosen in figures["chosen"]["shapes-clip"].items():
        assert 0.0 <= chosen <= figures["oracle"] <= 1.0
        assert figures["gap_points"]["shapes-clip"][name] == pytest.approx(
            100 * (figures["oracle"] - chosen), abs=0.05)


def test_layout_mix_runs(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("layout_mix").main(["--goals", "1", "--samples", "2", "--draws", "3"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert set(figures["chosen_right_by_mix"]) == {"2+0", "0+2"}
    assert all(0.0 <= v <= 1.0 for v in figures["chosen_right_by_mix"].values())
