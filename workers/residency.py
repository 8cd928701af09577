"""Per-process model residency: keep the last few models and scorers warm."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from engine.config import EngineConfig

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
    the embedded mode may call from several threads.
    """

    def __init__(
        self, config: EngineConfig | None = None, extra_models: tuple[str, ...] = (),
        capacity: int = 2,
    ):
        from engine.runner import Runner
        from engine.scorer import Scorer

        self.config = config or EngineConfig()
        self.lock = threading.Lock()
        self._runners = _LRU(capacity, lambda m: Runner(m, self.config, extra_models=extra_models))
        self._scorers = _LRU(capacity, lambda s: Scorer(s, device=self.config.device))

    def runner(self, model: str):  # noqa: ANN201 - engine.runner.Runner, imported lazily
        return self._runners.get(model)

    def scorer(self, name: str):  # noqa: ANN201 - engine.scorer.Scorer, imported lazily
        return self._scorers.get(name)
