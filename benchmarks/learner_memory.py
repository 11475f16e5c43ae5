"""Learner memory on a real architecture: Qwen2.5-0.5B's shape at random initialisation, on 2 CPU ranks.

The model is Qwen2.5-0.5B's published config written here (hidden 896, 24 layers, 14 query / 2 KV
heads, intermediate 4864, vocab 151,936, tied embeddings; 494 M parameters), randomly initialised and
saved as an HF model dir — memory and speed do not need trained weights. Each case starts a fresh
2-rank learner pool (gloo, one thread per rank) running the real `Trainer` at layout d2 for STEPS
steps on synthetic groups, fp32:

    none         replicated data parallel (every rank: parameters, gradients, AdamW state in full)
    full         FSDP2 / ZeRO-3 (`train.dp_sharding=full`, the default)
    full+ckpt    the same with `model.enable_gradient_checkpointing=true`

Per rank: the peak RSS (VmHWM) minus the RSS after imports, beside the planner's prediction for that
rank (`allocation/memory.py::learner_parts`, runtime overhead dropped: no CUDA context on CPU). Then
learner tokens/s (median step after the first) beside a plain single-process HF training step on the
same batch (HF forward with full logits, token-mean loss, backward, AdamW; same micro-batches) with
two threads — the same two cores the pool's two ranks use. glibc keeps freed buffers resident under its dynamic mmap threshold, so every process runs
with MALLOC_MMAP_THRESHOLD_=65536 (the tensors are what is compared, not the allocator's hoard).

    .venv/bin/python benchmarks/learner_memory.py        # ~15 min on 2 cores, ~20 GB RAM at its peak

The last line is the sharded/replicated ratio of the peak per rank (full / none, the larger rank of each).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

QWEN25_05B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  torch_dtype="float32")
STEPS = 3
GROUPS = dict(n_groups=2, n=4, min_len=100, max_len=124)  # 8 samples of ~104-128 tokens per step
MICRO_BATCH_TOKENS = 512
CHUNK = 256
CASES = [("none", False), ("full", False), ("full", True)]


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))


def _groups(step: int):
    from areal_like.learner.parallel.spawn import synthetic_groups

    return synthetic_groups(100 + step, vocab=QWEN25_05B["vocab_size"], **GROUPS)


def _train_cfg(sharding: str):
    from areal_like.api.config import TrainConfig

    return TrainConfig(lr=1e-5, micro_batch_tokens=MICRO_BATCH_TOKENS, logits_chunk_tokens=CHUNK, seed=0,
                       dp_sharding=sharding, collective_timeout_s=1800, warmup_steps=0)


def rank_main(rank: int, port: int, model_dir: str, sharding: str, ckpt: bool, out: str) -> None:
    """One rank of the d2 pool: STEPS train steps; writes its peak memory and step times."""
    import torch
    import torch.distributed as dist

    from areal_like.learner.trainer import Trainer

    torch.set_num_threads(1)
    base = _status("VmRSS")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=1800))
    ln = Trainer(model_dir, _train_cfg(sharding), "d2", temperature=1.0, gradient_checkpointing=ckpt)
    times, tokens = [], 0
    for step in range(STEPS):
        t0 = time.perf_counter()
        st = ln.train_step(_groups(step), version=step)
        times.append(time.perf_counter() - t0)
        tokens = st.num_tokens
    peak = _status("VmHWM") - base
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"peak": peak, "times": times, "tokens": tokens}, f)
    from areal_like.learner.parallel.spawn import leave_pool

    leave_pool()  # not a plain return: a rank may abort in the interpreter's finalization (exit_rank)


def plain_main(model_dir: str, out: str) -> None:
    """The plain single-process HF training step on the same batches (full logits per micro-batch)."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_like.learner.batching import pack

    torch.set_num_threads(2)  # the pool's 2 ranks × 1 thread: the same cores
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times, tokens = [], 0
    for step in range(STEPS):
        samples = [t for g in _groups(step) for t in g.trajectories]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        mbs = pack(samples, list(range(len(samples))), micro_batch_tokens=MICRO_BATCH_TOKENS, pad_id=0,
                   device=torch.device("cpu"))
        n_loss = sum(float(mb.loss_mask_BT1.sum()) for mb in mbs)
        for mb in mbs:
            logits = model(input_ids=mb.input_ids_BT, use_cache=False).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, mb.input_ids_BT[:, 1:, None]).squeeze(-1)
            (-(lp * mb.loss_mask_BT1).sum() / n_loss).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        tokens = sum(t.num_tokens for t in samples)
    with open(out, "w") as f:
        json.dump({"times": times, "tokens": tokens}, f)


