"""``install``: route a diffusers DiT (Flux family) through the kernels' dispatcher, in place.

What is patched, found by class name so that this package never imports diffusers:

- fused_adaln: ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``, ``AdaLayerNormContinuous``
  (their norm + modulation becomes :func:`kernels.dispatch.adaln`), and the Flux blocks
  (``FluxTransformerBlock``: the gated residual after attention and the norm + modulation
  before the feed-forward become one :func:`~kernels.dispatch.gated_adaln`, the gated
  residuals after the feed-forwards :func:`~kernels.dispatch.gated_residual`;
  ``FluxSingleTransformerBlock``: its final gated residual).
- fused_activations: diffusers ``GELU`` (projection + GELU, tanh or exact), ``GEGLU``, and
  ``torch.nn.GELU`` modules (Flux's single blocks use ``nn.GELU(approximate="tanh")``).
- int8_attention: every ``FluxAttnProcessor`` is replaced by :class:`KernelFluxAttnProcessor`,
  which does what FluxAttnProcessor does (projections, QK RMSNorm, joint text+image
  concat, rotary embedding) and calls :func:`kernels.dispatch.attention`.

Patched modules get an instance ``forward`` (parameters, state dict, hooks and device moves
are untouched); :func:`uninstall` removes them. A module that already carries diffusers hooks
(a step cache: ``enable_cache``) keeps them: the patched forward goes under the hooks, so
kernels and caches compose in either installation order. The patched forwards copy diffusers 0.42's
code, written out, with the fused calls in place of the eager ops; modules whose norms do
not fit (e.g. ``FP32LayerNorm``) are left alone and not counted.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kernels import dispatch

_PATCHED = "_agentloop_kernels"
"""Attribute set on every patched module (the kind of patch), so install is idempotent."""


# ---------------------------------------------------------------------------------------------
# Norms


def _norm_args(norm: nn.Module) -> dict[str, Any] | None:
    """Dispatcher arguments equivalent to ``norm``, or None when it is not one we can fuse."""
    if type(norm) is nn.LayerNorm and len(norm.normalized_shape) == 1:
        return {"norm": "layer", "eps": norm.eps, "weight": norm.weight, "bias": norm.bias}
    if type(norm).__name__ == "RMSNorm" and isinstance(getattr(norm, "eps", None), float):
        weight = getattr(norm, "weight", None)
        bias = getattr(norm, "bias", None)
        if weight is not None and weight.dim() != 1:
            return None
        return {"norm": "rms", "eps": norm.eps, "weight": weight, "bias": bias}
    return None


def _norm_kwargs(norm: nn.Module) -> dict[str, Any]:
    """:func:`_norm_args` of a norm that install() already checked (read at call time, so the
    weights are the module's current ones after any ``.to()``)."""
    args = _norm_args(norm)
    if args is None:
        raise TypeError(f"{type(norm).__name__} cannot be fused; uninstall() and install() again")
    return args


def _ada_zero_forward(
    self: Any,
    x: torch.Tensor,
    timestep: torch.Tensor | None = None,
    class_labels: torch.LongTensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    emb: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """AdaLayerNormZero.forward with the norm + modulation fused."""
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
    x = dispatch.adaln(x, shift_msa, scale_msa, **_norm_kwargs(self.norm))
    return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _ada_zero_single_forward(
    self: Any, x: torch.Tensor, emb: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """AdaLayerNormZeroSingle.forward with the norm + modulation fused."""
    emb = self.linear(self.silu(emb))
    shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
    x = dispatch.adaln(x, shift_msa, scale_msa, **_norm_kwargs(self.norm))
    return x, gate_msa


def _ada_continuous_forward(
    self: Any, x: torch.Tensor, conditioning_embedding: torch.Tensor
) -> torch.Tensor:
    """AdaLayerNormContinuous.forward with the norm + modulation fused (note: scale, then shift)."""
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return dispatch.adaln(x, shift, scale, **_norm_kwargs(self.norm))


_NORM_FORWARDS: dict[str, Callable[..., Any]] = {
    "AdaLayerNormZero": _ada_zero_forward,
    "AdaLayerNormZeroSingle": _ada_zero_single_forward,
    "AdaLayerNormContinuous": _ada_continuous_forward,
}


# ---------------------------------------------------------------------------------------------
# Flux blocks: the gated residual adds


def _flux_block_forward(
    self: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FluxTransformerBlock.forward with residual + gate * attn, norm2 and modulation fused."""
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(
        hidden_states, emb=temb
    )
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
        self.norm1_context(encoder_hidden_states, emb=temb)
    )
    joint_attention_kwargs = joint_attention_kwargs or {}
    attention_outputs = self.attn(
        hidden_states=norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )
    attn_output, context_attn_output = attention_outputs[0], attention_outputs[1]

    hidden_states, norm_hidden_states = dispatch.gated_adaln(
        hidden_states,
        gate_msa,
        attn_output,
        shift_mlp,
        scale_mlp,
        **_norm_kwargs(self.norm2),
    )
    ff_output = self.ff(norm_hidden_states)
    hidden_states = dispatch.gated_residual(hidden_states, gate_mlp, ff_output)
    if len(attention_outputs) == 3:
        hidden_states = hidden_states + attention_outputs[2]

    encoder_hidden_states, norm_encoder_hidden_states = dispatch.gated_adaln(
        encoder_hidden_states, c_gate_msa, context_attn_output, c_shift_mlp, c_scale_mlp,
        **_norm_kwargs(self.norm2_context),
    )  # fmt: skip
    context_ff_output = self.ff_context(norm_encoder_hidden_states)
    encoder_hidden_states = dispatch.gated_residual(
        encoder_hidden_states, c_gate_mlp, context_ff_output
    )
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _flux_single_block_forward(
    self: Any,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    joint_attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FluxSingleTransformerBlock.forward with the final residual + gate * out fused."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = self.attn(
        hidden_states=norm_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **joint_attention_kwargs,
    )
    hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
    hidden_states = dispatch.gated_residual(residual, gate, self.proj_out(hidden_states))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]


def _fusable_flux_block(module: nn.Module) -> bool:
    """The double block's norm2/norm2_context must be plain LayerNorms (they are, in 0.42)."""
    return all(
        _norm_args(getattr(module, name, nn.Identity())) is not None
        for name in ("norm2", "norm2_context")
    )


_BLOCK_FORWARDS: dict[str, tuple[Callable[..., Any], Callable[[nn.Module], bool]]] = {
    "FluxTransformerBlock": (_flux_block_forward, _fusable_flux_block),
    "FluxSingleTransformerBlock": (_flux_single_block_forward, lambda m: hasattr(m, "proj_out")),
}


# ---------------------------------------------------------------------------------------------
# Activations


def _diffusers_gelu_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """diffusers GELU.forward (projection, then GELU) through the dispatcher."""
    return dispatch.gelu(self.proj(hidden_states), approximate=self.approximate)


def _diffusers_geglu_forward(
    self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """diffusers GEGLU.forward (projection, then hidden * gelu(gate)) through the dispatcher."""
    return dispatch.geglu(self.proj(hidden_states), approximate="none")


def _torch_gelu_forward(self: Any, input: torch.Tensor) -> torch.Tensor:
    """torch.nn.GELU.forward through the dispatcher."""
    return dispatch.gelu(input, approximate=self.approximate)


def _activation_forward(module: nn.Module) -> Callable[..., Any] | None:
    if isinstance(module, nn.GELU):
        return _torch_gelu_forward
    name = type(module).__name__
    if (
        name == "GELU"
        and hasattr(module, "proj")
        and getattr(module, "approximate", None) in ("tanh", "none")
    ):
        return _diffusers_gelu_forward
    if name == "GEGLU" and hasattr(module, "proj"):
        return _diffusers_geglu_forward
    return None


# ---------------------------------------------------------------------------------------------
# Attention


def _apply_rotary(x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """diffusers' apply_rotary_emb(use_real=True, use_real_unbind_dim=-1, sequence_dim=1)."""
    cos, sin = freqs
    cos = cos[None, :, None, :].to(x.device)
    sin = sin[None, :, None, :].to(x.device)
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def _key_padding_mask(mask: torch.Tensor, batch: int, keys: int) -> torch.Tensor | None:
    """A boolean (B, keys) mask equivalent to an SDPA ``attn_mask``, or None if it is not one."""
    if mask.dtype != torch.bool or mask.numel() != batch * keys or mask.shape[-1] != keys:
        return None
    if mask.dim() >= 2 and mask.shape[0] != batch:
        return None
    return mask.reshape(batch, keys)


class KernelFluxAttnProcessor:
    """FluxAttnProcessor (diffusers 0.42) with the attention call routed to ``dispatch.attention``.

    Masks that are not a boolean key padding mask, and context-parallel configs, are not
    handled by the kernel: such masks go to plain SDPA; parallel configs are ignored.
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, original: Any = None) -> None:
        self.original = original
        """The processor this one replaced (restored by :func:`uninstall`)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        query, key, value, enc_q, enc_k, enc_v = _qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None and enc_q is not None:
            enc_q = attn.norm_added_q(enc_q.unflatten(-1, (-1, attn.head_dim)))
            enc_k = attn.norm_added_k(enc_k.unflatten(-1, (-1, attn.head_dim)))
            enc_v = enc_v.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([enc_q, query], dim=1)
            key = torch.cat([enc_k, key], dim=1)
            value = torch.cat([enc_v, value], dim=1)
        if image_rotary_emb is not None:
            query = _apply_rotary(query, image_rotary_emb)
            key = _apply_rotary(key, image_rotary_emb)

        # (B, S, H, D) -> (B, H, S, D) views: the kernels take strides, nothing is copied.
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        batch, keys = k.shape[0], k.shape[2]
        padding = (
            _key_padding_mask(attention_mask, batch, keys) if attention_mask is not None else None
        )
        if attention_mask is not None and padding is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        else:
            out = dispatch.attention(q, k, v, key_padding_mask=padding)
        hidden_states = out.transpose(1, 2).flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [text_len, hidden_states.shape[1] - text_len], dim=1
            )
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states
        return hidden_states


def _qkv_projections(
    attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """Q, K, V and the text stream's Q, K, V (or None), fused projections or not."""
    enc: tuple[Any, Any, Any] = (None, None, None)
    if getattr(attn, "fused_projections", False):
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        if encoder_hidden_states is not None and hasattr(attn, "to_added_qkv"):
            enc = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
        return (query, key, value, *enc)
    query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
    if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
        enc = (
            attn.add_q_proj(encoder_hidden_states),
            attn.add_k_proj(encoder_hidden_states),
            attn.add_v_proj(encoder_hidden_states),
        )
    return (query, key, value, *enc)


# ---------------------------------------------------------------------------------------------
# install / uninstall


def _hook_chain_root(module: nn.Module) -> Any:
    """The innermost link of a diffusers hook chain on ``module`` (``HookRegistry``, found by
    duck typing so this package never imports diffusers), or None when no hook is registered.

    diffusers' hooks (step caches, offloading) replace ``module.forward`` with a wrapper that
    calls the forward it found; the first hook's link holds the module's own forward, which
    every later hook reaches through the chain. Patching that link, rather than
    ``module.forward``, keeps the hooks and puts the kernels under them, whichever of the two
    was installed first.
    """
    registry = getattr(module, "_diffusers_hook", None)
    refs = getattr(registry, "_fn_refs", None)
    return refs[0] if refs else None


def _set_inner_forward(module: nn.Module, forward: Callable[..., Any] | None) -> None:
    """Make ``forward`` (bound; None: the class's own) what ``module`` runs under any hooks."""
    root = _hook_chain_root(module)
    if root is None:
        if forward is None:
            del module.forward
        else:
            module.forward = forward  # type: ignore[method-assign]
        return
    if forward is None:
        forward = types.MethodType(type(module).forward, module)
    if root.original_forward is not None:  # the hook replaces forward and calls the original
        root.original_forward = forward
    else:
        root.forward = forward


def _patch_forward(module: nn.Module, forward: Callable[..., Any], kind: str) -> None:
    _set_inner_forward(module, types.MethodType(forward, module))
    setattr(module, _PATCHED, kind)


def install(
    module: nn.Module, *, fused_adaln: bool, fused_activations: bool, int8_attention: bool
) -> dict[str, int]:
    """Patch ``module`` (a diffusers transformer, e.g. FluxTransformer2DModel) in place so its
    blocks call the kernels' dispatcher; returns how many modules of each kind are patched.

    Keys: "adaln" (AdaLayerNorm* modules), "blocks" (Flux blocks with fused gated residuals),
    "activations" (GELU/GEGLU modules), "attention" (attention processors). Idempotent:
    a second call patches nothing new and reports the same counts. On CPU the dispatcher runs
    the torch references, so installing is safe everywhere.
    """
    counts = {"adaln": 0, "blocks": 0, "activations": 0, "attention": 0}
    for sub in module.modules():
        name = type(sub).__name__
        already = getattr(sub, _PATCHED, None)
        if (
            fused_adaln
            and name in _NORM_FORWARDS
            and _norm_args(getattr(sub, "norm", nn.Identity()))
        ):
            if already is None:
                _patch_forward(sub, _NORM_FORWARDS[name], "adaln")
            counts["adaln"] += 1
        elif fused_adaln and name in _BLOCK_FORWARDS and _BLOCK_FORWARDS[name][1](sub):
            if already is None:
                _patch_forward(sub, _BLOCK_FORWARDS[name][0], "blocks")
            counts["blocks"] += 1
        elif fused_activations and (forward := _activation_forward(sub)) is not None:
            if already is None:
                _patch_forward(sub, forward, "activations")
            counts["activations"] += 1
        if int8_attention and hasattr(sub, "set_processor"):
            processor = getattr(sub, "processor", None)
            if type(processor).__name__ == "FluxAttnProcessor":
                cast(Any, sub).set_processor(KernelFluxAttnProcessor(processor))
                counts["attention"] += 1
            elif isinstance(processor, KernelFluxAttnProcessor):
                counts["attention"] += 1
    return counts


def uninstall(module: nn.Module) -> int:
    """Undo :func:`install` on ``module``; returns how many modules were restored."""
    restored = 0
    for sub in module.modules():
        if getattr(sub, _PATCHED, None) is not None:
            _set_inner_forward(sub, None)
            delattr(sub, _PATCHED)
            restored += 1
        processor = getattr(sub, "processor", None)
        if isinstance(processor, KernelFluxAttnProcessor) and processor.original is not None:
            cast(Any, sub).set_processor(processor.original)
            restored += 1
    return restored
