"""Fine-tune the shipped shapes-clip into a preview scorer: one that ranks partly denoised x0
previews the way the shipped scorer ranks the finished images they become.

    python -m engine.shapes.preview_data --goals 120 --seeds 24 --out /tmp/previews.npz
    python -m engine.shapes.train_clip_preview --data /tmp/previews.npz \\
        --init models/shapes-clip/open_clip_model.safetensors --out models/shapes-clip-preview

Data: ``engine.shapes.preview_data`` (train-split goals only; every candidate's previews at a
few early steps, its finished image, the shipped scorer's score of that image and the checker's
verdict).

Loss, per step:

- **Listwise distillation.** For ``--goals-per-step`` goals, one preview step k each (drawn from
  the recorded ks), the student scores the goal's candidates' previews as the reviser ranks
  candidates (CLIPScore of the goal text, or for two parts the mean of it and the weaker
  part's, both on the whole image). Within the goal, the teacher's distribution is the softmax
  of the finished images' standardized scores (z-scores over the goal's candidates, plus
  ``--checker-bonus`` score units for a candidate the checker passes, standardized together) at
  temperature ``--tau``; the student's is the softmax of its standardized preview scores at
  the same temperature; the loss is KL(teacher || student). Only the ranking is learned (both
  sides are standardized), and the softmax weights the top of the list, which is what pruning
  keeps.
- **Contrastive anchor**, weight ``--contrastive-weight``: shapes-clip's own training loss on a
  fresh batch of clean train-split renders with hard-negative captions
  (``train_clip.make_batch``), so the student still aligns text and images.

The text tower is frozen (``--train-text`` lets it learn): the previews change what images look
like, not what the goals say. The model runs in eval mode throughout, so the image tower's
BatchNorm keeps the shipped running statistics (its affine weights learn).

Output: ``<out>/visual.safetensors``, the image tower's weights alone (5.3 MB fp32), which the
catalog's ``shapes-clip-preview`` scorer lays over shapes-clip's; with ``--train-text``, every
weight as ``<out>/open_clip_model.safetensors`` instead (not a catalog scorer). A tenth of the goals (``--val-share``) is kept out of training;
before and after, the bench's rank correlation (Spearman, mean over goals and ks) of preview
scores against the teacher's final scores is reported on them, and the attribute accuracies
of ``train_clip`` on held-out renders.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.catalog import SHAPES_CLIP_PREVIEW_WEIGHTS
from engine.shapes import train_clip

CLIPSCORE_WEIGHT = 2.5


def standardize(x: torch.Tensor) -> torch.Tensor:
    """Z-scores over the last axis (a constant row gives zeros)."""
    return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True).clamp_min(1e-6)


def objective(img: torch.Tensor, text: torch.Tensor, parts: torch.Tensor | None) -> torch.Tensor:
    """The reviser's objective from unit embeddings: ``img`` (n, d) against the goal text (d,)
    and, when there are two or more parts, each part (p, d): 0.5 * (text + weakest part), the
    loop's objective when the measured fine-tunes (docs/models.md) were trained; the loop now
    ranks by the mean of the text's and every part's score (`objective_of`)."""
    score = CLIPSCORE_WEIGHT * (img @ text)
    if parts is None or parts.shape[0] < 2:
        return score
    return 0.5 * (score + (CLIPSCORE_WEIGHT * (img @ parts.T)).min(dim=1).values)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho (NaN when either side is constant)."""
    from bench.prune import spearman as rho

    return rho(list(map(float, x)), list(map(float, y)))


class Data:
    """The recorded previews as tensors, and the goals' text embeddings (frozen text tower)."""

    def __init__(self, paths: list[Path]) -> None:
        files = [np.load(p) for p in paths]
        if len({tuple(int(k) for k in d["ks"]) for d in files}) != 1:
            raise ValueError("the data files record previews at different steps")
        self.previews = np.concatenate([d["previews"] for d in files])  # (G, K, S, H, W, 3)
        self.final_score = torch.from_numpy(np.concatenate([d["final_score"] for d in files])).float()
        self.ok = torch.from_numpy(np.concatenate([d["ok"] for d in files])).float()  # (G, S)
        self.ks = [int(k) for k in files[0]["ks"]]
        self.goals = [g for d in files for g in json.loads(str(d["goals"]))]

    def teacher(self, g: int, bonus: float) -> torch.Tensor:
        return standardize(self.final_score[g] + bonus * self.ok[g])


