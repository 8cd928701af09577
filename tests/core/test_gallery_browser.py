"""The static gallery, opened in a real browser (headless Chromium): every candidate's image
is displayed, not just linked."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from agentloop.cli import app
from agentloop.settings import get_settings

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(page: Path, out: Path, tmp: Path) -> np.ndarray:
    subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp / 'chromium-profile'}", "--hide-scrollbars",
         "--window-size=1000,1000", f"--screenshot={out}", page.as_uri()],
        check=True, capture_output=True, timeout=60,
    )
    return np.asarray(Image.open(out).convert("RGB"))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/test.sh installs it)")
def test_gallery_shows_every_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTLOOP_DATA_DIR", str(tmp_path / "data"))
    get_settings.cache_clear()
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["run", "a red circle", "--budget", "4", "--fanout", "4",
                                      "--model", "tiny-dit", "--scorer", "tiny-clip", "--steps", "2",
                                      "--out", str(out)])
    get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    shot = screenshot(out / "index.html", tmp_path / "shot.png", tmp_path)
    shown = {tuple(c) for c in shot.reshape(-1, 3)}
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["candidates"]) == 4
    for cand in summary["candidates"]:
        pixels = np.asarray(Image.open(out / cand["image"]).convert("RGB")).reshape(-1, 3)
        colors = {tuple(c) for c in pixels}
        # Scaled up with image-rendering: pixelated, a displayed image keeps its exact colors.
        seen = len(colors & shown) / len(colors)
        assert seen > 0.8, f"{cand['image']}: only {seen:.0%} of its colors are on screen"
