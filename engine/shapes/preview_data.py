"""Partly denoised previews of the shipped shapes model, for training a preview scorer.

    python -m engine.shapes.preview_data --goals 60 --seeds 16 --out /tmp/previews.npz

For ``--goals`` goals per kind (one-object and two-object) drawn from the world's TRAIN split
(``world.sample_objects(..., "train")``: no held-out color x shape x position appears), each
goal's ``--seeds`` candidates are drawn as the search reviser's first iteration draws them
(the goal text, and for two objects at distinct positions its layout) and denoised once at
the model's default steps through the runner's own loop, keeping at every step k in ``--ks``
each candidate's x0 preview (x0 = x_t - sigma_t * v, decoded) and, at the end, the finished
image, its score by ``--scorer`` (as the reviser ranks candidates: the CLIPScore, or for two
parts the mean of it and the weaker part's) and the exact checker's verdict.

The file (numpy ``.npz``) holds ``previews`` (goals, ks, seeds, 32, 32, 3) uint8, ``final``
(goals, seeds, 32, 32, 3) uint8, ``final_score`` and ``ok`` (goals, seeds), ``ks``, and
``goals`` (JSON: text, parts, objects per goal). ``engine.shapes.train_clip_preview`` trains on
it. Seeds are ``derive_seed(TRAIN_SEED_BASE + 10,000 * seed + goal, 0, j)``, apart from the
benches' seeds; another ``--seed`` draws other goals and seeds (more data for the same run).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from agentloop.domain import split_parts
from agentloop.layout import plan_layout
from agentloop.revisers import derive_seed
from agentloop.revisers.base import objective_of
from engine.config import EngineConfig
from engine.defaults import model_defaults
from engine.denoise import DenoiseBatch, DenoiseStep, decode, decode_x0
from engine.runner import Runner
from engine.scorer import Scorer
from engine.shapes import checker, world
from engine.types import GenerationRequest, Region, ScoreRequest

TRAIN_SEED_BASE = 500_000
"""Goal indices for seeds start here, far from the benches' (0..2,999)."""


def train_goals(n: int, objects: int, seed: int) -> list[world.Goal]:
    """``n`` canonical-caption goals whose every object is a TRAIN color x shape x position."""
    rng = random.Random(seed)
    goals = []
    for _ in range(n):
        objs = world.sample_objects(rng, objects, "train")
        goals.append(world.Goal(text=world.canonical_caption(objs), objects=objs))
    return goals


def requests_for(goal: world.Goal, index: int, n: int, model: str, defaults: dict) -> list[GenerationRequest]:
    """The reviser's first iteration for ``goal``: its layout where it has one."""
    layout = plan_layout(split_parts(goal.text)) or ()
    regions = tuple(Region(*entry) for entry in layout)
    return [
        GenerationRequest(goal.text, seed=derive_seed(index, 0, j), width=world.IMAGE_SIZE,
                          height=world.IMAGE_SIZE, steps=int(defaults["steps"]),
                          guidance=float(defaults["guidance"]), model=model, regions=regions)
        for j in range(n)
    ]  # fmt: skip


def objectives(scorer: Scorer, goal: world.Goal, images: list) -> list[float]:
    """Each image's score as the reviser ranks candidates (whole-image parts)."""
    parts = tuple(split_parts(goal.text))
    results = scorer.score(images, [ScoreRequest(goal.text, parts)] * len(images))
    return [objective_of(r.clip_score, r.part_scores, parts) for r in results]


def denoise_with_previews(
    runner: Runner, requests: list[GenerationRequest], ks: list[int]
) -> tuple[dict[int, list], list]:
    """Denoise ``requests`` to the end once as one batch: the x0 previews decoded after every
    step k in ``ks`` (k -> one image per request) and the finished images."""
    assert runner.loop is not None
    first = requests[0]
    previews: dict[int, list] = {}

    def record(step: DenoiseStep, _batch: DenoiseBatch) -> None:
        if step.index + 1 in ks:
            previews[step.index + 1] = decode_x0(runner.pipe, step, first.height, first.width)

    final = runner.loop.run(runner.denoise_batch(requests), first.steps, record)
    return previews, decode(runner.pipe, final.latents, first.height, first.width)


def collect_goal(runner: Runner, scorer: Scorer, goal: world.Goal, requests: list[GenerationRequest],
                 ks: list[int]) -> tuple[np.ndarray, np.ndarray, list[float], list[bool]]:  # fmt: skip
    """Previews (ks, seeds, H, W, 3), finished images (seeds, H, W, 3), their scores, verdicts."""
    previews, images = denoise_with_previews(runner, requests, ks)
    as_array = lambda ims: np.stack([np.asarray(im.convert("RGB")) for im in ims])  # noqa: E731
    return (
        np.stack([as_array(previews[k]) for k in ks]), as_array(images),
        objectives(scorer, goal, images), [checker.check(im, goal.objects).all_ok for im in images],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="shapes")
    ap.add_argument("--scorer", default="shapes-clip")
    ap.add_argument("--goals", type=int, default=60, help="train goals per kind")
    ap.add_argument("--seeds", type=int, default=16, help="candidates per goal")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-minutes", type=float, default=25.0,
                    help="stop collecting after this long (what was collected is written)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    defaults = model_defaults(args.model)
    runner = Runner(args.model, EngineConfig(device="cpu", max_batch=64))
    scorer = Scorer(args.scorer, device="cpu")
    goals = [(g, kind) for kind in (1, 2)
             for g in train_goals(args.goals, kind, args.seed + 7919 * kind)]  # fmt: skip
    goals = [g for pair in zip(goals[: args.goals], goals[args.goals :], strict=True) for g in pair]
    start = time.perf_counter()
    rows: list[tuple] = []
    meta: list[dict] = []
    for gi, (goal, kind) in enumerate(goals):
        index = TRAIN_SEED_BASE + 10_000 * args.seed + gi  # another --seed: other goals and seeds
        requests = requests_for(goal, index, args.seeds, args.model, defaults)
        rows.append(collect_goal(runner, scorer, goal, requests, args.ks))
        meta.append({"text": goal.text, "parts": list(split_parts(goal.text)), "objects": goal.objects,
                     "kind": kind})  # fmt: skip
        elapsed = time.perf_counter() - start
        print(f"goal {gi + 1}/{len(goals)} ({kind}-object) {elapsed:.0f}s", file=sys.stderr, flush=True)
        if elapsed > args.max_minutes * 60:
            break
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out, previews=np.stack([r[0] for r in rows]), final=np.stack([r[1] for r in rows]),
        final_score=np.array([r[2] for r in rows], dtype=np.float32),
        ok=np.array([r[3] for r in rows], dtype=bool), ks=np.array(args.ks),
        goals=np.array(json.dumps(meta)),
    )  # fmt: skip
    ok = np.array([r[3] for r in rows])
    print(json.dumps({"event": "done", "goals": len(rows), "seeds": args.seeds, "ks": args.ks,
                      "checker_ok": round(float(ok.mean()), 4),
                      "seconds": round(time.perf_counter() - start, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
