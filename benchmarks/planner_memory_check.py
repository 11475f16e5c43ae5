"""The memory planner (allocation/memory.py) against the peak RSS of the learner's real pieces on CPU.

A small Qwen2-shaped model (h 256, 8 layers, 4/2 heads, I 1024, V 32000, fp32, random init) runs
3 steps of the learner's path — the pipeline-stage module (`parallelize_model`, optional per-layer
checkpointing), the chunked logprobs + entropy through lm_head (`chunked_token_logprobs`), backward,
AdamW — in a fresh subprocess per case; peak RSS (ru_maxrss) minus the RSS after imports is printed
beside `learner_parts(...)` (with `math_attention`: CPU SDPA with GQA runs the math kernel).
glibc's dynamic mmap threshold makes freed [chunk × vocab] buffers stay resident, so each case runs
with MALLOC_MMAP_THRESHOLD_=65536 (the tensors, not the allocator's hoard, are what is compared).

    .venv/bin/python benchmarks/planner_memory_check.py        # one JSON line per case; last: worst ratio
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

CFG = dict(model_type="qwen2", hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=8192)
CASES = [(False, 2048, 256), (True, 2048, 256), (False, 2048, 1024), (False, 2048, 0), (True, 1024, 0)]


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS"))


def one(ckpt: bool, T: int, chunk: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from allocation.memory import ModelShape, TrainSettings, learner_parts
    from areal_like.learner.logprobs import chunked_token_logprobs
    from areal_like.learner.parallel.layout import LayoutSpec, ParallelLayout
    from areal_like.learner.parallel.parallelize import apply_activation_checkpointing, parallelize_model

    base = _rss()
    torch.manual_seed(0)
    hf = {k: v for k, v in CFG.items() if k != "model_type"}
    model = Qwen2ForCausalLM(Qwen2Config(**hf, attn_implementation="sdpa")).eval()
    stage = parallelize_model(model, ParallelLayout(LayoutSpec(), device_type="cpu"))
    apply_activation_checkpointing(stage, ckpt)
    stage.return_hidden = True
    opt = torch.optim.AdamW([p for p in stage.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    x = torch.randint(0, CFG["vocab_size"], (1, T))
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        h = stage(x)
        lp, _ = chunked_token_logprobs(h[:, :-1], stage.hf.lm_head, x[:, 1:], chunk_tokens=chunk, with_entropy=True)
        (-lp.sum()).backward()  # entropy computed, not in the loss: the learner's default (entropy_coef 0)
        opt.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    parts = learner_parts(ModelShape.from_config(CFG),
                          TrainSettings(checkpointing=ckpt, micro_batch_tokens=T, seq_len=T, logits_chunk_tokens=chunk,
                                        math_attention=True), pp=1, tp=1, stage=0)
    parts.pop("runtime_bytes")  # CUDA context etc.: none on CPU
    pred = sum(parts.values())
    return {"checkpointing": ckpt, "tokens": T, "logits_chunk": chunk, "measured_MiB": round(peak / 2**20, 1),
            "predicted_MiB": round(pred / 2**20, 1), "ratio": round(peak / pred, 3)}


def main() -> None:
    if len(sys.argv) == 4:
        print(json.dumps(one(sys.argv[1] == "1", int(sys.argv[2]), int(sys.argv[3]))))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    ratios = []
    for ckpt, T, chunk in CASES:
        out = subprocess.run([sys.executable, __file__, "1" if ckpt else "0", str(T), str(chunk)], env=env,
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        print(out, flush=True)
        ratios.append(json.loads(out)["ratio"])
    worst = max(ratios, key=lambda r: abs(r - 1))
    print(f"measured/predicted: {min(ratios):.3f}..{max(ratios):.3f} (worst {worst:.3f})")


if __name__ == "__main__":
    main()
