"""Fine-tune the shipped shapes-clip as the loop's verifier: teach it to rank the generator's
own candidates the way a judge does, so the loop keeps a right image when it has made one.

    python -m engine.shapes.train_clip_verifier collect --out /tmp/verifier.npz --goals 60
    python -m engine.shapes.train_clip_verifier train --data /tmp/verifier.npz --out DIR

The shipped scorer learned from clean renders only; the generator's failures are objects of
the right color in the right place but a malformed shape, which that scorer has never seen
and places close to the shape asked for (docs/benchmarks.md, the selection gap). This is the
reward-model recipe (ImageReward, PickScore: a CLIP fine-tuned on judged generations) with
the shapes world's exact checker as the judge, on goals of the TRAIN split only; the loop is
measured on held-out goals, whose color x shape x position combinations never appear here.

``collect``: for ``--goals`` train goals of each kind (one, two and three objects), the
loop's first iteration (`engine.shapes.preview_data.requests_for`: the planned layout for
goals of several parts, ``--seeds`` candidates), generated at the model's defaults; the
checker's verdict on every image and on every object in it.

``train``, per step, for ``--goals-per-step`` goals whose candidates the checker splits:

- **Selection (listwise).** The student scores the goal's candidates as the loop ranked them
  when the measured fine-tune was trained (`agentloop.revisers.base.objective_of` then: the
  goal's CLIPScore, and for several parts the mean of it and the weakest part's CLIPScore on
  its region view, `engine.scorer.region_views`; the loop now takes every part's); the loss is the cross-entropy of the softmax of its
  standardized scores (temperature ``--tau``) against the checker's right candidates
  (uniform over them). Only the ranking is learned.
- **Parts (listwise).** The same per part, over the part's region views, against the
  candidates whose object the checker passes, weight ``--part-weight``.
- **Contrastive anchor**, weight ``--contrastive-weight``: shapes-clip's own loss on fresh
  train renders with hard-negative captions, so it still reads every attribute.

The text tower is frozen (the goals' words do not change, what images look like does) and
the model stays in eval mode (the image tower's BatchNorm keeps its statistics). A tenth of
the goals (``--val-share``) is held out of training: before and after, how often the top-
ranked candidate is right against how often any is (the selection gap), per kind; and
`train_clip`'s zero-shot and binding accuracies on held-out renders. Writes
``<out>/open_clip_model.safetensors`` and its config, a drop-in for ``models/shapes-clip``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from PIL import Image

from agentloop.layout import plan_layout
from agentloop.parts import goal_parts, part_regions
from engine.scorer import CLIPSCORE_WEIGHT, region_views
from engine.shapes import train_clip
from engine.shapes.train_clip_preview import contrastive, standardize
from engine.types import Region

KINDS = (1, 2, 3)


def _objects_ok(result, n: int) -> list[bool]:
    """Per requested object, whether the checker passes it (False where it found none)."""
    flags = [all(o.values()) for o in (result.objects or [])]
    return (flags + [False] * n)[:n]


def collect(args: argparse.Namespace) -> None:
    """Generate and judge the train goals' first-iteration candidates into ``args.out``."""
    from engine.config import EngineConfig
    from engine.defaults import model_defaults
    from engine.runner import Runner
    from engine.shapes import checker
    from engine.shapes.preview_data import TRAIN_SEED_BASE, requests_for, train_goals

    torch.set_num_threads(args.threads)
    defaults = model_defaults(args.model)
    runner = Runner(args.model, EngineConfig(device="cpu", max_batch=64))
    per_kind = [train_goals(args.goals, kind, args.seed + 104729 * kind) for kind in KINDS]
    goals = [(g, kind) for row in zip(*per_kind, strict=True) for g, kind in zip(row, KINDS, strict=True)]
    start = time.perf_counter()
    images, ok, objects_ok, meta = [], [], [], []
    for gi, (goal, kind) in enumerate(goals):
        index = TRAIN_SEED_BASE + 20_000 + 10_000 * args.seed + gi
        requests = requests_for(goal, index, args.seeds, args.model, defaults)
        results = runner.generate(requests)
        checks = [checker.check(r.image, goal.objects) for r in results]
        images.append(np.stack([np.asarray(r.image.convert("RGB")) for r in results]))
        ok.append([c.all_ok for c in checks])
        objects_ok.append([_objects_ok(c, 3) for c in checks])
        meta.append({"text": goal.text, "objects": goal.objects, "kind": kind,
                     "layout": [[r.prompt, r.x, r.y, r.scale] for r in requests[0].regions]})  # fmt: skip
        elapsed = time.perf_counter() - start
        print(f"goal {gi + 1}/{len(goals)} ({kind}-object) {elapsed:.0f}s", file=sys.stderr, flush=True)
        if elapsed > args.max_minutes * 60:
            break
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, images=np.stack(images), ok=np.array(ok, dtype=bool),
                        objects_ok=np.array(objects_ok, dtype=bool), goals=np.array(json.dumps(meta)))  # fmt: skip
    ok_arr = np.array(ok)
    print(json.dumps({"event": "done", "goals": len(images), "seeds": args.seeds,
                      "checker_ok": round(float(ok_arr.mean()), 4),
                      "goals_split": int(((ok_arr.sum(1) > 0) & (ok_arr.sum(1) < ok_arr.shape[1])).sum()),
                      "seconds": round(time.perf_counter() - start, 1)}))  # fmt: skip


