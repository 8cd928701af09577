"""The client stands alone: `pip install agentloop` into a fresh venv brings the SDK, the
CLI's client commands and the MCP stdio server, and none of the server's or the engine's
dependencies; the SDK and `agentloop mcp` from that venv talk to a real server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
SOURCES = ["agentloop", "engine", "workers", "kernels", "migrations"]
FORBIDDEN = {
    "torch", "torchvision", "triton", "diffusers", "transformers", "open-clip-torch",
    "celery", "sqlalchemy", "alembic", "psycopg", "psycopg-binary", "fastapi", "redis",
    "flower", "pydantic-settings", "numpy", "pillow",
}


def _bare_env() -> dict[str, str]:
    # Nothing of the test's own environment may leak in: no PYTHONPATH to the checkout.
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("AGENTLOOP_")}


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with `pip install <this checkout>` and no extras (pip's cache allowed)."""
    root = tmp_path_factory.mktemp("bare")
    src = root / "src"  # a copy, so that the build writes nothing into the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in SOURCES:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
         "--disable-pip-version-check", str(src)],
        env=_bare_env(), cwd=root, capture_output=True, text=True, timeout=600,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    yield venv


def _run(venv: Path, *args: str, **kwargs) -> subprocess.CompletedProcess[str]:  # noqa: ANN003
    return subprocess.run(list(args), env={**_bare_env(), **kwargs.pop("env", {})},
                          cwd=venv.parent, capture_output=True, text=True, timeout=120, **kwargs)


def test_bare_install_has_no_server_or_engine_dependencies(bare_venv: Path) -> None:
    listed = _run(bare_venv, str(bare_venv / "bin" / "python"), "-m", "pip", "list",
                  "--format", "json", "--disable-pip-version-check")
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert {"agentloop", "httpx", "pydantic", "typer", "rich", "mcp"} <= names
    assert not names & FORBIDDEN, sorted(names & FORBIDDEN)


def test_bare_install_imports_and_cli(bare_venv: Path) -> None:
    python = str(bare_venv / "bin" / "python")
    probe = _run(bare_venv, python, "-c", (
        "import sys; from agentloop import Client, AsyncClient; import agentloop.mcp_server;"
        "import agentloop.sdk as s; assert s.Goal.__module__ == 'agentloop.models';"
        "print(sorted(m for m in sys.modules if m.startswith(('agentloop.api', 'engine',"
        " 'agentloop.settings', 'agentloop.store'))))"
    ))
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"
    cli = str(bare_venv / "bin" / "agentloop")
    helped = _run(bare_venv, cli, "--help")
    assert helped.returncode == 0 and "mcp" in helped.stdout, helped.stderr
    assert _run(bare_venv, cli, "mcp", "--help").returncode == 0
    served = _run(bare_venv, cli, "serve")
    assert served.returncode == 1 and "agentloop[server]" in served.stderr


def test_bare_sdk_and_mcp_stdio_against_a_real_server(
    bare_venv: Path, agentloop_server: str
) -> None:
    script = (
        "import sys; from agentloop import Client\n"
        "with Client(sys.argv[1]) as c:\n"
        "    assert 'tiny-dit' in c.list_models().models\n"
        "    g = c.create_goal('a blue square', budget=2, fanout=2, steps=2, size=32)\n"
        "    g = c.wait(g.id, timeout=120)\n"
        "    assert g.status == 'done', g.status\n"
        "    assert c.artifact(g.best_candidate).startswith(b'\\x89PNG')\n"
        "print('ok')\n"
    )
    sdk = _run(bare_venv, str(bare_venv / "bin" / "python"), "-c", script, agentloop_server)
    assert sdk.returncode == 0 and sdk.stdout.strip() == "ok", sdk.stderr[-3000:]

    async def over_stdio() -> None:
        params = StdioServerParameters(command=str(bare_venv / "bin" / "agentloop"),
                                       args=["mcp", "--url", agentloop_server],
                                       cwd=str(bare_venv.parent))
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            tools = {t.name for t in (await session.list_tools()).tools}
            assert {"create_goal", "wait_goal", "get_image", "list_models"} <= tools
            models = await session.call_tool("list_models", {})
            assert not models.is_error and "tiny-dit" in models.content[0].text

    anyio.run(over_stdio)
