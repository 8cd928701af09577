"""Train the shapes world's small AutoencoderKL (2x downsampling, 4 latent channels).

    python -m engine.shapes.train_vae [--steps 700] [--threads 1] [--out runs/shapes-vae]
    python -m engine.shapes.train_vae --init runs/shapes-vae --decoder-only --out runs/shapes-vae-ft

The second form fine-tunes only the decoder: the latent space (and a diffusion model trained
on it) stays valid while reconstructions get sharper.

Loss: L1 + MSE reconstruction plus a tiny KL term (the latents stay close to a Gaussian
posterior without blurring edges). At the end it measures the latents' mean and standard
deviation on fresh renders and stores them as the VAE's ``shift_factor`` and
``scaling_factor``, so that ``(z - shift) * scale`` has roughly unit variance, which is what
FluxPipeline undoes before decoding. Saved with ``save_pretrained`` (safetensors).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL

from engine.shapes import components, world


def batch(rng: random.Random, n: int) -> torch.Tensor:
    """A batch of train-split renders (30% two-object scenes) as [-1, 1] NCHW."""
    images = np.stack(
        [world.render(world.sample_scene(rng, 2 if rng.random() < 0.3 else 1)) for _ in range(n)]
    )
    return components.images_to_tensor(images)


@torch.no_grad()
def calibrate(vae, rng: random.Random, n: int = 1024) -> tuple[float, float]:
    """(shift_factor, scaling_factor) from the latent means of ``n`` fresh renders."""
    z = torch.cat([vae.encode(batch(rng, 128)).latent_dist.mode() for _ in range(n // 128)])
    mean, std = float(z.mean()), float(z.std())
    return mean, 1.0 / std


@torch.no_grad()
def psnr(vae, rng: random.Random, n: int = 256) -> float:
    """Reconstruction PSNR (dB, images in [0, 1]) on fresh renders, decoding the posterior mode."""
    x = batch(rng, n)
    rec = vae.decode(vae.encode(x).latent_dist.mode()).sample.clamp(-1, 1)
    mse = float(((rec - x) / 2).pow(2).mean())
    return 10 * math.log10(1.0 / max(mse, 1e-12))


def main(argv: list[str] | None = None) -> None:
    """Train, log, save; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/shapes-vae")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--kl", type=float, default=1e-6)
    ap.add_argument("--max-minutes", type=float, default=10.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--init", default="", help="start from this saved VAE")
    ap.add_argument(
        "--decoder-only", action="store_true", help="freeze the encoder (keeps the latent space)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    if args.init:
        vae = AutoencoderKL.from_pretrained(args.init)
    else:
        vae = components.build_vae()
    if args.decoder_only:
        # the latent space stays exactly as the diffusion model learned it
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
        vae.encoder.eval()
    params = [p for p in vae.parameters() if p.requires_grad]
    print(
        json.dumps(
            {
                "event": "start",
                "params": sum(p.numel() for p in vae.parameters()),
                "args": vars(args),
            }
        ),
        flush=True,
    )
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = 50
    start = time.time()
    for step in range(args.steps):
        lr = (
            args.lr
            * min(1.0, (step + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(rng, args.batch)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        rec_loss = (rec - x).abs().mean() + (rec - x).pow(2).mean()
        kl = post.kl().mean() / x[0].numel()
        loss = rec_loss + args.kl * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        elapsed = time.time() - start
        if step % 25 == 0:
            print(
                json.dumps(
                    {
                        "step": step,
                        "rec": round(rec_loss.item(), 5),
                        "kl": round(kl.item(), 3),
                        "lr": round(lr, 6),
                        "elapsed_s": round(elapsed, 1),
                    }
                ),
                flush=True,
            )
        if elapsed > args.max_minutes * 60:
            break
    vae.eval()
    eval_rng = random.Random(10_000 + args.seed)
    if args.decoder_only:
        shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    else:
        shift, scale = calibrate(vae, eval_rng)
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    out = Path(args.out)
    vae.save_pretrained(out, safe_serialization=True)
    print(
        json.dumps(
            {
                "event": "done",
                "steps": step + 1,
                "psnr_db": round(psnr(vae, eval_rng), 2),
                "shift_factor": shift,
                "scaling_factor": scale,
                "elapsed_s": round(time.time() - start, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
