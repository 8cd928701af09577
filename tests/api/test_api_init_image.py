"""A goal that starts from an image: an upload (base64) or an earlier candidate's image."""

from __future__ import annotations

import base64
import io
import random

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from agentloop.settings import Settings
from agentloop.store import Store
from tests.api.fakes import row_counts
from tests.core.helpers import finish_all

NO_ROWS = {"goals": 0, "iterations": 0, "candidates": 0}


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """A small upload limit, so that "too large" needs no megabyte of test data."""
    return settings.model_copy(update={"max_init_image_bytes": 4000})


def _encoded(image: Image.Image, fmt: str = "PNG") -> str:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return base64.b64encode(out.getvalue()).decode("ascii")


def test_an_uploaded_image_is_stored_and_named_in_the_spec(
    api: TestClient, settings: Settings
) -> None:
    picture = Image.new("RGB", (40, 24), (200, 30, 30))
    r = api.post("/v1/goals", json={"goal": "a red circle", "init_image": _encoded(picture),
                                    "init_strength": 0.4})
    assert r.status_code == 201, r.text
    spec = r.json()["spec"]
    assert spec["init_strength"] == 0.4 and spec["init_image"].startswith("uploads/")
    stored = Image.open(settings.resolved_artifacts_dir() / spec["init_image"])
    assert stored.size == (40, 24) and stored.getpixel((0, 0)) == (200, 30, 30)
    served = api.get(f"/v1/artifacts/{spec['init_image']}")
    assert served.status_code == 200 and served.headers["content-type"] == "image/png"
    # a JPEG, as a data: URL, is taken too, with the default strength
    jpeg = f"data:image/jpeg;base64,{_encoded(picture, 'JPEG')}"
    r = api.post("/v1/goals", json={"goal": "a red circle", "init_image": jpeg})
    assert r.status_code == 201 and r.json()["spec"]["init_strength"] == 0.6
    # a goal from text carries none of it
    plain = api.post("/v1/goals", json={"goal": "a red circle"}).json()["spec"]
    assert "init_image" not in plain and "init_strength" not in plain


def test_bad_uploads_are_refused_with_their_code_and_leave_nothing(
    api: TestClient, store: Store, settings: Settings
) -> None:
    noisy = Image.frombytes("RGB", (64, 64), random.Random(0).randbytes(64 * 64 * 3))
    gif = io.BytesIO()
    Image.new("RGB", (8, 8)).save(gif, format="GIF")
    cases = [
        ("not base64", "%%% not base64 %%%", 422, "invalid_image"),
        ("base64 of text", base64.b64encode(b"hello, I am no image").decode(), 422, "invalid_image"),
        ("a GIF", base64.b64encode(gif.getvalue()).decode(), 422, "invalid_image"),
        ("empty", "", 422, "invalid_image"),
        ("truncated PNG", _encoded(Image.new("RGB", (16, 16)))[:60], 422, "invalid_image"),
        ("too large", _encoded(noisy), 413, "image_too_large"),
    ]
    for name, data, status, code in cases:
        r = api.post("/v1/goals", json={"goal": "a red circle", "init_image": data})
        assert r.status_code == status, (name, r.text)
        error = r.json()["error"]
        assert error["code"] == code and error["field"] == "init_image", (name, error)
        assert row_counts(store) == NO_ROWS, name
    for body, field in (
        ({"init_image": _encoded(Image.new("RGB", (8, 8))), "init_candidate_id": "x"}, "init_image"),
        ({"init_strength": 0.5}, "init_strength"),
        ({"init_image": _encoded(Image.new("RGB", (8, 8))), "init_strength": 1.5}, "init_strength"),
    ):
        r = api.post("/v1/goals", json={"goal": "a red circle", **body})
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
        assert field in [e["field"] for e in r.json()["error"]["errors"]]
    assert row_counts(store) == NO_ROWS
    assert not (settings.resolved_artifacts_dir() / "uploads").exists()


def test_a_goal_starts_from_an_earlier_candidate_of_its_tenant(
    api: TestClient, store: Store, settings: Settings
) -> None:
    first = api.post("/v1/goals", json={"goal": "a red circle", "budget": 2, "fanout": 2,
                                        "tenant": "acme"}).json()
    from agentloop.orchestrator import advance

    ids = advance(store, first["id"]).dispatch
    finish_all(store, ids[:1], lambda c: 0.5)
    done, queued = store.get_candidates(ids)
    image = settings.resolved_artifacts_dir() / done.artifact_uri
    image.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32)).save(image)

    r = api.post("/v1/goals", json={"goal": "a blue circle", "tenant": "acme",
                                    "init_candidate_id": done.id, "init_strength": 0.3})
    assert r.status_code == 201, r.text
    spec = r.json()["spec"]
    assert spec["init_image"] == done.artifact_uri and spec["init_candidate_id"] == done.id
    refused = {
        "another tenant's": {"tenant": "other", "init_candidate_id": done.id},
        "unknown": {"tenant": "acme", "init_candidate_id": "nope"},
        "unfinished": {"tenant": "acme", "init_candidate_id": queued.id},
    }
    for name, body in refused.items():
        r = api.post("/v1/goals", json={"goal": "a blue circle", **body})
        assert r.status_code == 422, (name, r.text)
        assert r.json()["error"]["code"] == "invalid_init_candidate", name
    image.unlink()
    r = api.post("/v1/goals", json={"goal": "a blue circle", "tenant": "acme",
                                    "init_candidate_id": done.id})
    assert r.status_code == 422 and "gone" in r.json()["error"]["message"]
