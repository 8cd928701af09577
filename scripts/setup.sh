#!/usr/bin/env bash
# Creates .venv and installs agentloop whole (client, server, engine) with its test tools.
# Safe to run again. A client alone is `pip install agentloop` (README, "Install").
# torch/torchvision are pinned (pyproject.toml) to the builds that lie on this machine's disk.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.agentloop-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q -e ".[server,gpu,dev]"
  touch "$stamp"
fi
