"""Learner tokens/s vs a plain single-process transformers training step, same model, same batch.

    plain:    pad the batch once → model(input_ids, labels) cross-entropy → backward → clip → AdamW
    learner:  Trainer.train_step (single process, d1p1t1): GRPO advantages, token-budget packing,
              decoupled-PPO loss with behaviour weights, entropy and the other stats, global-norm
              clip, finite check, LR schedule, AdamW

Both run the same weights on the same tokens with one micro-batch; the ratio is the learner's
tokens/s divided by the plain step's (1.0 = no overhead; lower = the learner's extra work costs).
Median of `--steps` timed steps each (interleaved) after 2 warm-up steps each. Last line: `learner_overhead: <ratio>`.

    python benchmarks/learner_overhead.py [--hidden 128 --layers 4 --groups 8 --n 8 --steps 10]
    python benchmarks/learner_overhead.py --model demo:qwen3-0.6b-shape [--device cuda] --max-len 512

`--model` takes a model directory or a `demo:` model instead of the tiny random Qwen2 (`--hidden`,
`--layers`); the token ids are drawn from its vocabulary. With `--model` the two steps run one after
the other (all the learner's steps, then the plain ones), each owning the memory alone: two fp32 copies of a
real-shape model with their AdamW state do not fit side by side. On CUDA every timed step ends with a
device sync (the learner's own host sync; `torch.cuda.synchronize()` after the plain one).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=48)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None, help="model dir or demo: name (default: a tiny random Qwen2)")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)

    from transformers import AutoModelForCausalLM

    from areal_like.api.config import TrainConfig
    from areal_like.data.tiny_model import build_tiny_model
    from areal_like.learner.batching import pack
    from areal_like.learner.parallel.spawn import synthetic_groups
    from areal_like.learner.trainer import Trainer

    if a.model:
        from areal_like.data.demo_task import resolve_demo_name

        model_dir = resolve_demo_name(a.model, "--model") if a.model.startswith("demo:") else a.model
    else:
        tmp = tempfile.mkdtemp(prefix="learner_overhead-")
        model_dir = build_tiny_model(f"{tmp}/m", hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                                     num_layers=a.layers, num_heads=4, num_kv_heads=2, seed=0)
    from transformers import AutoConfig

    mcfg = AutoConfig.from_pretrained(model_dir)
    groups = synthetic_groups(1, n_groups=a.groups, n=a.n, min_len=a.max_len // 2, max_len=a.max_len,
                              vocab=mcfg.vocab_size)
    samples = [t for g in groups for t in g.trajectories]
    tokens = sum(t.num_tokens for t in samples)
    cfg = TrainConfig(lr=1e-5, micro_batch_tokens=1 << 30, grad_clip=1.0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def make_plain():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
        model.eval()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        (mb,) = pack(samples, list(range(len(samples))), micro_batch_tokens=1 << 30,
                     pad_id=model.config.pad_token_id, device=dev, single=True)
        labels = mb.input_ids_BT.clone()
        labels[:, 1:][mb.loss_mask_BT1 == 0] = -100
        labels[:, 0] = -100

        def plain_step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=mb.input_ids_BT, labels=labels, use_cache=False).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            loss.item()  # host sync, as the learner's one per step
            sync()

        return plain_step, (model, opt)

    def make_learner():
        learner = Trainer(model_dir, cfg, None, temperature=1.0, device=a.device)

        def learner_step() -> None:
            learner.train_step(groups, version=0)
            sync()

        return learner_step, (learner,)

    def timed(fn, ts) -> None:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)

    ts_plain, ts_learner = [], []
    peaks = {}
    if a.model:  # one after the other: each owns the memory alone
        # the learner first: its peak is measured on a device nothing else has used yet
        for name, make, ts in (("learner", make_learner, ts_learner), ("plain", make_plain, ts_plain)):
            fn, held = make()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            for _ in range(2):
                fn()
            for _ in range(a.steps):
                timed(fn, ts)
            if dev.type == "cuda":
                peaks[name] = torch.cuda.max_memory_allocated(dev) / 2**30
            del fn, held
            import gc

            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                left = torch.cuda.memory_allocated(dev) / 2**30
                if left > 0.1:
                    print(f"note: {left:.2f} GiB still allocated after the {name} phase", flush=True)
    else:
        plain_step, _p = make_plain()
        learner_step, _l = make_learner()
        # Interleaved (plain, learner, plain, …) so that load from other processes hits both alike.
        for _ in range(2):
            plain_step()
            learner_step()
        for _ in range(a.steps):
            for fn, ts in ((plain_step, ts_plain), (learner_step, ts_learner)):
                timed(fn, ts)
    t_plain, t_learner = statistics.median(ts_plain), statistics.median(ts_learner)
    plain_tps, learner_tps = tokens / t_plain, tokens / t_learner
    what = (f"{a.model} ({mcfg.model_type}, hidden {mcfg.hidden_size}, {mcfg.num_hidden_layers} layers, "
            f"vocab {mcfg.vocab_size})" if a.model else f"hidden {a.hidden}, {a.layers} layers")
    print(f"model: {what}, fp32; batch: {len(samples)} sequences, {tokens} tokens; device {a.device}; "
          f"{a.threads} thread(s)")
    for name, gib in peaks.items():
        print(f"peak allocated CUDA memory, {name}: {gib:.2f} GiB")
    print(f"plain transformers step: {t_plain * 1e3:.1f} ms/step, {plain_tps:,.0f} tokens/s")
    print(f"learner train_step:      {t_learner * 1e3:.1f} ms/step, {learner_tps:,.0f} tokens/s")
    print(f"learner_overhead: {learner_tps / plain_tps:.3f}")


if __name__ == "__main__":
    main()
