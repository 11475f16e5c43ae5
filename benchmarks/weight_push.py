"""Achieved bandwidth of `WeightPusher.update` vs a raw torch.distributed broadcast of the same bytes.

Model: a random Qwen2 built locally (default hidden 1024, intermediate 2816, 2 layers ≈ 97 MB of
fp32 weights), so bytes dominate. N ∈ {1, 2} embedded servers (`--torch-threads 1`) receive it.

- push: `WeightPusher(servers[:N], bucket_bytes=B).update(weights, v)` — pause(abort) → per bucket:
  POST metadata, flatten (torch.cat), gloo broadcast as rank 0, wait until every server received,
  unflattened and loaded it → continue. Timed end to end (its own `push_s`). The trainer-side
  broadcast calls are also timed (the group's `broadcast` wrapped on this instance only), so
  `bcast-only` bandwidth = bytes / Σ broadcast seconds, and flatten time is timed the same way.
- raw: a separate gloo group of the same shape (this process = rank 0 + N receiver processes
  started here, formed with the same `init_weight_group`, same loopback transport), broadcasting
  preallocated uint8 buffers of exactly the push's bucket sizes one after another, then a 1-element
  allreduce so the time ends when every receiver has the bytes (as the push's does).

Rounds alternate push and raw for every (N, B); figures are medians.

    weight_push_vs_raw_broadcast = bandwidth(push) / bandwidth(raw)    (= raw s / push s)

The last line is the figure at `--figure-bucket-mib` (default 64, the demo config's `bucket_mb`)
with 1 server; the worst cell of the table is printed just above it.

Usage: python benchmarks/weight_push.py [--hidden 1024 --intermediate 2816 --layers 2]
       [--buckets-mib 16,64,256] [--servers 1,2] [--rounds 11]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import ROOT, child_env, free_port, start_server, stop_server

HEADER_LEN = 256  # int64 slots of the raw group's per-round header: [n_buckets, size_0, size_1, …]


# ---------------------------------------------------------------- raw receiver (a child process)
def raw_receiver(rank: int, world: int, port: int) -> None:
    """Rank `rank` of the raw group: per round, read the bucket sizes, preallocate, receive, sync."""
    import torch

    from areal_like.weights.group import init_weight_group

    torch.set_num_threads(1)
    g = init_weight_group(master_address="127.0.0.1", master_port=port, world_size=world, rank=rank,
                          group_name="raw_bcast", backend="gloo", timeout_s=600)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    one = torch.zeros(1)
    while True:
        g.broadcast(header, 0, what="the round header")
        n = int(header[0])
        if n == 0:
            break
        # Preallocated and touched before the timed part: the raw baseline is the transport alone.
        bufs = [torch.zeros(int(s), dtype=torch.uint8) for s in header[1:1 + n].tolist()]
        g.pg.allreduce([one]).wait()  # ready: the trainer starts its clock after this
        for b in bufs:
            g.broadcast(b, 0, what="a raw bucket")
        g.pg.allreduce([one]).wait()  # done: ends the trainer's clock
    g.destroy()


class RawGroup:
    """Rank 0 of the raw broadcast group and its N receiver processes."""

    def __init__(self, n: int, log_dir: str):
        self.port = free_port()
        env = child_env(1, GLOO_SOCKET_IFNAME="lo")
        self.procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--raw-receiver", str(r),
                                        "--raw-world", str(n + 1), "--raw-port", str(self.port)],
                                       stdout=open(os.path.join(log_dir, f"raw{n}_{r}.log"), "w"),
                                       stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                      for r in range(1, n + 1)]
        from areal_like.weights.group import init_weight_group

        self.g = init_weight_group(master_address="127.0.0.1", master_port=self.port, world_size=n + 1, rank=0,
                                   group_name="raw_bcast", backend="gloo", timeout_s=600)

    def round(self, sizes: list[int], bufs) -> float:
        import torch

        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[0] = len(sizes)
        header[1:1 + len(sizes)] = torch.tensor(sizes)
        one = torch.zeros(1)
        self.g.broadcast(header, 0)
        self.g.pg.allreduce([one]).wait()
        t0 = time.perf_counter()
        for b in bufs:
            self.g.broadcast(b, 0)
        self.g.pg.allreduce([one]).wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        import torch

        self.g.broadcast(torch.zeros(HEADER_LEN, dtype=torch.int64), 0)  # n = 0: stop
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()  # our own child, by its Popen handle
                p.wait()
        self.g.destroy()


# ---------------------------------------------------------------- the trainer side
async def measure(args, urls: list[str], weights, log_dir: str) -> dict:
    import torch

    import areal_like.weights.push as push_mod
    from areal_like.weights import WeightPusher, make_buckets

    # Time the bucket copies (the module's `fill_bucket`, what `push` calls; wrapped for this benchmark only).
    flat_s = [0.0]
    orig_fill = push_mod.fill_bucket

    def timed_fill(tensors, metas, out, to=None):
        t = time.perf_counter()
        out = orig_fill(tensors, metas, out, to)
        flat_s[0] += time.perf_counter() - t
        return out

    push_mod.fill_bucket = timed_fill
    bucket_sizes = [int(m * 2**20) for m in args.buckets_mib]
    res: dict = {}
    version = 0
    try:
        for n in args.servers:
            pusher = WeightPusher(urls[:n], master_port=free_port(), backend="gloo", timeout_s=600,
                                  group_name=f"wp_bench_{n}", overlap_loads=not args.no_overlap)
            await pusher.init()
            bcast_s = [0.0]
            orig_bcast = pusher.group.broadcast

            def timed_bcast(*a, _orig=orig_bcast, **k):
                t = time.perf_counter()
                _orig(*a, **k)
                bcast_s[0] += time.perf_counter() - t

            pusher.group.broadcast = timed_bcast  # this instance only: isolates the collective's time
            ctl_s = [0.0]
            srv = {"recv_s": 0.0, "load_s": 0.0}  # the servers' own per-bucket seconds (summed, per server)
            orig_post = pusher._post

            async def timed_post(url, path, body, _orig=orig_post, **kw):
                t = time.perf_counter()
                try:
                    reply = await _orig(url, path, body, **kw)
                    if path == "/update_weights_from_distributed" and isinstance(reply, dict):
                        for k in srv:
                            srv[k] += float(reply.get(k, 0.0)) / n
                    return reply
                finally:
                    if path != "/update_weights_from_distributed":  # those overlap the broadcast
                        ctl_s[0] += time.perf_counter() - t

            pusher._post = timed_post  # pause / begin / end / continue round trips (summed per server)
            raw = RawGroup(n, log_dir)
            try:
                for bb in bucket_sizes:
                    sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in make_buckets(weights, bb)]
                    raw_bufs = [torch.ones(s, dtype=torch.uint8) for s in sizes]
                    pusher.bucket_bytes = bb
                    rows = []
                    for r in range(args.rounds + 1):  # round 0 warms both paths up, not counted
                        flat_s[0] = bcast_s[0] = ctl_s[0] = srv["recv_s"] = srv["load_s"] = 0.0
                        version += 1
                        st = await pusher.update(weights, version)
                        raw_s = raw.round(sizes, raw_bufs)
                        if r:
                            rows.append((st.push_s, bcast_s[0], flat_s[0], raw_s, ctl_s[0] / n,
                                         srv["recv_s"], srv["load_s"]))
                    del raw_bufs
                    med = [statistics.median(col) for col in zip(*rows)]
                    res[(n, bb)] = {"bytes": st.bytes, "buckets": st.buckets, "push_s": med[0],
                                    "bcast_s": med[1], "flat_s": med[2], "raw_s": med[3], "ctl_s": med[4],
                                    "srv_recv_s": med[5], "srv_load_s": med[6],
                                    "ratio": statistics.median(rw[3] / rw[0] for rw in rows),
                                    "ratios": [rw[3] / rw[0] for rw in rows]}
            finally:
                raw.close()
                await pusher.close()
    finally:
        push_mod.fill_bucket = orig_fill
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--buckets-mib", type=lambda s: [float(x) for x in s.split(",")], default=[16, 64, 256])
    ap.add_argument("--servers", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--figure-bucket-mib", type=float, default=64)
    ap.add_argument("--no-overlap", action="store_true",
                    help="wait for every server's load of a bucket before the next broadcast (overlap_loads=False)")
    ap.add_argument("--raw-receiver", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--raw-world", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--raw-port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.raw_receiver is not None:
        raw_receiver(args.raw_receiver, args.raw_world, args.raw_port)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only; the servers inherit it
    import torch
    import uvloop
    from safetensors.torch import load_file

    from areal_like.data.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(os.path.join(tmp, "model"), hidden_size=args.hidden,
                                     intermediate_size=args.intermediate, num_layers=args.layers,
                                     num_heads=8, num_kv_heads=2)
        weights = sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())
        procs, urls = [], []
        try:
            for i in range(max(args.servers)):
                # Small KV budget: the servers only receive weights here.
                p, u = start_server(model_dir, os.path.join(tmp, f"server{i}.log"), "--max-context-len", "64",
                                    threads=1, max_batch=4)
                procs.append(p)
                urls.append(u)
            res = uvloop.run(measure(args, urls, weights, tmp))
        finally:
            for p in procs:
                stop_server(p)
    mb = sum(t.numel() * t.element_size() for _, t in weights) / 1e6
    print(f"model: qwen2 hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
          f"{len(weights)} tensors, {mb:.1f} MB fp32; gloo on loopback; {args.rounds} rounds, medians")
    print(f"{'servers':>7}{'bucket MiB':>11}{'buckets':>8}{'push s':>8}{'bcast s':>8}{'flat s':>7}{'ctl s':>7}"
          f"{'rest s':>7}{'raw s':>7}{'srv recv':>9}{'srv load':>9}{'push MB/s':>10}{'bcast MB/s':>11}{'raw MB/s':>9}"
          f"{'ratio':>7}  (min–max)")
    for (n, bb), r in res.items():
        b = r["bytes"] / 1e6
        print(f"{n:>7}{bb / 2**20:>11.0f}{r['buckets']:>8}{r['push_s']:>8.3f}{r['bcast_s']:>8.3f}{r['flat_s']:>7.3f}{r['ctl_s']:>7.3f}"
              f"{r['push_s'] - r['bcast_s'] - r['flat_s'] - r['ctl_s']:>7.3f}{r['raw_s']:>7.3f}"
              f"{r['srv_recv_s']:>9.3f}{r['srv_load_s']:>9.3f}{b / r['push_s']:>10.0f}{b / r['bcast_s']:>11.0f}{b / r['raw_s']:>9.0f}"
              f"{r['ratio']:>7.2f}  ({min(r['ratios']):.2f}–{max(r['ratios']):.2f})")
    print("push s = WeightPusher.update end to end (pause … continue); bcast s = its broadcast calls alone; "
          "flat s = its flatten copies; ctl s = pause/begin/end/continue HTTP (per server); rest s = the "
          "remainder (per bucket: waiting for each server's unflatten + load_weights + HTTP reply); "
          "raw s = raw gloo broadcast of the same bucket sizes; srv recv / srv load = the servers' own seconds "
          "in the receive (from its call, so it includes waiting for the broadcast) and in load_weights, "
          "summed over buckets (mean over servers)")
    worst = min(res.items(), key=lambda kv: kv[1]["ratio"])
    print(f"worst cell: {worst[0][0]} server(s), {worst[0][1] / 2**20:.0f} MiB buckets: {worst[1]['ratio']:.2f}")
    fig = res.get((1, int(args.figure_bucket_mib * 2**20)), worst[1])
    print(f"weight_push_vs_raw_broadcast: {fig['ratio']:.2f}")


if __name__ == "__main__":
    main()
