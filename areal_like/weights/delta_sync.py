"""The sender's half of `weights.sync=delta`, shared by both transports that carry deltas: the bucketed
broadcast (`push.WeightPusher`) and the file system (`disk.DiskWeightPusher`).

- `servers_hold(admin, version)`: whether every server reports the version the sender's copy makes up
  (the base a delta applies to); otherwise the push is full.
- `diff(sent, src, dtype, bucket_bytes)`: every tensor's change from the sender's copy, packed into
  buckets (weights/delta.py's wire layout), the copy following as each tensor is encoded.
- `check_servers(admin, weights, dtype, bucket_bytes, version)`: every server's per-tensor checksums
  (SGLang's /weights_checker) against those of a full push of the version (`weights.check_every`).
- `push(pusher, …)`: the choice between a pusher's full and delta push, the copy's version, the checks.

What a push sends and when it pauses stays with each pusher; this module holds no state of its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import aiohttp
import torch

from areal_like.api.step_stats import PushResult
from areal_like.weights import delta as deltas_
from areal_like.weights.admin import ServerAdmin, WeightPushError
from areal_like.weights.source import WeightSource, as_source, gather_in, plan_buckets, wire_dtype_of

log = logging.getLogger(__name__)

SYNCS = ("full", "delta")


def sent_copy(sync: str) -> deltas_.SentCopy | None:
    """A pusher's copy of what its servers hold: a `SentCopy` for `weights.sync=delta`, None for `full`."""
    if sync not in SYNCS:
        raise ValueError(f"sync={sync!r}: use 'full' or 'delta'")
    return deltas_.SentCopy() if sync == "delta" else None


Packed = list[tuple[list[list], torch.Tensor]]
"""Delta buckets: (the bucket's tensor descriptions, `TensorDelta.describe()` each; its packed bytes)."""


async def servers_hold(admin: ServerAdmin, version: int) -> bool:
    """Whether every server reports `version` (/model_info's weight_version). A server that does not
    answer counts as not holding it: the full push that follows reports it properly."""
    assert admin._session is not None

    async def one(url: str) -> str | None:
        try:
            async with admin._session.get(url + "/model_info", headers=admin._read_headers,
                                          timeout=aiohttp.ClientTimeout(total=admin.timeout_s)) as resp:
                return str((await resp.json(content_type=None)).get("weight_version")) if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
            log.info("weight version of %s unknown (%s): pushing the full weights", url, e)
            return None
    held = await asyncio.gather(*(one(u) for u in admin.server_urls))
    behind = [f"{u} ({h})" for u, h in zip(admin.server_urls, held) if h != str(version)]
    if behind:
        log.info("server(s) not on version %d, the base of a delta: %s — pushing the full weights",
                 version, ", ".join(behind))
    return not behind


def diff(sent: deltas_.SentCopy, src: WeightSource, dtype: torch.dtype | None,
         bucket_bytes: int) -> tuple[Packed, int, int]:
    """Every tensor's change from the last-sent copy, packed into buckets of at most `bucket_bytes`
    (blocking: on a thread, before the pause): the packed buckets, the changed elements and the elements
    compared. The source is opened bucket by bucket as a full push would (a sharded learner gathers one
    tensor at a time), each tensor cast to the servers' `dtype` on the host; a bucket's changes are packed
    as soon as it is full, so what is held is the payload. The copy takes each tensor's new bytes as it
    is encoded (`SentCopy.follow`): the caller sets its version once every server applied the push, and
    invalidates it if the push fails."""
    packed: Packed = []
    cur: list[deltas_.TensorDelta] = []
    changed = numel = size = 0

    def close() -> None:
        buf = torch.zeros(max(deltas_.ALIGN, size), dtype=torch.uint8)
        deltas_.pack(cur, buf)
        packed.append(([d.describe() for d in cur], buf))
        cur.clear()

    for idx in plan_buckets(src.meta, bucket_bytes, dtype):
        for name, t in src.open(idx):
            new = t.detach().to("cpu", wire_dtype_of(t.dtype, dtype), copy=True)
            del t
            numel += new.numel()
            d = deltas_.encode(name, new, sent.tensors.get(name))
            if d is None:
                continue
            sent.follow(new, d)
            del new
            if cur and size + d.nbytes > bucket_bytes:
                close()
                size = 0
            cur.append(d)
            size += d.nbytes
            changed += d.count
    if cur:
        close()
    return packed, changed, numel


async def check_servers(admin: ServerAdmin, weights: WeightSource | list[tuple[str, torch.Tensor]],
                        dtype: torch.dtype | None, bucket_bytes: int, version: int) -> int:
    """Compare every server's per-tensor checksums (SGLang's /weights_checker, action `checksum`) with
    those of what a full push of `version` sends (the source, cast to the servers' `dtype`), on the names
    both have; returns the tensors compared per server. Raises WeightPushError naming the server and the
    first tensors that differ (the learner then re-syncs: a full push)."""
    src = gather_in(as_source(weights), dtype)

    def expected() -> dict[str, str]:
        out = {}
        for idx in plan_buckets(src.meta, bucket_bytes, dtype):
            for name, t in src.open(idx):
                out[name] = deltas_.checksum(t.detach().to(wire_dtype_of(t.dtype, dtype)))
                del t
        return out
    want = await asyncio.to_thread(expected)
    replies = await admin._all("/weights_checker", {"action": "checksum"})
    compared = None
    for url, r in zip(admin.server_urls, replies):
        have: dict[str, str] = {}
        for rank in (r or {}).get("ranks") or []:
            have.update(rank.get("checksums") or {})
        common = sorted(set(have) & set(want))
        if not common:
            raise WeightPushError(f"{url}/weights_checker reported no tensor the learner pushes: nothing to "
                                  f"check (set weights.check_every=0)")
        differ = [n for n in common if have[n] != want[n]]
        if differ:
            raise WeightPushError(f"{url} holds {len(differ)} tensor(s) that differ from version {version} as "
                                  f"a full push sends it, e.g. {differ[:3]}: re-syncing with a full push")
        compared = len(common) if compared is None else min(compared, len(common))
    return compared or 0


async def push(pusher, weights, version: int, adapter: bool, full: Callable[[], Awaitable[PushResult]],
               delta: Callable[[], Awaitable[PushResult]], bucket_bytes: int) -> PushResult:
    """One push of `pusher` (a `WeightPusher` or `DiskWeightPusher`: `sent`, `dtype`, `check_every`,
    `pushes`): `delta()` when it keeps a sent copy whose version every server holds, else `full()` (which
    records the copy afresh: its version is set here once the push landed); every `check_every`-th push is
    then checked (`check_servers`). A failure invalidates the copy: the next push is full. A LoRA
    adapter's push (`adapter`) is always full and never checked."""
    sent = pusher.sent if not adapter else None
    try:
        if sent is not None and sent.version is not None and await servers_hold(pusher, sent.version):
            res = await delta()
        else:
            if sent is not None:
                sent.invalidate()  # recorded afresh by this full push
            res = await full()
            if sent is not None:
                sent.version = version
        pusher.pushes += 1
        if pusher.check_every and not adapter and pusher.pushes % pusher.check_every == 0:
            res.checked = await check_servers(pusher, weights, pusher.dtype, bucket_bytes, version)
    except BaseException:
        if sent is not None:
            sent.invalidate()  # the servers may hold anything: the next push is full
        raise
    return res
