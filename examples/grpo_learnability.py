"""Research aid: can a random tiny model learn the demo task by on-policy GRPO, and how fast?

Plain torch + the tiny HF model, no servers, no Redis: sample `n` completions per prompt at
temperature 1, score them with the demo reward, group-normalise the rewards (GRPO), and take one
Adam step on the token-level policy-gradient loss −Σ A·log π / (loss tokens in the batch) — what the
learner's decoupled-PPO loss reduces to when every sample is fresh (ratio = 1, weight = 1).

    .venv/bin/python examples/grpo_learnability.py --seed 1 --steps 150

Prints one line per `--log-every` steps (reward mean, exact-match fraction, seconds per step) and
a summary line: the first step whose 10-step running reward mean reaches 0.8.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_like.data.demo_task import demo_compute_score, make_example  # noqa: E402
from areal_like.data.tiny_model import build_tiny_model  # noqa: E402


def score_variant(v, t, g):
    if v == "demo":
        return demo_compute_score(t, g)
    s = t.strip()
    if v == "nofmt":
        return 1.0 if s == g else 0.5 if s.startswith(g) else 0.0
    if v == "ladder":
        return 1.0 if s == g else 0.5 if s.startswith(g) else 0.2 if len(s) == 1 else 0.0
    if v == "close3":
        if s == g:
            return 1.0
        if s[:1].isdigit():
            d = abs(int(s[0]) - int(g)) % 10
            d = min(d, 10 - d)
            return 0.5 if d == 0 else 0.3 * (1 - d / 5)
        return 0.0
    if v == "first":
        return 1.0 if s[:1] == g else 0.0
    if v == "close":
        if s == g:
            return 1.0
        if s[:1].isdigit():
            d = abs(int(s[0]) - int(g)) % 10
            d = min(d, 10 - d)
            return (0.5 if d == 0 else 0.0) + 0.1 * (1 - d / 5)
        return 0.0
    raise ValueError(v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--n", type=int, default=16, help="group size")
    ap.add_argument("--groups", type=int, default=8, help="groups (prompts) per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--variant", default="demo")
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--task", default="next")
    ap.add_argument("--lora-rank", type=int, default=0, help="train a peft LoRA adapter of this rank (0 = full)")
    ap.add_argument("--lora-alpha", type=float, default=16.0)
    ap.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        build_tiny_model(d, hidden_size=args.hidden, intermediate_size=args.inter, num_layers=args.layers, tie_word_embeddings=args.tie,
                         seed=args.seed)
        tok = AutoTokenizer.from_pretrained(d)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    if args.lora_rank:  # model.lora_rank / model.target_modules: only the adapter trains
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                                 target_modules=args.lora_targets.split(",")))
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.999))
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    hist: list[float] = []
    reached = None
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        # ---- generate: B*n rows, prompts left-padded ------------------------------------------
        examples = [make_example(rng) for _ in range(args.groups)]
        if args.task == "copy":
            examples = [(p, p[-1]) for p, _ in examples]
        prompts = [tok.encode(p, add_special_tokens=False) for p, _ in examples]
        L = max(len(p) for p in prompts)
        rows = [[pad] * (L - len(p)) + p for p in prompts for _ in range(args.n)]
        ids_BT = torch.tensor(rows)
        mask_BT = (ids_BT != pad).long()
        done_B = torch.zeros(len(rows), dtype=torch.bool)
        model.eval()
        with torch.no_grad():
            for _ in range(args.max_new):
                pos = (mask_BT.cumsum(-1) - 1).clamp(min=0)
                logits = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos).logits[:, -1]
                nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen).squeeze(-1)
                nxt = torch.where(done_B, torch.full_like(nxt, pad), nxt)
                ids_BT = torch.cat([ids_BT, nxt[:, None]], 1)
                mask_BT = torch.cat([mask_BT, (~done_B).long()[:, None]], 1)
                done_B |= nxt == eos
                if done_B.all():
                    break
        comp_BC = ids_BT[:, L:]
        loss_mask_BC = mask_BT[:, L:].float()
        texts = [tok.decode(c[m.bool()].tolist(), skip_special_tokens=True) for c, m in zip(comp_BC, loss_mask_BC)]
        gts = [a for _, a in examples for _ in range(args.n)]
        rewards = torch.tensor([score_variant(args.variant, t, g) for t, g in zip(texts, gts)])
        exact = sum(t.strip() == g for t, g in zip(texts, gts)) / len(texts)
        first = sum(t.strip()[:1] == g for t, g in zip(texts, gts)) / len(texts)
        # ---- GRPO advantages: per group (r - mean) / (std + eps) -------------------------------
        r_GN = rewards.view(args.groups, args.n)
        adv_GN = (r_GN - r_GN.mean(1, keepdim=True)) / (r_GN.std(1, keepdim=True) + 1e-6)
        adv_B = adv_GN.reshape(-1)
        # ---- policy-gradient step ---------------------------------------------------------------
        model.train()
        pos = (mask_BT.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos).logits[:, L - 1:-1]
        logp_BC = torch.log_softmax(logits.float(), -1).gather(-1, comp_BC[..., None]).squeeze(-1)
        n_tok = loss_mask_BC.sum().clamp(min=1)
        loss = -(adv_B[:, None] * logp_BC * loss_mask_BC).sum() / n_tok
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        dt = time.perf_counter() - t0
        hist.append(rewards.mean().item())
        run = sum(hist[-10:]) / len(hist[-10:])
        if reached is None and len(hist) >= 10 and run >= args.target:
            reached = step
        if os.environ.get("SHOW") and step % args.log_every == 0:
            print([ (p, t) for (p, _), t in zip([e for e in examples for _ in range(args.n)], texts)][::4])
        if step == 1 or step % args.log_every == 0:
            print(f"step {step:4d} reward {hist[-1]:.3f} run10 {run:.3f} exact {exact:.2f} first {first:.2f} "
                  f"len {loss_mask_BC.sum(1).mean().item():.2f} {dt * 1000:.0f} ms/step", flush=True)
    total = time.perf_counter() - t_start
    print(f"SUMMARY seed={args.seed} hidden={args.hidden} layers={args.layers} lr={args.lr} n={args.n} "
          f"groups={args.groups} init_reward10={sum(hist[:10]) / 10:.3f} final_run10={sum(hist[-10:]) / 10:.3f} "
          f"steps_to_{args.target}={reached} s_per_step={total / args.steps:.3f}", flush=True)


if __name__ == "__main__":
    main()
