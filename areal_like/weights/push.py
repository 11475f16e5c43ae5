"""Trainer side of weight sync: bucketed torch.distributed broadcast to every generation server.

One push (PROTOCOL.md "Order of one update"):
```
 pause(abort) all ──► for each bucket:  POST metadata to all servers (not awaited)
                                        broadcast the flattened bucket as rank 0   (thread)
                                        collect the replies  — at most one bucket in flight
                 ──► /flush_cache all (once) ──► continue all
```
With `overlap_loads` (our embedded servers) the replies of a bucket are not awaited before the next
bucket's broadcast: a server loads bucket k into its model while it receives bucket k+1 (into its
second receive buffer), so its load no longer sits between two broadcasts. Every reply is collected
before `/end_weight_update`, and a failure is raised as soon as it arrives. SGLang loads each bucket in
its scheduler before it receives the next one: nothing to overlap, the pusher waits per bucket.
The HTTP calls that block on the group (init, each update) are sent first and awaited last, because
each server answers only after the collective it is waiting for. Blocking torch.distributed work
runs on a thread so the event loop keeps serving the other HTTP replies. This module does not decide
when to push or which version comes next (the learner does).

`weights.sync=delta` (weights/delta.py): after a first full push, only the changed elements travel —
diffed and sent while the servers generate, applied by each server in one call inside a short pause.

A restarted server is not in the group, and a server that died mid-push breaks it: `reform()` waits
for every server, drops the old group (here, and best-effort on the servers) and forms a new one
under a new name (`<group_name>_r<k>`) on a fresh port; the learner then pushes its current weights.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from areal_like import metrics
from areal_like.api.step_stats import PushResult
from areal_like.weights import delta as deltas_
from areal_like.weights import delta_sync
from areal_like.weights.adapter import ADAPTER_NAME, is_adapter
from areal_like.weights.admin import ServerAdmin, WeightPushError  # WeightPushError: re-exported here
from areal_like.api.net import free_port
from areal_like.weights.group import WeightGroup, init_weight_group
from areal_like.weights.receive import dtype_name, parse_dtype
from areal_like.weights.source import (LocalWeights, WeightSource, as_source, fill_bucket, gather_in, meta_nbytes,
                                       plan_buckets, wire_dtype_of)

log = logging.getLogger(__name__)


def wire_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `t` travels in: the servers' `dtype` for floating-point tensors (None = as it is);
    integer and bool buffers are never cast."""
    return wire_dtype_of(t.dtype, dtype)


def wire_nbytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * wire_dtype(t, dtype).itemsize


def make_buckets(named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int,
                 dtype: torch.dtype | None = None) -> list[list[tuple[str, torch.Tensor]]]:
    """Cut the tensors, in order, into buckets of at most `bucket_bytes` as sent (cast to `dtype`;
    a bigger tensor goes alone). `plan_buckets` on a source's metadata does the same by index."""
    src = LocalWeights(named_tensors)
    return [[named_tensors[i] for i in b] for b in plan_buckets(src.meta, bucket_bytes, dtype, aligned=False)]


def align_bucket(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
                 ) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors ordered by element size as sent, largest first (see `plan_buckets`): a
    bucket mixing e.g. bool and fp32 tensors in model order would otherwise be rejected."""
    return sorted(bucket, key=lambda nt: -wire_dtype(nt[1], dtype).itemsize)


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """The tensors' bytes (floating-point ones cast to `dtype`) concatenated in order: one uint8
    tensor (on the tensors' device); with `out` (a uint8 buffer at least that big) in its prefix."""
    n = sum(wire_nbytes(t, dtype) for _, t in bucket)
    if out is None:
        out = torch.empty(n, dtype=torch.uint8, device=bucket[0][1].device)
    return fill_bucket(iter(bucket), LocalWeights(bucket).meta, out, dtype)


class FlatBuffers:
    """Two grow-only uint8 buffers, alternated per bucket: bucket i+1 is flattened into one while
    bucket i is on the wire from the other (still one bucket in flight). Fresh multi-MiB allocations
    per push cost page faults and zeroing that made the push ~3× slower than a raw broadcast."""

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None, None]

    def get(self, i: int, nbytes: int, device: torch.device) -> torch.Tensor:
        b = self._bufs[i % 2]
        if b is None or b.numel() < nbytes or b.device != device:
            b = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._bufs[i % 2] = b
        return b


