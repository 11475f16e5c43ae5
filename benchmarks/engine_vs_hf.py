"""Tokens/s of the embedded server (over HTTP) vs transformers `generate()` on the same model and prompts.

Workload: R concurrent requests (default 64) with long-tailed output lengths — max_new_tokens drawn
from a Pareto distribution (most short, a few long), `ignore_eos` so every request produces exactly
its length; sampling at temperature 1. Model: a random Qwen2 built locally (hidden 256, 4 layers,
GQA 4/2 heads, char tokenizer), fp32 on CPU.

- engine: one server subprocess (`--torch-threads T`), all R requests sent at once over loopback
  HTTP with `return_logprob` (what the RL rollout asks for); the server batches them continuously:
  a request leaves the batch when done, so short ones never wait for the long tail.
- HF: `model.generate` on the same R prompts as ONE left-padded batch (HF's best throughput case),
  `max_new_tokens` = the longest request; a padded static batch must run to its longest member —
  that is the comparison. Useful tokens are the requested lengths only. Same torch thread count T.

    engine_vs_hf = useful tokens/s (engine) / useful tokens/s (HF)

Usage: python benchmarks/engine_vs_hf.py [--requests 64] [--threads 1] [--hidden 256] [--layers 4]
       [--alpha 1.2] [--min-len 16] [--max-len 384] [--seed 0]
       [--model demo:qwen3-0.6b-shape] [--device cuda] [--dtype bfloat16]
`--model` replaces the random Qwen2 (a model dir or a `demo:` model: the prompts' ids are drawn from its
vocabulary); `--device`/`--dtype` are the server's and HF's alike.
The last line printed is `engine_vs_hf: <ratio>`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from _common import add_long_tail_args, long_tail_setup, stop_server  # first: puts the repository root on sys.path


async def run_engine(url: str, prompts, lengths) -> tuple[int, float]:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(p, n):
            body = {"input_ids": p, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}
            async with s.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=1800)) as r:
                reply = await r.json()
                assert r.status == 200, reply
                return len(reply["output_ids"])

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))
        wall = time.perf_counter() - t0
    assert got == list(lengths), "engine produced other lengths than requested"
    return sum(got), wall


def run_hf(model_dir: str, prompts, lengths, threads: int, device: str = "cpu",
           dtype: str = "float32") -> tuple[int, float, int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    T = max(len(p) for p in prompts)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=device)
    steps = max(lengths)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=steps, min_new_tokens=steps,
              pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids=ids[:4, -8:], attention_mask=mask[:4, -8:], **{**kw, "max_new_tokens": 4,
                                                                                "min_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        if out.is_cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    assert out.shape[1] - T == steps
    return sum(lengths), wall, len(prompts) * steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_long_tail_args(ap, requests=64, seed=0)
    args = ap.parse_args()
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts, lengths, proc, url = long_tail_setup(tmp, args)
        try:
            uvloop.run(run_engine(url, prompts[:4], [4] * len(prompts[:4])))  # warm-up
            e_tok, e_wall = uvloop.run(run_engine(url, prompts, lengths))
            print(f"engine: {e_tok} tokens in {e_wall:.2f} s", flush=True)
        finally:
            stop_server(proc)
        h_tok, h_wall, h_rows = run_hf(model_dir, prompts, lengths, args.threads, args.device, args.dtype)
    lens = sorted(lengths)
    what = args.model or f"qwen2 hidden {args.hidden}, {args.layers} layers"
    print(f"model: {what}, {args.dtype} on {args.device}, {args.threads} torch thread(s)")
    print(f"requests: {args.requests}, output lengths min {lens[0]} median {lens[len(lens) // 2]} "
          f"max {lens[-1]} total {sum(lens)}")
    print(f"{'system':<34}{'wall s':>9}{'useful tok':>12}{'useful tok/s':>14}")
    print(f"{'embedded server (HTTP, logprobs)':<34}{e_wall:>9.2f}{e_tok:>12}{e_tok / e_wall:>14.1f}")
    print(f"{'HF generate (1 padded batch)':<34}{h_wall:>9.2f}{h_tok:>12}{h_tok / h_wall:>14.1f}"
          f"   (computed {h_rows} row-tokens)")
    print(f"engine_vs_hf: {(e_tok / e_wall) / (h_tok / h_wall):.2f}")


if __name__ == "__main__":
    main()
