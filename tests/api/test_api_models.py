"""GET /v1/models: the models and scorers this installation knows, and the defaults."""

from __future__ import annotations

import sys

from fastapi.testclient import TestClient

from agentloop.settings import Settings


def test_models_lists_presets_and_defaults(api: TestClient, settings: Settings) -> None:
    answer = api.get("/v1/models")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert {"tiny-unet", "tiny-dit"} <= set(body["models"])
    assert "tiny-clip" in body["scorers"]
    assert body["default_model"] in body["models"]
    assert body["default_scorer"] in body["scorers"]
    assert "2.5" in body["score_scale"]


def test_the_catalog_answers_without_torch() -> None:
    import subprocess

    probe = subprocess.run(
        [sys.executable, "-c", "import sys, engine.catalog as c; c.known_models(); "
         "c.known_scorers(); print('torch' in sys.modules, 'open_clip' in sys.modules)"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert probe.stdout.strip() == "False False"


def test_sdk_list_models(api: TestClient) -> None:
    from agentloop.sdk import Client, Models

    with Client("http://testserver", http_client=api) as client:  # type: ignore[arg-type]
        known = client.list_models()
    assert isinstance(known, Models) and "tiny-dit" in known.models


def test_mcp_endpoint_is_mounted(api: TestClient) -> None:
    # The streamable HTTP endpoint answers (a GET without a session is refused, not 404).
    answer = api.get("/mcp", headers={"Accept": "text/event-stream"})
    assert answer.status_code != 404
