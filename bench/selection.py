"""How well does the verifier pick? The selection gap on layout samples of held-out goals.

For each held-out goal of two (or three) objects, N samples drawn from its planned layout
(`agentloop.layout.plan_layout` over the rule parser's parts), at the model's default steps.
The exact checker says which images are right. The scorer then ranks the N images by several
objectives, and the bench reports how often the top-ranked image is right ("chosen") against
how often any of the N is ("oracle"): the selection gap = oracle - chosen, in points.

Images are generated once: ``--record FILE`` appends each goal's images and verdicts to a JSON
lines file as they are made (a run that stops keeps what it made, and a rerun with the same
file only generates the goals it lacks); ``--replay FILE`` ranks a recorded run without
generating anything. Every objective is evaluated on the same images.

Objectives (per image; a part's view is its region view, `engine.scorer.region_views`, judged
on the region's prompt; cosines, higher is better):

  whole           cos(image, goal)
  parts-region    0.5 * (whole + weakest part's cos on its region): the loop's objective
                  until 2026-12-02
  region-min      the weakest part's cos on its region, alone
  region-mean     the parts' mean cos on their regions, alone (no whole-goal score)
  region-min+mean 0.5 * (weakest part + the parts' mean), no whole-goal score
  whole+parts     the mean of the whole-goal cos and every part's (the whole counts as one
                  part more): the loop's objective
  parts-mean      0.5 * (whole + the parts' mean cos on their regions)
  parts-mix       0.5 * whole + 0.25 * (weakest part + the parts' mean)
  margin-min      the weakest part's contrast margin: cos(view, own text) minus the best
                  cos(view, negative), negatives built from the goal's own words
                  (`agentloop.parts.part_contrasts`: attributes bound to the wrong part)
  prob-min        the weakest part's softmax probability of its own text among its negatives
                  (at the scorer's logit scale)
  logprob-sum     the sum over parts of those log probabilities
  presence-min    the weakest part's cos(view, own) - cos(blank view, own): how much the
                  region's content adds over an empty canvas
  contrast-min    the weakest part's cos(view, own) - max(best negative, blank view)
  whole+margin    whole + margin-min
  parts+margin    parts-region + margin-min
  verified        0.5 * (whole + weakest verified part), a verified part being
                  cos(view, own) - max(0, best negative - cos(view, own)): a part score
                  docked by how far a negative beats it
  verified-blank  the same with the blank view counted among the negatives
  goal-contrast   whole - the best cos(image, goal with one part's subject swapped for a
                  negative)
  crop-min        the weakest part's cos(zoomed view, the part's subject): its region view
                  cropped to a square around the part's anchor and scaled up to the image's
                  size (`zoom_view`), judged on the subject alone (no place words)
  crop-parts      0.5 * (whole + crop-min)
  crop-mix        0.5 * whole + 0.25 * (weakest part on its region + crop-min)
  consensus-min   the weakest part's consensus (`consensus`): how like the same part in the
                  goal's other images its region view is, the others weighted by their part
                  scores (self-consistency across the N samples)
  parts+consensus parts-region + consensus-min (and /2: half of it)
  own+consensus-min  0.5 * whole + 0.5 * the weakest part's (own + consensus)
  zpart-min       the weakest part after standardizing each part's cos over the goal's
                  images (how the part reads against the same part in the other samples)
  z-parts         0.5 * (standardized whole + zpart-min)
  z-sum           standardized whole + the sum of the standardized part scores

With ``--diffusion``, the generator itself as a part verifier (a diffusion classifier, Li et
al. 2023, region-weighted; `diffusion_fit`):

  diffusion-min   the weakest part's fit: how much its prompt lowers the denoiser's error on
                  its region, against the empty prompt (same noises for every image of a goal)
  parts+diffusion the rank of parts-region plus the rank of diffusion-min, within the goal

    python bench/selection.py                      # 20 goals of 2 objects, 16 samples each
    python bench/selection.py --objects 2,3 --goals 40 --record /tmp/sel.jsonl
    python bench/selection.py --replay /tmp/sel.jsonl [--replay /tmp/other.jsonl]
    python bench/selection.py --quick              # 4 goals, 8 samples (a smoke run)

Prints a table per kind; the last line is one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`, the script's folder comes first on sys.path, where the
# queue bench (bench/queue.py) would shadow the standard library's queue that torch imports.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import argparse
import base64
import io
import json
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from PIL import Image

from agentloop.layout import plan_layout
from agentloop.parts import contrast_subjects, goal_parts, part_contrasts, part_regions
from engine.defaults import model_defaults
from engine.scorer import Scorer, background_of, region_views
from engine.shapes import checker, world
from engine.types import GenerationRequest, Region

OBJECTIVES = (
    "whole", "parts-region", "crop-min", "crop-parts", "crop-mix",
    "region-min", "region-mean", "region-min+mean", "whole+parts", "parts-mean", "parts-mix", "margin-min", "prob-min", "logprob-sum",
    "presence-min", "contrast-min", "whole+margin", "parts+margin", "verified",
    "verified-blank", "goal-contrast", "consensus-min", "parts+consensus", "parts+consensus/2",
    "own+consensus-min", "zpart-min", "z-parts", "z-sum",
)
DIFFUSION_OBJECTIVES = ("diffusion-min", "parts+diffusion")
"""Objectives that need ``--diffusion`` (the generator loaded to judge)."""

DIFFUSION_SIGMAS = (0.4, 0.6, 0.8)
"""Noise levels at which ``diffusion_fit`` measures the denoiser's error."""

