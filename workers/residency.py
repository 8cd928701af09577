"""Per-process model residency: keep the last few models and scorers warm."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from engine.config import EngineConfig

if TYPE_CHECKING:
    from agentloop.settings import Settings

log = logging.getLogger(__name__)

T = TypeVar("T")


class _LRU(Generic[T]):
    def __init__(self, capacity: int, build: Callable[[str], T]):
        self.capacity, self.build = capacity, build
        self.items: OrderedDict[str, T] = OrderedDict()

    def get(self, name: str) -> T:
        if name in self.items:
            self.items.move_to_end(name)
            return self.items[name]
        item = self.build(name)
        self.items[name] = item
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)
        return item


class Residency:
    """Loads runners and scorers on first use and keeps them; one generation at a time.

    `lock` serializes use of the models: a GPU worker runs one batch at a time anyway, and
    the embedded mode may call from several threads. With `noop` it hands out
    `engine.noop.NoopRunner` and `NoopScorer` instead (no torch, no weights): reserved for
    `bench/queue.py`, which measures the queue around the engine.
    """

    def __init__(
        self, config: EngineConfig | None = None, extra_models: tuple[str, ...] = (),
        capacity: int = 2, noop: bool = False,
    ):
        self.config = config or EngineConfig()
        self.extra_models, self.noop = extra_models, noop
        self.lock = threading.Lock()
        # engine modules are imported on first use: a control worker holds a residency too
        # and never generates, so it must not pay for importing torch
        self._runners: _LRU[Any] = _LRU(capacity, self._build_runner)
        self._scorers: _LRU[Any] = _LRU(capacity, self._build_scorer)

    @classmethod
    def for_settings(cls, settings: Settings, worker: bool = False) -> Residency:
        """The residency these settings ask for: their extra models, compilation
        (`engine_compile`; "auto" compiles in a long-lived Celery ``worker``), the dtype
        (`engine_dtype`), and the no-op
        engine when `engine_noop` is on."""
        compile_ = {"on": True, "off": False}.get(settings.engine_compile, True if worker else None)
        return cls(
            EngineConfig(compile=compile_, dtype=settings.engine_dtype),
            extra_models=tuple(settings.extra_models),
            noop=settings.engine_noop,
        )  # fmt: skip

    def runner(self, model: str):  # noqa: ANN201 - engine.runner.Runner, imported lazily
        return self._runners.get(model)

    def scorer(self, name: str):  # noqa: ANN201 - engine.scorer.Scorer, imported lazily
        return self._scorers.get(name)

    def _build_runner(self, model: str) -> Any:
        if self.noop:
            from engine.noop import NoopRunner

            return NoopRunner(model)
        from engine.runner import Runner

        runner = Runner(model, self.config, extra_models=self.extra_models)
        report = runner.engine_report
        log.info(
            "model %s loaded: %s %s, attention %s, compiled %s, kernels %s", model,
            report.get("device"), report.get("dtype"), report.get("attention_backend"),
            report.get("compiled"), report.get("kernels") or "none",
        )  # fmt: skip
        return runner

    def _build_scorer(self, name: str) -> Any:
        if self.noop:
            from engine.noop import NoopScorer

            return NoopScorer(name)
        from engine.scorer import Scorer

        return Scorer(name, device=self.config.device)
