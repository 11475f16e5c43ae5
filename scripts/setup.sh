#!/usr/bin/env bash
# One-shot set-up on a fresh Debian 12 machine: system packages, a virtualenv in .venv, the project.
# Idempotent: re-running skips what is already there.
# Prints one line per step (apt, venv, torch, project). The tools run quietly, their output kept in a
# temporary file: when a step fails, its whole output is shown and set-up stops. (pip's warnings, e.g.
# "Location 'file:///…' is ignored" from this machine's pip config, are therefore only seen on failure.)
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
out=$(mktemp)
trap 'rm -f "$out"' EXIT

# step NAME COMMAND…: COMMAND's output goes to $out; on failure it is printed whole and set-up exits.
step() {
  local name=$1; shift
  if ! "$@" >"$out" 2>&1; then
    echo "setup: $name failed; its output:" >&2
    cat "$out" >&2
    exit 1
  fi
}

# System packages: redis-server (the replay buffer), prometheus-redis-exporter (Redis metrics on the
# dashboard; the launcher starts it beside its Redis when installed), and for the tests: tmux (the
# progress bar's terminal), prometheus (the dashboards' queries run against a real one) and chromium
# (report.html opened headless), npm (Grafana's dashboard schema, below). Every missing one is installed
# by one apt-get call.
APT_PACKAGES=(redis-server prometheus-redis-exporter tmux prometheus chromium npm)
have() { command -v "$1" >/dev/null 2>&1 || dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "ok installed"; }
missing=()
for p in "${APT_PACKAGES[@]}"; do have "$p" || missing+=("$p"); done
apt_install() {
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
}
if [ ${#missing[@]} -gt 0 ]; then
  step apt apt_install "${missing[@]}"
  echo "setup: apt: installed ${missing[*]}"
else
  echo "setup: apt: ${APT_PACKAGES[*]} already installed"
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  step venv "$PY" -m venv .venv
  step venv .venv/bin/python -m pip install -q --upgrade pip
  echo "setup: venv: created .venv ($(.venv/bin/python -V))"
else
  echo "setup: venv: .venv exists ($(.venv/bin/python -V))"
fi

torch_version() { .venv/bin/python -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null || echo "not installed"; }
stamp=.venv/.areal_like-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # torch first and pinned: pip finds the CPU wheel on this machine's disk in seconds.
  step torch .venv/bin/python -m pip install -q "torch==2.13.0"
  echo "setup: torch: $(torch_version)"
  step project .venv/bin/python -m pip install -q -e ".[dev,ray]"
  echo "setup: project: areal_like installed in .venv (editable, extras dev and ray)"
  touch "$stamp"
else
  echo "setup: torch: $(torch_version) (up to date)"
  echo "setup: project: up to date ($stamp is newer than pyproject.toml)"
fi

# Grafana's dashboard schema (@grafana/schema) and TypeScript for tests/unit/test_dashboard_schema.py,
# at the versions tests/dashboards/package-lock.json pins.
if [ ! -f tests/dashboards/node_modules/.package-lock.json ] \
    || [ tests/dashboards/package-lock.json -nt tests/dashboards/node_modules/.package-lock.json ]; then
  step npm npm ci --prefix tests/dashboards --no-audit --no-fund --loglevel=error
  echo "setup: npm: @grafana/schema and typescript in tests/dashboards/node_modules"
else
  echo "setup: npm: tests/dashboards/node_modules up to date"
fi
