"""A real agentloop server for the MCP tests: `agentloop serve` in a subprocess, embedded
(SQLite, in-process workers), the tiny presets by default so that a goal runs in seconds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AGENTLOOP_") or k in ("AGENTLOOP_MODELS_DIR", "AGENTLOOP_CACHE_DIR")}
    return {
        **env, "AGENTLOOP_DATA_DIR": str(data_dir), "AGENTLOOP_DEFAULT_MODEL": "tiny-dit",
        "AGENTLOOP_DEFAULT_SCORER": "tiny-clip", "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture(scope="session")
def agentloop_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a running embedded agentloop server."""
    root = tmp_path_factory.mktemp("mcp-server")
    port = free_port()
    log = root / "serve.log"
    proc = subprocess.Popen(
        [str(BIN / "agentloop"), "serve", "--port", str(port)], env=server_env(root / "data"),
        cwd=root, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"agentloop serve exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"agentloop serve did not start: {log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
