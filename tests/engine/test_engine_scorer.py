"""The CLIP scorer: the Hessel scale, part scores, the text cache, and loading paths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from engine.catalog import ModelLoadError, UnknownModelError
from engine.scorer import Scorer, clip_score
from engine.types import ScoreRequest


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    """The tiny preset scorer on the CPU."""
    return Scorer("tiny-clip", device="cpu")


def _images(n: int) -> list[Image.Image]:
    return [Image.new("RGB", (32, 32), (40 * i % 256, 90, 255 - 30 * i % 256)) for i in range(n)]


def test_clip_score_scale() -> None:
    assert clip_score(-0.4) == 0.0
    assert clip_score(0.3) == pytest.approx(0.75)
    assert clip_score(1.0) == 2.5


def test_scores_follow_the_hessel_formula(scorer: Scorer) -> None:
    images = _images(3)
    results = scorer.score(images, [ScoreRequest("a blue square")] * 3)
    with torch.no_grad():
        pixels = torch.stack([scorer.preprocess(img) for img in images])
        img = scorer.model.encode_image(pixels, normalize=True)
        txt = scorer.model.encode_text(scorer.tokenizer(["a blue square"]), normalize=True)
    expected = [2.5 * max(float(c), 0.0) for c in (img @ txt.T)[:, 0]]
    assert [r.clip_score for r in results] == pytest.approx(expected, abs=1e-5)
    assert all(0.0 <= r.clip_score <= 2.5 for r in results)


def test_part_scores_and_text_cache(scorer: Scorer) -> None:
    request = ScoreRequest("a red circle left of a yellow star", ("a red circle", "a yellow star"))
    hits, misses = scorer.text_cache_hits, scorer.text_cache_misses
    first = scorer.score(_images(2), [request, request])
    assert scorer.text_cache_misses - misses == 3 and scorer.text_cache_hits == hits
    second = scorer.score(_images(2), [request, request])
    assert scorer.text_cache_hits - hits == 3 and scorer.text_cache_misses - misses == 3
    for a, b in zip(first, second, strict=True):
        assert set(a.part_scores) == set(request.parts)
        assert all(0.0 <= s <= 2.5 for s in a.part_scores.values())
        assert a.clip_score == pytest.approx(b.clip_score) and a.part_scores == pytest.approx(
            b.part_scores
        )


def test_image_batching_does_not_change_scores(scorer: Scorer) -> None:
    small = Scorer("tiny-clip", device="cpu", batch_size=2)
    requests = [ScoreRequest(f"shape {i}") for i in range(5)]
    a, b = scorer.score(_images(5), requests), small.score(_images(5), requests)
    assert [r.clip_score for r in a] == pytest.approx([r.clip_score for r in b], abs=1e-5)


def test_mismatched_and_empty_inputs(scorer: Scorer) -> None:
    assert scorer.score([], []) == []
    with pytest.raises(ValueError, match="2 images but 1"):
        scorer.score(_images(2), [ScoreRequest("x")])


def test_unknown_scorer_raises() -> None:
    with pytest.raises(UnknownModelError, match="unknown scorer"):
        Scorer("no-such-scorer")


def test_weights_from_a_file(scorer: Scorer, tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in scorer.model.state_dict().items()}
    state["text_projection"] = -state["text_projection"]  # flips every cosine
    path = tmp_path / "tiny.pt"
    torch.save(state, path)
    flipped = Scorer(f"tiny-clip:{path}", device="cpu")
    assert torch.equal(flipped.model.state_dict()["text_projection"], state["text_projection"])
    request = [ScoreRequest("a green ring")] * 4
    a, b = scorer.score(_images(4), request), flipped.score(_images(4), request)
    for x, y in zip(a, b, strict=True):  # one of cos and -cos is clipped to zero
        assert min(x.clip_score, y.clip_score) == 0.0


def test_tagged_weights_fail_clearly_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # This machine has no network; offline mode makes the failure immediate instead of retrying.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="tagged weights need the network"):
        Scorer("RN50:openai", device="cpu")
