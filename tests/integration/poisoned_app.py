"""`workers.app` with one fault injected, for tests: the no-op engine raises on any batch that
holds a prompt containing "poison", as a request that breaks a model would (NaN latents, a
CUDA error). A test double for the failure only: the no-op engine never fails, and no real
model here fails on demand. Start a generation worker with `celery -A
tests.integration.poisoned_app worker ...` (`Cluster(gen_app=...)`)."""

from __future__ import annotations

from engine.noop import NoopRunner
from workers.app import app

__all__ = ["app"]

_generate = NoopRunner.generate


def _poisonable_generate(self: NoopRunner, requests):  # noqa: ANN001,ANN202
    if any("poison" in r.prompt for r in requests):
        raise RuntimeError("NaN in the latents")
    return _generate(self, requests)


NoopRunner.generate = _poisonable_generate  # type: ignore[method-assign]
