"""Train the shapes world's small AutoencoderKL (2x downsampling, 4 latent channels).

    python -m engine.shapes.train_vae [--steps 700] [--decoder-steps 800] [--out runs/shapes-vae]

One command, two stages: the whole autoencoder for ``--steps``, then the decoder alone for
``--decoder-steps`` at ``--decoder-lr`` (the encoder, and so the latent space, frozen) for sharper
reconstructions. ``--init DIR --steps 0`` fine-tunes the decoder of an existing VAE, keeping a
diffusion model trained on its latents valid.

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


def train(
    vae: AutoencoderKL,
    rng: random.Random,
    stage: str,
    steps: int,
    lr_max: float,
    batch_size: int,
    kl_weight: float,
    deadline: float,
    start: float,
) -> None:
    """One stage of AdamW on the trainable parameters: 50-step warm-up, cosine to 10%."""
    params = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr_max, weight_decay=0.0)
    warmup = 50
    for step in range(steps):
        lr = (
            lr_max
            * min(1.0, (step + 1) / warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(rng, batch_size)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        rec_loss = (rec - x).abs().mean() + (rec - x).pow(2).mean()
        kl = post.kl().mean() / x[0].numel()
        loss = rec_loss + kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == steps - 1:
            print(
                json.dumps(
                    {
                        "stage": stage,
                        "step": step,
                        "rec": round(rec_loss.item(), 5),
                        "kl": round(kl.item(), 3),
                        "lr": round(lr, 6),
                        "elapsed_s": round(time.time() - start, 1),
                    }
                ),
                flush=True,
            )
        if time.time() > deadline:
            raise SystemExit(f"train_vae: --max-minutes reached in stage {stage!r} at step {step}")


def main(argv: list[str] | None = None) -> None:
    """Train, log, save; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/shapes-vae")
    ap.add_argument("--steps", type=int, default=700)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--kl", type=float, default=1e-6)
    ap.add_argument("--decoder-steps", type=int, default=800)
    ap.add_argument("--decoder-lr", type=float, default=1e-3)
    ap.add_argument(
        "--max-minutes", type=float, default=30.0, help="safety stop for both stages together"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init", default="", help="start from this saved VAE")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    vae = AutoencoderKL.from_pretrained(args.init) if args.init else components.build_vae()
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
    start = time.time()
    deadline = start + args.max_minutes * 60
    eval_rng = random.Random(10_000 + args.seed)
    if args.steps > 0:
        train(vae, rng, "full", args.steps, args.lr, args.batch, args.kl, deadline, start)
        vae.eval()
        shift, scale = calibrate(vae, eval_rng)
        vae.register_to_config(shift_factor=shift, scaling_factor=scale)
        print(
            json.dumps(
                {"event": "stage", "stage": "full", "psnr_db": round(psnr(vae, eval_rng), 2)}
            ),
            flush=True,
        )
    if args.decoder_steps > 0:
        # the encoder is frozen: the latent space (and a diffusion model on it) stays valid
        vae.encoder.requires_grad_(False)
        vae.quant_conv.requires_grad_(False)
        vae.train()
        vae.encoder.eval()
        train(
            vae,
            rng,
            "decoder",
            args.decoder_steps,
            args.decoder_lr,
            args.batch,
            args.kl,
            deadline,
            start,
        )
    vae.eval()
    shift, scale = vae.config.shift_factor, vae.config.scaling_factor
    out = Path(args.out)
    vae.save_pretrained(out, safe_serialization=True)
    print(
        json.dumps(
            {
                "event": "done",
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
