"""Engine fixtures: tiny presets on the CPU, with generated files in a per-session cache."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig


@pytest.fixture(scope="session")
def engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh cache folder for generated tokenizer files."""
    return tmp_path_factory.mktemp("engine-cache")


@pytest.fixture(scope="session")
def cpu_config(engine_cache: Path) -> EngineConfig:
    """The safe default config, pinned to the CPU and float32 so results do not depend on the
    machine (``dtype="auto"`` is bfloat16 on a CPU with native bfloat16)."""
    return EngineConfig(device="cpu", dtype="float32", cache_dir=str(engine_cache), max_batch=4)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; more only fight other jobs for 2 shared cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
