#!/usr/bin/env bash
# Runs the whole test suite: installs what is missing, starts PostgreSQL and Redis if they
# are down, then pytest (slow and integration tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
  for _ in $(seq 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  echo "starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no
  for _ in $(seq 30); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 1; done
fi

if ! command -v chromium >/dev/null 2>&1; then
  echo "installing Chromium (the gallery is checked in a real browser)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/tmp/agentloop-chromium.log 2>&1; then
    echo "could not install chromium (see /tmp/agentloop-chromium.log); the browser test will skip"
  fi
fi

# Without a GPU, Triton kernels run under its interpreter (set before anything imports triton).
if ! nvidia-smi -L >/dev/null 2>&1; then
  export TRITON_INTERPRET="${TRITON_INTERPRET:-1}"
fi

exec .venv/bin/python -m pytest "$@"
