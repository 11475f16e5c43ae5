"""Supervised fine-tuning of a tiny demo model in place (plain torch, CPU): the recipe behind the demo
models that start trained — the agentic demo's warm start (agent_task.py), the demo judge
(demo_judge.py) and the demo teacher (demo_teacher.py). Cross-entropy on the tokens whose loss mask is 1 only."""

from __future__ import annotations

import random
import sys
import time
from typing import Any, Callable


def supervised_finetune(model_dir: str, example: Callable[[Any, random.Random], tuple[list[int], list[int]]], *,
                        steps: int, batch_size: int, lr: float, seed: int = 0, threads: int = 2,
                        log: Callable[[str], None] | None = None, what: str = "warm start") -> dict:
    """Train the HF model in `model_dir` on `example(tokenizer, rng) → (ids, loss_mask)` batches with AdamW
    (linear warm-up over the first tenth, then linear decay to 5%), and save it there. Returns
    {"steps", "loss", "seconds"}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1 - s / steps))
    t0 = time.monotonic()
    loss_val = float("nan")
    for step in range(steps):
        batch = [example(tok, rng) for _ in range(batch_size)]
        T = max(len(i) for i, _ in batch)
        ids_BT = torch.full((batch_size, T), tok.pad_token_id, dtype=torch.long)
        mask_BT = torch.zeros((batch_size, T), dtype=torch.float32)
        attn_BT = torch.zeros((batch_size, T), dtype=torch.long)
        for b, (ids, m) in enumerate(batch):
            ids_BT[b, :len(ids)] = torch.tensor(ids)
            mask_BT[b, :len(m)] = torch.tensor(m, dtype=torch.float32)
            attn_BT[b, :len(ids)] = 1
        logits = model(input_ids=ids_BT, attention_mask=attn_BT).logits[:, :-1]  # (B, T-1, V): predicts t+1
        nll_BT = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids_BT[:, 1:], reduction="none")
        m = mask_BT[:, 1:]
        loss = (nll_BT * m).sum() / m.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            loss_val = loss.item()  # host sync, only when logging
            log(f"{what}: step {step + 1}/{steps} loss {loss_val:.4f} ({time.monotonic() - t0:.0f}s)")
    model.save_pretrained(model_dir, safe_serialization=True)
    return {"steps": steps, "loss": loss_val, "seconds": time.monotonic() - t0}


def ensure_trained_demo_model(model_dir: str, example: Callable[[Any, random.Random], tuple[list[int], list[int]]], *,
                              seed: int, train: dict, accuracy: Callable[[str], float], record: str, what: str,
                              version: int, extra: dict | None = None, log: Callable[[str], None] | None = None) -> str:
    """The demo's tiny model (random init, `seed`) after `supervised_finetune` on `example` with `train`, in
    `model_dir` unless it has one: built in a temporary directory and renamed (two launchers racing on first use
    never load a half-trained model). What it learned is checked, not assumed: `accuracy(dir)` is logged and
    recorded in `record` (JSON, beside the weights) with the recipe (`version`, `seed`, `train`, `extra`)."""
    import json
    import os

    from areal_like.data.tiny_model import ensure_tiny_model

    if os.path.exists(os.path.join(model_dir, "config.json")):
        return model_dir
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    log(f"building the {what} in {model_dir} (once): {train}")

    def build(tmp: str) -> None:
        stats = supervised_finetune(tmp, example, seed=seed, log=log, what=what, **train)
        acc = accuracy(tmp)
        log(f"{what}: accuracy {acc:.3f}")
        with open(os.path.join(tmp, record), "w") as f:
            json.dump({"version": version, "seed": seed, **(extra or {}), **train, **stats, "accuracy": acc}, f,
                      indent=1)

    return ensure_tiny_model(model_dir, seed=seed, then=build)

