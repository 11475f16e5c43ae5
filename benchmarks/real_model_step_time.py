"""Where a step's time goes on the real model (issue 39 item 5): configs/real_model.yaml's step, part by part.

One step of that config is 4 prompts × 8 samples of SmolLM2-135M-Instruct (ChatML prompts of the
arithmetic task, ~38 tokens, of which the default system prompt is ~20) with replies of ~27 tokens early
in training and ~9 once it has learnt to answer briefly. Measured here, each part on its own, at both
reply lengths (`--early`, `--late`):

    generation   one embedded server (fp32, 1 thread, as the run) generating the step's 32 samples of
                 exactly that many tokens (ignore_eos), as one request per prompt with n = 8
    reward       the arithmetic reward of 32 replies (inline: verl's gsm8k scorer, flexible)
    learner      Trainer.train_step on 32 such samples (fp32, `--threads` as train.torch_threads), split
                 into its forward+backward (`_forward_backward`), its optimizer step (`_optimizer_step`:
                 clip, AdamW, finite check) and the rest (advantages, packing, statistics)
    push         the run's own figure: push_s of its metrics.jsonl (`--run-dir`, optional)

and, to show what the biggest part is made of, the learner's forward+backward once more on the same
replies with the prompts cut to their user turn (no system prompt): the share the prompt tokens cost.

    .venv/bin/python benchmarks/real_model_step_time.py [--run-dir runs/real_model]   # ~4 min, 2 cores

The last line is `real_model_step_time: learner share of the step's compute (late): <fraction>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request

from _common import ROOT, start_server, stop_server


def prompts(n: int):
    """(chat-templated prompt ids, the same with an empty system prompt, tokenizer) of the task's first n rows."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from areal_like.data.dataset import _chat_ids as chat_ids  # the rollout workers' own tokenization
    from areal_like.data.demo_task import resolve_demo_name

    tok = AutoTokenizer.from_pretrained(resolve_demo_name("demo:smollm2-135m-instruct", "model.path"))
    rows = pq.read_table(resolve_demo_name("demo:arithmetic-1d-add", "data.train_files")).to_pylist()[:n]
    return ([chat_ids(tok, r["prompt"]) for r in rows],
            [chat_ids(tok, [{"role": "system", "content": ""}, *r["prompt"]]) for r in rows], tok)


