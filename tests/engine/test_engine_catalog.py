"""The catalog: which names resolve, without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import catalog
from engine.catalog import ModelSource


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty models folder that AGENTLOOP_MODELS_DIR points at."""
    monkeypatch.setenv(catalog.MODELS_DIR_ENV, str(tmp_path))
    return tmp_path


def test_presets_resolve() -> None:
    assert catalog.resolve_model("tiny-unet").pipeline_class == "StableDiffusionPipeline"
    assert catalog.resolve_model("tiny-dit").source is ModelSource.PRESET
    assert {"tiny-unet", "tiny-dit"} <= set(catalog.known_models())


def test_unknown_names_do_not_resolve() -> None:
    assert catalog.resolve_model("no-such-model") is None
    assert not catalog.is_known_model("")
    assert not catalog.is_known_scorer("no-such-scorer")
    assert not catalog.is_known_scorer("NoSuchArch:laion2b")


def test_hub_id_known_only_when_registered() -> None:
    hub_id = "stabilityai/sd-turbo"
    assert not catalog.is_known_model(hub_id)
    spec = catalog.resolve_model(hub_id, extra_models=[hub_id])
    assert spec is not None and spec.source is ModelSource.HUB
    assert hub_id in catalog.known_models([hub_id])


def test_local_pipeline_folder(tmp_path: Path) -> None:
    assert not catalog.is_known_model(str(tmp_path))
    (tmp_path / "model_index.json").write_text("{}")
    spec = catalog.resolve_model(str(tmp_path))
    assert spec is not None and spec.source is ModelSource.LOCAL


def test_shapes_known_once_shipped(models_dir: Path) -> None:
    assert not catalog.is_known_model("shapes")
    assert "shapes" not in catalog.known_models()
    (models_dir / "shapes-dit").mkdir()
    (models_dir / "shapes-dit" / "model_index.json").write_text("{}")
    spec = catalog.resolve_model("shapes")
    assert spec is not None and spec.pipeline_class == "FluxPipeline"
    assert "shapes" in catalog.known_models()


def test_shapes_clip_needs_config_and_weights(models_dir: Path) -> None:
    folder = models_dir / "shapes-clip"
    folder.mkdir()
    (folder / "shapes-clip.json").write_text("{}")
    assert not catalog.is_known_scorer("shapes-clip")
    (folder / "open_clip_model.safetensors").write_bytes(b"")
    spec = catalog.resolve_scorer("shapes-clip")
    assert spec is not None and spec.model_name == "shapes-clip"
    assert spec.config_path == str(folder / "shapes-clip.json")
    assert catalog.known_scorers() == ["tiny-clip", "shapes-clip"]


def test_open_clip_names(tmp_path: Path) -> None:
    spec = catalog.resolve_scorer("ViT-B-32:laion2b_s34b_b79k")
    assert spec is not None and (spec.model_name, spec.pretrained) == (
        "ViT-B-32",
        "laion2b_s34b_b79k",
    )
    weights = tmp_path / "clip.safetensors"
    assert not catalog.is_known_scorer(f"ViT-B-32:{weights}")  # a missing file
    weights.write_bytes(b"")
    assert catalog.resolve_scorer(f"ViT-B-32:{weights}").pretrained == str(weights)
    assert not catalog.is_known_scorer("ViT-B-32")  # weights must be named


def test_catalog_and_package_import_stay_light() -> None:
    code = "import sys, engine, engine.catalog; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
