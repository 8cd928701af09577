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

from engine.defaults import model_defaults
from engine.scorer import Scorer

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
    # what the loop spent its generations on, per goal
    assert one["loop_2_moves_per_goal"] == {"seed": 2.0}
    assert two["loop_2_moves_per_goal"] == {"layout": 2.0}
    for kind in (one, two):
        assert kind["loop_2"] <= kind["loop_2_oracle"]
        assert kind["loop_2_selection_gap"] == pytest.approx(kind["loop_2_oracle"] - kind["loop_2"])


def test_loop_quality_lays_out_three_objects_placeless_and_phrased_goals(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    record = tmp_path / "loop.jsonl"
    figures = _load("loop_quality").main([
        "--goals", "1", "--budgets", "2", "--kinds", "3,2-noplace,2-phrased", "--no-baselines",
        "--reviser-option", "layout_share=1", "--reviser-option", "no_such_toggle=true",
        "--record", str(record), "--threads", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    # the record: each goal's candidates as the selection bench records a goal, and the pick
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["key"].split("/")[0] for r in lines] == ["3", "2-noplace", "2-phrased"]
    assert [r["objects_n"] for r in lines] == [3, 2, 2]
    selection = _load("selection")
    scorer = Scorer("shapes-clip", device="cpu")
    for r in lines:
        assert len(r["images"]) == len(r["right"]) == 2 and len(r["layout"]) == r["objects_n"]
        # the selection bench's copy of the loop's objective picks what the loop picked
        values = selection.objectives(selection.features(scorer, selection._decode(r)))
        assert int(values[selection.SHIPPED].argmax()) == r["picked"]
    replayed = selection.main(["--objects", "2,3", "--replay", str(record)])
    capsys.readouterr()
    assert replayed["kinds"]["3"]["goals"] == 1 and replayed["kinds"]["2"]["goals"] == 2
    assert figures["reviser_options"] == {"layout_share": 1}
    assert figures["reviser_options_left_out"] == ["no_such_toggle"]
    assert figures["3_object"]["loop_2_mean_passes"] == 6.0  # three regions per image
    assert figures["2_noplace"]["loop_2_mean_passes"] == 4.0  # the planner placed both
    assert figures["2_phrased"]["loop_2_mean_passes"] == 4.0  # "with", "plus", ... split
    for kind in ("3_object", "2_noplace", "2_phrased"):
        assert "single" not in figures[kind]  # --no-baselines
        assert 0.0 <= figures[kind]["loop_2"] <= figures[kind]["loop_2_oracle"] <= 1.0


def test_selection_records_replays_and_ranks_two_and_three_objects(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    selection = _load("selection")
    record = tmp_path / "sel.jsonl"
    figures = selection.main(["--goals", "1", "--samples", "2", "--objects", "2,3",
                              "--record", str(record)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert figures["steps"] == model_defaults("shapes")["steps"]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["objects_n"] for r in lines] == [2, 3] and all(len(r["images"]) == 2 for r in lines)
    for kind in ("2", "3"):
        k = figures["kinds"][kind]
        assert set(k["chosen"]) == set(selection.OBJECTIVES)
        for name, chosen in k["chosen"].items():
            assert 0.0 <= chosen <= k["oracle"] <= 1.0
            assert k["gap_points"][name] == pytest.approx(100 * (k["oracle"] - chosen), abs=0.05)
    # a rerun with the record generates nothing new; a replay ranks the same images the same way
    again = selection.main(["--goals", "1", "--samples", "2", "--objects", "2,3",
                            "--record", str(record)])
    assert len(record.read_text().splitlines()) == 2
    replayed = selection.main(["--objects", "2,3", "--replay", str(record)])
    capsys.readouterr()
    assert replayed["kinds"] == again["kinds"] == figures["kinds"]
    assert replayed["generate_s"] < 5
    # the generator as a verifier adds its objectives and leaves the others as they were
    judged = selection.main(["--objects", "2,3", "--replay", str(record), "--diffusion"])
    capsys.readouterr()
    for kind in ("2", "3"):
        k, before = judged["kinds"][kind], figures["kinds"][kind]
        assert set(k["chosen"]) == set(selection.OBJECTIVES) | set(selection.DIFFUSION_OBJECTIVES)
        assert {n: k["chosen"][n] for n in selection.OBJECTIVES} == before["chosen"]
        assert "diffusion" in k["part_auroc"]


def test_layout_mix_runs(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("layout_mix").main(["--goals", "1", "--samples", "2", "--draws", "3"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert set(figures["chosen_right_by_mix"]) == {"2+0", "0+2"}
    assert all(0.0 <= v <= 1.0 for v in figures["chosen_right_by_mix"].values())


def test_layout_draw_runs_every_setting_on_the_same_images(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _load("layout_draw")
    argv = ["--goals", "1", "--samples", "2", "--objects", "3", "--settings", "1:0.01", "0.5:0.08", "alone"]
    figures = bench.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    rows = figures["rows"]
    assert set(rows) == {"1:0.01", "0.5:0.08", "alone"}
    assert [rows[s]["3"]["images"] for s in rows] == [2, 2, 6]  # alone: one image per part
    assert all(0.0 <= rows[s]["3"]["right"] <= 1.0 for s in rows)
    assert rows["alone"]["3"]["right"] == rows["alone"]["3"]["part_right"]  # one object an image
    with pytest.raises(SystemExit, match="split:softness"):
        bench.main(["--settings", "half"])
    with pytest.raises(ValueError, match="layout_split"):
        bench.main(["--settings", "2:0.08"])


def test_prune_runs_resumes_and_agrees_with_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "goals.jsonl"
    argv = ["--goals", "1", "--seeds", "4", "--ks", "2", "--recommend", "4:2:2",
            "--record", str(record)]  # fmt: skip
    bench = _load("prune")
    figures = bench.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert figures["engine_agrees"] == "2/2"  # the engine's cut picks what the simulation does
    rows = {r["label"]: r for r in figures["rows"]}
    steps = model_defaults("shapes")["steps"]  # the bench runs the model's default steps
    assert rows["4:k2:keep2"]["cost"] == pytest.approx((4 * 2 + 2 * (steps - 2)) / (16 * steps), abs=1e-4)
    assert all(0.0 <= r["acc_mean"] <= 1.0 for r in rows.values())
    assert len(record.read_text().splitlines()) == 2  # one line per goal collected
    again = bench.main(argv)  # from the record: nothing generated again, same figures
    assert again["rows"] == figures["rows"] and again["spearman"] == figures["spearman"]
    assert len(record.read_text().splitlines()) == 2


def test_prune_ranks_previews_with_a_second_scorer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--preview-scorer scores the previews again in the same run: with the scorer itself as
    the preview scorer, both sets of figures agree; the engine check runs with it."""
    record = tmp_path / "goals.jsonl"
    argv = ["--goals", "1", "--seeds", "4", "--ks", "1", "2", "--recommend", "4:2:2",
            "--preview-scorer", "shapes-clip", "--record", str(record)]  # fmt: skip
    bench = _load("prune")
    figures = bench.main(argv)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert figures["preview_scorer"] == "shapes-clip" and figures["engine_agrees"] == "2/2"
    assert figures["rows_preview_scorer"] == figures["rows"]
    assert figures["spearman_preview_scorer"] == figures["spearman"]
    again = bench.main(argv)  # the record keeps the preview scorer's scores too
    assert again["rows_preview_scorer"] == figures["rows_preview_scorer"]
    assert len(record.read_text().splitlines()) == 2


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
    with pytest.raises(SystemExit):
        steps.main(["--configs", "2:3:1:heun"])
    solver = steps.Setting.parse("8:3:1:dpm++2m")
    assert (solver.solver, solver.label, steps.Setting.parse("8:3:1").solver) == (
        "dpm++2m", "8:3:1:dpm++2m", "euler")


def test_solver_bench_compares_with_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("solver").main(
        ["--goals", "2", "--steps", "2", "4", "--guidance", "3", "--reference-steps", "4"]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    two, four = figures["rows"]
    assert four["euler"] == 99.0  # the reference itself: the same images
    assert 0 < two["euler"] < 99.0 and 0 < two["dpm++2m"] < 99.0


def test_engine_bench_runs_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("engine").main(
        ["--goals", "2", "--repeats", "1", "--steps", "3", "--batch", "2", "--caches", "first_block 0.1",
         "--vanilla-bf16"]
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    rows = figures["rows"]
    assert {"vanilla", "diffusers first_block 0.1", "runner (all off)", "runner + step cache",
            "runner + solver", "runner + bfloat16", "runner, all on", "bf16 vanilla",
            "bf16 diffusers first_block 0.1"} <= set(rows)  # fmt: skip
    # the bfloat16 references are reported beside the targets, never chosen as "diffusers best"
    assert figures["targets"]["defaults"]["vs_bf16_vanilla"] > 0
    assert rows["vanilla"]["speedup"] == 1.0 and rows["vanilla"]["work"] == 1.0
    assert rows["vanilla"]["calls_per_image"] == 3 * 2 / 2  # 3 steps x (cond, uncond), 2 images a call
    assert rows["runner (all off)"]["psnr_db"] >= 40  # the same images as vanilla, to rounding
    for row in rows.values():
        assert row["images_per_s"] > 0 and 0 <= row["accuracy"] <= 1 and 0 <= row["clip_score"] <= 2.5
    assert figures["targets"]["diffusers_best"] in (None, "diffusers first_block 0.1")


def test_repair_runs(capsys: pytest.CaptureFixture[str]) -> None:
    figures = _load("repair").main(["--goals", "1", "--samples", "2", "--seeds", "1",
                                    "--strengths", "1.0", "--steps", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == figures
    assert set(figures["rows"]) == {"repair wrong part @1", "repair CLIP-weakest part @1",
                                    "fresh layout sample"}
    assert 0 <= figures["one_part_wrong"] <= 2 and 0.0 <= figures["layout_right"] <= 1.0
    assert set(figures["gap_sweep"]) == {"0.05", "0.1", "0.15", "0.2", "0.3"}


def test_loop_quality_counts_a_repair_or_refinement_at_its_strength() -> None:
    from types import SimpleNamespace

    share = _load("loop_quality")._share
    plain = SimpleNamespace(pruned_at_step=None, params={"steps": 8})
    repair = SimpleNamespace(pruned_at_step=None,
                             params={"steps": 8, "init_image": "g/c0-1.png", "strength": 0.7})
    pruned = SimpleNamespace(pruned_at_step=2, params={"steps": 8})
    assert (share(plain), share(repair), share(pruned)) == (1.0, 0.7, 0.25)
