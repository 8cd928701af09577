"""Measure the shipped shapes models on held-out goals.

    python -m engine.shapes.evaluate dit [--n 200] [--steps 20] [--shift 3.0] [--cfg 3.0] [--objects 1]
                                         [--cache 0.05] [--layout]
    python -m engine.shapes.evaluate clip [--n 400]

``dit``: one sample per held-out goal (canonical text, seed 0 for goals and noise), judged by
the exact checker; accuracy per attribute, "count" (right number of objects) and "all" (every
requested attribute right and the count right). ``--cfg`` above 1 runs true classifier-free
guidance against the empty prompt. ``--layout`` draws each object's canonical phrase in its own
region, anchored at its position's anchor (``GenerationRequest.regions``, through the engine's
runner; noise seeded per goal, seed + goal index). ``clip``: zero-shot attribute accuracy on
held-out renders.
Prints a table, then one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import numpy as np
import torch

from engine.config import EngineConfig
from engine.runner import Runner
from engine.shapes import checker, world
from engine.types import GenerationRequest, Region


def generate(
    pipe,
    prompts: list[str],
    steps: int,
    cfg: float = 1.0,
    seed: int = 0,
    batch: int = 100,
    max_sequence_length: int | None = None,
) -> np.ndarray:
    """uint8 NHWC samples, one per prompt, from a FluxPipeline (noise seeded per batch)."""
    if max_sequence_length is None:  # the length the model was trained at
        max_sequence_length = int(pipe.tokenizer_2.model_max_length)
    out = []
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        kwargs = {}
        if cfg > 1.0:
            kwargs = {"negative_prompt": [""] * len(chunk), "true_cfg_scale": cfg}
        images = pipe(
            prompt=chunk,
            height=world.IMAGE_SIZE,
            width=world.IMAGE_SIZE,
            num_inference_steps=steps,
            max_sequence_length=max_sequence_length,
            generator=torch.Generator().manual_seed(seed + start),
            output_type="np",
            **kwargs,
        ).images
        out.append((np.clip(images, 0, 1) * 255).round().astype(np.uint8))
    return np.concatenate(out)


def layout_of(objects: list[dict[str, str]]) -> tuple[Region, ...]:
    """Each object's canonical phrase as a region, anchored where its position word puts it."""
    size = float(world.IMAGE_SIZE)
    return tuple(
        Region(world.object_phrase(o), world.POSITIONS[o["position"]][0] / size,
               world.POSITIONS[o["position"]][1] / size)
        for o in objects
    )


def generate_layouts(
    runner: Runner, goals: list[world.Goal], steps: int, cfg: float, seed: int
) -> np.ndarray:
    """uint8 NHWC samples, one per goal, each object drawn in its own region."""
    requests = [
        GenerationRequest(g.text, seed=seed + i, width=world.IMAGE_SIZE, height=world.IMAGE_SIZE,
                          steps=steps, guidance=cfg, model=runner.model, regions=layout_of(g.objects))
        for i, g in enumerate(goals)
    ]
    return np.stack([np.asarray(r.image.convert("RGB")) for r in runner.generate(requests)])


def evaluate_dit(args: argparse.Namespace) -> dict:
    """Checker accuracy of the Flux pipeline on held-out goals."""
    from diffusers import FluxPipeline

    from engine.shapes import components

    runner = None
    if args.layout:
        runner = Runner(args.model, EngineConfig(max_batch=32))
        pipe = runner.pipe
    else:
        pipe = FluxPipeline.from_pretrained(args.model)
    pipe.set_progress_bar_config(disable=True)
    if args.shift is not None:
        pipe.scheduler = components.build_scheduler(args.shift)
    if args.cache > 0:
        from diffusers import FirstBlockCacheConfig

        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=args.cache))
    goals = world.heldout_goals(args.n, objects=args.objects, seed=args.seed)
    start = time.time()
    if runner is not None:
        images = generate_layouts(runner, goals, args.steps, args.cfg, args.seed)
    else:
        images = generate(pipe, [g.text for g in goals], args.steps, args.cfg, seed=args.seed)
    seconds = time.time() - start
    acc = checker.accuracy(list(images), [g.objects for g in goals])
    return {
        "model": args.model,
        "n": args.n,
        "objects": args.objects,
        "steps": args.steps,
        "shift": pipe.scheduler.config.shift,
        "cfg": args.cfg,
        "first_block_cache": args.cache,
        "layout": args.layout,
        "seconds_per_image": round(seconds / args.n, 4),
        **{k: round(v, 4) for k, v in acc.items()},
    }


def evaluate_clip(args: argparse.Namespace) -> dict:
    """Zero-shot attribute accuracy of the shapes CLIP on held-out renders."""
    import open_clip

    from engine.shapes import train_clip

    train_clip.register(args.model)
    model, _, _ = open_clip.create_model_and_transforms(
        "shapes-clip", pretrained=f"{args.model}/open_clip_model.safetensors"
    )
    tokenizer = open_clip.get_tokenizer("shapes-clip")
    acc = train_clip.zero_shot(model, tokenizer, n=args.n, seed=args.seed)
    pairs = zero_shot_pairs(model, tokenizer, n=args.n // 2, seed=args.seed)
    return {
        "model": args.model,
        "n": args.n,
        **{k: round(v, 4) for k, v in acc.items()},
        **{f"two_object_{k}": round(v, 4) for k, v in pairs.items()},
    }


@torch.no_grad()
def zero_shot_pairs(model, tokenizer, n: int, seed: int) -> dict[str, float]:
    """Two-object held-out renders: per attribute, does the true caption outrank every caption
    that changes that attribute of one object (binding, not just presence)?"""
    from engine.shapes.train_clip import image_tensor

    model.eval()
    goals = world.heldout_goals(n, objects=2, seed=seed)
    rng = random.Random(seed)
    scenes = [world.place(g.objects, rng) for g in goals]
    img = model.encode_image(image_tensor(np.stack([world.render(s) for s in scenes]), model))
    img = torch.nn.functional.normalize(img, dim=-1)
    values = {
        "color": world.COLOR_NAMES,
        "shape": world.SHAPES,
        "size": world.SIZE_NAMES,
        "position": world.POSITION_NAMES,
    }
    hits = dict.fromkeys(values, 0)
    for i, goal in enumerate(goals):
        for attr, vals in values.items():
            texts = [goal.text]
            for k in range(2):
                for v in vals:
                    changed = [dict(o) for o in goal.objects]
                    changed[k][attr] = v
                    if changed != goal.objects and world.fits_together(changed):
                        texts.append(world.canonical_caption(changed))
            txt = torch.nn.functional.normalize(model.encode_text(tokenizer(texts)), dim=-1)
            hits[attr] += int((txt @ img[i]).argmax()) == 0
    return {k: v / n for k, v in hits.items()}


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, evaluate, print a table and a JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("dit", "clip"))
    ap.add_argument("--model", default="")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--objects", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shift", type=float, default=None, help="scheduler shift (default: saved)")
    ap.add_argument("--cfg", type=float, default=1.0)
    ap.add_argument("--cache", type=float, default=0.0, help="FirstBlockCache threshold (0: off)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--layout", action="store_true",
                    help="draw each object in its own region (regional prompting)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "dit":
        args.model = args.model or "models/shapes-dit"
        result = evaluate_dit(args)
    else:
        args.model = args.model or "models/shapes-clip"
        args.seed = args.seed or 1234
        result = evaluate_clip(args)
    for key, value in result.items():
        print(f"{key:>20}  {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
