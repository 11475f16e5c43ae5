#!/usr/bin/env bash
# The real-shape figures on one CUDA GPU (issue 26): Qwen3-0.6B's published shape at random init with
# Qwen3's tokenizer (demo:qwen3-0.6b-shape), in one short script so that a lent GPU's minutes go to
# measuring. Each stage runs under its own time limit and writes its log to OUT_DIR; a failing stage
# does not stop the next. Stages, in order:
#
#   learner     benchmarks/learner_overhead.py --model … --device cuda: the learner's train_step vs a
#               plain transformers step (fp32, AdamW) on the same batch; peak CUDA memory of each
#   engine      benchmarks/engine_vs_hf.py --model … --device cuda --dtype bfloat16: the embedded server
#               (HTTP, logprobs, continuous batching) vs HF generate() on a long-tailed workload
#   real_shape  benchmarks/real_shape_run.py --device cuda: `launcher run` of configs/real_shape.yaml with
#               the server and the learner on the GPU (bf16 servers + IcePop, then fp32 servers): step
#               time, push time of the 1.19 GB bf16 model, learner peak memory, mismatch metrics
#   nccl_push   benchmarks/nccl_push_failure.py (issue 40 item 1): learner rank 0's side of the NCCL weight
#               group, with the launcher's TORCH_NCCL_ASYNC_ERROR_HANDLING=2, survives a receiver that dies
#               mid-push and re-forms the group with a fresh one; prints `survived: yes`. Needs 2 GPUs (NCCL
#               puts one rank per GPU): on one it says so and ends
#   ipc_reuse   benchmarks/cuda_ipc_handoff.py (issue 40 item 3): the co-located CUDA-IPC handoff's buffers
#               are never overwritten before the receiver's (late) copy of them completed: a receiver
#               process answering before its copy ran, fresh buffers (the push's) vs one reused buffer;
#               prints `intact: yes`
#   colocated   (only with STAGES naming it) benchmarks/real_shape_run.py --device cuda with
#               `allocation=embedded:d1|fsdp:d1`: the server and the learner take turns on the one GPU
#               (issue 27) — the learner log's `co-located step: release … → handoff … → resume …` lines, the
#               handoff through host shared memory, and smi.csv's used memory dropping while the server is
#               released; bf16 then fp32 servers as real_shape
#
# nvidia-smi samples the GPU's used memory and load every second into OUT_DIR/smi.csv meanwhile.
#
#     bash benchmarks/cuda_figures.sh OUT_DIR
#
# PYTHON (default python3) runs everything; it needs the project's dependencies and redis-server on PATH.
set -u
out=${1:?usage: bash benchmarks/cuda_figures.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 GLOO_SOCKET_IFNAME=lo TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
model=${MODEL:-demo:qwen3-0.6b-shape}

stages=" ${STAGES:-learner engine nccl_push ipc_reuse real_shape} "  # STAGES="engine" runs that one alone (the model is built first)
stage() {  # stage NAME SECONDS CMD…: run CMD under a time limit, its output in OUT_DIR/NAME.log
    local name=$1 limit=$2 t0 rc
    shift 2
    [[ $name == model || $stages == *" $name "* ]] || return 0
    echo "=== $name: $* ($(date +%T), limit ${limit}s)"
    t0=$(date +%s)
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    echo "=== $name: rc=$rc after $(( $(date +%s) - t0 )) s"
    tail -n "${TAIL:-14}" "$out/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 1 > "$out/smi.csv" 2>&1 &
smi=$!
trap 'kill $smi 2>/dev/null' EXIT

stage model "${T_MODEL:-120}" "$py" -c "from areal_like.data.demo_task import resolve_demo_name; print(resolve_demo_name('$model', 'MODEL'))"
stage learner "${T_LEARNER:-100}" "$py" benchmarks/learner_overhead.py --model "$model" --device cuda \
    --groups 8 --n 4 --max-len 512 --steps 5
stage engine "${T_ENGINE:-200}" "$py" benchmarks/engine_vs_hf.py --model "$model" --device cuda --dtype bfloat16 \
    --requests 64 --max-len "${ENGINE_MAX_LEN:-256}" --min-len 32
stage nccl_push "${T_NCCL:-120}" "$py" benchmarks/nccl_push_failure.py --mb 256 --timeout 20
stage ipc_reuse "${T_IPC:-120}" "$py" benchmarks/cuda_ipc_handoff.py --buckets 8 --mib 64
if [[ $stages == *" colocated "* ]]; then
    coloc=$(mktemp -d)
    TAIL=40 stage colocated "${T_COLOC:-280}" "$py" benchmarks/real_shape_run.py --device cuda --steps 3 --keep "$coloc" \
        --set 'allocation=embedded:d1|fsdp:d1' --set train.batch_size=8 --set generation.n=4 \
        --set generation.max_new_tokens=192 --set train.micro_batch_tokens=16384 --set train.logits_chunk_tokens=4096 \
        --set server.max_batch_size=64
    grep -h "co-located step" "$coloc"/*/logs/learner.log > "$out/colocated_phases.log" 2>/dev/null
    (cd "$coloc" && tar -czf "$out/colocated_runs.tgz" --exclude='checkpoints' -- */logs */metrics.jsonl */config.json) 2>/dev/null
fi
[[ $stages == *" real_shape "* ]] || exit 0
runs=$(mktemp -d)
TAIL=30 stage real_shape "${T_RUN:-290}" "$py" benchmarks/real_shape_run.py --device cuda --steps 3 --keep "$runs" \
    --set train.batch_size=8 --set generation.n=4 --set generation.max_new_tokens=192 \
    --set train.micro_batch_tokens=16384 --set train.logits_chunk_tokens=4096 --set server.max_batch_size=64
# the runs' logs, configs and metrics in one file
(cd "$runs" && tar -czf "$out/runs.tgz" --exclude='checkpoints' --exclude='weights_disk' -- */logs */metrics.jsonl */config.json) 2>/dev/null
