"""The parts of the tiny shapes text-to-image model, as stock diffusers / transformers classes.

``FluxPipeline`` wants: a CLIP text model (pooled vector) with its tokenizer, a T5 encoder
(token sequence) with its tokenizer, an ``AutoencoderKL``, a ``FlowMatchEulerDiscreteScheduler``
and a ``FluxTransformer2DModel``. Here all are small:

- one word-level tokenizer over the world's vocabulary (``tokenizers``, wrapped as
  ``PreTrainedTokenizerFast``), used for both text encoders;
- CLIPTextModel (the pooled vector) and T5EncoderModel (the token sequence the transformer
  attends to), width 64, two layers each;
- AutoencoderKL with two levels (2x downsampling): 32x32x3 images become 16x16x4 latents,
  which the pipeline packs 2x2 into 64 tokens of 16 channels;
- FluxTransformer2DModel with 2 double-stream and 4 single-stream blocks, width 128.
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)

from engine.shapes import world

TEXT_LENGTH = 32
"""Tokens per prompt for both text encoders, ``<s>`` and ``</s>`` included. 99.9% of the world's
captions fit (the longest, with prefix and background, are 33); the rest are cut at the end.
Every token costs: the transformer attends over 64 image + 32 text tokens in every block."""

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
TEXT_WIDTH = 64
"""Width of the CLIP text encoder (its pooled vector conditions the transformer's norms)."""
T5_WIDTH = 64
"""Width of the T5 encoder, whose token sequence the transformer attends to."""
T5_LAYERS = 2
LATENT_CHANNELS = 4


def build_tokenizer(max_length: int = TEXT_LENGTH) -> PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer over the world's words and punctuation.

    Adds ``<s>`` ... ``</s>``; unknown words map to ``<unk>``. Ids: pad 0, unk 1, bos 2, eos 3
    (eos must not be 2: CLIPTextModel treats eos id 2 as the legacy "argmax" pooling).
    """
    vocab = {PAD: 0, UNK: 1, BOS: 2, EOS: 3}
    for word in [*world.vocabulary(), ",", ".", "-", "'"]:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}",
        pair=f"{BOS} $A {EOS} $B {EOS}",
        special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=max_length,
        pad_token=PAD,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="right",
        truncation_side="right",
    )


def build_text_encoders(
    vocab_size: int, text_length: int = TEXT_LENGTH
) -> tuple[CLIPTextModel, T5EncoderModel]:
    """Random-initialized CLIPTextModel (pooled at ``</s>``, width 64) and T5EncoderModel."""
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=TEXT_WIDTH,
            intermediate_size=4 * TEXT_WIDTH,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=text_length,
            projection_dim=TEXT_WIDTH,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
        )
    )
    t5 = T5EncoderModel(
        T5Config(  # type: ignore[call-arg]  # extra keys go through **kwargs
            vocab_size=vocab_size,
            d_model=T5_WIDTH,
            d_kv=16,
            d_ff=4 * T5_WIDTH,
            num_layers=T5_LAYERS,
            num_heads=4,
            relative_attention_num_buckets=16,
            relative_attention_max_distance=64,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
            pad_token_id=0,
            eos_token_id=3,
            decoder_start_token_id=0,
            is_encoder_decoder=False,
            use_cache=False,
        )
    )
    return clip, t5


def build_vae() -> AutoencoderKL:
    """AutoencoderKL with 2x downsampling: 3x32x32 images to 4x16x16 latents."""
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        latent_channels=LATENT_CHANNELS,
        norm_num_groups=16,
        sample_size=world.IMAGE_SIZE,
        mid_block_add_attention=False,
        scaling_factor=1.0,
        shift_factor=0.0,
    )


def build_transformer() -> FluxTransformer2DModel:
    """FluxTransformer2DModel: 2 double + 4 single blocks, 4 heads of 32, 64 tokens of 16 channels."""
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * LATENT_CHANNELS,
        num_layers=2,
        num_single_layers=4,
        attention_head_dim=32,
        num_attention_heads=4,
        joint_attention_dim=T5_WIDTH,
        pooled_projection_dim=TEXT_WIDTH,
        guidance_embeds=False,
        axes_dims_rope=(8, 12, 12),
    )


def build_scheduler(shift: float = 1.0) -> FlowMatchEulerDiscreteScheduler:
    """Euler flow-matching scheduler with a fixed shift (no resolution-dependent shifting)."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False
    )


def images_to_tensor(images) -> torch.Tensor:
    """uint8 NHWC numpy images to float NCHW in [-1, 1] (the VAE's input range)."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