class WeightPusher(ServerAdmin):
    def __init__(self, server_urls: list[str], *, master_addr: str = "127.0.0.1", master_port: int,
                 backend: str = "gloo", bucket_bytes: int = 512 << 20, timeout_s: float = 300.0,
                 admin_api_key: str | None = None, api_key: str | None = None, group_name: str = "weight_update_group",
                 devices_per_server: list[int] | None = None, flattened: bool = True,
                 dtype: str | torch.dtype | None = None, overlap_loads: bool = False, sync: str = "full",
                 check_every: int = 0, delta_route: str = "broadcast"):
        super().__init__(server_urls, timeout_s=timeout_s, admin_api_key=admin_api_key, api_key=api_key)
        self.overlap_loads = overlap_loads
        # How a delta reaches the servers: `broadcast` (our embedded servers: the group, staged while they
        # generate) or `tensor` (SGLang: /update_weights_from_tensor by value, applied by weights/sglang_delta.py)
        if delta_route not in ("broadcast", "tensor"):
            raise ValueError(f"delta_route={delta_route!r}: use 'broadcast' (embedded servers) or 'tensor' (SGLang)")
        self.delta_route = delta_route
        # `weights.sync=delta`: what the servers hold, as last sent (host memory), and the version it makes up;
        # a push whose servers all hold that version sends only the changed elements (weights/delta.py)
        self.sent = delta_sync.sent_copy(sync)
        # `weights.check_every`: every k-th push, each server's per-tensor checksums (/weights_checker) are
        # compared with what a full push of the version sends (0: never)
        self.check_every = check_every
        self.pushes = 0
        # The servers' dtype (`server.dtype`): floating-point tensors are cast to it in the bucket, so
        # the wire carries what the servers hold. None = push every tensor in its own dtype.
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.group_name = group_name
        self.flattened = flattened
        # rank_offset of server k = 1 + Σ devices of servers before k; world = 1 + all devices.
        self.devices = devices_per_server or [1] * len(self.server_urls)
        if len(self.devices) != len(self.server_urls):
            raise ValueError("devices_per_server must have one entry per server URL")
        self.world_size = 1 + sum(self.devices)
        self.group: WeightGroup | None = None
        self._flat = FlatBuffers()
        self.base_group_name = group_name
        self.reforms = 0  # groups re-formed so far (the k of `<group_name>_r<k>`)
        self._collective: asyncio.Future | None = None  # the collective thread of the last call, if any
        self.stuck: list[str] = []  # servers whose call had not answered when the last push failed

    # ---------------------------------------------------------------- collectives
    async def _with_collective(self, http: list[asyncio.Task], collective, *, replies: bool = True) -> list:
        """Run the blocking collective on a thread while the servers' replies are pending; an early
        HTTP failure is raised at once instead of after the collective's timeout. `replies=False`:
        return once the collective is done, leaving the replies pending (still watched till then)."""
        coll = self._collective = asyncio.ensure_future(asyncio.to_thread(collective))
        coll.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" noise
        pending = {coll, *http}
        try:
            while coll in pending or (replies and pending):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    try:
                        d.result()  # raises the first failure (naming its server or the group)
                    except WeightPushError:
                        raise
                    except Exception as e:  # the collective (RuntimeError naming the group and peer)
                        raise WeightPushError(str(e)) from e
        except BaseException:
            # Servers whose call had not answered are still inside the collective (or about to enter it):
            # with NCCL, SGLang's side of the group has torch's default 30-minute timeout and no route to
            # end it — the learner asks the launcher to restart them (`stuck`, learner/weight_sync.py).
            self.stuck = [t.get_name() for t in http if not t.done()]  # `_send` names each call by its server
            for t in http:
                t.cancel()
            # NCCL: abort the group, so the collective thread ends now rather than at the group's timeout
            # (TORCH_NCCL_ASYNC_ERROR_HANDLING=2 on the learner's rank 0 keeps the process alive through
            # it). Gloo's cannot be interrupted: it ends at the timeout (`reform` waits for it).
            if coll in pending and self.group is not None:
                self.group.abort()
            raise
        return [t.result() for t in http] if replies else []

    def _send(self, url: str, route: str, body: dict) -> asyncio.Task:
        """POST `body` to `url``route` as a task named by its server (see `stuck`)."""
        return asyncio.get_running_loop().create_task(self._post(url, route, body), name=url)

    # ---------------------------------------------------------------- API
    async def init(self) -> None:
        """Form the weight group with every server (trainer = rank 0)."""
        await super().init()
        await self._form_group()

    async def _form_group(self) -> None:
        http = []
        offset = 1
        for url, ndev in zip(self.server_urls, self.devices):
            body = {"master_address": self.master_addr, "master_port": self.master_port, "rank_offset": offset,
                    "world_size": self.world_size, "group_name": self.group_name, "backend": self.backend}
            # The server answers only once every rank joined: send first, join as rank 0, then collect.
            http.append(self._send(url, "/init_weights_update_group", body))
            offset += ndev
        box: list[WeightGroup] = []

        def join():
            box.append(init_weight_group(master_address=self.master_addr, master_port=self.master_port,
                                         world_size=self.world_size, rank=0, group_name=self.group_name,
                                         backend=self.backend, timeout_s=self.timeout_s))

        await self._with_collective(http, join)
        self.group = box[0]
        log.info("weight group %r formed with %d servers", self.group_name, len(self.server_urls))

    async def _drop_group(self, server_timeout_s: float = 10.0) -> None:
        """Forget the current group: best-effort destroy on the servers (a restarted one never had
        it; errors ignored), then here — once the collective thread of a failed call has ended (it
        ends at the group's timeout at the latest); one still running then is abandoned with its group."""
        group, name = self.group, self.group_name
        self.group = None
        if self._session is not None:
            res = await asyncio.gather(*(self._post(u, "/destroy_weights_update_group", {"group_name": name},
                                                    timeout_s=server_timeout_s) for u in self.server_urls),
                                       return_exceptions=True)
            for url, r in zip(self.server_urls, res):
                if isinstance(r, BaseException):
                    log.info("destroying weight group %r on %s (ignored): %s", name, url, r)
        coll, self._collective = self._collective, None
        if group is None:
            return  # never formed (a join that failed or still runs is abandoned: it ends at its timeout)
        if coll is not None and not coll.done():
            await asyncio.wait({coll}, timeout=self.timeout_s + 5)
            if not coll.done():
                log.warning("a collective of weight group %r is still running: abandoning the group", name)
                return
        await asyncio.to_thread(group.destroy)

    async def reform(self) -> str:
        """Re-form the weight group after a server restarted or a push failed: wait until every
        server answers (bounded by the timeout; the error names those that did not), drop the old
        group, form `<group_name>_r<k>` on a fresh free port of `master_addr`. Returns its description.
        The servers keep serving what they hold (a restarted one stays paused): push next."""
        await ServerAdmin.init(self)
        await self.wait_servers()
        if self.sent is not None:
            self.sent.invalidate()  # a restarted server holds another version: the next push is full
        await self._drop_group()
        self.reforms += 1
        self.group_name = f"{self.base_group_name}_r{self.reforms}"
        self.master_port = free_port(self.master_addr)
        await self._form_group()
        return f"re-formed the weight group as {self.group_name!r} on {self.master_addr}:{self.master_port}"

    async def update(self, weights: WeightSource | list[tuple[str, torch.Tensor]], version: int, *,
                     paused: bool = False) -> PushResult:
        """Pause → bucketed broadcast → continue. Sets every server's weight_version to str(version).
        `paused=True`: the caller paused the servers and continues them (no pause, flush or continue here).

        `weights`: a `WeightSource` (a sharded learner's gathers one bucket at a time) or a list of
        (name, tensor). Buckets are planned from its metadata; each is filled tensor by tensor, cast
        to the servers' dtype on the way (a gathering source casts its shards before it gathers them:
        `gather_in`). The next bucket is filled while one is on the wire (two buffers), so the sending
        rank holds at most two buckets plus the tensor being gathered beyond its shard.

        On failure the servers stay paused (their weights may be partly new): retry the push, or
        reload from disk, then `resume()`.

        `sync="delta"` (`weights.sync=delta`): once a full push recorded what the servers hold, a push to
        servers that all report that version sends only the changed elements (`_update_delta`); any other
        case, a failure or `reform()` makes the next push full. `check_every=k`: every k-th push is then
        compared, tensor by tensor, with the checksums of a full push (`check`).
        """
        if self.group is None:
            raise WeightPushError("update() before init(): the weight group does not exist")
        self.stuck = []
        t0 = time.perf_counter()
        src = gather_in(as_source(weights), self.dtype)
        # A LoRA learner's push: the adapter's tensors, loaded by the servers as the run's adapter
        # (our route; SGLang has no distributed one for adapters — its LoRA runs push through disk)
        adapter = is_adapter(weights)
        return await delta_sync.push(self, src, version, adapter,
                                     lambda: self._update_full(src, weights, version, paused, t0, adapter),
                                     lambda: self._update_delta(src, version, paused, t0), self.bucket_bytes)

    async def _update_full(self, src: WeightSource, weights, version: int, paused: bool, t0: float,
                           adapter: bool) -> PushResult:
        """Every tensor, in buckets (see `update`); with `weights.sync=delta` each is also kept as sent."""
        dt = self.dtype
        meta = src.meta
        sent = self.sent if not adapter else None
        route = "/load_lora_adapter_from_distributed" if adapter else "/update_weights_from_distributed"
        buckets = plan_buckets(meta, self.bucket_bytes, dt)
        device = src.device
        total_bytes = 0

        def flatten(i: int) -> torch.Tensor:
            idx = buckets[i]
            nbytes = sum(meta_nbytes(meta[j], dt) for j in idx)
            buf = self._flat.get(i, nbytes, device)
            out = fill_bucket(src.open(idx), [meta[j] for j in idx], buf, dt)
            if sent is not None:  # the bucket holds each tensor as sent: keep it
                off = 0
                for j in idx:
                    n = meta_nbytes(meta[j], dt)
                    sent.record(meta[j][0], out[off:off + n].view(wire_dtype_of(meta[j][2], dt)).view(meta[j][1]))
                    off += n
            return out

        # The first bucket is filled before the pause: generation does not wait for it.
        next_flat = asyncio.ensure_future(asyncio.to_thread(flatten, 0)) if self.flattened and buckets else None
        t_paused = time.perf_counter()
        try:
            if not paused:
                await self.pause("abort")
            t_paused = time.perf_counter()
            await self._begin_or_end("/begin_weight_update")
            unanswered: list[asyncio.Future] = []  # overlap_loads: the replies of earlier buckets
            for i, idx in enumerate(buckets):
                last = i == len(buckets) - 1
                body = {
                    "names": [meta[j][0] for j in idx],
                    "dtypes": [dtype_name(wire_dtype_of(meta[j][2], dt)) for j in idx],
                    "shapes": [list(meta[j][1]) for j in idx],
                    "group_name": self.group_name,
                    # No flush per bucket (0.5.5–0.5.21: a flush while requests run kills the scheduler); one
                    # /flush_cache per update below, once every bucket landed.
                    "flush_cache": False,
                    "abort_all_requests": False,
                    # Only the last bucket sets the version: a server never reports a half-landed one.
                    "weight_version": str(version) if last else None,
                    "load_format": "flattened_bucket" if self.flattened else None,
                }
                if adapter:
                    body.update(lora_name=ADAPTER_NAME, config_dict=weights.adapter_config)
                if self.flattened:
                    # A gathering source is filled before the servers are asked to receive: they wait in
                    # the broadcast only as long as it takes.
                    buf = await next_flat
                    http = [self._send(u, route, body) for u in self.server_urls]
                    # Bucket i+1 is filled into the other buffer while this one is broadcast — a sharded learner's
                    # gathered from the shards (in the servers' dtype) meanwhile, so its gathers no longer add to
                    # the pause window (issue 40 item 7); rank 0 then holds two buckets.
                    next_flat = asyncio.ensure_future(asyncio.to_thread(flatten, i + 1)) if not last else None
                    total_bytes += buf.numel()
                    coll = lambda buf=buf, i=i: self.group.broadcast(buf, 0, what=f"bucket {i}")  # noqa: E731
                else:
                    http = [self._send(u, route, body) for u in self.server_urls]
                    total_bytes += sum(meta_nbytes(meta[j], dt) for j in idx)

                    def coll(idx=idx):
                        for n, t in src.open(idx):  # cast one tensor at a time, right before it is sent
                            wt = t.detach().to(wire_dtype(t, dt)).contiguous()
                            self.group.broadcast(wt, 0, what=f"tensor {n!r}")
                            if sent is not None:
                                sent.record(n, wt)
                            del t, wt
                if self.overlap_loads:
                    unanswered += http
                    await self._with_collective(unanswered, coll, replies=last)
                    unanswered = [t for t in unanswered if not t.done()]  # the done ones were checked
                else:
                    await self._with_collective(http, coll)
        except BaseException:
            # A failed bucket may leave the next one's fill running: a sharded learner's runs the pool's
            # gathers, which must end before anything else uses the pool (a retry's gathers).
            if next_flat is not None and not next_flat.done():
                await asyncio.wait({next_flat})
            raise
        await self._begin_or_end("/end_weight_update")
        # One cache flush per update, before continue: SGLang keeps finished and aborted requests'
        # prefixes in its radix cache, so a resubmitted prefix would continue on the old weights' KV
        # while labelled with the new version. Paused (abort), nothing runs, so the flush is accepted
        # (requests sent meanwhile wait in SGLang's tokenizer, not in the scheduler).
        if not paused:
            await self._all("/flush_cache", {})
            await self.resume()
        if device.type == "cuda":
            # On a GPU the bucket buffers go back to the caching allocator between pushes (training reuses
            # the blocks; a new one costs no page faults there). On the host they stay: see FlatBuffers.
            self._flat = FlatBuffers()
        t_end = time.perf_counter()
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return PushResult(push_s=t_end - t0, pause_window_s=t_end - t_paused, bytes=total_bytes,
                          buckets=len(buckets), adapter=adapter)

    # ---------------------------------------------------------------- weights.sync=delta
    async def _update_delta(self, src: WeightSource, version: int, paused: bool, t0: float) -> PushResult:
        """The changed elements since `self.sent.version` (which every server holds), in buckets of their
        encoded size (weights/delta.py). Diffed and packed before the pause, and sent while the servers still
        generate: each stages what it receives. Then pause → one empty bucket that sets the version (each
        server applies the whole update in one engine call) → continue: the pause window is the apply."""
        sent = self.sent
        assert sent is not None and sent.version is not None
        base = str(sent.version)
        packed, changed, numel = await asyncio.to_thread(delta_sync.diff, sent, src, self.dtype, self.bucket_bytes)
        if self.delta_route == "tensor":
            return await self._update_delta_tensor(packed, changed, numel, base, version, paused, t0)
        commit = ([], torch.zeros(deltas_.ALIGN, dtype=torch.uint8))  # sets the version: the servers apply
        device = src.device
        total = 0
        t_paused = None
        await self._begin_or_end("/begin_weight_update")
        unanswered: list[asyncio.Future] = []
        for i, (described, buf) in enumerate([*packed, commit]):
            last = i == len(packed)
            if last and not paused:
                t_paused = time.perf_counter()
                await self.pause("abort")
            t_paused = t_paused or time.perf_counter()
            body = {"deltas": described, "base_version": base, "group_name": self.group_name, "flush_cache": False,
                    "abort_all_requests": False, "weight_version": str(version) if last else None,
                    "load_format": "delta"}
            wire = buf.to(device) if device.type == "cuda" else buf
            total += wire.numel()
            http = [self._send(u, "/update_weights_from_distributed", body) for u in self.server_urls]
            coll = lambda wire=wire, i=i: self.group.broadcast(wire, 0, what=f"delta bucket {i}")  # noqa: E731
            unanswered += http
            # the last data bucket waits for every server to have staged them all: the pause holds the apply alone
            await self._with_collective(unanswered, coll, replies=i >= len(packed) - 1)
            unanswered = [t for t in unanswered if not t.done()]
        await self._begin_or_end("/end_weight_update")
        if not paused:
            await self._all("/flush_cache", {})
            await self.resume()
        t_end = time.perf_counter()
        sent.version = version  # every server applied it (the copy followed during the diff)
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return PushResult(push_s=t_end - t0, pause_window_s=t_end - t_paused, bytes=total, buckets=len(packed) + 1,
                          delta=True, changed=changed / max(1, numel))

    async def _update_delta_tensor(self, packed: delta_sync.Packed, changed: int, numel: int, base: str,
                                   version: int, paused: bool, t0: float) -> PushResult:
        """SGLang's side of `weights.sync=delta` (weights/sglang_delta.py): the packed buckets by value in one
        /update_weights_from_tensor per server (one copy per TP rank), applied by the loader the launcher
        registered (`--custom-weight-loader`), inside begin/end_weight_update. Serialized before the pause;
        the bytes travel inside it (SGLang stages nothing while it generates)."""
        from areal_like.weights import sglang_delta

        payload = await asyncio.to_thread(sglang_delta.serialize, sglang_delta.named_tensors(packed, base))
        t_paused = time.perf_counter()
        if not paused:
            await self.pause("abort")
        t_paused = time.perf_counter()
        await self._begin_or_end("/begin_weight_update")
        bodies = [{"serialized_named_tensors": [payload] * ndev, "load_format": sglang_delta.LOADER,
                   "flush_cache": False, "abort_all_requests": False, "weight_version": str(version)}
                  for ndev in self.devices]
        await asyncio.gather(*(self._post(u, "/update_weights_from_tensor", b)
                               for u, b in zip(self.server_urls, bodies)))
        await self._begin_or_end("/end_weight_update")
        if not paused:
            await self._all("/flush_cache", {})
            await self.resume()
        t_end = time.perf_counter()
        self.sent.version = version  # every server applied it (the copy followed during the diff)
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return PushResult(push_s=t_end - t0, pause_window_s=t_end - t_paused,
                          bytes=sum(buf.numel() for _, buf in packed), buckets=len(packed), delta=True,
                          changed=changed / max(1, numel))

    async def check(self, weights: WeightSource | list[tuple[str, torch.Tensor]], version: int) -> int:
        """Compare every server's per-tensor checksums with a full push of `version` (`delta_sync.check_servers`)."""
        return await delta_sync.check_servers(self, weights, self.dtype, self.bucket_bytes, version)

    async def close(self) -> None:
        """Destroy the group on the servers and here; close the HTTP session."""
        try:
            if self.group is not None and self._session is not None:
                await self._drop_group(server_timeout_s=30)
        finally:
            await super().close()