DIFFUSION_NOISES = 2
"""Noise draws per level (shared by every image of a goal: a paired comparison)."""


def _png(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _unpng(text: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(text))).convert("RGB")


def _goal_key(objects: int, seed: int, index: int) -> str:
    return f"{objects}/{seed}/{index}"


def collect(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every goal's record: its text, objects, layout, images and the checker's verdicts,
    read from ``args.replay`` / ``args.record`` where there, generated (and recorded) where not."""
    paths = args.replay or ([args.record] if args.record else [])
    have: dict[str, dict[str, Any]] = {}
    for path in paths:
        if not Path(path).is_file():
            continue
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                have[rec["key"]] = rec
    if args.replay:
        return [_decode(r) for r in have.values() if r["objects_n"] in args.objects]
    runner = None
    out = []
    for n_obj in args.objects:
        goals = world.heldout_goals(args.goals, objects=n_obj, seed=args.goal_seed)
        for gi, goal in enumerate(goals):
            key = _goal_key(n_obj, args.goal_seed, gi)
            rec = have.get(key)
            if rec is None or len(rec["images"]) < args.samples:
                if runner is None:
                    from engine.config import EngineConfig
                    from engine.runner import Runner
                    runner = Runner(args.model, EngineConfig(max_batch=32))
                rec = _generate(runner, args, key, n_obj, gi, goal)
                if args.record:
                    with open(args.record, "a") as fh:
                        fh.write(json.dumps(rec) + "\n")
            out.append(_decode(rec, args.samples))
    return out


def _generate(runner: Any, args: argparse.Namespace, key: str, n_obj: int, gi: int,
              goal: world.Goal) -> dict[str, Any]:
    parts = goal_parts(goal.text)
    plan = plan_layout(parts)
    assert plan is not None, goal.text
    regions = tuple(Region(*r) for r in plan)
    base = GenerationRequest(goal.text, seed=0, width=32, height=32, steps=args.steps,
                             guidance=args.guidance, model=args.model, regions=regions)
    seeds = [70000 + (n_obj - 2) * 50000 + gi * 100 + s for s in range(args.samples)]
    results = runner.generate([replace(base, seed=s) for s in seeds])
    checks = [checker.check(r.image, goal.objects) for r in results]
    return {
        "key": key, "objects_n": n_obj, "text": goal.text, "objects": goal.objects,
        "layout": [list(e) for e in plan], "seeds": seeds, "steps": args.steps,
        "right": [c.all_ok for c in checks],
        "objects_ok": [[all(o.values()) for o in c.objects] for c in checks],
        "images": [_png(r.image) for r in results],
    }


def _decode(rec: dict[str, Any], samples: int | None = None) -> dict[str, Any]:
    k = samples or len(rec["images"])
    return {**rec, "images": [_unpng(t) for t in rec["images"][:k]], "right": rec["right"][:k],
            "objects_ok": rec["objects_ok"][:k]}


@torch.inference_mode()
def features(scorer: Scorer, rec: dict[str, Any]) -> dict[str, np.ndarray]:
    """Cosines for one goal's images: whole vs goal, each part's view vs its own text and its
    negatives, the blank view vs each part's text, the whole image vs the goal's negatives."""
    parts = goal_parts(rec["text"])
    judged = part_regions(parts, tuple(tuple(e) for e in rec["layout"]))
    regions = [Region(*r) for r in judged]  # type: ignore[misc]
    texts = tuple(r.prompt for r in regions)
    negatives = part_contrasts(parts, texts)
    goal_negs = [rec["text"].replace(p.subject, s, 1)
                 for k, p in enumerate(parts) if p.subject in rec["text"]
                 for s in contrast_subjects(p.subject, [q.subject for i, q in enumerate(parts) if i != k])]
    images = rec["images"]
    views = [v for im in images for v in region_views(im, regions)]
    crops = [zoom_view(v, regions[k % len(regions)]) for k, v in enumerate(views)]
    blanks = [Image.new("RGB", im.size, tuple(int(c) for c in np.rint(background_of(im))))
              for im in images]
    emb = scorer._encode_images([*images, *views, *blanks, *crops])
    n, p = len(images), len(parts)
    whole, view = emb[:n], emb[n:n + n * p].reshape(n, p, -1)
    blank, crop = emb[n + n * p:2 * n + n * p], emb[2 * n + n * p:].reshape(n, p, -1)
    subjects = [q.subject for q in parts]
    all_texts = sorted({rec["text"], *texts, *subjects, *(t for ns in negatives for t in ns),
                        *goal_negs})
    temb = scorer._encode_texts(all_texts)
    t = lambda s: temb[s]  # noqa: E731
    own = torch.stack([view[:, k] @ t(texts[k]) for k in range(p)], 1)  # n x p
    neg = [torch.stack([view[:, k] @ t(s) for s in negatives[k]], 1) if negatives[k]
           else torch.full((n, 1), -1.0) for k in range(p)]
    return {
        "whole": (whole @ t(rec["text"])).numpy(),
        "own": own.numpy(),
        "crop": torch.stack([crop[:, k] @ t(subjects[k]) for k in range(p)], 1).numpy(),
        "neg": [x.numpy() for x in neg],
        "blank": torch.stack([blank @ t(texts[k]) for k in range(p)], 1).numpy(),
        "goal_neg": (torch.stack([whole @ t(s) for s in goal_negs], 1).numpy() if goal_negs
                     else np.full((n, 1), -1.0)),
        "scale": float(scorer.model.logit_scale.exp().clamp(max=100)),
        "consensus": consensus(view, own).numpy(),
    }


@torch.inference_mode()
def diffusion_fit(runner: Any, images: list[Image.Image], regions: list[Region]) -> np.ndarray:
    """Per image and part (n x p): the drop in the denoiser's velocity error on the part's
    region (weighted by `engine.regions.region_weights`) when it is given the part's prompt
    instead of the empty one, averaged over ``DIFFUSION_SIGMAS`` x ``DIFFUSION_NOISES``. The
    generator as a verifier: a part drawn as its prompt says is one the prompt predicts well.
    Flux-family runners only (packed latents)."""
    from diffusers import FluxPipeline

    from engine.regions import region_weights

    pipe, n, p = runner.pipe, len(images), len(regions)
    vae = pipe.vae
    pixels = torch.from_numpy(np.stack([np.asarray(im) for im in images]))
    z = vae.encode((pixels.permute(0, 3, 1, 2).float() / 127.5 - 1.0).to(vae.dtype)).latent_dist.mode()
    z = (z - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
    c, h, w = z.shape[1:]
    x0 = FluxPipeline._pack_latents(z, n, c, h, w)
    texts = runner._embed_many([r.prompt for r in regions] + [""])
    hidden = torch.cat([e.hidden for e in texts]).repeat(n, 1, 1)
    pooled = torch.cat([e.pooled for e in texts]).repeat(n, 1)
    weights = region_weights(regions, h // 2, w // 2).reshape(p, -1)
    weights = weights / weights.sum(1, keepdim=True)
    image_ids = runner.loop.image_ids(images[0].height, images[0].width, x0.dtype)
    text_ids = torch.zeros(hidden.shape[1], 3)
    g = torch.Generator().manual_seed(1234)
    fit = torch.zeros(n, p)
    for sigma in DIFFUSION_SIGMAS:
        for _ in range(DIFFUSION_NOISES):
            noise = torch.randn(1, *x0.shape[1:], generator=g).to(x0.dtype).expand(n, -1, -1)
            x_t = ((1 - sigma) * x0 + sigma * noise).repeat_interleave(p + 1, 0)
            out = pipe.transformer(
                hidden_states=x_t, timestep=torch.full([n * (p + 1)], sigma, dtype=x0.dtype),
                pooled_projections=pooled, encoder_hidden_states=hidden,
                txt_ids=text_ids, img_ids=image_ids, return_dict=False,
            )[0]  # fmt: skip
            target = (noise - x0).repeat_interleave(p + 1, 0)
            err = ((out.float() - target.float()) ** 2).mean(-1).reshape(n, p + 1, -1)
            fit += ((err[:, p:] - err[:, :p]) * weights).sum(-1)
    return (fit / (len(DIFFUSION_SIGMAS) * DIFFUSION_NOISES)).numpy()


def _within_goal_z(x: np.ndarray) -> np.ndarray:
    """Each column standardized over the goal's images (a part's score against the same
    part's in the goal's other images, so a part that reads low everywhere does not decide)."""
    return (x - x.mean(0, keepdims=True)) / (x.std(0, keepdims=True) + 1e-6)


def _within_goal_rank(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x, kind="stable"), kind="stable") / max(len(x) - 1, 1)


def consensus(view: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Per image and part (n x p): how much its part view looks like the same part in the
    goal's other images, each weighted by how well it reads as the part's text (softmax of
    the part scores over the images, at CLIP's usual scale 100). Self-consistency: when most
    samples draw a part right, the right drawing is the common one and a wrong one stands out."""
    n = view.shape[0]
    sim = torch.einsum("ipd,jpd->pij", view, view)  # p x n x n cosines (unit embeddings)
    w = torch.softmax(100.0 * own.T, dim=1)[:, None, :].expand(-1, n, -1).clone()  # p x n x n
    w[:, torch.arange(n), torch.arange(n)] = 0.0  # not itself
    return ((sim * w).sum(2) / w.sum(2).clamp_min(1e-9)).T


