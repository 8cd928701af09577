"""The ``shapes-clip-preview`` scorer: shapes-clip with its image tower's weights replaced by
the ones in ``<models dir>/shapes-clip-preview/visual.safetensors``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from engine import catalog
from engine.catalog import ModelLoadError
from engine.scorer import Scorer
from engine.types import ScoreRequest

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "shapes-clip"


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A models folder holding the shipped shapes-clip and nothing else."""
    shutil.copytree(SHIPPED, tmp_path / "shapes-clip")
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path))
    return tmp_path


def _write_overlay(models_dir: Path, state: dict[str, torch.Tensor]) -> Path:
    path = models_dir / "shapes-clip-preview" / "visual.safetensors"
    path.parent.mkdir(exist_ok=True)
    save_file(state, str(path))
    return path


def _nudged_visual() -> dict[str, torch.Tensor]:
    """The shipped image tower with every float weight nudged (a stand-in for a fine-tune)."""
    shipped = load_file(str(SHIPPED / "open_clip_model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    return {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).contiguous()
            if v.is_floating_point() else v for k, v in shipped.items()
            if k.startswith("visual.")}  # fmt: skip


def test_it_resolves_only_with_both_weights(models_dir: Path) -> None:
    assert not catalog.is_known_scorer("shapes-clip-preview")
    assert catalog.known_scorers() == ["tiny-clip", "shapes-clip"]
    overlay = _write_overlay(models_dir, _nudged_visual())
    spec = catalog.resolve_scorer("shapes-clip-preview")
    assert spec is not None and spec.overlay == str(overlay)
    assert spec.pretrained == str(models_dir / "shapes-clip" / "open_clip_model.safetensors")
    assert catalog.known_scorers() == ["tiny-clip", "shapes-clip", "shapes-clip-preview"]
    shutil.rmtree(models_dir / "shapes-clip")  # the overlay alone is no scorer
    assert not catalog.is_known_scorer("shapes-clip-preview")


def test_the_overlay_replaces_the_image_tower_only(models_dir: Path) -> None:
    overlay = _nudged_visual()
    _write_overlay(models_dir, overlay)
    base, preview = Scorer("shapes-clip", device="cpu"), Scorer("shapes-clip-preview", device="cpu")
    base_state, preview_state = base.model.state_dict(), preview.model.state_dict()
    for name, value in preview_state.items():
        expected = overlay[name] if name.startswith("visual.") else base_state[name]
        assert torch.equal(value, expected), name
    image = [Image.new("RGB", (32, 32), (30, 30, 30))]
    image[0].paste((220, 20, 20), (4, 12, 14, 22))
    asked = [ScoreRequest("a red square on the left")]
    assert preview.score(image, asked)[0].clip_score != base.score(image, asked)[0].clip_score


def test_weights_that_do_not_fit_are_refused(models_dir: Path) -> None:
    _write_overlay(models_dir, {"visual.no_such_layer": torch.zeros(3)})
    with pytest.raises(ModelLoadError, match="do not fit"):
        Scorer("shapes-clip-preview", device="cpu")
    shapes = {k: torch.zeros(1) for k in list(_nudged_visual())[:1]}  # a known name, wrong shape
    _write_overlay(models_dir, shapes)
    with pytest.raises(ModelLoadError, match="do not fit"):
        Scorer("shapes-clip-preview", device="cpu")
