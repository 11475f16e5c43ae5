#!/usr/bin/env bash
# Run every benchmark script once, one after another (never in parallel: they would measure each
# other), saving each full output and collecting the last lines (`name: value`).
#
#   benchmarks/run_all.sh [OUT_DIR]        (default: a new temp dir; printed at the end)
#
# Each script's load average (/proc/loadavg) before it starts and its wall time are recorded too,
# because on a shared machine the figures move with the load.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-$(mktemp -d -t areal_like_bench.XXXXXX)}
mkdir -p "$OUT"
SCRIPTS=(buffer_throughput client_overhead engine_vs_hf interrupt_cost learner_overhead weight_push async_vs_sync e2e_vs_minimal_loop colocated lora real_model_step_time judge_share distill_vs_grpo critic_pool judge_open_task moe_routing_replay moe_expert_parallel)
# The real model learning in five modes (~1 h on 2 cores): `benchmarks/run_all.sh` runs it only with REAL_MODEL=1.
if [ "${REAL_MODEL:-0}" = "1" ]; then SCRIPTS+=(real_model_learns); fi
# Qwen3-0.6B shape, 60 learner steps (the broadcast at two lrs, disk at one; ~12 min, ~20 GiB): only with DELTA=1.
# and delta vs full in a whole run on the same shape (two runs, ~8 min): also with DELTA=1.
if [ "${DELTA:-0}" = "1" ]; then SCRIPTS+=(delta_sync delta_sync_run); fi
# Heavy (~35 processes, ~11 GiB): `benchmarks/run_all.sh` runs it only with MISSION=1.
if [ "${MISSION:-0}" = "1" ]; then SCRIPTS+=(mission_toy_ray); fi
: > "$OUT/summary.txt"
for s in "${SCRIPTS[@]}"; do
    load=$(cut -d' ' -f1-3 /proc/loadavg)
    start=$(date +%s)
    echo "== $s (loadavg before: $load)"
    "$PY" "benchmarks/$s.py" > "$OUT/$s.log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    last=$(grep -v '^\s*$' "$OUT/$s.log" | tail -n 1)
    echo "$s | rc $rc | ${secs}s | loadavg before $load | $last" | tee -a "$OUT/summary.txt"
done
echo "logs and summary in $OUT"
