"""Replay-buffer throughput: groups/s through add + read + ack, against raw redis-py on the same bytes.

One run, one redis-server (started here, production config: AOF everysec, password, 127.0.0.1). For
512- and 8,192-token trajectories (groups of 8):

  buffer  producer thread: ReplayBuffer.add_group(group)        (validate + msgpack encode + ADD_GROUP
                                                                  script: idempotency marker, back-
                                                                  pressure check, XADD, gate counters)
          consumer thread: ReplayBuffer.read(8) → ack(ids)      (XREADGROUP + decode/validate + ACK
                                                                  script: XACK + XDEL)
  raw     producer thread: XADD stream g=<the same encoded bytes>
          consumer thread: XREADGROUP COUNT 8 → pipeline(XACK, XDEL)  (the buffer deletes what it
                                                                  acks, so the baseline does too)

groups/s = groups / wall time until the consumer acked the last one; add→read latency = time from
the add call to the read that returned the group (same process clock). Each repetition runs the
buffer and then raw redis-py back to back on fresh streams and yields one ratio, so load from other
processes hits both sides of a ratio alike; the table shows medians over `--repeat` repetitions.
The last line is `buffer_vs_raw_redis: <median ratio>`, the worse of the two sizes (goal ≥ 0.5).

    python benchmarks/buffer_throughput.py [--groups-512 500] [--groups-8192 80] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from areal_like.api.trajectory import Trajectory, TrajectoryGroup, encode_group  # noqa: E402
from areal_like.buffer.redis_client import make_client  # noqa: E402
from areal_like.buffer.redis_server import RedisServer  # noqa: E402
from areal_like.buffer.replay_buffer import ReplayBuffer  # noqa: E402

GROUP_N = 8  # trajectories per group
PROMPT = 128  # prompt tokens of each trajectory; the rest is generated
BATCH = 8  # groups per read


def make_groups(n: int, tokens: int, tag: str) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        gid = f"{tag}-{i}"
        trajs = [
            Trajectory.build(traj_id=f"{gid}-{j}", group_id=gid, prompt_id=f"p{i}",
                             prompt_ids=rng.integers(0, 32000, PROMPT, dtype=np.int32),
                             output_ids=rng.integers(0, 32000, tokens - PROMPT, dtype=np.int32),
                             output_logprobs=rng.standard_normal(tokens - PROMPT, dtype=np.float32),
                             output_versions=np.zeros(tokens - PROMPT, dtype=np.int32), reward=1.0,
                             finish_reason="stop")
            for j in range(GROUP_N)
        ]
        out.append(TrajectoryGroup(group_id=gid, prompt_id=f"p{i}", trajectories=trajs, created_at=time.time()))
    return out


def run_pair(produce, consume, n: int) -> tuple[float, list[float]]:
    """Run producer and consumer threads; returns (groups/s, add→read latencies in s)."""
    t_add: dict[int, float] = {}
    t_read: dict[int, float] = {}
    err: list[BaseException] = []

    def prod() -> None:
        try:
            produce(t_add)
        except BaseException as e:  # noqa: BLE001
            err.append(e)

    th = threading.Thread(target=prod, daemon=True)
    t0 = time.perf_counter()
    th.start()
    consume(t_read, n)
    wall = time.perf_counter() - t0
    th.join()
    if err:
        raise err[0]
    return n / wall, [t_read[i] - t_add[i] for i in range(n)]


def bench_buffer(url: str, groups: list[TrajectoryGroup], stream: str) -> tuple[float, list[float]]:
    prod = ReplayBuffer(url, stream=stream, block_ms=200, max_groups=4 * len(groups))
    cons = ReplayBuffer(url, stream=stream, block_ms=200)
    cons.stats()  # connect + create the group before the clock starts, like the raw path
    index = {g.group_id: i for i, g in enumerate(groups)}

    def produce(t_add: dict) -> None:
        for i, g in enumerate(groups):
            t_add[i] = time.perf_counter()
            prod.add_group(g)

    def consume(t_read: dict, n: int) -> None:
        got = 0
        while got < n:
            entries = cons.read(BATCH, consumer="bench")
            now = time.perf_counter()
            for _, g in entries:
                t_read[index[g.group_id]] = now
            cons.ack([e for e, _ in entries])
            got += len(entries)

    try:
        return run_pair(produce, consume, len(groups))
    finally:
        prod.close()
        cons.close()


def bench_raw(url: str, payloads: list[bytes], stream: str) -> tuple[float, list[float]]:
    """XADD / XREADGROUP / XACK+XDEL of the same bytes; latency keyed by entry id."""
    prod = make_client(url, password_env=None)
    cons = make_client(url, password_env=None)
    key = "{" + stream + "}:stream"
    cons.xgroup_create(key, "g", id="0", mkstream=True)
    adds: list[tuple[float, bytes]] = []
    reads: dict[bytes, float] = {}

    def produce(_t_add: dict) -> None:
        for p in payloads:
            t = time.perf_counter()
            adds.append((t, prod.xadd(key, {"g": p})))

    def consume(_t_read: dict, n: int) -> None:
        got = 0
        while got < n:
            reply = cons.xreadgroup("g", "c", {key: ">"}, count=BATCH, block=200)
            now = time.perf_counter()
            ids = [e for e, _ in (reply[0][1] if reply else [])]
            for e in ids:
                reads[e] = now
            if ids:
                pipe = cons.pipeline(transaction=False)
                pipe.xack(key, "g", *ids)
                pipe.xdel(key, *ids)
                pipe.execute()
            got += len(ids)

    t0 = time.perf_counter()
    th = threading.Thread(target=produce, args=({},), daemon=True)
    th.start()
    consume({}, len(payloads))
    wall = time.perf_counter() - t0
    th.join()
    prod.close()
    cons.close()
    return len(payloads) / wall, [reads[e] - t for t, e in adds]


def p99(xs: list[float]) -> float:
    return float(np.percentile(np.asarray(xs), 99)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups-512", type=int, default=500)
    ap.add_argument("--groups-8192", type=int, default=80)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as d, RedisServer(d) as srv:
        for tokens, n in ((512, a.groups_512), (8192, a.groups_8192)):
            groups = make_groups(n, tokens, f"t{tokens}")
            payloads = [encode_group(g) for g in groups]
            mb = sum(map(len, payloads)) / n / 2**20
            buf_gps, raw_gps, ratios, buf_lat, raw_lat = [], [], [], [], []
            for r in range(a.repeat):
                # each repetition gets fresh group ids (idempotency markers) and a fresh stream
                gs = [TrajectoryGroup(group_id=f"{g.group_id}-r{r}", prompt_id=g.prompt_id,
                                      trajectories=g.trajectories, created_at=g.created_at) for g in groups]
                gps, lat = bench_buffer(srv.url, gs, f"buf-{tokens}-{r}")
                buf_gps.append(gps)
                buf_lat += lat
                gps, lat = bench_raw(srv.url, payloads, f"raw-{tokens}-{r}")
                raw_gps.append(gps)
                raw_lat += lat
                ratios.append(buf_gps[-1] / raw_gps[-1])
            b, rw = statistics.median(buf_gps), statistics.median(raw_gps)
            rows.append((tokens, n, mb, b, rw, statistics.median(ratios), p99(buf_lat), p99(raw_lat),
                         min(ratios), max(ratios)))

    print(f"# buffer_throughput  {time.strftime('%Y-%m-%d')}  {platform.node()}  {os.cpu_count()} CPU  "
          f"python {platform.python_version()}  groups of {GROUP_N}, read batch {BATCH}, median of {a.repeat}")
    print(f"{'tokens/traj':>11} {'groups':>6} {'MiB/group':>9} {'buffer g/s':>10} {'raw g/s':>9} {'ratio':>6} "
          f"{'(min–max)':>10} {'p99 add→read buffer':>20} {'raw':>9}")
    for tokens, n, mb, b, rw, ratio, pb, pr, lo, hi in rows:
        print(f"{tokens:>11} {n:>6} {mb:>9.3f} {b:>10.1f} {rw:>9.1f} {ratio:>6.2f} {lo:>4.2f}–{hi:<4.2f} "
              f"{pb * 1000:>17.1f} ms {pr * 1000:>6.1f} ms")
    print(f"buffer_vs_raw_redis: {min(r[5] for r in rows):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
