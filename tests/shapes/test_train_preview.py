"""The preview scorer's tools run end to end at toy sizes: previews of train-split goals
recorded, the image tower fine-tuned on them, and the result loadable as a catalog scorer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from engine import catalog
from engine.scorer import Scorer
from engine.shapes import preview_data, train_clip_preview, world

pytestmark = pytest.mark.slow

MODELS = Path(__file__).resolve().parents[2] / "models"


def test_training_goals_are_never_held_out() -> None:
    for kind in (1, 2):
        for goal in preview_data.train_goals(50, kind, seed=kind):
            assert not any(world.is_heldout(o["color"], o["shape"], o["position"])
                           for o in goal.objects)  # fmt: skip


def test_record_train_and_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    data = tmp_path / "previews.npz"
    preview_data.main(["--out", str(data), "--goals", "2", "--seeds", "3", "--ks", "1", "3"])
    d = np.load(data)
    assert d["previews"].shape == (4, 2, 3, 32, 32, 3) and d["final"].shape == (4, 3, 32, 32, 3)
    assert d["final_score"].shape == d["ok"].shape == (4, 3) and list(d["ks"]) == [1, 3]
    assert [g["kind"] for g in json.loads(str(d["goals"]))] == [1, 2, 1, 2]
    out = tmp_path / "models" / "shapes-clip-preview"
    train_clip_preview.main(["--data", str(data), "--out", str(out), "--steps", "2",
                             "--goals-per-step", "2", "--contrastive-batch", "8",
                             "--val-share", "0.25", "--eval-every", "1"])  # fmt: skip
    done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert done["event"] == "done" and done["steps"] == 2
    assert set(done["after"]["val"]) == {f"k{k}_{w}" for k in (1, 3) for w in ("vs_final", "vs_checker")}
    weights = load_file(str(out / "visual.safetensors"))
    shipped = load_file(str(MODELS / "shapes-clip" / "open_clip_model.safetensors"))
    assert weights and all(k.startswith("visual.") for k in weights)
    assert set(weights) == {k for k in shipped if k.startswith("visual.")}  # the whole tower
    shutil.copytree(MODELS / "shapes-clip", tmp_path / "models" / "shapes-clip")
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path / "models"))
    scorer = Scorer("shapes-clip-preview", device="cpu")
    state = scorer.model.state_dict()
    assert all((state[k] == v).all() for k, v in weights.items())
