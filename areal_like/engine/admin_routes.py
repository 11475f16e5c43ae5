"""The embedded server's admin surface for weights and memory: SGLang's control routes (pause, continue,
abort, flush), its weight-update routes (a torch.distributed group, a disk checkpoint, tensors through
shared memory, a begin/end session, /update_weight_version) and the co-located memory routes
(/release_memory_occupation, /resume_memory_occupation). Apart from `GenerationServer`, which serves and
schedules generation: these routes change what it serves, through its scheduler and model runner.

`AdminRoutes` owns the weight-update state (the receive groups and buffers, the shared-memory reader,
the update lock); the server keeps what generation itself checks (`released`, `weights_undefined`).
Every route here is an admin path (`ADMIN_PATHS`: the admin key when one is set).
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch
from aiohttp import web

from areal_like import metrics
from areal_like.engine.errors import BadRequest, error
from areal_like.weights import delta
from areal_like.weights.receive import WeightReceiver, parse_dtype
from areal_like.weights.shm import LOAD_FORMAT as SHM_LOAD_FORMAT
from areal_like.weights.shm import ShmReader

log = logging.getLogger("areal_like.engine.server")  # the server's log: these are its routes

RECV_SLOTS = 2  # receive buffers per weight group: bucket k+1 arrives while bucket k loads


class AdminRoutes:
    """The weight, memory and control routes of one `GenerationServer` (see the module docstring)."""

    ROUTES = (("POST", "/pause_generation", "pause"), ("POST", "/continue_generation", "continue_"),
              ("POST", "/abort_request", "abort_request"), ("POST", "/flush_cache", "flush_cache"),
              ("GET", "/flush_cache", "flush_cache"), ("POST", "/init_weights_update_group", "init_group"),
              ("POST", "/update_weights_from_distributed", "update_distributed"),
              ("POST", "/destroy_weights_update_group", "destroy_group"),
              ("POST", "/update_weights_from_disk", "update_disk"),
              ("POST", "/update_weights_from_tensor", "update_tensor"),
              ("POST", "/get_weights_by_name", "weights_by_name"),
              ("POST", "/release_memory_occupation", "release_memory"),
              ("POST", "/resume_memory_occupation", "resume_memory"),
              ("POST", "/begin_weight_update", "begin_end"), ("POST", "/end_weight_update", "begin_end"),
              ("POST", "/update_weight_version", "update_weight_version"),
              ("GET", "/weights_checker", "weights_checker"), ("POST", "/weights_checker", "weights_checker"))

    def __init__(self, server) -> None:
        self.server = server  # the GenerationServer whose weights and memory these routes change
        self.receiver = WeightReceiver(server.args.device)
        self.shm = ShmReader()  # /update_weights_from_tensor's shared-memory segments (co-located learner)
        self.update_lock = asyncio.Lock()
        # update_weights_from_distributed overlaps bucket k's load (engine thread) with bucket k+1's receive:
        # per group, the loads of the update in flight (checked by the bucket that sets the version) and
        # the receive count (bucket k receives into buffer k % RECV_SLOTS, free once its last load ended)
        self._group_loads: dict[str, list[asyncio.Future]] = {}
        self._group_received: dict[str, int] = {}
        # a delta update (load_format "delta") in flight per group: its tensors' changes, staged until its
        # last bucket arrives and then applied in one engine call (a torn update applies nothing)
        self._group_deltas: dict[str, list[delta.TensorDelta]] = {}
        # a delta update from the file system (/update_weights_from_disk, load_format "delta"), read and decoded
        # by the body that stages it: (its directory, its manifest, its tensors' changes)
        self._disk_delta: tuple[str, dict, list[delta.TensorDelta]] | None = None

    def add_to(self, app: web.Application) -> None:
        for method, path, handler in self.ROUTES:
            app.router.add_route(method, path, getattr(self, handler))

    async def pause(self, request: web.Request) -> web.Response:
        body = await self.server._json(request)
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"unknown pause mode {mode!r}: use abort, retract or in_place")
        await self.server.scheduler.pause(mode)
        return web.json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_(self, request: web.Request) -> web.Response:
        blocked = self._memory_blocker()
        if blocked:
            raise BadRequest(f"cannot continue generation: {blocked}")
        self.server.request_loras.resolve_held()
        self.server.scheduler.resume()
        return web.json_response({"success": True, "message": "continued"})

    def _memory_blocker(self, *, for_update: bool = False) -> str:
        """Why generation (or, `for_update`, a weight update) cannot run now; '' when it can."""
        if "weights" in self.server.released:
            return ("the weights' memory is released: POST /resume_memory_occupation "
                    '{"tags": ["weights"]} first')
        if for_update:
            return ""
        if self.server.released:
            return f"memory is released ({', '.join(sorted(self.server.released))}): POST /resume_memory_occupation first"
        if self.server.weights_undefined:
            return ("the weights were released and resumed without content: update them first "
                    "(/update_weights_from_disk, or /update_weights_from_distributed or "
                    "/update_weights_from_tensor ending with a bucket that sets weight_version)")
        return ""

    def _update_refused(self, **reply) -> web.Response | None:
        """A weight update while the weights' memory is released: SGLang's `success: false` reply (with
        the route's other reply fields, `reply`); None when the update may run."""
        blocked = self._memory_blocker(for_update=True)
        if not blocked:
            return None
        return web.json_response({"success": False, "message": f"cannot update weights: {blocked}", **reply})

    def _memory_tags(self, body: dict) -> set[str]:
        from areal_like.weights.control import MEMORY_TAGS

        tags = body.get("tags")
        if tags is None or tags == []:
            return set(MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise BadRequest("'tags' must be a list of strings or null")
        unknown = sorted(set(tags) - set(MEMORY_TAGS))
        if unknown:
            raise BadRequest(f"unknown memory tag(s) {unknown}: use {list(MEMORY_TAGS)} (or null for all)")
        return set(tags)

    async def release_memory(self, request: web.Request) -> web.Response:
        """SGLang's /release_memory_occupation (co-located mode): free the KV cache and/or the weights.
        Stricter than SGLang, which asserts an idle server: this one must be paused (/pause_generation),
        so no request can start on freed memory."""
        tags = self._memory_tags(await self.server._json(request))
        if not self.server.scheduler.paused:
            raise BadRequest("release_memory_occupation needs a paused server: POST /pause_generation first")
        async with self.update_lock:
            try:
                freed = await self.server.scheduler.run_on_engine(self.server.runner.release_memory, tags)
            except RuntimeError as e:
                raise BadRequest(str(e))
            self.server.released |= tags
        log.info("released %s (%s)", sorted(tags), ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in freed.items()))
        return web.json_response({"success": True, "message": f"released {sorted(tags)}", "freed_bytes": freed})

    async def resume_memory(self, request: web.Request) -> web.Response:
        """SGLang's /resume_memory_occupation: allocate what was released. Weights come back without
        content: a weight update must land before /continue_generation is accepted."""
        tags = self._memory_tags(await self.server._json(request))
        async with self.update_lock:
            got = await self.server.scheduler.run_on_engine(self.server.runner.resume_memory, tags & self.server.released)
            if "weights" in tags & self.server.released:
                self.server.weights_undefined = True
            self.server.released -= tags
        return web.json_response({"success": True, "message": f"resumed {sorted(tags)}", "allocated_bytes": got})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self.server._json(request)
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all", False))
        if not rid and not abort_all:
            raise BadRequest("give 'rid' or 'abort_all': true")
        n = self.server.scheduler.abort(rid, abort_all=abort_all)
        return web.json_response({"success": True, "message": f"aborted {n} request(s)", "num_aborted": n})

    async def flush_cache(self, request: web.Request) -> web.Response:
        # SGLang's rule: refused while requests run or wait in the scheduler; requests held by a pause
        # wait in SGLang's tokenizer, so they do not count (the pusher flushes while paused).
        if self.server.scheduler.running or self.server.scheduler.waiting:
            return error("Cache not flushed: there are running or waiting requests. Pause first.", 400)
        # No prefix cache to drop: the batch cache lives only as long as its rows.
        return web.json_response({"success": True, "message": "Cache flushed."})

    async def begin_end(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True, "message": ""})

    # ---------------------------------------------------------------- weights
    async def weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's `/get_weights_by_name`: the first `truncate_size` rows of one parameter as nested
        lists of floats (exact for every served dtype), read on the engine thread (never half-loaded).
        Admin-only here: weights are the learner's product."""
        b = await self.server._json(request)
        name, k = b.get("name"), b.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(k, int) or k < 1:
            raise BadRequest("get_weights_by_name needs {\"name\": str, \"truncate_size\": int ≥ 1}")
        own = self.server.runner.named_weights()
        if name not in own:
            raise BadRequest(f"no parameter {name!r}: see the model's state_dict names")

        def read():
            return own[name].detach()[:k].to("cpu", torch.float32).tolist()
        return web.json_response(await self.server.scheduler.run_on_engine(read))

    async def init_group(self, request: web.Request) -> web.Response:
        b = await self.server._json(request)
        try:
            kw = dict(master_address=str(b["master_address"]), master_port=int(b["master_port"]),
                      rank_offset=int(b["rank_offset"]), world_size=int(b["world_size"]),
                      group_name=str(b.get("group_name") or "weight_update_group"),
                      backend=str(b.get("backend") or ("nccl" if self.server.runner.device.type == "cuda" else "gloo")),
                      timeout_s=float(b.get("timeout_s") or self.server.args.weight_sync_timeout_s))
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"bad init_weights_update_group body: {e!r}")
        try:
            # Blocks until every rank joined: on a thread, so the server keeps serving meanwhile.
            await asyncio.to_thread(self._init_group_on_thread, kw)
        except Exception as e:
            log.error("init_weights_update_group failed: %s", e)
            return web.json_response({"success": False, "message": str(e)})
        return web.json_response({"success": True, "message": f"joined group {kw['group_name']!r} as rank "
                                                              f"{kw['rank_offset']} of {kw['world_size']}"})

    def _init_group_on_thread(self, kw: dict) -> None:
        if self.server.runner.device.type == "cuda":
            torch.cuda.set_device(self.server.runner.device)  # NCCL binds the thread's current device
        self.receiver.init_group(**kw)

    async def update_distributed(self, request: web.Request) -> web.Response:
        b = await self.server._json(request)
        if b.get("load_format") == "delta":
            return await self._update_delta(b)
        try:
            names, dtypes, shapes = list(b["names"]), list(b["dtypes"]), [list(s) for s in b["shapes"]]
        except (KeyError, TypeError) as e:
            raise BadRequest(f"bad update_weights_from_distributed body: {e!r}")
        group_name = str(b.get("group_name") or "weight_update_group")
        refused = self._update_refused()
        if refused is not None:
            return refused
        loads = self._group_loads.setdefault(group_name, [])
        async with self.update_lock:  # receives in arrival order: the broadcasts' order
            if b.get("abort_all_requests"):
                self.server.scheduler.abort(abort_all=True, message="aborted for weight update")
            t0 = time.perf_counter()
            k = self._group_received.get(group_name, 0)
            if len(loads) >= RECV_SLOTS:  # the load that last read buffer k % RECV_SLOTS must be done
                await asyncio.wait([loads[-RECV_SLOTS]])
            try:
                named = await self._receive(group_name, names, dtypes, shapes, b.get("load_format"), k % RECV_SLOTS)
            except Exception as e:
                log.error("update_weights_from_distributed failed: %s", e)
                return web.json_response({"success": False, "message": str(e)})
            self._group_received[group_name] = k + 1
            t_recv = time.perf_counter()
            # Loads run on the engine thread (FIFO): between two decode steps, all or nothing per bucket.
            load = asyncio.ensure_future(self.server.scheduler.run_on_engine(self.server.runner.load_weights, named))
            loads.append(load)
        # Outside the lock: the next bucket is received while this one loads.
        try:
            await load
        except Exception as e:
            log.error("update_weights_from_distributed failed: %s", e)
            return web.json_response({"success": False, "message": str(e)})
        t_load = time.perf_counter()
        if b.get("weight_version") is not None:
            # The last bucket of an update: every bucket of it must have landed before the version moves
            # (the executor is FIFO, so they have finished; one that failed fails the update).
            done = self._end_group_update(group_name)
            failed = [f.exception() for f in done if f.exception() is not None]
            if failed:
                return web.json_response({"success": False, "message": (
                    f"an earlier bucket of this update failed to load, the version stays "
                    f"{self.server.scheduler.weight_version}: {failed[0]}")})
            self.server._set_version(str(b["weight_version"]))
            self.server.weights_undefined = False  # a whole update landed
        metrics.WEIGHT_LOAD_SECONDS.observe(time.perf_counter() - t0)
        refused = self._flush_refused(b)
        if refused is not None:
            return refused
        # recv_s/load_s: beyond SGLang's reply, where this server's time went (the receive includes the
        # wait for the trainer's broadcast to start; the load, the wait for earlier buckets' loads)
        return web.json_response({"success": True, "message": f"updated {len(names)} tensors",
                                  "recv_s": t_recv - t0, "load_s": t_load - t_recv})

    async def _update_delta(self, b: dict) -> web.Response:
        """One bucket of a delta update (`weights.sync=delta`, weights/delta.py): body `deltas` (one
        `[name, dtype, shape, encoding, count]` per tensor, in the bucket's order) and `base_version`, the
        version the update applies to. Every bucket is received and staged; the last one (it sets
        `weight_version`) applies the whole update in one engine call if this server holds `base_version`
        — else it refuses and nothing changes (the sender then pushes the full weights)."""
        group_name = str(b.get("group_name") or "weight_update_group")
        try:
            described = [list(e) for e in b["deltas"]]
            base = str(b["base_version"])
            nbytes = max(delta.ALIGN, sum(delta.part_nbytes(parse_dtype(str(e[1])), [int(x) for x in e[2]], str(e[3]),
                                                            int(e[4])) for e in described))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise BadRequest(f"bad delta update body (want deltas: [[name, dtype, shape, encoding, count], …] and "
                             f"base_version): {e!r}")
        refused = self._update_refused()
        if refused is not None:
            return refused
        async with self.update_lock:  # receives in arrival order: the broadcasts' order
            if b.get("abort_all_requests"):
                self.server.scheduler.abort(abort_all=True, message="aborted for weight update")
            t0 = time.perf_counter()
            k = self._group_received.get(group_name, 0)
            if k == 0:
                self._group_deltas[group_name] = []
                log.info("receiving a delta update from version %s in group %r", base, group_name)
            if self.server.runner.device.type == "cuda":
                torch.cuda.set_device(self.server.runner.device)
            try:
                staged = await asyncio.to_thread(self._receive_delta, group_name, nbytes, described, k % RECV_SLOTS)
            except Exception as e:
                log.error("update_weights_from_distributed (delta) failed: %s", e)
                return web.json_response({"success": False, "message": str(e)})
            self._group_received[group_name] = k + 1
            self._group_deltas.setdefault(group_name, []).extend(staged)
        t_recv = time.perf_counter()
        if b.get("weight_version") is None:
            return web.json_response({"success": True, "message": f"staged {len(staged)} tensor deltas",
                                      "recv_s": t_recv - t0, "load_s": 0.0})
        deltas = self._group_deltas.pop(group_name, [])
        self._end_group_update(group_name)
        failed = await self._apply_deltas(deltas, base, str(b["weight_version"]), "update_weights_from_distributed",
                                          "this delta update", self.server.scheduler.run_on_engine, since=t0)
        if failed is not None:
            return web.json_response({"success": False, "message": failed})
        t_load = time.perf_counter()
        refused = self._flush_refused(b)
        if refused is not None:
            return refused
        return web.json_response({"success": True, "message": f"applied {len(deltas)} tensor deltas",
                                  "recv_s": t_recv - t0, "load_s": t_load - t_recv})

    async def _apply_deltas(self, deltas: list[delta.TensorDelta], base: str, version: str, route: str, what: str,
                            run, since: float | None = None) -> str | None:
        """Apply a staged delta update from `base` to `version` in one engine call (`run(load, deltas)`, e.g.
        the scheduler's `run_on_engine`) if this server holds `base`; then set the version, log and time it
        (WEIGHT_LOAD_SECONDS from `since`, default the apply's start). None once applied, else why nothing
        was: another version held, or the apply's own check failed (it checks before any write)."""
        have = self.server.scheduler.weight_version
        if have != base or self.server.weights_undefined:
            held = "undefined weights" if self.server.weights_undefined else f"version {have!r}"
            msg = f"{what} applies to version {base!r}, but this server holds {held}: nothing was applied; push the full weights"
            log.error("%s (delta) refused: %s", route, msg)
            return msg
        t_apply = time.perf_counter()
        try:
            await run(self.server.runner.apply_weight_deltas, deltas)
        except Exception as e:  # checked before any write: the old weights still serve
            log.error("%s (delta) failed: %s", route, e)
            return str(e)
        t_load = time.perf_counter()
        self.server._set_version(version)
        log.info("applied a delta update from version %s to %s (%d tensors, %d elements) in %.3f s", base, version,
                 len(deltas), sum(d.count for d in deltas), t_load - t_apply)
        metrics.WEIGHT_LOAD_SECONDS.observe(t_load - (t_apply if since is None else since))
        return None

    def _receive_delta(self, group_name: str, nbytes: int, described: list[list], slot: int) -> list[delta.TensorDelta]:
        """Receive one delta bucket (blocking; on a thread), decode its positions and copy its values out of
        the receive buffer."""
        buf = self.receiver.receive_bytes(group_name=group_name, nbytes=nbytes, slot=slot,
                                          what=f"a delta bucket of {len(described)} tensors ({nbytes} bytes)")
        return [d.prepare() for d in delta.unpack(buf, described)]  # positions decoded now, not in the pause

    async def weights_checker(self, request: web.Request) -> web.Response:
        """SGLang's /weights_checker, action `checksum` (its other actions — snapshot, compare, reset_tensors
        — are for debugging SGLang's loaders and are refused): per tensor, by HF name, the first 8 bytes of
        the SHA-256 of its bytes as hex, read on the engine thread (never half-loaded), in SGLang's reply
        shape (`ranks`: one entry for this one-device server, and `per_engine_checksum`)."""
        b = {} if not request.can_read_body else await self.server._json(request)
        action = b.get("action") or "checksum"
        if action != "checksum":
            return web.json_response({"success": False, "message": f"action {action!r} is not supported by this "
                                      "server: use 'checksum'"}, status=400)
        skip = b.get("skip_tensor_list") or []
        own = self.server.runner.named_weights()

        def hashes() -> dict[str, str]:
            return {n: delta.checksum(t) for n, t in own.items() if not any(p in n for p in skip)}
        sums = await self.server.scheduler.run_on_engine(hashes)
        overall = delta.overall_checksum(sums)
        info = {"checksums": sums, "per_gpu_checksum": overall,
                "parallelism_info": {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                     "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}}
        return web.json_response({"success": True, "message": f"checksum of {len(sums)} tensors", "ranks": [info],
                                  "per_engine_checksum": delta.engine_checksum([overall])})

    async def _receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                       load_format: str | None, slot: int) -> dict[str, torch.Tensor]:
        """One bucket from the weight group (on a thread): per-tensor broadcasts, or one flattened bucket
        received into the group's buffer `slot` (the tensors are views of it)."""
        if self.server.runner.device.type == "cuda":
            torch.cuda.set_device(self.server.runner.device)
        return await asyncio.to_thread(self.receiver.receive, group_name=group_name, names=names, dtypes=dtypes,
                                       shapes=shapes, load_format=load_format, slot=slot)

    def _flush_refused(self, body: dict) -> web.Response | None:
        """After a weight update's load: SGLang's rule — `flush_cache` (default true) flushes, and a flush
        refused because requests still run or wait fails the update. No prefix cache here, but the same
        answer. (Requests held by the pause are not running: SGLang's tokenizer holds those too.)"""
        if body.get("flush_cache", True) and (self.server.scheduler.running or self.server.scheduler.waiting):
            return web.json_response({"success": False, "message": (
                "Weights were updated, but the cache was not flushed because requests are still running "
                "or queued. Retract or finish them, then call /flush_cache.")})
        return None

    def _end_group_update(self, group_name: str) -> list[asyncio.Future]:
        """Forget the update in flight on `group_name`; its load futures (all done once the last one is)."""
        self._group_received.pop(group_name, None)
        self._group_deltas.pop(group_name, None)
        return self._group_loads.pop(group_name, [])

    async def destroy_group(self, request: web.Request) -> web.Response:
        b = await self.server._json(request)
        name = str(b.get("group_name") or "weight_update_group")
        async with self.update_lock:
            loads = self._end_group_update(name)
            if loads:  # its receive buffers go with the group: no load may still read them
                await asyncio.wait(loads)
            try:
                await asyncio.to_thread(self.receiver.destroy, name)
            except Exception as e:
                return web.json_response({"success": False, "message": str(e)})
        return web.json_response({"success": True, "message": f"destroyed group {name!r}"})

    async def _abort_and_load(self, b: dict, load, arg) -> float:
        """A whole-weights load under the update lock (disk, shared memory): every request aborted first if the
        body asks (`abort_all_requests`), then `load(arg)` on the engine thread; returns when the load started
        (perf_counter: what WEIGHT_LOAD_SECONDS measures from)."""
        if b.get("abort_all_requests"):
            self.server.scheduler.abort(abort_all=True, message="aborted for weight update")
        t0 = time.perf_counter()
        await self.server.scheduler.run_on_engine(load, arg)
        return t0

    async def update_disk(self, request: web.Request) -> web.Response:
        b = await self.server._json(request)
        path = b.get("model_path")
        if not path:
            raise BadRequest("'model_path' is required")
        if b.get("load_format") == "delta":
            return await self._update_disk_delta(b, str(path))
        if b.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {b['load_format']!r} is not supported: use null (safetensors) or "
                             "'delta' (a delta update's directory, weights.sync=delta)")
        refused = self._update_refused(num_paused_requests=0)
        if refused is not None:
            return refused
        async with self.update_lock:
            try:
                t0 = await self._abort_and_load(b, self.server.runner.load_weights_from_disk, str(path))
            except Exception as e:  # the runner validated before copying / restored: old weights still serve
                log.error("update_weights_from_disk(%s) failed, old weights kept: %s", path, e)
                return web.json_response({"success": False, "message": f"Failed to load {path}: {e}. "
                                          f"Rolled back to the previous weights.", "num_paused_requests": 0})
            if b.get("weight_version") is not None:
                self.server._set_version(str(b["weight_version"]))
            self.server.weights_undefined = False  # every tensor of a checkpoint loaded
            metrics.WEIGHT_LOAD_SECONDS.observe(time.perf_counter() - t0)
        return web.json_response({"success": True, "message": f"loaded {path}", "num_paused_requests": 0})

    async def _update_disk_delta(self, b: dict, path: str) -> web.Response:
        """A delta update from the file system (`weights.sync=delta` with `weights.mode=disk`; the directory
        `weights.disk.write_delta_dir` wrote). A body without `weight_version` stages it: read and decoded
        while generation runs. The body that sets `weight_version` applies it in one engine call (reading it
        first if it was not staged) if this server holds the manifest's `base_version` — else it refuses and
        nothing changes (the sender then pushes the full weights)."""
        from areal_like.weights.delta import read_delta_dir

        staged = self._disk_delta
        if staged is None or staged[0] != path:
            t0 = time.perf_counter()
            try:
                manifest, deltas = await asyncio.to_thread(read_delta_dir, path)
            except Exception as e:
                log.error("update_weights_from_disk (delta) could not read %s: %s", path, e)
                return web.json_response({"success": False, "num_paused_requests": 0,
                                          "message": f"Failed to read the delta update in {path}: {e}"})
            staged = self._disk_delta = (path, manifest, deltas)
            log.info("staged a delta update from version %s in %s (%d tensors) in %.3f s", manifest["base_version"],
                     path, len(deltas), time.perf_counter() - t0)
        _, manifest, deltas = staged
        if b.get("weight_version") is None:
            return web.json_response({"success": True, "num_paused_requests": 0,
                                      "message": f"staged {len(deltas)} tensor deltas from {path}"})
        self._disk_delta = None
        refused = self._update_refused(num_paused_requests=0)
        if refused is not None:
            return refused
        base = str(manifest["base_version"])
        async with self.update_lock:
            failed = await self._apply_deltas(deltas, base, str(b["weight_version"]), "update_weights_from_disk",
                                              f"the delta update in {path}",
                                              lambda load, arg: self._abort_and_load(b, load, arg))
        if failed is not None:
            return web.json_response({"success": False, "message": failed, "num_paused_requests": 0})
        return web.json_response({"success": True, "message": f"applied {len(deltas)} tensor deltas from {path}",
                                  "num_paused_requests": 0})

    async def update_tensor(self, request: web.Request) -> web.Response:
        """SGLang's /update_weights_from_tensor, for a co-located learner on this host: the tensors are in
        a shared-memory segment the learner filled (`load_format` "areal_like_shm", weights/shm.py),
        copied from there into the parameters on the engine thread (all or nothing per bucket). SGLang's
        own payload — a pickle of CUDA-IPC handles — is refused: nothing received over HTTP is unpickled.
        The bucket that sets `weight_version` ends the update (weights defined again after a release)."""
        b = await self.server._json(request)
        fmt = b.get("load_format")
        if fmt != SHM_LOAD_FORMAT:
            raise BadRequest(f"load_format {fmt!r} is not supported here: this server loads tensors from shared "
                             f"memory only (load_format {SHM_LOAD_FORMAT!r}, see areal_like/weights/shm.py); "
                             "SGLang's pickled CUDA-IPC payload is not unpickled")
        try:
            named = self.shm.read(b.get("serialized_named_tensors"))
        except (ValueError, OSError) as e:
            raise BadRequest(f"bad update_weights_from_tensor body: {e}")
        refused = self._update_refused()
        if refused is not None:
            return refused
        async with self.update_lock:
            try:
                t0 = await self._abort_and_load(b, self.server.runner.load_weights, dict(named))
            except Exception as e:  # names, shapes, dtypes checked before any copy: the old weights serve
                log.error("update_weights_from_tensor failed: %s", e)
                return web.json_response({"success": False, "message": str(e)})
            if b.get("weight_version") is not None:
                self.server._set_version(str(b["weight_version"]))
                self.server.weights_undefined = False  # the update's last bucket landed
            metrics.WEIGHT_LOAD_SECONDS.observe(time.perf_counter() - t0)
        refused = self._flush_refused(b)
        if refused is not None:
            return refused
        return web.json_response({"success": True, "message": f"updated {len(named)} tensors",
                                  "load_s": time.perf_counter() - t0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's /update_weight_version {new_version, abort_all_requests = true}."""
        b = await self.server._json(request)
        version = b.get("new_version")
        if not isinstance(version, str) or not version:
            raise BadRequest("'new_version' (a non-empty string) is required")
        abort = b.get("abort_all_requests", True)
        if not isinstance(abort, bool):
            raise BadRequest("'abort_all_requests' must be true or false")
        if abort:
            self.server.scheduler.abort(abort_all=True, message="aborted for weight version update")
        self.server._set_version(version)
        return web.json_response({"success": True, "message": f"Weight version updated to {version}",
                                  "new_version": version})
