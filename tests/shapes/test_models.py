"""The shipped shapes models: the tiny CLIP (open_clip) and the tiny Flux pipeline (diffusers)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.shapes import checker, world

ROOT = Path(__file__).resolve().parents[2]
CLIP_DIR = ROOT / "models" / "shapes-clip"
DIT_DIR = ROOT / "models" / "shapes-dit"


@pytest.fixture(scope="module")
def clip():
    import open_clip

    open_clip.add_model_config(CLIP_DIR)
    model, _, preprocess = open_clip.create_model_and_transforms(
        "shapes-clip", pretrained=str(CLIP_DIR / "open_clip_model.safetensors")
    )
    return model.eval(), preprocess, open_clip.get_tokenizer("shapes-clip")


@pytest.fixture(scope="module")
def pipe():
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(DIT_DIR)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_weights_are_small_safetensors() -> None:
    files = [p for d in (CLIP_DIR, DIT_DIR) for p in d.rglob("*") if p.is_file()]
    weights = [p for p in files if p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".ckpt")]
    assert weights and all(p.suffix == ".safetensors" for p in weights)
    assert sum(p.stat().st_size for p in files) <= 40 * 2**20


def test_clip_ranks_the_true_caption_first(clip) -> None:
    model, preprocess, tokenizer = clip
    rng = random.Random(0)
    images, texts = [], []
    for _ in range(12):
        (truth,) = world.sample_objects(rng, 1, "heldout")
        images.append(preprocess(world.render_image(world.place([truth], rng))))
        for attr, values in (
            ("color", world.COLOR_NAMES),
            ("shape", world.SHAPES),
            ("position", world.POSITION_NAMES),
        ):
            wrong = {**truth, attr: rng.choice([v for v in values if v != truth[attr]])}
            texts += [world.canonical_caption([truth]), world.canonical_caption([wrong])]
    with torch.no_grad():
        img = torch.nn.functional.normalize(model.encode_image(torch.stack(images)), dim=-1)
        txt = torch.nn.functional.normalize(model.encode_text(tokenizer(texts)), dim=-1)
    sims = (txt.view(12, 3, 2, -1) * img.view(12, 1, 1, -1)).sum(-1)  # image, attribute, true/wrong
    wins = int((sims[..., 0] > sims[..., 1]).sum())
    assert wins / 36 >= 0.85, f"{wins}/36"


def test_flux_pipeline_generates_32x32(pipe) -> None:
    meta = json.loads((DIT_DIR / "agentloop.json").read_text())
    assert {"steps", "guidance", "size"} <= set(meta) and meta["size"] == 32
    out = pipe(
        "a small red circle on the left",
        height=32,
        width=32,
        num_inference_steps=4,
        max_sequence_length=meta["max_sequence_length"],
        generator=torch.Generator().manual_seed(0),
    )
    assert out.images[0].size == (32, 32) and out.images[0].mode == "RGB"


def test_flux_first_block_cache_runs(pipe) -> None:
    from diffusers import FirstBlockCacheConfig

    kwargs = dict(
        prompt=["a large blue square at the top"] * 2,
        height=32,
        width=32,
        num_inference_steps=6,
        max_sequence_length=pipe.tokenizer_2.model_max_length,
        output_type="np",
    )
    plain = pipe(**kwargs, generator=torch.Generator().manual_seed(1)).images
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.05))
    try:
        cached = pipe(**kwargs, generator=torch.Generator().manual_seed(1)).images
    finally:
        pipe.transformer.disable_cache()
    assert cached.shape == plain.shape == (2, 32, 32, 3)
    assert np.abs(cached - plain).mean() < 0.1


def test_short_generation_is_judged_by_the_checker(pipe) -> None:
    meta = json.loads((DIT_DIR / "agentloop.json").read_text())
    goals = world.heldout_goals(12, objects=1, seed=123)
    images = pipe(
        [g.text for g in goals],
        negative_prompt=[""] * len(goals),
        true_cfg_scale=meta["guidance"],
        height=32,
        width=32,
        num_inference_steps=8,
        max_sequence_length=meta["max_sequence_length"],
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    acc = checker.accuracy(list(images), [g.objects for g in goals])
    # chance: color 1/8, position 1/5, all four attributes 1/400; measured at 20 steps
    # on 200 goals: color 0.995, position 1.00, all 0.705 (docs/models.md)
    assert acc["color"] >= 0.75 and acc["position"] >= 0.75 and acc["all"] >= 0.3, acc


def test_evaluate_lays_each_object_out_at_its_anchor() -> None:
    from engine.shapes.evaluate import layout_of
    from engine.types import Region

    objects = [
        {"color": "red", "shape": "circle", "size": "small", "position": "left"},
        {"color": "blue", "shape": "ring", "size": "large", "position": "top"},
    ]
    assert layout_of(objects) == (
        Region("a small red circle on the left", 0.25, 0.5),
        Region("a large blue ring at the top", 0.5, 0.25),
    )
