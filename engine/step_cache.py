"""Step caching: skip transformer work on denoising steps whose result barely changes.

Every method is a set of diffusers hooks (``HookRegistry`` / ``ModelHook``) on the
transformer's blocks, so it works inside any loop that calls the transformer: the stock
``FluxPipeline`` (contexts "cond" and "uncond", one call each per step) and the runner's own
loop (one batched call per step) alike, without either knowing. State is kept per
``cache_context`` and cleared by ``transformer._reset_stateful_cache()``, which the runner
calls before every batch (the pipelines call it after).

Methods (``EngineConfig.step_cache``):

- ``"first_block"``: diffusers' FirstBlockCache. After the first block, the relative change of
  its residual since the last full step decides, for the whole batch, whether the other blocks
  run or their cached residual is added (one host read per call).
- ``"taylorseer"``: diffusers' TaylorSeer. Every attention output is computed on a fixed
  interval and predicted by a Taylor expansion in between.
- ``"magcache"``: diffusers' MagCache, with magnitude ratios calibrated for the model by
  ``python -m engine.calibrate_magcache MODEL`` (stored beside it as ``magcache.json``).
- ``"agentloop"``: ours (:class:`RowCacheHeadHook`). FirstBlockCache's test made per row: each
  row of the batch (each request, and its unconditional twin) skips or computes on its own, a
  row never skips more than ``max_skips`` steps in a row, and only the rows that compute run
  the remaining blocks (gathered into a smaller batch). One host read per call (which rows
  skip), right after the first block, as FirstBlockCache's; with ``rows="whole"`` the batch is
  computed whole unless every row may skip (no gather, a fixed batch shape).

Rows and batch changes (ours): state is kept per row. When the batch shrinks from the end (the
own loop dropping the trailing unconditional rows once guidance is truncated) the leading
rows keep theirs; each row's text conditioning is fingerprinted, so a row whose text changed
(rows removed from the middle, a different batch) computes afresh; a batch that grows, or
whose token shapes change, starts over. :func:`select_rows` maps state explicitly when a
caller removes rows from anywhere.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.hooks import BaseState, CacheContext, StateManager

from engine.config import MAGCACHE_FILE, STEP_CACHES, StepCacheSettings

__all__ = [
    "STEP_CACHES", "RowCacheHeadHook", "StepCache", "StepCacheSettings", "apply_row_cache", "has_row_cache",
    "load_mag_ratios", "magcache_path", "remove_row_cache", "select_rows",
]

_HEAD_HOOK = "agentloop_row_cache_head"
_BLOCK_HOOK = "agentloop_row_cache_block"
_DEFAULT_CONTEXT = "default"
_EPS = 1e-8


# ---------------------------------------------------------------------------------------------
# Ours: per-row first-block cache


def _blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks in call order (diffusers' own rule: named ModuleLists)."""
    blocks: list[torch.nn.Module] = []
    for name, child in transformer.named_children():
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList):
            blocks.extend(child)
    return blocks


class RowCacheState(BaseState):
    """Per-context state of the per-row cache: one entry per batch row."""

    def __init__(self) -> None:
        self.ref: torch.Tensor | None = None
        """(B, S, D) the first block's residual at each row's last computed call."""
        self.tail: tuple[torch.Tensor, torch.Tensor] | None = None
        """(hidden, encoder) residuals of the remaining blocks at each row's last computed call."""
        self.skips: torch.Tensor | None = None
        """(B,) int: consecutive skipped calls per row."""
        self.valid: torch.Tensor | None = None
        """(B,) bool: the row has a reference and residuals it may reuse."""
        self.fingerprint: torch.Tensor | None = None
        """(B, 2) a digest of each row's text conditioning, to notice rows that changed."""
        self.calls = 0
        # per call
        self.plan = "all"
        self.index: torch.Tensor | None = None
        self.head_out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.temb: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    @property
    def batch(self) -> int:
        return 0 if self.skips is None else int(self.skips.shape[0])

    def keep(self, index: torch.Tensor) -> None:
        """Keep the rows at ``index`` (in that order), dropping the others."""
        if self.ref is None or self.tail is None or self.skips is None:
            return
        assert self.valid is not None and self.fingerprint is not None
        index = index.to(self.skips.device)
        self.ref = self.ref.index_select(0, index)
        self.tail = (self.tail[0].index_select(0, index), self.tail[1].index_select(0, index))
        self.skips = self.skips.index_select(0, index)
        self.valid = self.valid.index_select(0, index)
        self.fingerprint = self.fingerprint.index_select(0, index)