class Goal:
    """One recorded goal: its candidates, their region views and the texts they are judged on."""

    def __init__(self, meta: dict, images: np.ndarray, ok: np.ndarray, objects_ok: np.ndarray) -> None:
        self.text, self.kind = meta["text"], meta["kind"]
        parts = goal_parts(self.text)
        layout = tuple(tuple(e) for e in meta["layout"]) or (plan_layout(parts) or ())
        judged = part_regions(parts, layout) if parts else ()
        regions = [Region(*r) for r in judged if r is not None]
        if len(regions) != len(parts):
            raise ValueError(f"goal {self.text!r}: its parts are not all placed")
        self.images = images  # (S, H, W, 3) uint8
        self.ok = torch.from_numpy(ok).float()  # (S,)
        # views (P, S, H, W, 3); part k is the goal's object k (canonical captions keep the order)
        for part, obj in zip(parts, meta["objects"], strict=False):
            if obj["color"] not in part.text:
                raise ValueError(f"goal {self.text!r}: part {part.text!r} is not object {obj}")
        pil = [Image.fromarray(im) for im in images]
        self.views = (np.stack([np.stack([np.asarray(v) for v in region_views(im, regions)]) for im in pil], 1)
                      if regions else np.zeros((0, *images.shape), dtype=np.uint8))  # fmt: skip
        self.part_ok = torch.from_numpy(objects_ok[:, : len(regions)].T.copy()).float()  # (P, S)
        self.texts = [self.text, *(r.prompt for r in regions)]

    def split(self) -> bool:
        """Whether the checker passes some candidates and fails others (a ranking to learn)."""
        return 0 < float(self.ok.sum()) < len(self.ok)


def load(paths: list[Path]) -> list[Goal]:
    out = []
    for path in paths:
        d = np.load(path)
        for meta, images, ok, objects_ok in zip(json.loads(str(d["goals"])), d["images"], d["ok"],
                                                d["objects_ok"], strict=True):  # fmt: skip
            out.append(Goal(meta, images, ok, objects_ok))
    return out


def scores(model, text_emb: torch.Tensor, goal: Goal) -> tuple[torch.Tensor, torch.Tensor]:
    """(objective (S,), part scores (P, S)) on the CLIPScore scale, as the loop computes them."""
    n, p = len(goal.images), goal.views.shape[0]
    pixels = np.concatenate([goal.images, goal.views.reshape(-1, *goal.images.shape[1:])])
    emb = F.normalize(model.encode_image(train_clip.image_tensor(pixels, model)), dim=-1)
    whole = CLIPSCORE_WEIGHT * (emb[:n] @ text_emb[0]).clamp_min(0)
    if p == 0:
        return whole, torch.zeros(0, n)
    views = emb[n:].reshape(p, n, -1)
    parts = CLIPSCORE_WEIGHT * torch.einsum("psd,pd->ps", views, text_emb[1:]).clamp_min(0)
    return 0.5 * (whole + parts.min(0).values), parts


def listwise(student: torch.Tensor, right: torch.Tensor, tau: float) -> torch.Tensor:
    """Cross-entropy of softmax(standardized student / tau) against uniform over ``right``."""
    target = right / right.sum()
    return -(target * F.log_softmax(standardize(student) / tau, dim=0)).sum()


