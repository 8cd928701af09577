"""Loading diffusers pipelines: offline presets built from config, folders, and hub ids.

Presets get random weights seeded from the preset name, drawn on the CPU before moving to
the device, so the same preset is the same model in every process and on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from engine._tokenizers import CLIP_VOCAB_SIZE, load_clip_tokenizer, load_t5_tokenizer
from engine.catalog import (
    ModelLoadError,
    ModelSource,
    ModelSpec,
    UnknownModelError,
    known_models,
    preset_seed,
    resolve_model,
)
from engine.config import EngineConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

TEXT_WIDTH = 32
"""Hidden size of the presets' text encoders (2 heads of 16)."""
T5_MAX_LENGTH = 32
"""Tokens the tiny-dit T5 encoder reads (real Flux models read up to 512)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for an EngineConfig.dtype string."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def _tiny_clip_text_encoder() -> CLIPTextModel:
    config = CLIPTextConfig(
        vocab_size=CLIP_VOCAB_SIZE,
        hidden_size=TEXT_WIDTH,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=77,
        projection_dim=TEXT_WIDTH,
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=49407,
    )
    return CLIPTextModel(config)


def _tiny_vae(blocks: int, shift_factor: float | None) -> AutoencoderKL:
    return AutoencoderKL(
        block_out_channels=(8, 16, 16)[:blocks],
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        shift_factor=shift_factor,
    )


def build_tiny_unet(cache_dir: Path) -> StableDiffusionPipeline:
    """StableDiffusionPipeline with a one-layer-per-block UNet; VAE factor 4 (32x32 -> 8x8)."""
    unet = UNet2DConditionModel(
        block_out_channels=(16, 32),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=TEXT_WIDTH,
        attention_head_dim=(8, 16),
        norm_num_groups=4,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=_tiny_vae(3, None),
        text_encoder=_tiny_clip_text_encoder(),
        tokenizer=load_clip_tokenizer(cache_dir),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    )


def build_tiny_dit(cache_dir: Path) -> FluxPipeline:
    """FluxPipeline with 1 double + 1 single block, head dim 16; VAE factor 4, so sizes are multiples of 8."""
    tokenizer_2 = load_t5_tokenizer(cache_dir, max_length=T5_MAX_LENGTH)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=TEXT_WIDTH,
            d_kv=16,
            d_ff=64,
            num_layers=1,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH,
        pooled_projection_dim=TEXT_WIDTH,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_tiny_vae(3, 0.0),
        text_encoder=_tiny_clip_text_encoder(),
        tokenizer=load_clip_tokenizer(cache_dir),
        text_encoder_2=t5,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


_PRESETS: dict[str, Callable[[Path], DiffusionPipeline]] = {
    "tiny-unet": build_tiny_unet,
    "tiny-dit": build_tiny_dit,
}


def _build_preset(spec: ModelSpec, cache_dir: Path) -> DiffusionPipeline:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(preset_seed(spec.location))
        pipe = _PRESETS[spec.location](cache_dir)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()  # modules built from config start in training mode (dropout on)
    return pipe


def _quiet_loading() -> None:
    """No progress bars while loading: workers log, they do not draw bars."""
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def _from_pretrained(spec: ModelSpec, dtype: torch.dtype) -> DiffusionPipeline:
    cls = FluxPipeline if spec.pipeline_class == "FluxPipeline" else DiffusionPipeline
    _quiet_loading()
    try:
        return cls.from_pretrained(spec.location, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as exc:
        where = "the Hugging Face Hub" if spec.source is ModelSource.HUB else "disk"
        raise ModelLoadError(
            f"could not load model {spec.name!r} from {where} ({spec.location}); "
            f"offline machines need the weights in a local folder or the HF cache: {exc}"
        ) from exc


def load_pipeline(
    name: str, config: EngineConfig = EngineConfig(), extra_models: Iterable[str] = ()
) -> DiffusionPipeline:
    """Load a model by catalog name onto ``config.resolved_device()`` in
    ``config.resolved_dtype()`` (speed-ups are applied after, by ``engine.speedups``).

    Raises UnknownModelError for names the catalog does not know and ModelLoadError when a
    known model's files cannot be read (for a hub id on an offline machine, for instance).
    """
    extra = tuple(extra_models)
    spec = resolve_model(name, extra)
    if spec is None:
        raise UnknownModelError(f"unknown model {name!r}; known: {known_models(extra)}")
    device = config.resolved_device()
    dtype = torch_dtype(config.resolved_dtype(device))
    if spec.source is ModelSource.PRESET:
        pipe = _build_preset(spec, config.resolved_cache_dir())
        if dtype != torch.float32:  # presets are built in float32; cast only when asked
            pipe = pipe.to(dtype=dtype)
    else:
        pipe = _from_pretrained(spec, dtype)
    pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
