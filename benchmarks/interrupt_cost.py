"""Cost of an interruptible weight update vs waiting for in-flight requests to drain, same server/load.

One embedded server (the engine_vs_hf model: random Qwen2 hidden 256, 4 layers, fp32 CPU) and a
load of R requests with long-tailed output lengths, driven through `GenerationClient` (which
resubmits aborted requests with prompt + tokens so far, PROTOCOL's interruptible loop). Once the
batch has run for `--after` seconds, a weight update is wanted (the update itself is a real
`/update_weights_from_disk` of the same checkpoint, with a new weight_version):

- interrupt: POST /pause_generation {"mode": "abort"} → update → /continue_generation. In-flight
  requests return their partial output and are resubmitted; they wait while paused.
- drain: wait until every in-flight request finished (no new ones are sent) → update.

pause window = from "update wanted" to "new weights serve". Tokens lost = tokens the server
generated that no client received (the in-flight step of aborted rows); re-prefilled = extra prompt
tokens the server prefilled for resubmissions (the recompute price of dropping the KV).

    interrupt_cost = pause window (drain) / pause window (interrupt)

Usage: python benchmarks/interrupt_cost.py [--requests 32] [--after 0.4] [--threads 1] [--max-len 384]
The last line printed is `interrupt_cost: <ratio>`.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import tempfile
import time

import aiohttp

from _common import add_long_tail_args, long_tail_setup, stop_server  # first: puts the repository root on sys.path
from areal_like.engine.client import GenerationClient


async def counters(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for name in ("areal_like_generated_tokens_total", "areal_like_prompt_tokens_total"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


async def scenario(mode: str, url: str, model_dir: str, prompts, lengths, after: float, version: int):
    async with aiohttp.ClientSession() as s, GenerationClient([url], request_timeout_s=1800) as client:
        c0 = await counters(s, url)
        t_start = time.perf_counter()
        tasks = [asyncio.ensure_future(client.generate(p, max_new_tokens=n, ignore_eos=True, key="one-server"))
                 for p, n in zip(prompts, lengths)]
        await asyncio.sleep(after)
        t0 = time.perf_counter()  # the update is wanted now
        upd = {"model_path": model_dir, "weight_version": str(version)}
        if mode == "interrupt":
            async with s.post(url + "/pause_generation", json={"mode": "abort"}) as r:
                assert r.status == 200
            async with s.post(url + "/update_weights_from_disk", json=upd) as r:
                assert (await r.json())["success"]
            async with s.post(url + "/continue_generation", json={}) as r:
                assert r.status == 200
        else:
            await asyncio.wait(tasks)
            async with s.post(url + "/update_weights_from_disk", json=upd) as r:
                assert (await r.json())["success"]
        window = time.perf_counter() - t0
        results = await asyncio.gather(*tasks)
        total = time.perf_counter() - t_start
        c1 = await counters(s, url)
    received = sum(len(r.output_ids) for r in results)
    assert [len(r.output_ids) for r in results] == list(lengths)
    generated = c1["areal_like_generated_tokens_total"] - c0["areal_like_generated_tokens_total"]
    prefilled = c1["areal_like_prompt_tokens_total"] - c0["areal_like_prompt_tokens_total"]
    return {"window": window, "lost": int(generated - received), "reprefill": int(prefilled - sum(map(len, prompts))),
            "interrupted": sum(r.num_interruptions > 0 for r in results), "total": total, "tokens": received,
            "new_version_tokens": sum(v == version for r in results for v in r.output_versions)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_long_tail_args(ap, requests=32, seed=1, length_shape=False)
    ap.add_argument("--after", type=float, default=0.4, help="seconds of generation before the update")
    args = ap.parse_args()
    import uvloop

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts, lengths, proc, url = long_tail_setup(tmp, args)
        try:
            res = {}
            for v, mode in enumerate(("interrupt", "drain"), start=1):
                res[mode] = uvloop.run(scenario(mode, url, model_dir, prompts, lengths, args.after, v))
        finally:
            stop_server(proc)
    lens = sorted(lengths)
    print(f"model: qwen2 hidden {args.hidden}, {args.layers} layers, fp32 CPU, {args.threads} torch thread(s); "
          f"{args.requests} requests, lengths median {lens[len(lens) // 2]} max {lens[-1]}; update after {args.after}s")
    print(f"{'mode':<11}{'window s':>10}{'tok lost':>10}{'re-prefill':>12}{'interrupted':>13}"
          f"{'new-ver tok':>13}{'run s':>8}")
    for mode, r in res.items():
        print(f"{mode:<11}{r['window']:>10.3f}{r['lost']:>10}{r['reprefill']:>12}{r['interrupted']:>13}"
              f"{r['new_version_tokens']:>13}{r['total']:>8.2f}")
    print(f"interrupt_cost: {res['drain']['window'] / res['interrupt']['window']:.1f}")


if __name__ == "__main__":
    main()
