"""Throughput through the rollout client vs a minimal direct load generator, on the same server.

One embedded server (tiny random Qwen2, built locally) on a free loopback port; this process drives
it with N requests, C in flight, first through `GenerationClient.generate` (a), then through raw
aiohttp POSTs of the same bodies (b) — the same prompts, max_new_tokens, ignore_eos, logprobs and
concurrency, on one uvloop event loop and one connection pool each. Each round runs both, in
alternating order (a,b then b,a, …), so the two runs of a round see about the same load on a shared
machine; the figure is the median over rounds of the paired ratio:

    client_overhead = median_rounds( tokens/s (b) / tokens/s (a) ) − 1     (extra wall time per token)

Also printed: the load generator's own CPU per request in each mode (time.process_time of this
process) — on a machine the server shares, that CPU is what the client can take from the server.

Usage: python benchmarks/client_overhead.py [--requests 512] [--concurrency 64] [--max-new-tokens 32]
       [--rounds 3] [--hidden 128] [--profile]   (--profile: cProfile of one client run, top 25)
The last line printed is `client_overhead: <percent>%`.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
import uuid

import aiohttp

from _common import start_server, stop_server  # first: puts the repository root on sys.path
from areal_like.engine.client import GenerationClient


async def run_pool(n_requests: int, concurrency: int, one) -> tuple[int, float, float]:
    """(completion tokens, wall s, this process's CPU s) of n requests, `concurrency` in flight."""
    next_i = iter(range(n_requests))
    tokens = 0

    async def worker():
        nonlocal tokens
        for i in next_i:
            n = await one(i)  # not `tokens += await …`: that reads `tokens` before the await
            tokens += n

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0, time.process_time() - cpu0


async def via_client(url, prompts, args) -> tuple[int, float, float]:
    async with GenerationClient([url], request_timeout_s=600) as client:
        async def one(i):
            r = await client.generate(prompts[i], max_new_tokens=args.max_new_tokens, ignore_eos=True)
            return len(r.output_ids)

        return await run_pool(len(prompts), args.concurrency, one)


async def direct(url, prompts, args) -> tuple[int, float, float]:
    """The minimal load generator: the same body the client sends, one POST, decode the JSON."""
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i):
            body = {"input_ids": prompts[i],
                    "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0,
                                        "top_k": -1, "ignore_eos": True},
                    "return_logprob": True, "rid": uuid.uuid4().hex}
            async with session.post(url + "/generate", json=body, timeout=timeout) as r:
                reply = json.loads(await r.read())
            if r.status != 200:
                raise RuntimeError(f"{url}/generate returned {r.status}: {reply}")
            return len(reply["output_ids"])

        return await run_pool(len(prompts), args.concurrency, one)


MODES = {"client": via_client, "direct": direct}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="cProfile one client run and print the top entries")
    args = ap.parse_args()

    import uvloop

    from areal_like.data.tiny_model import build_tiny_model

    tmp = tempfile.mkdtemp(prefix="client_overhead-")
    model_dir = build_tiny_model(os.path.join(tmp, "model"), hidden_size=args.hidden,
                                 intermediate_size=2 * args.hidden, max_position_embeddings=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 60) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    proc, url = start_server(model_dir, os.path.join(tmp, "server.log"), max_batch=args.concurrency)
    results: dict[str, list[tuple[int, float, float]]] = {m: [] for m in MODES}
    try:
        # Warm-up (allocator, first batches, connection set-up), not counted.
        warm = prompts[: max(args.concurrency, 1)]
        for fn in MODES.values():
            uvloop.run(fn(url, warm, args))
        for r in range(args.rounds):
            order = ["client", "direct"] if r % 2 == 0 else ["direct", "client"]
            for mode in order:
                res = uvloop.run(MODES[mode](url, prompts, args))
                results[mode].append(res)
                tok, wall, cpu = res
                print(f"round {r} {mode:6s}: {tok / wall:9.1f} tok/s  {args.requests / wall:7.1f} req/s  "
                      f"wall {wall:6.2f}s  load-generator CPU {cpu:5.2f}s", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            uvloop.run(via_client(url, prompts, args))
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            print(s.getvalue())
    finally:
        stop_server(proc)

    print()
    print(f"{args.requests} requests, {args.concurrency} in flight, max_new_tokens {args.max_new_tokens} "
          f"(ignore_eos), prompt {args.prompt_len} tokens, tiny Qwen2 hidden {args.hidden}, {args.rounds} rounds")
    print(f"{'mode':8s} {'tok/s (median)':>15s} {'req/s (median)':>15s} {'CPU ms/req':>11s}")
    med, cpu_med = {}, {}
    for mode, rows in results.items():
        tps = statistics.median(t / w for t, w, _ in rows)
        rps = statistics.median(args.requests / w for _, w, _ in rows)
        cpu = statistics.median(c for _, _, c in rows) / args.requests * 1e3
        med[mode], cpu_med[mode] = tps, cpu
        print(f"{mode:8s} {tps:15.1f} {rps:15.1f} {cpu:11.3f}")
    wall_per_req_ms = 1e3 / statistics.median(args.requests / w for _, w, _ in results["direct"])
    extra = cpu_med["client"] - cpu_med["direct"]
    print(f"client's extra CPU: {extra * 1e3:.0f} µs/request = {extra / wall_per_req_ms * 100:.1f}% of the "
          f"direct run's wall time per request ({wall_per_req_ms:.2f} ms at {args.concurrency} in flight)")
    ratios = [(td / wd) / (tc / wc) for (tc, wc, _), (td, wd, _) in zip(results["client"], results["direct"])]
    print(f"paired ratio direct/client per round: {' '.join(f'{r:.3f}' for r in ratios)}")
    print(f"ratio of medians: {med['direct'] / med['client']:.3f}")
    overhead = (statistics.median(ratios) - 1.0) * 100.0
    print(f"client_overhead: {overhead:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