def predicted(sharding: str, ckpt: bool, seq_len: int) -> int:
    from allocation.memory import ModelShape, TrainSettings, learner_parts

    parts = learner_parts(ModelShape.from_config(QWEN25_05B),
                          TrainSettings(dtype="float32", master_dtype="float32", dp_sharding=sharding,
                                        checkpointing=ckpt, micro_batch_tokens=MICRO_BATCH_TOKENS, seq_len=seq_len,
                                        logits_chunk_tokens=CHUNK, math_attention=True),
                          pp=1, tp=1, stage=0, dp=2)
    parts.pop("runtime_bytes")  # CUDA context and allocator reserve: none on CPU
    return sum(parts.values())


def _spawn_case(model_dir: str, sharding: str, ckpt: bool, tmp: str) -> list[dict]:
    from areal_like.api.net import free_port

    out = os.path.join(tmp, f"{sharding}-{int(ckpt)}")
    port = free_port()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), str(port), model_dir, sharding,
                               str(int(ckpt)), out], env=env) for r in range(2)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"rank exited {p.returncode} ({sharding}, checkpointing={ckpt})")
    res = []
    for r in range(2):
        with open(f"{out}.{r}") as f:
            res.append(json.load(f))
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        _, _, rank, port, model_dir, sharding, ckpt, out = sys.argv
        rank_main(int(rank), int(port), model_dir, sharding, ckpt == "1", out)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "plain":
        plain_main(sys.argv[2], sys.argv[3])
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = tempfile.mkdtemp(prefix="learner_memory-")
    model_dir = os.path.join(tmp, "qwen2.5-0.5b-shape")
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(**QWEN25_05B)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    del model
    seq_len = max(t.num_tokens for s in range(STEPS) for g in _groups(s) for t in g.trajectories)
    print(f"Qwen2.5-0.5B shape, random init: {n_params / 1e6:.0f} M parameters, fp32; d2 on CPU (gloo, 1 thread "
          f"per rank); {STEPS} steps of {GROUPS['n_groups'] * GROUPS['n']} samples (≤ {seq_len} tokens), "
          f"micro-batch {MICRO_BATCH_TOKENS} tokens, logits chunk {CHUNK}", flush=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    plain_out = os.path.join(tmp, "plain.json")
    subprocess.run([sys.executable, __file__, "plain", model_dir, plain_out], env=env, check=True)
    with open(plain_out) as f:
        plain = json.load(f)
    plain_tps = plain["tokens"] / statistics.median(plain["times"][1:])
    print(json.dumps({"case": "plain HF, 1 process, 2 threads", "tokens_per_s": round(plain_tps, 1)}), flush=True)
    peaks: dict[str, int] = {}
    ratios = []
    for sharding, ckpt in CASES:
        res = _spawn_case(model_dir, sharding, ckpt, tmp)
        pred = predicted(sharding, ckpt, seq_len)
        name = sharding + ("+ckpt" if ckpt else "")
        peak = max(r["peak"] for r in res)
        peaks[name] = peak
        step_s = statistics.median(max(a, b) for a, b in zip(res[0]["times"][1:], res[1]["times"][1:]))
        tps = res[0]["tokens"] / step_s
        for r in res:
            ratios.append(r["peak"] / pred)
        print(json.dumps({"case": name, "peak_GiB_per_rank": [round(r["peak"] / 2**30, 2) for r in res],
                          "planner_GiB": round(pred / 2**30, 2),
                          "measured/planner": [round(r["peak"] / pred, 3) for r in res],
                          "tokens_per_s": round(tps, 1), "vs_plain_hf": round(tps / plain_tps, 2)}), flush=True)
    print(f"measured/planner over every rank and case: {min(ratios):.3f}..{max(ratios):.3f}")
    print(f"full+ckpt/none peak per rank: {peaks['full+ckpt'] / peaks['none']:.3f}")
    print(f"sharded/replicated peak per rank (full/none): {peaks['full'] / peaks['none']:.3f}")


if __name__ == "__main__":
    main()
