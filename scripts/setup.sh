#!/usr/bin/env bash
# One-shot set-up on a fresh Debian 12 machine: system packages, a virtualenv in .venv, the project.
# Idempotent: re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
if ! command -v redis-server >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.areal_like-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned: pip finds the CPU wheel on this machine's disk in seconds.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev,ray]"
  touch "$stamp"
fi