def embed_texts(model, tokenizer, goals: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    out = []
    with torch.no_grad():
        for goal in goals:
            e = F.normalize(model.encode_text(tokenizer([goal["text"], *goal["parts"]])), dim=-1)
            out.append((e[0], e[1:] if len(goal["parts"]) >= 2 else None))
    return out


@torch.no_grad()
def validate(model, data: Data, texts, goals: list[int]) -> dict[str, float]:
    """Spearman of preview score vs the teacher's final score (and vs the checker), mean over
    goals, per k."""
    model.eval()  # (training runs in eval mode too: see main)
    out: dict[str, float] = {}
    for ki, k in enumerate(data.ks):
        vs_final, vs_ok = [], []
        for g in goals:
            img = F.normalize(model.encode_image(train_clip.image_tensor(data.previews[g, ki], model)), dim=-1)
            s = objective(img, *texts[g]).numpy()
            vs_final.append(spearman(s, data.final_score[g].numpy()))
            vs_ok.append(spearman(s, data.ok[g].numpy()))
        out[f"k{k}_vs_final"] = round(float(np.nanmean(vs_final)), 4)
        ok = [v for v in vs_ok if not math.isnan(v)]
        out[f"k{k}_vs_checker"] = round(float(np.mean(ok)), 4) if ok else float("nan")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, nargs="+", required=True,
                    help="preview_data files (several: their goals together)")
    ap.add_argument("--init", default="models/shapes-clip/open_clip_model.safetensors")
    ap.add_argument("--out", type=Path, default=Path("models/shapes-clip-preview"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--goals-per-step", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--tau", type=float, default=0.5, help="softmax temperature on z-scores")
    ap.add_argument("--checker-bonus", type=float, default=0.0,
                    help="score units added to a candidate the checker passes, in the teacher")
    ap.add_argument("--contrastive-weight", type=float, default=0.5)
    ap.add_argument("--contrastive-batch", type=int, default=64)
    ap.add_argument("--train-text", action="store_true", help="let the text tower learn too")
    ap.add_argument("--train-ks", type=int, nargs="+", default=None,
                    help="train on the previews of these steps only (default: every recorded k)")
    ap.add_argument("--val-share", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=200, help="log the validation figures")
    ap.add_argument("--max-minutes", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data = Data(args.data)
    n_goals = len(data.goals)
    order = list(range(n_goals))
    random.Random(args.seed + 1).shuffle(order)
    n_val = max(1, round(args.val_share * n_goals))
    val, train = sorted(order[:n_val]), order[n_val:]

    args.out.mkdir(parents=True, exist_ok=True)
    train_clip.register(Path(args.init).parent)  # the shipped config: the architecture is the same
    model, _, _ = open_clip.create_model_and_transforms(train_clip.MODEL_NAME, pretrained=args.init)
    tokenizer = open_clip.get_tokenizer(train_clip.MODEL_NAME)
    if not args.train_text:
        for name, p in model.named_parameters():
            if not name.startswith("visual."):
                p.requires_grad_(False)
    texts = embed_texts(model, tokenizer, data.goals)
    before = {"val": validate(model, data, texts, val),
              "zero_shot_heldout": train_clip.zero_shot(model, tokenizer),
              "binding_heldout_two_objects": train_clip.binding(model, tokenizer)}  # fmt: skip
    print(json.dumps({"event": "start", "goals": n_goals, "train_goals": len(train), "val_goals": n_val,
                      "ks": data.ks, "args": {k: str(v) for k, v in vars(args).items()},
                      "before": before}), flush=True)  # fmt: skip

    train_kis = [data.ks.index(k) for k in (args.train_ks or data.ks)]

    def current() -> list:
        return embed_texts(model, tokenizer, data.goals) if args.train_text else texts

    # eval mode throughout: the image tower's BatchNorm keeps the shipped running statistics
    # (its affine weights still learn), so batches of previews do not shift how the tower
    # normalizes every other image
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(  # decay on matrices only, as train_clip
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.05},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
    )  # fmt: skip
    start = time.time()
    running = None
    step = 0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = train_clip.lr_at(step, args.steps, args.lr, args.warmup)
        picked = rng.sample(train, args.goals_per_step)
        kis = [rng.choice(train_kis) for _ in picked]
        pixels = np.concatenate([data.previews[g, ki] for g, ki in zip(picked, kis, strict=True)])
        img = F.normalize(model.encode_image(train_clip.image_tensor(pixels, model)), dim=-1)
        if args.train_text:
            texts_now = embed_texts_grad(model, tokenizer, [data.goals[g] for g in picked])
        else:
            texts_now = [texts[g] for g in picked]
        seeds = data.previews.shape[2]
        loss_rank = torch.zeros(())
        for j, g in enumerate(picked):
            student = standardize(objective(img[j * seeds:(j + 1) * seeds], *texts_now[j]))
            target = F.softmax(data.teacher(g, args.checker_bonus) / args.tau, dim=0)
            loss_rank = loss_rank + F.kl_div(F.log_softmax(student / args.tau, dim=0), target,
                                             reduction="sum")  # fmt: skip
        loss_rank = loss_rank / len(picked)
        loss = loss_rank
        loss_c = torch.zeros(())
        if args.contrastive_weight > 0:
            loss_c = contrastive(model, tokenizer, rng, args.contrastive_batch, args.train_text)
            loss = loss + args.contrastive_weight * loss_c
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        running = loss_rank.item() if running is None else 0.98 * running + 0.02 * loss_rank.item()
        elapsed = time.time() - start
        if step % 25 == 0:
            print(json.dumps({"step": step, "rank_kl": round(loss_rank.item(), 4),
                              "rank_kl_ema": round(running, 4), "contrastive": round(loss_c.item(), 4),
                              "grad_norm": round(grad_norm, 3), "elapsed_s": round(elapsed, 1)}),
                  flush=True)  # fmt: skip
        if args.eval_every and (step + 1) % args.eval_every == 0:
            print(json.dumps({"event": "eval", "step": step + 1, "elapsed_s": round(elapsed, 1),
                              "val": validate(model, data, current(), val)}), flush=True)  # fmt: skip
        if elapsed > args.max_minutes * 60:
            break
    after = {"val": validate(model, data, current(), val),
             "zero_shot_heldout": train_clip.zero_shot(model, tokenizer),
             "binding_heldout_two_objects": train_clip.binding(model, tokenizer)}  # fmt: skip
    save(model, args.out, args.train_text)
    print(json.dumps({"event": "done", "steps": step + 1, "elapsed_s": round(time.time() - start, 1),
                      "before": before, "after": after}), flush=True)  # fmt: skip


def save(model: torch.nn.Module, out: Path, whole: bool) -> None:
    """The image tower's weights as ``visual.safetensors`` (what the catalog's
    ``shapes-clip-preview`` lays over shapes-clip's), or with ``whole`` (the text tower
    trained too) every weight as ``open_clip_model.safetensors``, with its config."""
    if whole:
        train_clip.save(model, out)
        return
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k.startswith("visual.")}
    tmp = out / f"{SHAPES_CLIP_PREVIEW_WEIGHTS}.tmp"
    save_file(state, str(tmp), metadata={"base": train_clip.MODEL_NAME, "format": "pt"})
    tmp.replace(out / SHAPES_CLIP_PREVIEW_WEIGHTS)


