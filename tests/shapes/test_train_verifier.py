"""The verifier fine-tune's tools run end to end at toy sizes: train goals' candidates
generated and judged, the image tower fine-tuned on them, the result loadable as a scorer;
and its ranking loss rewards ranking the checker's right candidates first."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine.shapes import train_clip_verifier

MODELS = Path(__file__).resolve().parents[2] / "models"


def test_listwise_loss_prefers_right_candidates_on_top() -> None:
    right = torch.tensor([0.0, 1.0, 0.0, 1.0])
    good = train_clip_verifier.listwise(torch.tensor([0.1, 0.9, 0.2, 0.8]), right, tau=0.5)
    bad = train_clip_verifier.listwise(torch.tensor([0.9, 0.1, 0.8, 0.2]), right, tau=0.5)
    assert good < bad
    # only the ranking counts: shifting and scaling every score changes nothing
    same = train_clip_verifier.listwise(torch.tensor([0.1, 0.9, 0.2, 0.8]) * 3 + 1, right, tau=0.5)
    assert torch.isclose(good, same)


@pytest.mark.slow
def test_collect_train_and_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "verifier.npz"
    train_clip_verifier.main(["collect", "--out", str(data), "--goals", "2", "--seeds", "4"])
    d = np.load(data)
    meta = json.loads(str(d["goals"]))
    assert d["images"].shape == (6, 4, 32, 32, 3) and d["ok"].shape == (6, 4)
    assert d["objects_ok"].shape == (6, 4, 3)
    assert [g["kind"] for g in meta] == [1, 2, 3, 1, 2, 3]
    # a goal of several parts is drawn from its layout, one region per object
    assert [len(g["layout"]) for g in meta] == [0, 2, 3, 0, 2, 3]
    # an image the checker passes passes every object in it
    assert all(d["objects_ok"][g, s, : meta[g]["kind"]].all()
               for g in range(6) for s in range(4) if d["ok"][g, s])  # fmt: skip
    goals = train_clip_verifier.load([data])
    assert [g.views.shape[:2] for g in goals] == [(k, 4) for k in (0, 2, 3, 0, 2, 3)]

    # the labels the mechanism learns from, set so that every goal splits (the toy draw's own
    # verdicts may split none); the generated images are kept
    labels = tmp_path / "labels.npz"
    ok = np.tile([True, False, True, False], (6, 1))
    np.savez(labels, images=d["images"], ok=ok, objects_ok=np.repeat(ok[..., None], 3, 2),
             goals=d["goals"])
    out = tmp_path / "shapes-clip"
    capsys.readouterr()
    train_clip_verifier.main(["train", "--data", str(labels), "--out", str(out), "--steps", "2",
                              "--goals-per-step", "2", "--contrastive-batch", "8",
                              "--val-share", "0.34", "--eval-every", "1"])  # fmt: skip
    done = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert done["event"] == "done" and done["steps"] == 2
    assert set(done["after"]["val"]) <= {"1", "2", "3"} and done["after"]["val"]
    weights = load_file(str(out / "open_clip_model.safetensors"))
    shipped = load_file(str(MODELS / "shapes-clip" / "open_clip_model.safetensors"))
    assert set(weights) == set(shipped)
    # the text tower is frozen; the image tower learned
    assert all(torch.equal(weights[k], shipped[k]) for k in shipped if not k.startswith("visual."))
    assert any(not torch.equal(weights[k], shipped[k]) for k in shipped if k.startswith("visual."))