@torch.no_grad()
def validate(model, texts: list[torch.Tensor], goals: list[Goal], idx: list[int]) -> dict:
    """Per kind: chosen right (top candidate right), oracle (any right), their gap in points."""
    out: dict[str, dict] = {}
    for kind in KINDS:
        rows = [i for i in idx if goals[i].kind == kind]
        if not rows:
            continue
        chosen = [float(goals[i].ok[int(scores(model, texts[i], goals[i])[0].argmax())]) for i in rows]
        oracle = [float(goals[i].ok.max()) for i in rows]
        out[str(kind)] = {"goals": len(rows), "chosen": round(float(np.mean(chosen)), 4),
                          "oracle": round(float(np.mean(oracle)), 4),
                          "gap_points": round(100 * float(np.mean(oracle) - np.mean(chosen)), 1)}  # fmt: skip
    return out


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    goals = load(args.data)
    order = list(range(len(goals)))
    random.Random(args.seed + 1).shuffle(order)
    n_val = max(1, round(args.val_share * len(goals)))
    val, rest = sorted(order[:n_val]), order[n_val:]
    train_idx = [i for i in rest if goals[i].split()]
    part_idx = [i for i in rest if any(0 < float(r.sum()) < len(r) for r in goals[i].part_ok)]

    train_clip.register(Path(args.init).parent)
    model, _, _ = open_clip.create_model_and_transforms(train_clip.MODEL_NAME, pretrained=args.init)
    tokenizer = open_clip.get_tokenizer(train_clip.MODEL_NAME)
    for name, p in model.named_parameters():
        if not name.startswith("visual."):
            p.requires_grad_(False)
    model.eval()  # BatchNorm keeps the shipped statistics (see the module docstring)
    with torch.no_grad():
        texts = [F.normalize(model.encode_text(tokenizer(g.texts)), dim=-1) for g in goals]
    before = {"val": validate(model, texts, goals, val), "train_split_goals": len(train_idx),
              "zero_shot_heldout": train_clip.zero_shot(model, tokenizer),
              "binding_heldout_two_objects": train_clip.binding(model, tokenizer)}  # fmt: skip
    print(json.dumps({"event": "start", "goals": len(goals), "val_goals": n_val,
                      "args": {k: str(v) for k, v in vars(args).items()}, "before": before}), flush=True)  # fmt: skip
    if not train_idx:
        raise SystemExit("no training goal has both right and wrong candidates: collect more goals")

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.05},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
    )  # fmt: skip
    start = time.time()
    step = 0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = train_clip.lr_at(step, args.steps, args.lr, args.warmup)
        picked = rng.sample(train_idx, min(args.goals_per_step, len(train_idx)))
        if part_idx and args.part_weight > 0:
            picked += rng.sample(part_idx, min(args.goals_per_step // 2, len(part_idx)))
            picked = list(dict.fromkeys(picked))  # a goal drawn twice is scored once
        loss_sel, loss_part, n_sel, n_part = torch.zeros(()), torch.zeros(()), 0, 0
        for i in picked:
            goal = goals[i]
            objective, parts = scores(model, texts[i], goal)
            if goal.split():
                loss_sel, n_sel = loss_sel + listwise(objective, goal.ok, args.tau), n_sel + 1
            for k in range(parts.shape[0]):
                right = goal.part_ok[k]
                if 0 < float(right.sum()) < len(right):
                    loss_part, n_part = loss_part + listwise(parts[k], right, args.tau), n_part + 1
        loss = loss_sel / max(n_sel, 1) + args.part_weight * loss_part / max(n_part, 1)
        loss_c = contrastive(model, tokenizer, rng, args.contrastive_batch, False)
        loss = loss + args.contrastive_weight * loss_c
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        elapsed = time.time() - start
        if step % 25 == 0:
            print(json.dumps({"step": step, "selection": round(loss_sel.item() / max(n_sel, 1), 4),
                              "parts": round(loss_part.item() / max(n_part, 1), 4),
                              "contrastive": round(loss_c.item(), 4), "grad_norm": round(grad_norm, 3),
                              "elapsed_s": round(elapsed, 1)}), flush=True)  # fmt: skip
        if args.eval_every and (step + 1) % args.eval_every == 0:
            print(json.dumps({"event": "eval", "step": step + 1, "val": validate(model, texts, goals, val)}),
                  flush=True)  # fmt: skip
        if elapsed > args.max_minutes * 60:
            break
    after = {"val": validate(model, texts, goals, val),
             "zero_shot_heldout": train_clip.zero_shot(model, tokenizer),
             "binding_heldout_two_objects": train_clip.binding(model, tokenizer)}  # fmt: skip
    train_clip.save(model, args.out)
    print(json.dumps({"event": "done", "steps": step + 1, "elapsed_s": round(time.time() - start, 1),
                      "before": before, "after": after}), flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="generate and judge train goals' candidates")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--model", default="shapes")
    c.add_argument("--goals", type=int, default=60, help="train goals per kind (1, 2, 3 objects)")
    c.add_argument("--seeds", type=int, default=16, help="candidates per goal")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--max-minutes", type=float, default=30.0, help="stop collecting after this long")
    t = sub.add_parser("train", help="fine-tune on collected candidates")
    t.add_argument("--data", type=Path, nargs="+", required=True)
    t.add_argument("--init", default="models/shapes-clip/open_clip_model.safetensors")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=600)
    t.add_argument("--goals-per-step", type=int, default=6)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--tau", type=float, default=0.5)
    t.add_argument("--part-weight", type=float, default=0.5)
    t.add_argument("--contrastive-weight", type=float, default=0.5)
    t.add_argument("--contrastive-batch", type=int, default=64)
    t.add_argument("--val-share", type=float, default=0.1)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--max-minutes", type=float, default=15.0)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    (collect if args.command == "collect" else train)(args)


if __name__ == "__main__":
    main()