def groups_of(prompt_ids: list[list[int]], n: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    from areal_like.api.trajectory import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for gi, p in enumerate(prompt_ids):
        trajs = [Trajectory.build(
            traj_id=f"g{gi}-{k}", group_id=f"g{gi}", prompt_id=f"p{gi}", prompt_ids=list(p),
            output_ids=rng.integers(100, vocab, size=length).tolist(),
            output_logprobs=(-rng.uniform(0.1, 3.0, size=length)).astype(np.float32),
            output_versions=[0] * length, reward=float(k % 2), finish_reason="length") for k in range(n)]
        out.append(TrajectoryGroup(group_id=f"g{gi}", prompt_id=f"p{gi}", trajectories=trajs, created_at=0.0))
    return out


def time_learner(model_dir: str, groups, threads: int, steps: int) -> dict[str, float]:
    import torch

    from areal_like.api.config import load_config
    from areal_like.learner.trainer import Trainer

    torch.set_num_threads(threads)
    cfg = load_config(os.path.join(ROOT, "configs", "real_model.yaml")).train
    trainer = Trainer(model_dir, cfg, None, temperature=1.0)
    parts = {"fwd_bwd": 0.0, "optimizer": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] += time.perf_counter() - t0
        return wrapper

    trainer._forward_backward = timed("fwd_bwd", trainer._forward_backward)
    trainer._optimizer_step = timed("optimizer", trainer._optimizer_step)
    trainer.train_step(groups, version=0)  # warm-up (allocations, AdamW state)
    rows = []
    for s in range(steps):
        parts.update(fwd_bwd=0.0, optimizer=0.0)
        t0 = time.perf_counter()
        trainer.train_step(groups, version=s + 1)
        total = time.perf_counter() - t0
        rows.append({"total": total, **parts, "rest": total - parts["fwd_bwd"] - parts["optimizer"]})
    del trainer
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def time_generation(url: str, prompt_ids: list[list[int]], n: int, length: int, rounds: int) -> float:
    import asyncio

    import aiohttp

    async def one_step() -> float:
        async with aiohttp.ClientSession() as s:
            async def gen(p):
                body = {"input_ids": p, "sampling_params": {"max_new_tokens": length, "temperature": 1.0,
                                                            "ignore_eos": True, "n": n}, "return_logprob": True}
                async with s.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
                    r.raise_for_status()
                    await r.read()
            t0 = time.perf_counter()
            await asyncio.gather(*(gen(p) for p in prompt_ids))
            return time.perf_counter() - t0

    asyncio.run(one_step())  # warm-up
    return statistics.median(asyncio.run(one_step()) for _ in range(rounds))


def time_reward(n: int) -> float:
    import asyncio

    from areal_like.data.arithmetic import ARITHMETIC_DATA_SOURCE
    from areal_like.reward.fn import RewardFn

    async def run() -> float:
        fn = RewardFn()
        t0 = time.perf_counter()
        for i in range(n):
            await fn.score(ARITHMETIC_DATA_SOURCE, f"{i % 9} + 4 = {i % 9 + 4}.", str(i % 9 + 4))
        dt = time.perf_counter() - t0
        await fn.close()
        return dt

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--early", type=int, default=27, help="reply tokens early in training")
    ap.add_argument("--late", type=int, default=9, help="reply tokens once the policy answers briefly")
    ap.add_argument("--threads", type=int, default=2, help="learner threads (train.torch_threads)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--run-dir", default=None, help="a run of configs/real_model.yaml: its push_s")
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    from areal_like.data.demo_task import resolve_demo_name

    model_dir = resolve_demo_name("demo:smollm2-135m-instruct", "model.path")
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}", flush=True)
    prompt_ids, user_only, tok = prompts(4)
    plen = statistics.mean(len(p) for p in prompt_ids)
    ulen = statistics.mean(len(p) for p in user_only)
    print(f"prompt tokens: {plen:.1f} with the default system prompt, {ulen:.1f} with an empty one", flush=True)
    server, url = start_server(model_dir, os.path.join(ROOT, "runs", "real_model_step_time-server.log"), threads=1)
    try:
        gen = {L: time_generation(url, prompt_ids, 8, L, 3) for L in (a.early, a.late)}
    finally:
        stop_server(server)
    reward = time_reward(32)
    vocab = tok.vocab_size
    learn = {L: time_learner(model_dir, groups_of(prompt_ids, 8, L, vocab), a.threads, a.steps) for L in (a.early, a.late)}
    short = time_learner(model_dir, groups_of(user_only, 8, a.late, vocab), a.threads, a.steps)
    push = None
    if a.run_dir:
        rows = [json.loads(line) for line in open(os.path.join(a.run_dir, "metrics.jsonl"))]
        push = statistics.median(r["push_s"] for r in rows)
    print()
    print("| part (one step: 4 prompts × 8 samples) | early (%d reply tokens) s | late (%d reply tokens) s |" % (a.early, a.late))
    print("|---|---|---|")
    for name, vals in (("generation (server, 1 thread)", gen),
                       ("reward (32 replies, inline)", {L: reward for L in gen}),
                       ("learner: forward + backward", {L: learn[L]["fwd_bwd"] for L in gen}),
                       ("learner: optimizer step", {L: learn[L]["optimizer"] for L in gen}),
                       ("learner: the rest", {L: learn[L]["rest"] for L in gen}),
                       ("learner: whole step", {L: learn[L]["total"] for L in gen})):
        print(f"| {name} | {vals[a.early]:.3f} | {vals[a.late]:.3f} |")
    if push is not None:
        print(f"| push (the run's median push_s) | {push:.3f} | {push:.3f} |")
    saved = 1 - short["fwd_bwd"] / learn[a.late]["fwd_bwd"]
    print(f"\nlearner forward+backward (late) with the system prompt cut ({plen:.0f} → {ulen:.0f} prompt tokens): "
          f"{short['fwd_bwd']:.3f} s vs {learn[a.late]['fwd_bwd']:.3f} s ({saved:.0%} less)")
    compute = gen[a.late] + reward + learn[a.late]["total"]
    print(f"real_model_step_time: learner share of the step's compute (late): {learn[a.late]['total'] / compute:.2f}")


if __name__ == "__main__":
    main()
