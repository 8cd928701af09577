#!/usr/bin/env bash
# Installs agentloop (first time only) and runs one goal on the embedded default:
# SQLite in ./agentloop-data, in-process workers, the shipped shapes model and CLIP.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/agentloop run "${1:-a small red circle on the left}" --budget "${BUDGET:-16}"
