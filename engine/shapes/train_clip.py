"""Train the tiny CLIP ("shapes-clip") contrastively on the shapes world.

    python -m engine.shapes.train_clip [--steps 1500] [--threads 1] [--out models/shapes-clip]

The model is open_clip's own architecture from a small JSON config (registered with
``open_clip.add_model_config``), so it loads anywhere open_clip does::

    open_clip.add_model_config("models/shapes-clip")
    model, _, preprocess = open_clip.create_model_and_transforms(
        "shapes-clip", pretrained="models/shapes-clip/open_clip_model.safetensors")
    tokenizer = open_clip.get_tokenizer("shapes-clip")

Training uses the train split only (held-out color x shape x position combinations never
appear), one- and two-object scenes, and per image one hard-negative caption that changes a
single attribute, so the model must read color, shape, size and position. Multiple positives
(two scenes with the same attributes in one batch) share the target mass. Warm-up, cosine
decay and gradient clipping keep the loss free of spikes. Every ``--eval-every`` steps it
logs zero-shot attribute accuracy on held-out renders and checkpoints the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from itertools import permutations
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from engine.shapes import world

MODEL_NAME = "shapes-clip"

CONFIG: dict = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 16, "head_width": 32},
    "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 3},
}
"""open_clip config: a ModifiedResNet image tower (one bottleneck per stage, width 16, attention
pooling) and a 3-layer text tower. A ViT with 4x4 patches (width 128, 4 layers) was tried first:
it learned color at once but position not at all in 300-400 contrastive steps (and not in 60
supervised steps either), while this ResNet learns position in ~30 supervised steps at a quarter
of the cost per step."""


def register(folder: str | Path) -> None:
    """Register the folder's ``shapes-clip.json`` with open_clip (idempotent)."""
    open_clip.add_model_config(Path(folder))


