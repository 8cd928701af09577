"""The queue bench runs end to end at toy size with real processes (API, Celery workers,
PostgreSQL, a private Redis) and reports what it claims to; and the no-op engine it relies on
keeps the engine's contract. The figures themselves are in docs/benchmarks.md."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from PIL import Image

from agentloop.settings import Settings
from engine.types import GenerationRequest, Region, ScoreRequest
from workers.residency import Residency

BENCH = Path(__file__).resolve().parents[2] / "bench" / "queue.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_queue", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_noop_residency_keeps_the_engine_contract_without_torch() -> None:
    residency = Residency.for_settings(Settings(engine_noop=True, extra_models=["org/model"]))
    assert residency.noop and residency.extra_models == ("org/model",)
    runner, scorer = residency.runner("tiny-dit"), residency.scorer("tiny-clip")
    requests = [GenerationRequest("a red circle", seed=s, width=16, height=24) for s in (1, 2, 1)]
    results = runner.generate(requests)
    assert [r.request for r in results] == requests
    assert results[0].image.size == (16, 24) and results[0].timings["denoise_s"] >= 0
    assert results[0].image.tobytes() == results[2].image.tobytes()  # same request, same image
    with pytest.raises(ValueError, match="multiple of 8"):
        runner.validate(GenerationRequest("a red circle", seed=0, width=12, height=16))
    layout = GenerationRequest("x", seed=0, regions=(Region("a red circle", 0.2, 0.5),))
    runner.validate(layout)
    images = [r.image for r in results] + [Image.new("RGB", (8, 8))]
    score_requests = [ScoreRequest("a red circle and a blue ring", ("a red circle", "a blue ring"))] * 4
    scores = scorer.score(images, score_requests)
    assert scores[0] == scores[2]
    for s in scores:
        assert 0.0 <= s.clip_score <= 2.5 and set(s.part_scores) == {"a red circle", "a blue ring"}
        assert all(0.0 <= v <= 2.5 for v in s.part_scores.values())


def test_real_residency_by_default() -> None:
    assert not Residency.for_settings(Settings()).noop


@pytest.mark.integration
@pytest.mark.slow
def test_queue_bench_runs_at_toy_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "queue.json"
    figures = _load().main(["--quick", "--json-out", str(out)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == figures == json.loads(out.read_text())
    assert figures["accepted"] == figures["ended"] == figures["done"] == 4
    assert figures["lost_goals"] == figures["http_5xx"] == figures["transport_errors"] == 0
    assert figures["candidates"] == 16 and figures["candidates_failed"] == 0
    assert figures["candidates_per_s"] > 0 and figures["goals_per_s"] > 0
    for key in ("first_candidate", "done"):
        p50, p95, p99 = (figures[f"{key}_ms_{q}"] for q in ("p50", "p95", "p99"))
        assert 0 < p50 <= p95 <= p99
    assert figures["first_candidate_ms_p50"] <= figures["done_ms_p99"]
    assert figures["engine_s"] < 1.0  # the no-op engine: nothing was denoised
    assert set(figures["cpu_s"]) >= {"api", "control", "gen", "postgres", "redis"}
    assert figures["overhead_cpu_ms_per_candidate"] > 0
    if figures["shapes_s_per_image"] is not None:  # the shapes weights are shipped
        assert figures["overhead_share_of_shapes"] > 0
        assert figures["met_overhead"] in (True, False)