@dataclass
class RowCacheCounters:
    """What the per-row cache did since it was installed (host integers, no device reads)."""

    calls: int = 0
    rows: int = 0
    rows_skipped: int = 0
    calls_skipped: int = 0
    restarts: int = 0


def _bind(metadata: Any, module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The block's call as a name -> value dict."""
    if not args:
        return dict(kwargs)
    names = list(inspect.signature(type(module).forward).parameters)[1:]
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _pair(metadata: Any, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, encoder) from a block's output tuple."""
    return output[metadata.return_hidden_states_index], output[metadata.return_encoder_hidden_states_index]


def _as_output(metadata: Any, hidden: torch.Tensor, encoder: torch.Tensor) -> tuple:
    out: list[Any] = [None] * (
        max(metadata.return_hidden_states_index, metadata.return_encoder_hidden_states_index) + 1
    )
    out[metadata.return_hidden_states_index] = hidden
    out[metadata.return_encoder_hidden_states_index] = encoder
    return tuple(out)


def _fingerprint(encoder: torch.Tensor) -> torch.Tensor:
    """(B, 2) per row: the mean and a fixed projection of its text conditioning."""
    flat = encoder.detach().flatten(1).float()
    weights = torch.sin(torch.arange(flat.shape[1], device=flat.device, dtype=flat.dtype) * 0.7071)
    return torch.stack([flat.mean(dim=1), flat @ weights / flat.shape[1]], dim=1)


class _RowHook(ModelHook):
    """Shared by the head and the other blocks' hooks."""

    def __init__(self, state_manager: StateManager, counters: RowCacheCounters) -> None:
        super().__init__()
        self.state_manager = state_manager
        self.counters = counters
        self._metadata: Any = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self._metadata = TransformerBlockRegistry.get(type(module))
        if self._metadata.return_encoder_hidden_states_index is None:
            raise TypeError(f"{type(module).__name__} returns no encoder states; not a joint block")
        return module

    def _state(self) -> RowCacheState:
        if self.state_manager._context is None:  # called outside cache_context
            self.state_manager.set_context(CacheContext(_DEFAULT_CONTEXT))
        return self.state_manager.get_state()


class RowCacheHeadHook(_RowHook):
    """On the first block: runs it for every row, then decides per row whether the remaining
    blocks run (computing rows) or are replaced by the row's cached residual (skipping rows)."""

    _is_stateful = True

    def __init__(
        self, state_manager: StateManager, counters: RowCacheCounters, settings: StepCacheSettings
    ) -> None:
        super().__init__(state_manager, counters)
        self.settings = settings

    def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
        self.state_manager.reset()
        return module

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        meta = self._metadata
        call = _bind(meta, module, args, kwargs)
        hidden_in, encoder_in = call[meta.hidden_states_argument_name], call[meta.encoder_hidden_states_argument_name]
        output = self.fn_ref.original_forward(*args, **kwargs)
        hidden, encoder = _pair(meta, output)
        residual = hidden - hidden_in
        state = self._state()
        batch = hidden.shape[0]
        fingerprint = _fingerprint(encoder_in)
        self._align(state, residual, encoder, fingerprint)
        state.calls += 1
        self.counters.calls += 1
        self.counters.rows += batch
        state.head_out = (hidden, encoder)
        state.temb = None

        skip = self._skippable(state, residual)
        if skip is None:
            return self._compute_all(state, residual, output)
        # the one host read of the call: which rows skip
        flags = skip.tolist()
        skipped = sum(flags)
        if skipped == 0 or (self.settings.rows == "whole" and skipped < batch):
            return self._compute_all(state, residual, output)
        assert state.tail is not None and state.skips is not None and state.ref is not None
        self.counters.rows_skipped += skipped
        state.skips = torch.where(skip, state.skips + 1, torch.zeros_like(state.skips))
        if skipped == batch:
            state.plan = "none"
            self.counters.calls_skipped += 1
            return _as_output(meta, hidden + state.tail[0], encoder + state.tail[1])
        state.plan = "rows"
        index = torch.tensor([i for i, f in enumerate(flags) if not f], device=hidden.device)
        state.index = index
        keep = skip.view(-1, *([1] * (residual.ndim - 1)))
        state.ref = torch.where(keep, state.ref, residual)
        return _as_output(meta, hidden.index_select(0, index), encoder.index_select(0, index))

    def _compute_all(self, state: RowCacheState, residual: torch.Tensor, output: Any) -> Any:
        state.plan = "all"
        state.index = None
        state.ref = residual
        state.skips = torch.zeros(residual.shape[0], dtype=torch.int32, device=residual.device)
        return output

    def _skippable(self, state: RowCacheState, residual: torch.Tensor) -> torch.Tensor | None:
        """(B,) bool: rows that may skip this call; None when none can (no device work)."""
        s = self.settings
        if state.ref is None or state.tail is None or state.calls <= s.warmup or s.max_skips < 1:
            return None
        assert state.skips is not None and state.valid is not None
        dims = tuple(range(1, residual.ndim))
        change = (residual - state.ref).abs().mean(dim=dims)
        scale = state.ref.abs().mean(dim=dims).clamp_min(_EPS)
        return state.valid & (change / scale < s.threshold) & (state.skips < s.max_skips)

    def _align(
        self, state: RowCacheState, residual: torch.Tensor, encoder: torch.Tensor,
        fingerprint: torch.Tensor,
    ) -> None:
        """Fit the per-row state to this call's batch (see the module docstring)."""
        batch = residual.shape[0]
        if state.ref is not None and state.tail is not None:
            same_tokens = (
                state.ref.shape[1:] == residual.shape[1:] and state.tail[1].shape[1:] == encoder.shape[1:]
            )
            if batch > state.batch or not same_tokens:
                self.counters.restarts += 1
                state.reset()
            elif batch < state.batch:
                state.keep(torch.arange(batch, device=residual.device))
        if state.fingerprint is not None and state.valid is not None:
            same = torch.isclose(state.fingerprint, fingerprint, rtol=1e-4, atol=1e-6).all(dim=1)
            state.valid = state.valid & same
        state.fingerprint = fingerprint


class RowCacheBlockHook(_RowHook):
    """On every block after the first: runs for the computing rows only; the last block also
    records the residuals and puts the skipping rows back."""

    def __init__(self, state_manager: StateManager, counters: RowCacheCounters, is_tail: bool) -> None:
        super().__init__(state_manager, counters)
        self.is_tail = is_tail

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        meta = self._metadata
        state = self._state()
        if state.plan == "none":
            call = _bind(meta, module, args, kwargs)
            return _as_output(
                meta, call[meta.hidden_states_argument_name], call[meta.encoder_hidden_states_argument_name]
            )
        if state.plan == "rows":
            args, kwargs = self._rows_only(module, state, args, kwargs)
        output = self.fn_ref.original_forward(*args, **kwargs)
        if not self.is_tail:
            return output
        hidden, encoder = _pair(meta, output)
        assert state.head_out is not None
        head_hidden, head_encoder = state.head_out
        if state.plan == "all":
            state.tail = (hidden - head_hidden, encoder - head_encoder)
            state.valid = torch.ones(hidden.shape[0], dtype=torch.bool, device=hidden.device)
            return output
        assert state.index is not None and state.tail is not None
        index = state.index
        tail_hidden = state.tail[0].index_copy(0, index, hidden - head_hidden.index_select(0, index))
        tail_encoder = state.tail[1].index_copy(0, index, encoder - head_encoder.index_select(0, index))
        state.tail = (tail_hidden, tail_encoder)
        assert state.valid is not None
        state.valid = state.valid.index_fill(0, index, True)
        full_hidden = (head_hidden + tail_hidden).index_copy(0, index, hidden)
        full_encoder = (head_encoder + tail_encoder).index_copy(0, index, encoder)
        return _as_output(meta, full_hidden, full_encoder)

    def _rows_only(
        self, module: torch.nn.Module, state: RowCacheState, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """The call with its per-row conditioning (``temb``) cut to the computing rows; the
        hidden states already are (the previous block returned only those rows)."""
        call = _bind(self._metadata, module, args, kwargs)
        temb = call.get("temb")
        if temb is not None:
            if state.temb is None or state.temb[0] is not temb:
                assert state.index is not None
                state.temb = (temb, temb.index_select(0, state.index))
            call["temb"] = state.temb[1]
        return (), call


@dataclass
class RowCache:
    """The per-row cache installed on one transformer."""

    transformer: torch.nn.Module
    counters: RowCacheCounters
    head: RowCacheHeadHook

    def states(self) -> list[RowCacheState]:
        return list(self.head.state_manager._state_cache.values())


def apply_row_cache(transformer: torch.nn.Module, settings: StepCacheSettings) -> RowCache:
    """Install the per-row cache on ``transformer``'s blocks (the first decides, the others
    follow). Raises TypeError for a model whose blocks diffusers has no metadata for."""
    blocks = _blocks(transformer)
    if len(blocks) < 2:
        raise TypeError(f"{type(transformer).__name__} has fewer than two transformer blocks")
    for block in blocks:
        try:
            TransformerBlockRegistry.get(type(block))
        except ValueError:
            raise TypeError(f"step_cache='agentloop' does not know {type(block).__name__}") from None
    manager = StateManager(RowCacheState)
    counters = RowCacheCounters()
    head = RowCacheHeadHook(manager, counters, settings)
    HookRegistry.check_if_exists_or_initialize(transformer)
    HookRegistry.check_if_exists_or_initialize(blocks[0]).register_hook(head, _HEAD_HOOK)
    for k, block in enumerate(blocks[1:], start=1):
        hook = RowCacheBlockHook(manager, counters, is_tail=k == len(blocks) - 1)
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, _BLOCK_HOOK)
    HookRegistry.check_if_exists_or_initialize(transformer).invalidate_child_registries_cache()
    return RowCache(transformer, counters, head)


def remove_row_cache(transformer: torch.nn.Module) -> None:
    """Undo :func:`apply_row_cache`."""
    registry = HookRegistry.check_if_exists_or_initialize(transformer)
    registry.remove_hook(_HEAD_HOOK, recurse=True)
    registry.remove_hook(_BLOCK_HOOK, recurse=True)
    registry.invalidate_child_registries_cache()


def has_row_cache(transformer: torch.nn.Module) -> bool:
    """Whether :func:`apply_row_cache` is installed on ``transformer``."""
    blocks = _blocks(transformer)
    registry = getattr(blocks[0], "_diffusers_hook", None) if blocks else None
    return registry is not None and registry.get_hook(_HEAD_HOOK) is not None


def select_rows(transformer: torch.nn.Module, index: torch.Tensor | list[int]) -> None:
    """Tell the per-row cache that the next call's batch is the current one's rows ``index``
    (in that order), in every context: a loop that removes rows mid-denoise calls this so the
    survivors keep their cached state. Does nothing when the cache is not installed."""
    for block in _blocks(transformer):
        registry = getattr(block, "_diffusers_hook", None)
        hook = registry.get_hook(_HEAD_HOOK) if registry is not None else None
        if isinstance(hook, RowCacheHeadHook):
            rows = torch.as_tensor(index, dtype=torch.long)
            for state in hook.state_manager._state_cache.values():
                state.keep(rows)
            return


# ---------------------------------------------------------------------------------------------
# MagCache calibration file


def magcache_path(model_dir: str | Path) -> Path:
    """Where a model folder keeps its MagCache calibration."""
    return Path(model_dir) / MAGCACHE_FILE


def load_mag_ratios(path: str | Path) -> list[float]:
    """The magnitude ratios stored by ``python -m engine.calibrate_magcache``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no MagCache calibration at {path}; run `python -m engine.calibrate_magcache MODEL`"
        ) from None
    ratios = data.get("mag_ratios") if isinstance(data, dict) else None
    if not (isinstance(ratios, list) and ratios and all(isinstance(r, int | float) for r in ratios)):
        raise ValueError(f"{path} holds no 'mag_ratios' list of numbers")
    return [float(r) for r in ratios]


# ---------------------------------------------------------------------------------------------
# The engine's handle


class StepCache:
    """The step cache the runner installed on its transformer (``method`` "none": nothing)."""

    def __init__(self, transformer: torch.nn.Module, settings: StepCacheSettings, model_dir: Path | None) -> None:
        self.transformer = transformer
        self.settings = settings
        self.model_dir = model_dir
        self.row_cache: RowCache | None = None
        self._mag_ratios: list[float] | None = None
        self._steps: int | None = None
        if settings.method == "none":
            return
        if not hasattr(transformer, "enable_cache"):
            raise TypeError(f"{type(transformer).__name__} does not support diffusers cache hooks")
        if settings.method == "magcache":
            file = settings.magcache_file or (magcache_path(model_dir) if model_dir else None)
            if file is None:
                raise ValueError(
                    "step_cache='magcache' needs a calibration: this model has no folder; "
                    "set EngineConfig.magcache_file (python -m engine.calibrate_magcache MODEL --out FILE)"
                )
            self._mag_ratios = load_mag_ratios(file)
        elif settings.method == "agentloop":
            self.row_cache = apply_row_cache(transformer, settings)
        else:
            transformer.enable_cache(self._diffusers_config(steps=None))

    def _diffusers_config(self, steps: int | None) -> Any:
        from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

        s = self.settings
        if s.method == "first_block":
            return FirstBlockCacheConfig(threshold=s.threshold)
        if s.method == "taylorseer":
            return TaylorSeerCacheConfig(
                cache_interval=s.max_skips + 1, disable_cache_before_step=s.warmup,
                max_order=1, taylor_factors_dtype=torch.float32,
            )  # fmt: skip
        assert steps is not None and self._mag_ratios is not None
        return MagCacheConfig(
            threshold=s.threshold, max_skip_steps=s.max_skips,
            retention_ratio=min(1.0, s.warmup / steps), num_inference_steps=steps,
            mag_ratios=list(self._mag_ratios),
        )  # fmt: skip

    def prepare(self, steps: int) -> None:
        """Before a batch of ``steps`` steps: clear state, and fit MagCache to the step count
        (its ratios are per step)."""
        if self.settings.method == "none":
            return
        if self.settings.method == "magcache" and steps != self._steps:
            if self._steps is not None:
                self.transformer.disable_cache()
            self.transformer.enable_cache(self._diffusers_config(steps))
            self._steps = steps
        self.transformer._reset_stateful_cache()

    def remove(self) -> None:
        """Take the hooks off the transformer."""
        if self.row_cache is not None:
            remove_row_cache(self.transformer)
            self.row_cache = None
        elif getattr(self.transformer, "is_cache_enabled", False):
            self.transformer.disable_cache()
        self._steps = None
