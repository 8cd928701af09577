"""Calibrate MagCache for a model: measure how the transformer's residual magnitude changes
from step to step, and store the ratios beside the model for ``step_cache="magcache"``.

    python -m engine.calibrate_magcache shapes                 # writes models/shapes-dit/magcache.json
    python -m engine.calibrate_magcache tiny-dit --out FILE    # a preset has no folder: say where

The model runs its default steps and guidance through the engine's runner (stock pipeline,
no cache) on ``--prompts`` captions of the shapes world's training split (or the lines of
``--prompts-file``), one seed each. The residual is what all the transformer blocks add to the
hidden states (last block's output minus first block's input); for each step, the ratio is
the mean over rows and tokens of ``|residual_t| / |residual_t-1|``, as diffusers' own MagCache
calibration computes it, averaged over every prompt and over the conditional and
unconditional passes (the first step is 1.0). Prints the ratios, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.catalog import ModelSource, resolve_model
from engine.config import EngineConfig
from engine.defaults import model_defaults
from engine.runner import Runner
from engine.step_cache import _blocks, magcache_path
from engine.types import GenerationRequest


class ResidualProbe:
    """Torch forward hooks on the first and last block that collect per-step magnitude ratios.

    The per-token residual norms of every transformer call of a generation are kept; at its
    end the calls are split evenly over the steps (the stock pipeline calls the transformer
    twice per step under classifier-free guidance, conditional then unconditional; the own
    loop once, on both row sets), and each call is compared with the same call one step
    earlier.
    """

    def __init__(self, transformer: torch.nn.Module) -> None:
        blocks = _blocks(transformer)
        if len(blocks) < 2:
            raise TypeError(f"{type(transformer).__name__} has fewer than two transformer blocks")
        self._input: torch.Tensor | None = None
        self._norms: list[torch.Tensor] = []
        self.ratios: dict[int, list[float]] = {}
        self._handles = [
            blocks[0].register_forward_pre_hook(self._pre, with_kwargs=True),
            blocks[-1].register_forward_hook(self._post),
        ]

    def _pre(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        self._input = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def _post(self, _module: torch.nn.Module, _args: tuple, output: Any) -> None:
        assert self._input is not None
        hidden = output[1] if isinstance(output, tuple) else output  # Flux blocks: (encoder, hidden)
        self._norms.append(torch.linalg.norm((hidden - self._input).float(), dim=-1))

    def end_generation(self, steps: int) -> None:
        """File the generation's calls under their steps."""
        calls, self._norms = self._norms, []
        if len(calls) % steps:
            raise RuntimeError(f"{len(calls)} transformer calls do not split over {steps} steps")
        passes = len(calls) // steps
        for k in range(passes, len(calls)):
            now, before = calls[k], calls[k - passes]
            if now.shape == before.shape:
                self.ratios.setdefault(k // passes, []).append((now / (before + 1e-8)).mean().item())

    def mean_ratios(self, steps: int) -> list[float]:
        return [1.0] + [sum(self.ratios[s]) / len(self.ratios[s]) for s in range(1, steps)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _prompts(n: int, seed: int, prompts_file: Path | None) -> list[str]:
    if prompts_file is not None:
        lines = [line.strip() for line in prompts_file.read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{prompts_file} holds no prompts")
        return lines[:n]
    from engine.shapes import world

    rng = random.Random(seed)
    return [world.canonical_caption(world.sample_objects(rng, 1)) for _ in range(n)]


def calibrate(
    model: str, prompts: list[str], steps: int | None = None, guidance: float | None = None,
    size: int | None = None, seed: int = 0, config: EngineConfig | None = None,
) -> dict[str, Any]:
    """Magnitude ratios of ``model`` at its default (or the given) steps, guidance and size."""
    defaults = model_defaults(model)
    steps = int(steps or defaults["steps"])
    guidance = float(guidance if guidance is not None else defaults["guidance"])
    size = int(size or defaults["size"])
    runner = Runner(model, config or EngineConfig(max_batch=len(prompts)))
    probe = ResidualProbe(runner.denoiser)
    requests = [
        GenerationRequest(p, seed=seed + i, width=size, height=size, steps=steps,
                          guidance=guidance, model=model)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    try:
        for batch in runner._batches(requests):
            runner.generate([requests[i] for i in batch])
            probe.end_generation(steps)
    finally:
        probe.remove()
    return {
        "model": model, "num_inference_steps": steps, "guidance": guidance, "size": size,
        "prompts": len(prompts), "seed": seed, "mag_ratios": [round(r, 5) for r in probe.mean_ratios(steps)],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments, calibrate, write the file, print the ratios and a JSON line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="catalog name (shapes, tiny-dit) or a pipeline folder")
    ap.add_argument("--out", type=Path, default=None, help="default: MODEL_FOLDER/magcache.json")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompts-file", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=None, help="default: the model's")
    ap.add_argument("--guidance", type=float, default=None, help="default: the model's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    spec = resolve_model(args.model)
    if spec is None:
        ap.error(f"unknown model {args.model!r}")
    out = args.out
    if out is None:
        if spec.source is not ModelSource.LOCAL:
            ap.error(f"{args.model!r} has no folder to store the calibration in; pass --out FILE")
        out = magcache_path(spec.location)
    start = time.perf_counter()
    prompts = _prompts(args.prompts, args.seed, args.prompts_file)
    figures = calibrate(args.model, prompts, args.steps, args.guidance, seed=args.seed,
                        config=EngineConfig(device=args.device, max_batch=len(prompts)))
    figures["seconds"] = round(time.perf_counter() - start, 1)
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    print(" ".join(f"{r:.3f}" for r in figures["mag_ratios"]))
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    main()
