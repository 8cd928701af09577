"""Train the tiny Flux-family text-to-image model of the shapes world and save a FluxPipeline.

    python -m engine.shapes.train_vae                    # first: the autoencoder (runs/shapes-vae)
    python -m engine.shapes.train_dit --steps 2800 --out models/shapes-dit

The transformer (FluxTransformer2DModel) and both text encoders (CLIPTextModel for the pooled
vector, T5EncoderModel for the token sequence) are trained jointly from random initialization
with the rectified-flow loss: x_t = (1 - t) z + t e, target e - z, t logit-normal, on
VAE latents of train-split renders (held-out combinations never appear; half the scenes hold
two objects). The loss is weighted ``1 + --object-weight`` on object pixels (objects cover
5-20% of an image; unweighted, most of the gradient goes to flat background and the model
learns color and place but not shape). 10% of captions are
replaced by "" so true classifier-free guidance (``true_cfg_scale`` with a negative prompt) is
available. AdamW with warm-up, cosine decay and gradient clipping; an exponential moving
average of the weights is what gets saved, every ``--save-every`` steps and at the end, as a
complete ``FluxPipeline.save_pretrained`` folder (safetensors) plus ``agentloop.json`` with
default sampling settings.

``--steps`` gives a fully reproducible run (fixed seeds); with ``--minutes`` instead, the
schedule follows wall-clock progress and the step count is logged. Every ``--eval-every`` steps
the EMA weights are judged by the exact checker on 48 held-out one- and two-object goals.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL, FluxPipeline

from engine.shapes import components, world

DEFAULTS = {
    "steps": 8,
    "guidance": 3.0,
    "true_cfg_scale": 3.0,
    "size": 32,
    "max_sequence_length": components.TEXT_LENGTH,
    "notes": "guidance is true classifier-free guidance (true_cfg_scale, negative prompt ''); "
    "the transformer has no guidance embedding, so guidance_scale does nothing. Pass "
    "height=width=32 and max_sequence_length as given here. Scheduler shift 3.0 (inference only). "
    "Steps 8 (was 20): same held-out checker accuracy, measured with bench/steps.py "
    "(docs/benchmarks.md).",
}
"""Sampling defaults written to ``agentloop.json``: the best measured setting (docs/models.md).
``guidance`` means true classifier-free guidance against the empty prompt."""

SAMPLING_SHIFT = 3.0
"""Scheduler shift saved with the pipeline (inference only: training samples t directly)."""


def make_pipeline(
    vae, clip, t5, tokenizer, transformer, shift: float = SAMPLING_SHIFT
) -> FluxPipeline:
    """A stock FluxPipeline around the given parts (one tokenizer serves both encoders)."""
    return FluxPipeline(
        scheduler=components.build_scheduler(shift),
        vae=vae,
        text_encoder=clip,
        tokenizer=tokenizer,
        text_encoder_2=t5,
        tokenizer_2=copy.deepcopy(tokenizer),
        transformer=transformer,
    )


def save_pipeline(pipe: FluxPipeline, out: Path, extra: dict) -> None:
    """``save_pretrained`` in safetensors, then ``agentloop.json`` (sampling defaults + provenance)."""
    pipe.save_pretrained(out, safe_serialization=True)
    meta_path = out / "agentloop.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else dict(DEFAULTS)
    meta.update(extra)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")


@torch.no_grad()
def evaluate(
    pipe: FluxPipeline, n: int = 48, objects: int = 1, steps: int = DEFAULTS["steps"], seed: int = 0
) -> dict[str, float]:
    """Checker accuracy of one sample per held-out goal (canonical text) at the shipped
    sampling defaults (true CFG against the empty prompt)."""
    from engine.shapes import checker
    from engine.shapes.evaluate import generate

    pipe.set_progress_bar_config(disable=True)
    goals = world.heldout_goals(n, objects=objects, seed=seed)
    images = generate(pipe, [g.text for g in goals], steps, DEFAULTS["true_cfg_scale"], seed)
    return checker.accuracy(images, [g.objects for g in goals])


def object_weights(scenes: list[world.Scene], strength: float) -> torch.Tensor:
    """Per-token loss weights (batch, 64, 16) in packed latent layout: 1 on the background,
    up to ``1 + strength`` on the objects (their masks at latent resolution, grown by one latent
    pixel). Objects cover ~5-20% of an image, so an unweighted loss spends most of its gradient
    on flat background, and the shape of an object is a few pixels of that small area."""
    masks = np.zeros((len(scenes), 1, world.IMAGE_SIZE, world.IMAGE_SIZE), dtype=np.float32)
    for k, scene in enumerate(scenes):
        for o in scene.objects:
            masks[k, 0] = np.maximum(masks[k, 0], world.shape_mask(o.shape, o.cx, o.cy, o.extent))
    m = torch.nn.functional.avg_pool2d(torch.from_numpy(masks), 2)
    m = torch.nn.functional.max_pool2d(m, 3, stride=1, padding=1)
    w = (1.0 + strength * m).expand(-1, components.LATENT_CHANNELS, -1, -1)
    hw = world.IMAGE_SIZE // 2
    return FluxPipeline._pack_latents(w, len(scenes), components.LATENT_CHANNELS, hw, hw)


def main(argv: list[str] | None = None) -> None:
    """Train, log, checkpoint; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vae", default="runs/shapes-vae")
    ap.add_argument("--out", default="models/shapes-dit")
    ap.add_argument("--init", default="", help="continue from this saved pipeline folder")
    ap.add_argument(
        "--minutes", type=float, default=55.0, help="wall-clock budget (schedule follows it)"
    )
    ap.add_argument("--steps", type=int, default=0, help="fixed step count instead of --minutes")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ema", type=float, default=0.999)
    ap.add_argument(
        "--object-weight", type=float, default=4.0, help="extra loss weight on object pixels"
    )
    ap.add_argument("--uncond-prob", type=float, default=0.1)
    ap.add_argument("--two-object-prob", type=float, default=0.3)
    ap.add_argument("--save-every", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--threads-file", default="", help="file with a thread count, re-read every 25 steps"
    )
    ap.add_argument(
        "--text-length",
        type=int,
        default=components.TEXT_LENGTH,
        help="tokens per caption (the shipped model was trained at 40)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    out = Path(args.out)

    vae = AutoencoderKL.from_pretrained(args.vae).eval().requires_grad_(False)
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    tokenizer = components.build_tokenizer(args.text_length)
    if args.init:  # continue from a saved pipeline (its EMA weights)
        init = FluxPipeline.from_pretrained(args.init, vae=vae)
        clip, t5, transformer = init.text_encoder, init.text_encoder_2, init.transformer
    else:
        clip, t5 = components.build_text_encoders(len(tokenizer), args.text_length)
        transformer = components.build_transformer()
    trained = torch.nn.ModuleList([transformer, clip, t5]).train()
    ema = copy.deepcopy(trained).eval().requires_grad_(False)
    params: list[torch.Tensor] = [p for p in trained.parameters() if p.requires_grad]
    ema_params: list[torch.Tensor] = list(ema.parameters())
    n_params = {
        "transformer": sum(p.numel() for p in transformer.parameters()),
        "text_encoder": sum(p.numel() for p in clip.parameters()),
        "text_encoder_2": sum(p.numel() for p in t5.parameters()),
    }
    print(json.dumps({"event": "start", "params": n_params, "args": vars(args)}), flush=True)

    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    latent_hw = world.IMAGE_SIZE // 2
    img_ids = FluxPipeline._prepare_latent_image_ids(
        args.batch, latent_hw // 2, latent_hw // 2, "cpu", torch.float32
    )
    txt_ids = torch.zeros(args.text_length, 3)
    start = time.time()
    wall_start = start  # the command's whole wall time, evaluations included
    running = None
    step = 0
    while True:
        elapsed = time.time() - start
        progress = step / args.steps if args.steps else elapsed / (args.minutes * 60)
        if progress >= 1.0:
            break
        lr = (
            args.lr
            * min(1.0, (step + 1) / args.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        )
        for g in opt.param_groups:
            g["lr"] = lr

        images, captions, scenes = world.sample(
            rng.randrange(2**31), args.batch, "train", args.two_object_prob
        )
        captions = ["" if rng.random() < args.uncond_prob else c for c in captions]
        ids = tokenizer(
            captions,
            padding="max_length",
            max_length=args.text_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        with torch.no_grad():
            z = vae.encode(components.images_to_tensor(images)).latent_dist.mode()
            z = (z - shift) * scale
            z = FluxPipeline._pack_latents(
                z, args.batch, components.LATENT_CHANNELS, latent_hw, latent_hw
            )
        t = torch.sigmoid(torch.randn(args.batch))
        noise = torch.randn_like(z)
        x_t = (1 - t[:, None, None]) * z + t[:, None, None] * noise
        pred = transformer(
            hidden_states=x_t,
            timestep=t,
            pooled_projections=clip(ids).pooler_output,
            encoder_hidden_states=t5(ids)[0],
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        if args.object_weight > 0:
            weight = object_weights(scenes, args.object_weight)
            loss = (weight * (pred - (noise - z)) ** 2).mean() / weight.mean()
        else:
            loss = torch.nn.functional.mse_loss(pred, noise - z)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        step += 1

        if step % 25 == 0 and args.threads_file and Path(args.threads_file).exists():
            # the CPU is shared: let an operator change the thread count mid-run
            wanted = int(Path(args.threads_file).read_text().strip() or args.threads)
            if wanted != torch.get_num_threads():
                torch.set_num_threads(wanted)
                print(json.dumps({"event": "threads", "step": step, "threads": wanted}), flush=True)
        value = loss.item()
        running = value if running is None else 0.98 * running + 0.02 * value
        if step % 25 == 0 or step == 1:
            print(
                json.dumps(
                    {
                        "step": step,
                        "loss": round(value, 4),
                        "loss_ema": round(running, 4),
                        "grad_norm": round(grad_norm, 3),
                        "lr": round(lr, 6),
                        "elapsed_s": round(time.time() - start, 1),
                    }
                ),
                flush=True,
            )
        if step % args.save_every == 0 or step % args.eval_every == 0:
            pipe = make_pipeline(vae, ema[1], ema[2], tokenizer, ema[0])
            save_pipeline(
                pipe,
                out,
                {
                    "train_steps": step,
                    "train_loss_ema": round(running, 4),
                    "max_sequence_length": args.text_length,
                },
            )
            if step % args.eval_every == 0:
                t_eval = time.time()
                report = {"heldout_1obj": evaluate(pipe), "heldout_2obj": evaluate(pipe, objects=2)}
                start += time.time() - t_eval  # evaluation does not eat the training budget
                print(json.dumps({"event": "eval", "step": step, **report}), flush=True)

    pipe = make_pipeline(vae, ema[1], ema[2], tokenizer, ema[0])
    save_pipeline(
        pipe,
        out,
        {
            "train_steps": step,
            "train_loss_ema": round(running or 0.0, 4),
            "max_sequence_length": args.text_length,
            "train_seconds": round(time.time() - start, 1),
            "wall_seconds": round(time.time() - wall_start, 1),
            "seed": args.seed,
        },
    )
    print(
        json.dumps(
            {
                "event": "done",
                "steps": step,
                "loss_ema": running,
                "elapsed_s": round(time.time() - start, 1),
                "wall_s": round(time.time() - wall_start, 1),
            }
        ),
        flush=True,
    )
    try:
        print(
            json.dumps(
                {
                    "event": "eval",
                    "step": step,
                    "heldout_1obj": evaluate(pipe, n=96),
                    "heldout_2obj": evaluate(pipe, n=96, objects=2),
                }
            ),
            flush=True,
        )
    except ImportError:
        pass


if __name__ == "__main__":
    main()