def image_tensor(images: np.ndarray, model: torch.nn.Module) -> torch.Tensor:
    """uint8 NHWC images to the normalized NCHW tensor open_clip's preprocess would give."""
    cfg = open_clip.get_model_preprocess_cfg(model)
    mean = torch.tensor(cfg["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(cfg["std"]).view(1, 3, 1, 1)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    return (x - mean) / std


def describes(caption_objects: list[dict[str, str]], scene_objects: list[dict[str, str]]) -> bool:
    """Whether a caption naming ``caption_objects`` (possibly partial) truly describes a scene."""
    if len(caption_objects) != len(scene_objects):
        return False
    return any(
        all(
            all(s.get(k) == v for k, v in c.items())
            for c, s in zip(caption_objects, perm, strict=True)
        )
        for perm in permutations(scene_objects)
    )


def hard_negative(objects: list[dict[str, str]], rng: random.Random) -> list[dict[str, str]]:
    """The same (possibly partial) objects with one stated attribute of one object changed."""
    out = [dict(o) for o in objects]
    o = rng.choice(out)
    attr = rng.choice(
        [a for a in ("color", "shape", "shape", "position", "position", "size") if a in o]
    )
    choices = {
        "color": world.COLOR_NAMES,
        "shape": world.SHAPES,
        "position": world.POSITION_NAMES,
        "size": world.SIZE_NAMES,
    }[attr]
    o[attr] = rng.choice([v for v in choices if v != o[attr]])
    return out


SWAPPABLE: tuple[str, ...] = ("color", "shape", "shape", "size", "position")
"""Attributes a binding negative may swap between two objects (shape twice: the weakest)."""


def swap_negative(
    objects: list[dict[str, str]], rng: random.Random
) -> list[dict[str, str]] | None:
    """The objects with one attribute's values swapped between two of them (NegCLIP-style:
    the same words, bound to the other object), or None when no stated attribute differs
    between any two objects ("a red circle and a blue square" -> "a blue circle and a red
    square")."""
    options = [
        (i, j, a)
        for i in range(len(objects))
        for j in range(i + 1, len(objects))
        for a in SWAPPABLE
        if a in objects[i] and a in objects[j] and objects[i][a] != objects[j][a]
    ]
    if not options:
        return None
    i, j, attr = rng.choice(options)
    out = [dict(o) for o in objects]
    out[i][attr], out[j][attr] = objects[j][attr], objects[i][attr]
    return out


BLOB = "blob"
"""The shape of an object drawn rounded off (`render_rounded`): no shape word describes it."""


def _blur(alpha: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur of a 2-D coverage map."""
    radius = max(1, int(3 * sigma))
    x = np.arange(-radius, radius + 1, dtype=np.float32)
    k = np.exp(-0.5 * (x / sigma) ** 2)
    k /= k.sum()
    out = np.apply_along_axis(lambda r: np.convolve(r, k, mode="same"), 1, alpha)
    return np.apply_along_axis(lambda c: np.convolve(c, k, mode="same"), 0, out)


def render_rounded(scene: world.Scene, index: int, rng: random.Random) -> np.ndarray:
    """The scene with object ``index`` drawn as a rounded-off blob of its shape (its coverage
    blurred, then cut again at a random level, so the edge stays crisp): the malformed shape a
    generator draws when it half-draws a cross or a triangle. A negative image for any caption
    that names that object's shape."""
    img = np.empty((world.IMAGE_SIZE, world.IMAGE_SIZE, 3), dtype=np.float32)
    img[:] = np.asarray(scene.background_rgb, dtype=np.float32)
    for k, o in enumerate(scene.objects):
        alpha = world.shape_mask(o.shape, o.cx, o.cy, o.extent)
        if k == index:
            soft = _blur(alpha, sigma=o.extent * rng.uniform(0.15, 0.25))
            level = rng.uniform(0.3, 0.45) * soft.max()
            alpha = np.clip((soft - level) / 0.08 + 0.5, 0.0, 1.0)
        img = img * (1 - alpha[..., None]) + np.asarray(o.rgb, dtype=np.float32) * alpha[..., None]
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _n_objects(rng: random.Random, two_object_prob: float, three_object_prob: float) -> int:
    u = rng.random()
    return 3 if u < three_object_prob else 2 if u < three_object_prob + two_object_prob else 1


def _partial(
    objects: list[dict[str, str]], rng: random.Random, drop: float
) -> list[dict[str, str]]:
    """Objects with each attribute left out with probability ``drop`` (at least one kept), and
    with probability ``drop`` reduced to a single attribute ("a shape on the left"): captions
    that name one attribute alone give each attribute its own gradient."""
    out = []
    for o in objects:
        if rng.random() < drop:
            attr = rng.choice(("color", "shape", "position", "position", "size"))
            keep = {attr: o[attr]}
        else:
            keep = {k: v for k, v in o.items() if rng.random() >= drop} or {"shape": o["shape"]}
        out.append(keep)
    return out


def make_batch(
    rng: random.Random, n: int, two_object_prob: float, drop: float,
    three_object_prob: float = 0.0, swap_prob: float = 0.0, blob_prob: float = 0.0,
) -> tuple[np.ndarray, list[str], torch.Tensor]:
    """Images, then n positive and n hard-negative captions, and the (n, 2n) target matrix
    (1 where a caption truly describes an image: duplicates and partial captions included).

    A scene of several objects gets, with probability ``swap_prob``, a binding negative (an
    attribute swapped between two objects, `swap_negative`) instead of a changed attribute.
    With probability ``blob_prob`` a scene with a square, triangle or cross has one such
    object drawn rounded off (`render_rounded`): its positive caption leaves that object's
    shape unsaid and its negative names the shape it was meant to be."""
    images = np.empty((n, world.IMAGE_SIZE, world.IMAGE_SIZE, 3), dtype=np.uint8)
    scenes: list[list[dict[str, str]]] = []
    pos: list[str] = []
    neg: list[str] = []
    pos_objs: list[list[dict[str, str]]] = []
    neg_objs: list[list[dict[str, str]]] = []
    for k in range(n):
        n_objects = _n_objects(rng, two_object_prob, three_object_prob)
        scene = world.sample_scene(rng, n_objects, "train")
        objs = scene.attributes()
        roundable = [i for i, o in enumerate(objs) if o["shape"] not in ("circle", "ring")]
        if roundable and rng.random() < blob_prob:
            j = rng.choice(roundable)
            images[k] = render_rounded(scene, j, rng)
            stated = _partial(objs, rng, drop)
            meant = stated[j].get("shape") or objs[j]["shape"]
            stated[j].pop("shape", None)
            if not stated[j]:
                stated[j] = {"color": objs[j]["color"]}
            negative = [dict(o) for o in stated]
            negative[j]["shape"] = meant
            objs[j] = {**objs[j], "shape": BLOB}
        else:
            images[k] = world.render(scene)
            stated = _partial(objs, rng, drop)
            swapped = swap_negative(stated, rng) if n_objects > 1 and rng.random() < swap_prob else None
            negative = swapped or hard_negative(stated, rng)
        for phrases_of, texts in ((stated, pos), (negative, neg)):
            phrases = [world.object_phrase(o, rng) for o in phrases_of]
            rng.shuffle(phrases)
            prefix = rng.choice(world.PREFIXES[:4])
            if not phrases[0].startswith(("a ", "an ")):
                prefix = ""  # not "a picture of on the left, ..."
            texts.append(prefix + " and ".join(phrases))
        scenes.append(objs)
        pos_objs.append(stated)
        neg_objs.append(negative)
    caption_objs = pos_objs + neg_objs
    target = torch.tensor([[float(describes(c, s)) for c in caption_objs] for s in scenes])
    return images, pos + neg, target


@torch.no_grad()
def zero_shot(model: Any, tokenizer, n: int = 400, seed: int = 1234) -> dict[str, float]:
    """Zero-shot accuracy per attribute on held-out one-object renders.

    For each attribute, the candidates are the canonical captions that differ from the truth
    only in that attribute; "all" ranks all 400 one-object canonical captions.
    """
    model.eval()
    rng = random.Random(seed)
    scenes = [world.place(world.sample_objects(rng, 1, "heldout"), rng) for _ in range(n)]
    img = model.encode_image(image_tensor(np.stack([world.render(s) for s in scenes]), model))
    img = F.normalize(img, dim=-1)
    cache: dict[str, torch.Tensor] = {}

    def embed(texts: list[str]) -> torch.Tensor:
        missing = [t for t in texts if t not in cache]
        if missing:
            e = F.normalize(model.encode_text(tokenizer(missing)), dim=-1)
            cache.update(zip(missing, e, strict=True))
        return torch.stack([cache[t] for t in texts])

    values = {
        "color": world.COLOR_NAMES,
        "shape": world.SHAPES,
        "size": world.SIZE_NAMES,
        "position": world.POSITION_NAMES,
    }
    all_objs = [
        {"color": c, "shape": s, "size": z, "position": p}
        for c, s, p in world.combinations("all")
        for z in world.SIZE_NAMES
    ]
    all_emb = embed([world.canonical_caption([o]) for o in all_objs])
    acc = {k: 0 for k in [*values, "all"]}
    for i, scene in enumerate(scenes):
        truth = scene.attributes()[0]
        for attr, vals in values.items():
            texts = [world.canonical_caption([{**truth, attr: v}]) for v in vals]
            best = int((embed(texts) @ img[i]).argmax())
            acc[attr] += vals[best] == truth[attr]
        acc["all"] += all_objs[int((all_emb @ img[i]).argmax())] == truth
    model.train()
    return {k: v / n for k, v in acc.items()}


@torch.no_grad()
def binding(model: Any, tokenizer, n: int = 200, seed: int = 4321) -> dict[str, float]:
    """How often the true canonical caption of a held-out two-object render outranks every
    caption that swaps one attribute between its objects ("swap"), and every caption that
    changes one attribute of one object ("change")."""
    model.eval()
    rng = random.Random(seed)
    hits = {"swap": 0, "change": 0}
    counts = {"swap": 0, "change": 0}
    values = {"color": world.COLOR_NAMES, "shape": world.SHAPES,
              "size": world.SIZE_NAMES, "position": world.POSITION_NAMES}
    for _ in range(n):
        objs = world.sample_objects(rng, 2, "heldout")
        scene = world.place(objs, rng)
        img = F.normalize(model.encode_image(image_tensor(world.render(scene)[None], model)), dim=-1)[0]
        swaps = []
        for a in SWAPPABLE[:1] + SWAPPABLE[2:]:
            if objs[0][a] != objs[1][a]:
                swapped = [dict(o) for o in objs]
                swapped[0][a], swapped[1][a] = objs[1][a], objs[0][a]
                swaps.append(swapped)
        changes = [[{**o, a: v} if i == k else o for i, o in enumerate(objs)]
                   for k in range(2) for a, vs in values.items() for v in vs if v != objs[k][a]]
        changes = [c for c in changes if world.fits_together(c)]
        for kind, others in (("swap", swaps), ("change", changes)):
            if not others:
                continue
            texts = [world.canonical_caption(objs)] + [world.canonical_caption(o) for o in others]
            emb = F.normalize(model.encode_text(tokenizer(texts)), dim=-1)
            sims = emb @ img
            hits[kind] += bool(sims[0] > sims[1:].max())
            counts[kind] += 1
    model.train()
    return {k: hits[k] / max(counts[k], 1) for k in hits}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to 5% of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def save(model: torch.nn.Module, out: Path) -> None:
    """Write the config JSON and the state dict (safetensors) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{MODEL_NAME}.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tmp = out / "open_clip_model.safetensors.tmp"
    save_file(state, str(tmp))
    tmp.replace(out / "open_clip_model.safetensors")


def main(argv: list[str] | None = None) -> None:
    """Train, log, checkpoint; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="models/shapes-clip")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--two-object-prob", type=float, default=0.3)
    ap.add_argument("--three-object-prob", type=float, default=0.0,
                    help="share of three-object scenes (small objects on three sides)")
    ap.add_argument("--swap-prob", type=float, default=0.0,
                    help="chance that a scene of several objects gets a binding negative (an "
                         "attribute swapped between two objects) instead of a changed attribute")
    ap.add_argument("--blob-prob", type=float, default=0.0,
                    help="chance that a scene has one object drawn rounded off, captioned "
                         "without its shape, its hard negative naming the shape (render_rounded)")
    ap.add_argument("--pair-weight", type=float, default=0.0,
                    help="weight of a loss that ranks each image's caption above its own hard "
                         "negative alone (focuses the gradient on the negatives)")
    ap.add_argument("--init", default=None,
                    help="start from these weights (a safetensors state dict) instead of random: "
                         "fine-tuning")
    ap.add_argument(
        "--drop", type=float, default=0.15, help="chance to leave out each non-shape attribute"
    )
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument(
        "--max-minutes", type=float, default=20.0, help="stop (and save) after this long"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{MODEL_NAME}.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    register(out)
    model, _, _ = open_clip.create_model_and_transforms(MODEL_NAME, pretrained=args.init)
    tokenizer = open_clip.get_tokenizer(MODEL_NAME)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        json.dumps({"event": "start", "params": n_params, "config": CONFIG, "args": vars(args)}),
        flush=True,
    )

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embedding" not in n]
    no_decay = [
        p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embedding" not in n)
    ]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        eps=1e-6,
    )
    start = time.time()
    running = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        images, texts, target = make_batch(
            rng, args.batch, args.two_object_prob, args.drop, args.three_object_prob, args.swap_prob,
            args.blob_prob,
        )
        img = F.normalize(model.encode_image(image_tensor(images, model)), dim=-1)
        txt = F.normalize(model.encode_text(tokenizer(texts)), dim=-1)
        scale = model.logit_scale.exp().clamp(max=100)
        logits = scale * img @ txt.T  # B x 2B: image -> all captions, hard negatives included
        loss_i = -(target / target.sum(1, keepdim=True) * logits.log_softmax(1)).sum(1).mean()
        t2i = logits[:, : args.batch].T  # positive captions -> images
        tt = target[:, : args.batch].T
        loss_t = -(tt / tt.sum(1, keepdim=True) * t2i.log_softmax(1)).sum(1).mean()
        loss = (loss_i + loss_t) / 2
        if args.pair_weight > 0:  # each image against its own hard negative alone
            rows = torch.arange(args.batch)
            pair = torch.stack([logits[rows, rows], logits[rows, rows + args.batch]], dim=1)
            real = target[rows, rows + args.batch] == 0  # a negative that is no negative
            loss_pair = F.cross_entropy(pair[real], torch.zeros(int(real.sum()), dtype=torch.long))
            loss = loss + args.pair_weight * loss_pair
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        loss_value = loss.item()
        running = loss_value if running is None else 0.98 * running + 0.02 * loss_value
        elapsed = time.time() - start
        if step % 25 == 0:
            print(
                json.dumps(
                    {
                        "step": step,
                        "loss": round(loss_value, 4),
                        "loss_ema": round(running, 4),
                        "grad_norm": round(grad_norm, 3),
                        "lr": round(opt.param_groups[0]["lr"], 6),
                        "logit_scale": round(float(scale), 2),
                        "elapsed_s": round(elapsed, 1),
                    }
                ),
                flush=True,
            )
        last = step == args.steps - 1 or elapsed > args.max_minutes * 60
        if (step + 1) % args.eval_every == 0 or last:
            acc = zero_shot(model, tokenizer)
            print(
                json.dumps(
                    {
                        "event": "eval",
                        "step": step + 1,
                        "zero_shot_heldout": acc,
                        "binding_heldout_two_objects": binding(model, tokenizer),
                        "loss_ema": round(running, 4),
                        "elapsed_s": round(time.time() - start, 1),
                    }
                ),
                flush=True,
            )
            save(model, out)
        if last:
            break
    print(
        json.dumps(
            {"event": "done", "steps": step + 1, "elapsed_s": round(time.time() - start, 1)}
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