def embed_texts_grad(model, tokenizer, goals: list[dict]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Like ``embed_texts``, with gradients (``--train-text``)."""
    out = []
    for goal in goals:
        e = F.normalize(model.encode_text(tokenizer([goal["text"], *goal["parts"]])), dim=-1)
        out.append((e[0], e[1:] if len(goal["parts"]) >= 2 else None))
    return out


def contrastive(model, tokenizer, rng: random.Random, n: int, train_text: bool) -> torch.Tensor:
    """shapes-clip's own loss on clean train-split renders (``train_clip.main``'s, both ways)."""
    images, captions, target = train_clip.make_batch(rng, n, 0.3, 0.15, swap_prob=0.3)
    img = F.normalize(model.encode_image(train_clip.image_tensor(images, model)), dim=-1)
    with torch.set_grad_enabled(train_text):
        txt = F.normalize(model.encode_text(tokenizer(captions)), dim=-1)
    scale = model.logit_scale.exp().clamp(max=100).detach()
    logits = scale * img @ txt.T
    loss_i = -(target / target.sum(1, keepdim=True) * logits.log_softmax(1)).sum(1).mean()
    t2i, tt = logits[:, :n].T, target[:, :n].T
    loss_t = -(tt / tt.sum(1, keepdim=True) * t2i.log_softmax(1)).sum(1).mean()
    return (loss_i + loss_t) / 2


if __name__ == "__main__":
    main()