ZOOM_SIDE = 0.5
"""The zoomed view's side, as a fraction of the image's (times the region's scale)."""


def zoom_view(view: Image.Image, region: Region) -> Image.Image:
    """A square of ``view`` around the region's anchor, ``ZOOM_SIDE`` times the region's scale
    of the image's side (kept inside the image), scaled back up to the image's size: the
    part drawn with as many of the scorer's pixels as the whole image gets."""
    w, h = view.size
    side = min(1.0, max(0.3, ZOOM_SIDE * region.scale))
    x0 = min(max(region.x - side / 2, 0.0), 1.0 - side)
    y0 = min(max(region.y - side / 2, 0.0), 1.0 - side)
    box = (x0 * w, y0 * h, (x0 + side) * w, (y0 + side) * h)
    return view.resize((w, h), Image.Resampling.BICUBIC, box=box)


def objectives(f: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each objective's value per image (higher: ranked first)."""
    own, whole, blank = f["own"], f["whole"], f["blank"]
    best_neg = np.stack([x.max(1) for x in f["neg"]], 1)  # n x p
    margin = own - best_neg
    logp = []
    for k, x in enumerate(f["neg"]):
        logits = f["scale"] * np.concatenate([own[:, k:k + 1], x], 1)
        logits -= logits.max(1, keepdims=True)
        logp.append(logits[:, 0] - np.log(np.exp(logits).sum(1)))
    logp = np.stack(logp, 1)
    verified = own - np.maximum(0.0, best_neg - own)
    verified_blank = own - np.maximum(0.0, np.maximum(best_neg, blank) - own)
    parts_region = 0.5 * (whole + own.min(1))
    crop = f["crop"]
    return {
        "whole": whole,
        "parts-region": parts_region,
        "crop-min": crop.min(1),
        "crop-parts": 0.5 * (whole + crop.min(1)),
        "crop-mix": 0.5 * whole + 0.25 * (own.min(1) + crop.min(1)),
        "region-min": own.min(1),
        "region-mean": own.mean(1),
        "region-min+mean": 0.5 * (own.min(1) + own.mean(1)),
        "whole+parts": (whole + own.sum(1)) / (own.shape[1] + 1),
        "parts-mean": 0.5 * (whole + own.mean(1)),
        "parts-mix": 0.5 * whole + 0.25 * (own.min(1) + own.mean(1)),
        "margin-min": margin.min(1),
        "prob-min": np.exp(logp.min(1)),
        "logprob-sum": logp.sum(1),
        "presence-min": (own - blank).min(1),
        "contrast-min": (own - np.maximum(best_neg, blank)).min(1),
        "whole+margin": whole + margin.min(1),
        "parts+margin": parts_region + margin.min(1),
        "verified": 0.5 * (whole + verified.min(1)),
        "verified-blank": 0.5 * (whole + verified_blank.min(1)),
        "goal-contrast": whole - f["goal_neg"].max(1),
        "consensus-min": f["consensus"].min(1),
        "parts+consensus": parts_region + f["consensus"].min(1),
        "parts+consensus/2": parts_region + 0.5 * f["consensus"].min(1),
        "own+consensus-min": 0.5 * whole + 0.5 * (own + f["consensus"]).min(1),
        "zpart-min": _within_goal_z(own).min(1),
        "z-parts": 0.5 * (_within_goal_z(whole) + _within_goal_z(own).min(1)),
        "z-sum": _within_goal_z(whole) + _within_goal_z(own).sum(1),
    } | ({} if "diffusion" not in f else {
        "diffusion-min": f["diffusion"].min(1),
        "parts+diffusion": _within_goal_rank(parts_region) + _within_goal_rank(f["diffusion"].min(1)),
    })


SHIPPED = "whole+parts"
"""The loop's objective (`agentloop.revisers.base.objective_of` on these part scores)."""


def why_wrong(image: Image.Image, objects: list[dict[str, str]]) -> str:
    """What the checker finds wrong in an image: the failing attributes, "count" first."""
    result = checker.check(image, objects)
    failed = sorted({a for o in result.objects for a, ok in o.items() if not ok})
    return "+".join((["count"] if not result.count_ok else []) + failed) or "right"


def part_auroc(pairs: list[tuple[np.ndarray, np.ndarray]]) -> float | None:
    """Within-goal AUROC of a part signal: over every goal and part, the chance that an image
    whose object for that part is right (by the checker) scores above one whose object is
    wrong (ties count half). 0.5 is chance; selection needs it near 1. None without such pairs."""
    hits = total = 0.0
    for values, ok in pairs:
        pos, neg = values[ok], values[~ok]
        hits += (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
        total += len(pos) * len(neg)
    return round(float(hits / total), 3) if total else None


def shape_margins(image: Image.Image, objects: list[dict[str, str]]) -> list[tuple[bool, float]]:
    """How sure the judge itself is of each requested shape: (right, soft IoU of the requested
    shape's template minus the best other template's) per requested object found alone at its
    position (objects asked without a position are left out). Near 0: the checker's call is
    a close one."""
    out = []
    for req in objects:
        if "position" not in req:
            continue
        found = [d for d in checker.detect(image) if d.position == req["position"]]
        if len(found) != 1 or not found[0].shape_scores:
            continue
        scores = found[0].shape_scores
        best_other = max(v for k, v in scores.items() if k != req["shape"])
        out.append((found[0].shape == req["shape"], scores.get(req["shape"], 0.0) - best_other))
    return out


def rank(scorer: Scorer, records: list[dict[str, Any]],
         runner: Any = None) -> dict[int, dict[str, Any]]:
    """Per number of objects: the share of goals whose top-ranked image is right, per
    objective, plus the oracle, one sample's rate, and what is wrong (by the checker) in the
    wrong images and in the shipped objective's wrong picks of goals that had a right one.
    With a ``runner`` (the generator), the diffusion objectives too."""
    names = OBJECTIVES + (DIFFUSION_OBJECTIVES if runner is not None else ())
    by_kind: dict[int, dict[str, list[float]]] = {}
    reasons: dict[int, dict[str, dict[str, int]]] = {}
    signals: dict[int, dict[str, list]] = {}
    margins: dict[int, list[tuple[bool, float]]] = {}
    for rec in records:
        f = features(scorer, rec)
        if runner is not None:
            judged = part_regions(goal_parts(rec["text"]), tuple(tuple(e) for e in rec["layout"]))
            f["diffusion"] = diffusion_fit(runner, rec["images"], [Region(*r) for r in judged])  # type: ignore[misc]
        values = objectives(f)
        ok_parts = np.array(rec["objects_ok"], dtype=bool)
        sig = signals.setdefault(rec["objects_n"], {"own": [], "margin": [], "crop": []})
        for k in range(ok_parts.shape[1]):
            sig["own"].append((f["own"][:, k], ok_parts[:, k]))
            sig["margin"].append((f["own"][:, k] - f["neg"][k].max(1), ok_parts[:, k]))
            sig["crop"].append((f["crop"][:, k], ok_parts[:, k]))
            sig.setdefault("consensus", []).append((f["consensus"][:, k], ok_parts[:, k]))
            if "diffusion" in f:
                sig.setdefault("diffusion", []).append((f["diffusion"][:, k], ok_parts[:, k]))
        margins.setdefault(rec["objects_n"], []).extend(
            m for image in rec["images"] for m in shape_margins(image, rec["objects"]))
        row = by_kind.setdefault(rec["objects_n"], {n: [] for n in (*names, "oracle", "one")})
        why = reasons.setdefault(rec["objects_n"], {"all_wrong": {}, "picked_wrong": {}})
        ok = rec["right"]
        for name in names:
            v = values[name]
            top = max(range(len(ok)), key=lambda k, v=v: (float(v[k]), -k))
            row[name].append(float(ok[top]))
            if name == SHIPPED and any(ok) and not ok[top]:
                r = why_wrong(rec["images"][top], rec["objects"])
                why["picked_wrong"][r] = why["picked_wrong"].get(r, 0) + 1
        for image, good in zip(rec["images"], ok, strict=True):
            if not good:
                r = why_wrong(image, rec["objects"])
                why["all_wrong"][r] = why["all_wrong"].get(r, 0) + 1
        row["oracle"].append(float(any(ok)))
        row["one"].append(sum(ok) / len(ok))
    out = {}
    for k, row in sorted(by_kind.items()):
        right = np.array([m for ok, m in margins[k] if ok])
        wrong = np.array([m for ok, m in margins[k] if not ok])
        out[k] = {n: float(np.mean(v)) for n, v in row.items()} | {
            "goals": len(row["oracle"]), "why": reasons[k],
            "part_auroc": {n: part_auroc(p) for n, p in signals[k].items()},
            "judge_close_calls": {
                "right_shapes_within_0.05": round(float((right < 0.05).mean()), 3) if len(right) else None,
                "wrong_shapes_within_0.05": round(float((wrong > -0.05).mean()), 3) if len(wrong) else None,
            },
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 goals, 8 samples each")
    parser.add_argument("--goals", type=int, default=20, help="goals per number of objects")
    parser.add_argument("--samples", type=int, default=16, help="N: layout samples per goal")
    parser.add_argument("--objects", default="2", help="numbers of objects, comma-separated (2, 3)")
    parser.add_argument("--goal-seed", type=int, default=7,
                        help="not the loop bench's goals (seeds 1 to 3)")
    parser.add_argument("--model", default="shapes")
    parser.add_argument("--steps", type=int, default=None, help="default: the model's")
    parser.add_argument("--guidance", type=float, default=None, help="default: the model's")
    parser.add_argument("--scorer", default="shapes-clip")
    parser.add_argument("--weights", metavar="PATH",
                        help="load the scorer's weights from this safetensors file (e.g. a "
                             "fine-tune; replay a record to compare weights on the same images)")
    parser.add_argument("--record", help="JSON lines file: append each generated goal")
    parser.add_argument("--replay", action="append",
                        help="JSON lines file: rank its goals, generate nothing (repeatable: pooled)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--diffusion", action="store_true",
                        help="also rank by the generator's own fit to each part (loads --model)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.objects = [int(k) for k in args.objects.split(",") if k.strip()]
    if any(k not in (2, 3) for k in args.objects):
        parser.error("--objects takes 2 and/or 3")
    if args.quick:
        args.goals, args.samples = 4, 8
    defaults = model_defaults(args.model)
    args.steps = args.steps or int(defaults.get("steps", 20))
    args.guidance = args.guidance if args.guidance is not None else float(defaults.get("guidance", 3.0))
    t0 = time.perf_counter()
    records = collect(args)
    t_gen = time.perf_counter() - t0
    scorer = Scorer(args.scorer)
    if args.weights:
        from safetensors.torch import load_file
        scorer.model.load_state_dict(load_file(args.weights))
    runner = None
    if args.diffusion:
        from engine.config import EngineConfig
        from engine.runner import Runner
        runner = Runner(args.model, EngineConfig())
    result = rank(scorer, records, runner)
    names = OBJECTIVES + (DIFFUSION_OBJECTIVES if runner is not None else ())
    elapsed = time.perf_counter() - t0
    source = f"replayed from {', '.join(args.replay)}" if args.replay else f"model {args.model}, {args.steps} steps"
    for n_obj, r in result.items():
        print(f"\nSelection on {r['goals']} held-out {n_obj}-object goals ({source}), "
              f"{len(records[0]['right'])} layout samples each; right = the exact checker's all_ok.")
        print(f"one sample right {r['one']:.3f}; oracle (any of N right) {r['oracle']:.3f}\n")
        header = f"{'objective':<15} {'chosen right':>12} {'oracle':>7} {'gap (points)':>13}"
        print(header)
        print("-" * len(header))
        for name in names:
            print(f"{name:<15} {r[name]:>12.3f} {r['oracle']:>7.3f} "
                  f"{100 * (r['oracle'] - r[name]):>13.1f}" + ("  (the loop's)" if name == SHIPPED else ""))
        print(f"part AUROC (within goal, right vs wrong object by the checker): own text on its "
              f"region {r['part_auroc']['own']}, contrast margin {r['part_auroc']['margin']}, "
              f"subject on the zoomed view {r['part_auroc']['crop']}"
              + (f", the generator's fit {r['part_auroc']['diffusion']}" if runner else ""))
        close = r["judge_close_calls"]
        print(f"the checker's own close calls (soft IoU of the asked shape within 0.05 of another): "
              f"{close['right_shapes_within_0.05']} of right shapes, "
              f"{close['wrong_shapes_within_0.05']} of wrong ones")
        for label, counts in (("wrong images", r["why"]["all_wrong"]),
                              (f"{SHIPPED}'s wrong picks (goals with a right image)",
                               r["why"]["picked_wrong"])):
            total = sum(counts.values()) or 1
            top = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
            print(f"what the checker finds wrong in {label}: "
                  + ", ".join(f"{k} {v / total:.0%}" for k, v in top))
    figures = {
        "bench": "selection", "scorer": args.scorer, "weights": args.weights, "model": args.model, "steps": args.steps,
        "goal_seed": None if args.replay else args.goal_seed, "replay": args.replay,
        "kinds": {str(k): {"goals": r["goals"], "one_sample_right": round(r["one"], 4),
                           "oracle": round(r["oracle"], 4),
                           "chosen": {n: round(r[n], 4) for n in names},
                           "gap_points": {n: round(100 * (r["oracle"] - r[n]), 1) for n in names},
                           "why": r["why"], "part_auroc": r["part_auroc"],
                           "judge_close_calls": r["judge_close_calls"]}
                  for k, r in result.items()},
        "generate_s": round(t_gen, 1), "seconds": round(elapsed, 1),
    }
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
