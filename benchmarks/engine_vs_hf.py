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
The last line printed is `engine_vs_hf: <ratio>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, log_path: str, *args: str, threads: int = 1) -> tuple[subprocess.Popen, str]:
    """An embedded server subprocess on a free loopback port, healthy; stop it with `stop_server`."""
    port = free_port()
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(threads))
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_like.engine.server", "--model-path", model_dir, "--host", "127.0.0.1",
         "--port", str(port), "--torch-threads", str(threads), "--random-seed", "0", "--log-level", "WARNING",
         *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after 120s; log {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # our own child, by its Popen handle
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


def build_model(out_dir: str, hidden: int, layers: int) -> str:
    from areal_like.data.tiny_model import build_tiny_model

    return build_tiny_model(out_dir, hidden_size=hidden, intermediate_size=3 * hidden, num_layers=layers,
                            num_heads=4, num_kv_heads=2, max_position_embeddings=1024)


def workload(n: int, seed: int, alpha: float, min_len: int, max_len: int, vocab: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]
    lengths = [min(max_len, int(min_len * rng.paretovariate(alpha))) for _ in range(n)]
    lengths[rng.randrange(n)] = max_len  # the long tail is always there
    return prompts, lengths


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


def run_hf(model_dir: str, prompts, lengths, threads: int) -> tuple[int, float, int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    steps = max(lengths)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=steps, min_new_tokens=steps,
              pad_token_id=tok.pad_token_id)
    with torch.inference_mode():
        model.generate(input_ids=ids[:4, -8:], attention_mask=mask[:4, -8:], **{**kw, "max_new_tokens": 4,
                                                                                "min_new_tokens": 4})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kw)
        wall = time.perf_counter() - t0
    assert out.shape[1] - T == steps
    return sum(lengths), wall, len(prompts) * steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=1.2, help="Pareto shape of the output lengths")
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(os.path.join(tmp, "model"), args.hidden, args.layers)
        from transformers import AutoTokenizer

        vocab = len(AutoTokenizer.from_pretrained(model_dir))
        prompts, lengths = workload(args.requests, args.seed, args.alpha, args.min_len, args.max_len, vocab)
        ctx = max(len(p) for p in prompts) + max(lengths) + 8
        proc, url = start_server(model_dir, os.path.join(tmp, "server.log"), "--max-batch-size",
                                 str(args.requests), "--max-context-len", str(ctx), threads=args.threads)
        try:
            uvloop.run(run_engine(url, prompts[:4], [4] * 4))  # warm-up
            e_tok, e_wall = uvloop.run(run_engine(url, prompts, lengths))
        finally:
            stop_server(proc)
        h_tok, h_wall, h_rows = run_hf(model_dir, prompts, lengths, args.threads)
    lens = sorted(lengths)
    print(f"model: qwen2 hidden {args.hidden}, {args.layers} layers, fp32 CPU, {args.threads} torch thread(s)")
    print(f"requests: {args.requests}, output lengths min {lens[0]} median {lens[len(lens) // 2]} "
          f"max {lens[-1]} total {sum(lens)}")
    print(f"{'system':<34}{'wall s':>9}{'useful tok':>12}{'useful tok/s':>14}")
    print(f"{'embedded server (HTTP, logprobs)':<34}{e_wall:>9.2f}{e_tok:>12}{e_tok / e_wall:>14.1f}")
    print(f"{'HF generate (1 padded batch)':<34}{h_wall:>9.2f}{h_tok:>12}{h_tok / h_wall:>14.1f}"
          f"   (computed {h_rows} row-tokens)")
    print(f"engine_vs_hf: {(e_tok / e_wall) / (h_tok / h_wall):.2f}")


if __name__ == "__main__":
    main()
