"""`launcher run|status|stop`, local backend: start every role of a run, supervise it, end it cleanly.

Start order (DESIGN.md): Redis → generation servers, and while they load the learner pool (it
builds its models and resumes meanwhile) and the rollout workers → wait for the servers' /health →
endpoints.json (learner rank 0 and the workers wait for it; rank 0 then forms the weight-sync group
with the servers, the workers start generating) → supervision. The launcher owns no training
logic: it only places processes, watches them and reports progress.

    launcher ──┬─ redis-server            (AOF, 127.0.0.1, password; unless buffer.redis_url is set)
               ├─ server0 … serverN-1     (python -m areal_like.engine.server, one per generation DP replica)
               ├─ learner                 (python -m areal_like.learner.main; ends the run after total_steps)
               └─ rollout0 … rolloutK-1   (python -m areal_like.rollout.worker)

A role that dies is restarted within its budget (`launcher.max_restarts.<role>`, one policy in
`Run._on_death`): the learner pool from its checkpoint, a generation server paused on its port (the
learner re-syncs it), a rollout worker after its gate slots are freed, our redis-server from its AOF.
The run ends when the learner exits 0 (done), when a role dies past its budget or a rollout worker
stops on reward failures (exit 1: the role, its exit code and the tail of its log), or on Ctrl-C /
SIGTERM. In every case the launcher ends exactly the processes it started, by process group, and
writes summary.json (with every restart). One `launcher run` per run directory: it holds
`<run-dir>/.lock` (flock) for its life and a second one is refused before it writes anything there.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import time
import urllib.request
from collections.abc import Callable

from areal_like.api.config import lora_target_modules
from areal_like.api.net import reach_host, url_host
from areal_like.api.process import process_running
from areal_like.api.run_files import Endpoints, reward_reached
from launcher.procs import ProcessTable, Role, end_process_group, learner_role, role_kind


class RunError(RuntimeError):
    pass


def _resolve(args):
    from allocation import AllocationError, parse_allocation

    from areal_like.api.config import ConfigError, explicit_keys, load_config

    overrides = list(args.overrides or [])
    if args.allocation:
        overrides.append(f"allocation={args.allocation}")
    if getattr(args, "backend", None):
        overrides.append(f"launcher.backend={args.backend}")
    if getattr(args, "ray_address", None):
        overrides.append(f"launcher.ray.address={args.ray_address}")
    config = args.config
    if config is None:  # the CPU demo's file, unless the command line asks for SGLang servers (issue 40 item 6)
        config = None if _names_sglang(args.allocation) else DEMO_CONFIG
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        raise RunError(str(e)) from None
    try:
        alloc = parse_allocation(cfg.allocation)
    except AllocationError as e:
        raise RunError(f"allocation {cfg.allocation!r}:\n{e}") from None
    if alloc.generation is not None and alloc.generation.backend == "sglang":
        _gpu_settings(cfg, alloc, explicit_keys(config, overrides))
    return cfg, alloc


DEMO_CONFIG = "configs/demo.yaml"  # `launcher run` without --config: the CPU demo


def _names_sglang(allocation: str | None) -> bool:
    """Whether an --allocation asks for SGLang servers (a GPU run, which does not start from the CPU demo)."""
    if not allocation:
        return False
    from allocation import AllocationError, parse_allocation

    try:
        gen = parse_allocation(allocation).generation
    except AllocationError:
        return False  # reported with the config's own check
    return gen is not None and gen.backend == "sglang"


def _gpu_settings(cfg, alloc, explicit: set[str]) -> None:
    """A GPU (SGLang) run (issue 40 item 6): the keys the config leaves at the CPU demo's defaults get verl's
    values (`GPU_DEFAULTS`, printed), and values the user chose that only make sense on CPU are named."""
    from areal_like.api.config import ConfigError, apply_gpu_defaults, cpu_only_values

    try:
        changed = apply_gpu_defaults(cfg, explicit)
    except ConfigError as e:
        raise RunError(f"with the GPU run's defaults: {e}") from None
    for line in changed:
        print(f"[launcher] GPU run default: {line}", flush=True)
    for line in cpu_only_values(cfg, num_servers=alloc.generation.dp):
        print(f"[launcher] warning, a CPU-demo value in a GPU run: {line}", file=sys.stderr, flush=True)


def _check_runnable(cfg, alloc) -> tuple[str, int, int]:
    gen, train = alloc.generation, alloc.training
    if gen is None or train is None:
        raise RunError(
            f"allocation {cfg.allocation!r} is {alloc.kind}: `launcher run` needs a generation part and a "
            "training part, e.g. --allocation embedded.d1p1t1+d1p1t1"
        )
    aux = [c for c in (aux_component(alloc, r) for r in AUX_ROLES) if c is not None]
    critic = critic_component(alloc)
    extra = [c for c in alloc.components if c is not gen and c is not train and c not in aux and c is not critic]
    if extra:
        names = ", ".join(f"{c.backend}[{c.name}] (role {c.role})" for c in extra)
        raise RunError(
            f"allocation {cfg.allocation!r} names components `launcher run` does not start yet: {names}. A run "
            f"starts one rollout pool ({gen.backend}[{gen.name}]), one actor pool ({train.backend}[{train.name}]), "
            "at most one critic pool (fsdp[critic]:dN, algorithm.adv_estimator=gae; without it the critic trains "
            "inside the actor's ranks), one judge pool (embedded[judge]:dN or sglang[judge]:…) and one teacher pool "
            "(embedded[teacher]:dN or sglang[teacher]:…); the reference model runs inside the actor's process: remove the other "
            "components from --allocation"
        )
    for c in aux:
        _check_aux(cfg, alloc, c)
    if critic is not None:
        _check_critic(cfg, alloc, critic)
    from allocation import AllocationError

    try:
        alloc.require_runnable()
    except AllocationError as e:
        raise RunError(str(e)) from None
    if gen.backend == "sglang":
        _require_sglang(cfg)
    elif gen.tp * gen.pp != 1:
        raise RunError(f"the embedded engine runs one device per server; got t={gen.tp} p={gen.pp}: use embedded.d{gen.dp}p1t1")
    world = train.world_size
    if train.cp > 1:
        raise RunError(f"context parallel (c={train.cp}) is not implemented by the learner pool: drop the c dimension")
    return gen.backend, gen.dp, world


def _require_sglang(cfg) -> None:
    """SGLang importable by server.python (a rollout, judge or teacher pool of SGLang servers), else RunError."""
    from areal_like.engine.sglang_args import SGLangNotInstalled, require_sglang

    try:
        require_sglang(cfg.server.python)
    except SGLangNotInstalled as e:
        raise RunError(str(e)) from None


AUX_ROLES = ("judge", "teacher")
"""Components whose servers serve a fixed model of their own (`judge.model_path`, `teacher.model_path`): started
like the embedded generation servers, never in a weight group, restarted on their port (`judge<i>`,
`teacher<i>`)."""


def aux_component(alloc, role: str):
    """The allocation's component of `role` (judge or teacher: names are unique, so at most one), or None."""
    return next((c for c in alloc.components if c.role == role), None)


def _check_aux(cfg, alloc, comp) -> None:
    """A judge or teacher pool runs the embedded engine (one device per server) or SGLang (GPUs), on devices of
    its own."""
    if comp.backend not in ("embedded", "sglang"):
        raise RunError(f"{comp.backend}[{comp.name}]: `launcher run` starts {comp.role} servers of the embedded engine "
                       f"(CPU or GPU) or of SGLang (GPU): use embedded[{comp.name}]:d{comp.dp} or "
                       f"sglang[{comp.name}]:d{comp.dp}")
    if comp.backend == "sglang":
        _require_sglang(cfg)
    elif comp.tp * comp.pp != 1:
        raise RunError(f"the embedded engine runs one device per server; the {comp.role} has t={comp.tp} p={comp.pp}: "
                       f"use embedded[{comp.name}]:d{comp.dp}")
    if any(comp in group and len(group) > 1 for group in alloc.groups):
        raise RunError(f"{comp.role} component {comp.name!r} is co-located (`|`) with another component: a "
                       f"{comp.role}'s servers keep their devices for the run; write it as a pool of its own (`+`)")


def critic_component(alloc):
    """The allocation's critic component (a critic on a pool of its own), or None."""
    return next((c for c in alloc.training_components if c.role == "critic"), None)


def _check_critic(cfg, alloc, comp) -> None:
    """A critic pool: a learner pool of its own (fsdp or megatron, no cp), beside a disaggregated generation part."""
    if comp.backend not in ("fsdp", "megatron"):
        raise RunError(f"{comp.backend}[{comp.name}]: a critic pool runs the learner's trainer; use "
                       f"fsdp[{comp.name}]:d{comp.dp} (or megatron[{comp.name}]:…)")
    if getattr(comp, "cp", 1) > 1:
        raise RunError(f"context parallel (c={comp.cp}) is not implemented by the learner pool: drop the c dimension "
                       f"of {comp.backend}[{comp.name}]")
    if alloc.colocated:
        raise RunError(f"critic component {comp.name!r} with a co-located generation part (`<generation>|<training>`): "
                       "the servers hand their devices to the actor's pool alone; write the generation part as a pool "
                       "of its own (`+`), or drop the critic component (the critic then trains inside the actor's ranks)")


def _wait_health(url: str, timeout_s: float, role, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if role.proc.poll() is not None:
            raise RunError(f"{what} at {url} exited with {role.proc.returncode} while starting:\n{role.tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as e:  # connection refused while it loads: keep waiting
            last = str(e)
        time.sleep(0.3)
    raise RunError(f"{what} at {url} not healthy after {timeout_s:.0f}s (last error: {last}); log {role.log_path}:\n{role.tail()}")


def _default_run_dir(cfg) -> str:
    return os.path.join("runs", f"{cfg.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}")


def read_metrics(path: str) -> list[dict]:
    """The rows of a run's metrics.jsonl ([] without the file); a line being written right now is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line being written right now
    return out


def summarize(rows: list[dict], max_staleness: int, wall_s: float, new_rows: list[dict] | None = None) -> dict:
    """summary.json. reward_first/last average the first/last min(5, steps) steps (one step is noisy).

    After a learner restart the steps since its checkpoint are trained again: the last row of each
    step is the one the final model contains.
    """
    rows = list({r["step"]: r for r in rows}.values())
    new_rows = rows if new_rows is None else new_rows  # what this launch trained (a resumed run appends)
    rewards = [r["reward_mean"] for r in rows if r.get("samples")]  # steps that trained on something
    k = min(5, len(rewards))
    samples = sum(r.get("samples", 0) for r in new_rows)
    return {
        "steps": len(rows),
        "final_version": rows[-1]["version"] if rows else 0,
        "reward_first": (sum(rewards[:k]) / k) if k else None,
        "reward_last": (sum(rewards[-k:]) / k) if k else None,
        "dropped_stale": sum(r.get("dropped_stale", 0) for r in rows),
        "max_staleness": max_staleness,
        "max_staleness_observed": max((r["staleness_max"] for r in rows), default=0),
        "samples_per_s": samples / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
    }


def _reward_failures_text(counts: dict[str, int]) -> str:
    """"  reward failures: exception 12, timeout 3" for the progress line; "" while there are none."""
    parts = [f"{kind} {n}" for kind, n in counts.items() if n]
    return f"  reward failures: {', '.join(parts)}" if parts else ""


def cmd_run(args) -> int:
    try:
        cfg, alloc = _resolve(args)
        _, n_servers, _ = _check_runnable(cfg, alloc)
        _check_devices(cfg, alloc)
        # every model/data/tools/workflow file checked before the run dir is created or anything starts
        _preflight(cfg)
        _check_memory(cfg, alloc)
    except RunError as e:
        print(f"launcher run: {e}", file=sys.stderr)
        return 2
    run_dir = os.path.abspath(args.run_dir or _default_run_dir(cfg))
    # owner-only from the start (issue 24): the run dir holds config.json's keys, the Redis AOF (every
    # trajectory and reward), logs; 0700 stops another account even listing it. An existing dir keeps its mode.
    os.makedirs(run_dir, mode=0o700, exist_ok=True)
    try:  # before anything in the run dir is written: a second run must not touch the first one's files
        _lock_run_dir(run_dir)
    except RunError as e:
        print(f"launcher run: {e}", file=sys.stderr)
        return 2
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    return Run(cfg, alloc, run_dir, n_servers).execute()


def _preflight(cfg) -> None:
    """Demo names → cache paths (in `cfg`), then every file the run reads checked — model and data paths,
    every prompt cell and agent_name of the data files, empty files, rollout.tools_config, the workflows —
    before the run dir is created or anything starts (launcher/preflight.py); RunError naming the key,
    the file and the row."""
    from launcher.preflight import PreflightError, check_rollout_inputs, resolve_and_check

    log = lambda msg: print(f"[launcher] {msg}", flush=True)  # noqa: E731
    try:
        resolve_and_check(cfg, log=log)
        check_rollout_inputs(cfg, log=log)
    except PreflightError as e:
        raise RunError(str(e)) from None


def cuda_device_memory() -> int | None:
    """Smallest memory of this machine's visible GPUs (bytes) from `nvidia-smi`, or None where there is
    no nvidia-smi or it answers nothing usable (the launcher never imports torch to ask)."""
    from launcher.devices import cuda_gpus

    gpus = cuda_gpus()
    return min(g.memory_bytes for g in gpus) if gpus else None


def _check_devices(cfg, alloc) -> None:
    """Issue 40: the local backend refuses an allocation larger than this machine's GPUs (naming
    `--backend ray`) and SGLang on a machine without one; SGLang servers must run the learner's torch
    release (launcher/devices.py). Before the run dir is created or anything starts."""
    from launcher.devices import (DeviceCheckError, check_local_devices, check_torch_pairing, colocated_ray_refusal,
                                  cuda_gpus, uses_cuda)

    try:
        if cfg.launcher.backend == "ray":
            why = colocated_ray_refusal(cfg.allocation, cuda=uses_cuda(cfg, alloc))
            if why:
                raise DeviceCheckError(why)
        elif uses_cuda(cfg, alloc):
            check_local_devices(cfg, alloc, cuda_gpus())
        if any(c.backend == "sglang" for c in alloc.generation_components):
            check_torch_pairing(_server_python(cfg))
    except DeviceCheckError as e:
        raise RunError(str(e)) from None


def colocated_gpus(plan) -> tuple[list[list[list[int]]], list[list[int]]]:
    """A co-located plan's (node, device) of each server's TP ranks (TP-rank order: SGLang puts TP rank r on
    --base-gpu-id + r, the server's r-th slot) and of each learner rank: `Endpoints.server_gpus` and
    `learner_gpus`, from which learner rank 0 routes each rank's CUDA-IPC payload (weights/ipc.py)."""
    return ([[list(slot) for slot in sp.slots] for sp in plan.servers], [[r.node, r.device] for r in plan.ranks])


def _server_python(cfg) -> str:
    """server.python as the servers are started with it (a relative path is taken from the launcher's directory)."""
    p = cfg.server.python
    if not p:
        return sys.executable
    return os.path.abspath(p) if os.sep in p else p


def _check_memory(cfg, alloc) -> None:
    """Refuse a plan whose devices cannot hold it (`launcher plan --model`'s arithmetic,
    allocation/memory.py) — only where the roles run on CUDA devices (SGLang servers, or
    `server.device=cuda…`: the learner then trains on its plan devices too) and their memory is known
    from nvidia-smi. On CPU there is nothing to check: host memory is shared by every role."""
    gen = alloc.generation
    if not cfg.launcher.check_memory:
        return
    if gen is None or not (gen.backend == "sglang" or cfg.server.device.startswith("cuda")):
        return
    capacity = cuda_device_memory()
    if capacity is None:
        return
    from allocation import place
    from allocation.memory import ModelShape, TrainSettings, plan_memory, refusal_message

    try:
        shape = ModelShape.load(cfg.model.path)
    except ValueError:
        return  # not a decoder config the planner knows: nothing to say
    settings = TrainSettings.from_config(cfg, sglang=gen.backend == "sglang")
    from launcher.plan import aux_shapes

    placement = place(alloc)
    plan = plan_memory(placement, shape, settings, capacity, aux_shapes=aux_shapes(cfg, placement))
    if not plan.fits:
        raise RunError(refusal_message(plan))


RUN_LOCK = ".lock"
_run_lock_fd: int | None = None  # held open (and locked) until this process exits


def _lock_run_dir(run_dir: str) -> None:
    """`flock(LOCK_EX|LOCK_NB)` on `<run_dir>/.lock` for the launcher's life (issue 24): a second `launcher
    run` on the same run dir would rewrite config.json (a new admin key: the first learner gets 401), start
    a second Redis on the same AOF and mix summary.json. The kernel drops the lock when the process exits,
    however it exits (SIGKILL included), so a stale lock file never blocks a re-run; the fd is not
    inherited by the roles (PEP 446), so an orphaned role cannot hold it either. The holder's pid is
    written into the file for the refusal message. `launcher status/stop/report/replay` never take it."""
    import fcntl

    global _run_lock_fd
    path = os.path.join(run_dir, RUN_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunError(f"run directory {run_dir} is in use by another `launcher run` (pid {holder}, lock {path}); "
                       f"wait for it to end or stop it with `launcher stop --run-dir {run_dir}`, or pass another "
                       "--run-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _run_lock_fd = fd


def _local_table(run_dir: str, alloc, cfg) -> ProcessTable:
    from allocation import place

    from areal_like.api.config import cpu_sets

    # one node with exactly the devices the allocation needs; roles pinned by launcher.cpu_affinity
    return ProcessTable(run_dir, plan=place(alloc), cpu_affinity=cpu_sets(cfg.launcher, colocated=alloc.colocated))


class Run:
    def __init__(self, cfg, alloc, run_dir: str, n_servers: int):
        self.cfg, self.alloc, self.run_dir, self.n_servers = cfg, alloc, run_dir, n_servers
        self.procs = _local_table(run_dir, alloc, cfg)  # `--backend ray`: replaced by `_place_on_ray` in execute()
        self.redis = None
        self.redis_exporter = None
        self._file_sd_path: str | None = None  # <metrics.file_sd_dir>/<run>.targets.json while the run lives
        self._redis_url: str | None = None
        self._buffer = None  # read-only view for the progress line
        self._incarnation = 0
        self._server_devices: list[int] | None = None  # devices per server in the weight-update group
        self._colocated_gpus: tuple[list, list] | None = None  # co-located SGLang: (server_gpus, learner_gpus)
        self._learner_device = "cpu"
        self._stop_reason: str | None = None
        from areal_like.buffer.scripts import REWARD_FAILURE_KINDS

        self._reward_failures: dict[str, int] = dict.fromkeys(REWARD_FAILURE_KINDS, 0)  # run totals, from Redis
        self._reward_failures_shown: set[str] = set()  # kinds whose first failure was printed
        self._buffer_stats: dict = {}  # buffer counters last read (added, duplicates, dropped, …)
        self._gate = None  # frees a dead rollout worker's slots before it restarts
        self._t0 = time.monotonic()
        # Supervision (issue 11): every restart, in order — summary.json's `restarts`
        self._restarts: list[dict] = []
        self._restarting: dict[str, tuple] = {}  # restarted servers still loading: name → (role, url, deadline)

    # ---- phases -------------------------------------------------------------------------------
    @property
    def plan(self):
        return self.procs.plan

    def _place_on_ray(self) -> None:
        """`--backend ray`: connect (or start a local cluster), place the allocation on its nodes, reserve
        one placement group per node and check every node sees the run directory."""
        from allocation import AllocationError, place

        from launcher.ray_procs import RayBackendError, RayProcessTable, cluster_nodes, connect

        rc = self.cfg.launcher.ray
        log = lambda msg: print(f"[launcher] {msg}", flush=True)  # noqa: E731
        try:
            critic = critic_component(self.alloc)
            roles = (self.n_servers + self.alloc.training.world_size + self.cfg.rollout.workers
                     + (critic.world_size if critic is not None else 0)
                     + sum(c.num_servers for c in (aux_component(self.alloc, r) for r in AUX_ROLES) if c is not None))
            connect(rc.address, devices_needed=self.alloc.total_devices, roles_needed=roles,
                              device_resource=rc.device_resource,
                              cpu_run=self.cfg.server.device == "cpu" and self.alloc.generation.backend == "embedded",
                              log=log)
            nodes = cluster_nodes(rc.device_resource)
            if not nodes:
                raise RayBackendError(f"no alive Ray node declares the device resource {rc.device_resource!r} "
                                      "(launcher.ray.device_resource): start the nodes with --num-gpus (or "
                                      f"--resources '{{\"{rc.device_resource}\": N}}')")
            per_node = min(int(n["Resources"][rc.device_resource]) for n in nodes)
            try:
                plan = place(self.alloc, nodes=len(nodes), devices_per_node=per_node)
            except AllocationError as e:
                raise RayBackendError(f"allocation {self.cfg.allocation!r} does not fit the Ray cluster "
                                      f"({len(nodes)} node(s) × {per_node} {rc.device_resource}):\n{e}") from None
            table = RayProcessTable(self.run_dir, plan, nodes, n_rollouts=self.cfg.rollout.workers,
                                    device_resource=rc.device_resource, placement_timeout_s=rc.placement_timeout_s,
                                    call_timeout_s=rc.call_timeout_s)
            self.procs = table
            table.reserve()
            table.check_shared_run_dir()
        except RayBackendError as e:
            raise RunError(str(e)) from None
        log(f"Ray: {len(nodes)} node(s) × {per_node} {rc.device_resource}; placement groups "
            + ", ".join(f"node {n} → {nodes[n]['NodeID'][:12]} ({nodes[n].get('NodeManagerAddress')})"
                        for n in sorted(table.pgs)))

    def _all_loopback(self) -> bool:
        if self.procs.backend != "ray":
            return True
        from launcher.ray_procs import is_loopback

        return all(is_loopback(n.get("NodeManagerAddress", "")) for n in self.procs.nodes)

    def _start_redis(self) -> str:
        if self.cfg.buffer.redis_url:
            return self.cfg.buffer.redis_url
        from areal_like.buffer.redis_server import RedisServer

        host = "127.0.0.1"
        if self.procs.backend == "ray":  # on the driver's (head) node, reachable from the others
            import ray

            host = ray.util.get_node_ip_address()
        self.redis = RedisServer(os.path.join(self.run_dir, "redis"), host=host)
        self.redis.start()
        self.procs.add_service("redis", self.redis.pid)
        print(f"[launcher] redis-server pid {self.redis.pid} on {host}:{self.redis.port} (AOF on)", flush=True)
        self._start_redis_exporter()
        return self.redis.url

    def _start_redis_exporter(self) -> None:
        """metrics.redis_exporter: the run's Redis metrics served by the launcher itself (a thread, not a
        process): INFO on our own Redis only, at /metrics only — no `/scrape?target=`, so no local user
        can make it send the password elsewhere (issue 24)."""
        from areal_like.metrics.redis_info import RedisMetricsEndpoint

        if self.cfg.metrics.redis_exporter is False or not self.cfg.metrics.prometheus:
            return
        # the launcher's node address: 127.0.0.1 locally, the head node's under Ray (where Redis is)
        endpoint = RedisMetricsEndpoint(self.redis.host, self.redis.port, self.redis.password, host=self.redis.host)
        try:
            endpoint.start()
        except OSError as e:
            raise RunError(f"metrics.redis_exporter: cannot serve the Redis metrics on {self.redis.host} ({e}); "
                           "set metrics.redis_exporter=false to run without the dashboard's Redis panels") from None
        self.redis_exporter = endpoint
        print(f"[launcher] Redis metrics at http://{endpoint.address}/metrics", flush=True)

    def _child_env(self, redis_url: str) -> dict[str, str]:
        env = dict(os.environ)
        env["AREAL_LIKE_REDIS_URL"] = redis_url  # the password travels in the environment, not in files
        lc = self.cfg.launcher
        if lc.gloo_socket_ifname:
            env["GLOO_SOCKET_IFNAME"] = lc.gloo_socket_ifname
        elif self._all_loopback():
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        if lc.nccl_socket_ifname:
            env["NCCL_SOCKET_IFNAME"] = lc.nccl_socket_ifname
        env["PYTHONUNBUFFERED"] = "1"
        # Each role is one process on a shared CPU: keep torch from oversubscribing the cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        return env

    def _server_env(self, env: dict[str, str]) -> dict[str, str]:
        """A generation server's environment: the roles' less every Redis secret — it never uses Redis, so
        neither the run's URL (with its password) nor buffer.password_env's variable nor any REDIS_*
        variable of the user's shell reaches it (issue 24: /proc/<pid>/environ of a process is one more
        place a password can leak from, e.g. through a server's crash dump or a debugger)."""
        drop = {"AREAL_LIKE_REDIS_URL", "AREAL_LIKE_REDIS_PASSWORD", self.cfg.buffer.password_env or ""}
        return {k: v for k, v in env.items() if k not in drop and "REDIS" not in k.upper()}

    def _role_env(self, name: str, devices: bool = True) -> dict[str, str]:
        """What differs per role: its devices (CUDA_VISIBLE_DEVICES from the plan) and, under Ray, the
        address its own listeners (/metrics) bind to."""
        env = dict(self.procs.device_env(name)) if devices else {}
        if self.procs.backend == "ray":
            from areal_like.metrics import BIND_HOST_ENV

            env[BIND_HOST_ENV] = self.procs.host(name)
        return env

    def _start_sglang_servers(self, env, while_loading: Callable[[], None]) -> list[str]:
        """Real SGLang, one server per generation DP replica, on the GPUs the plan gives it."""
        from areal_like.engine.sglang_args import (SGLangNotInstalled, build_sglang_servers, delta_loader_dir,
                                                   sglang_server_flags)

        cfg, plan = self.cfg, self.plan
        names = [f"server{i}" for i in range(self.n_servers)]
        ports = [cfg.server.base_port + i if cfg.server.base_port else self.procs.free_port(n) for i, n in enumerate(names)]
        ray = self.procs.backend == "ray"
        node_hosts = self._sglang_node_hosts(names)
        try:  # SGLang's own parser, read by server.python (the launcher never imports sglang)
            flags = sglang_server_flags(cfg.server.python)
        except SGLangNotInstalled as e:
            raise RunError(str(e)) from None
        servers = build_sglang_servers(plan, model_path=cfg.model.path, ports=ports, seeds=cfg.seed,
                                       api_key=cfg.server.api_key, admin_api_key=cfg.server.admin_api_key,
                                       host=None if ray else cfg.server.host, node_hosts=node_hosts,
                                       supported_flags=flags, enable_metrics=cfg.metrics.prometheus,
                                       python=_server_python(cfg),
                                       weight_update=cfg.resolved_weights_mode(), dtype=cfg.server.dtype,
                                       memory_saver=self.alloc.colocated and cfg.colocate.release_memory,
                                       fp32_lm_head=cfg.model.fp32_lm_head,
                                       mem_fraction_static=cfg.server.mem_fraction_static,
                                       lora_rank=cfg.model.lora_rank, lora_targets=lora_target_modules(
                                           cfg.model.target_modules) if cfg.model.lora_rank > 0 else (),
                                       delta_loader=delta_loader_dir(self.run_dir) if cfg.weights.sync == "delta"
                                       else None,
                                       return_routed_experts=cfg.train.routing_replay == "rollout",
                                       # the workflows' limit, also SGLang's (else it takes the model's)
                                       extra_args=["--context-length", str(cfg.resolved_max_context_len())],
                                       # the keys: a 0600 --config file in the 0700 run dir, never argv (issue 24)
                                       secrets_file=os.path.join(self.run_dir, "sglang-secrets.yaml"))
        roles = self._start_sglang_processes(servers, [f"server{srv.index}" for srv in servers], env)
        self._server_devices = [srv.devices for srv in servers]
        if self.alloc.colocated:  # each learner rank hands its own GPU's weights to the server there
            self._colocated_gpus = colocated_gpus(plan)
        self._learner_device = "cuda:0"  # each rank's CUDA_VISIBLE_DEVICES holds its plan device alone
        while_loading()
        for srv, role in zip(servers, roles):
            # Model load and CUDA-graph capture take minutes on real models.
            _wait_health(srv.url, max(cfg.server.health_timeout_s, 900.0), role, f"sglang server {srv.index}")
        if cfg.model.lora_rank > 0:
            # Every request names the run's adapter, which SGLang refuses ("never been loaded") until the
            # learner's first push loads it, and SGLang has no start-paused flag: pause them now — paused,
            # SGLang holds new requests before it resolves their adapter; that push continues them.
            for srv in servers:
                self._pause_server(srv.url)
            print(f"[launcher] {len(servers)} SGLang server(s) paused until the learner's first push loads the "
                  f"LoRA adapter", flush=True)
        return [srv.url for srv in servers]

    def _start_embedded_server(self, name: str, model_path: str, *, seed: int, env, port: int | None,
                               aux: str | None = None):
        """One embedded engine server (`server<i>` serving the policy, or — `aux` judge or teacher — `judge<i>` /
        `teacher<i>` serving judge.model_path / teacher.model_path, which the learner never updates: no LoRA,
        no weight group) → (url, role)."""
        fixed = aux is not None  # a judge's or teacher's fixed model: no LoRA, no fp32 head, its own limits
        cfg, sv = self.cfg, self.cfg.server
        port = port or self.procs.free_port(name)
        host = self.procs.host(name) if self.procs.backend == "ray" else sv.host
        cuda = sv.device.startswith("cuda")
        argv = [sys.executable, "-m", "areal_like.engine.server", "--model-path", model_path,
                "--host", host, "--port", str(port),
                # on CUDA its CUDA_VISIBLE_DEVICES holds the plan's device for it: cuda:0 inside
                "--device", "cuda:0" if cuda else sv.device,
                "--dtype", sv.dtype, "--max-batch-size", str(sv.max_batch_size),
                # a teacher scores the policy's own sequences: the policy's limit
                "--max-context-len", str(cfg.judge.max_context_len if aux == "judge" else cfg.resolved_max_context_len()),
                "--weight-version", "0", "--random-seed", str(seed), "--torch-threads", str(sv.torch_threads),
                # its side of a weight group times out as the learner's does: a server left inside a
                # gloo collective whose peer died is free for the re-sync after weights.timeout_s
                "--weight-sync-timeout-s", str(cfg.weights.timeout_s)]
        if not cfg.metrics.prometheus:
            argv.append("--disable-metrics")
        if cfg.model.fp32_lm_head and not fixed:
            argv.append("--enable-fp32-lm-head")
        if cfg.train.routing_replay == "rollout" and not fixed:  # MoE: each position's routed experts, recorded
            argv.append("--enable-return-routed-experts")
        if cfg.model.lora_rank > 0 and not fixed:
            # runtime LoRA: the run's adapter (each push replaces it) plus the one a push is swapping
            # in while requests that started on the old one still run
            argv += ["--enable-lora", "--max-lora-rank", str(cfg.model.lora_rank), "--lora-target-modules",
                     *lora_target_modules(cfg.model.target_modules), "--max-loras-per-batch", "2",
                     "--max-loaded-loras", "2",
                     # every request names the run's adapter: held until the learner's first push loaded it
                     "--start-paused"]
        argv += ["--max-n", str(sv.max_n), "--max-request-bytes", str(int(sv.max_request_mb * 2**20))]
        for flag, value in (("--max-new-tokens-limit", sv.max_new_tokens_limit),
                            ("--max-prompt-len", None if fixed else sv.max_prompt_len),
                            ("--max-queued-tokens", sv.max_queued_tokens)):
            if value is not None:
                argv += [flag, str(value)]
        # Keys travel in the environment, not argv (/proc/<pid>/cmdline is readable by every user).
        server_env = {**env, **self._role_env(name), "AREAL_LIKE_API_KEY": sv.api_key or "",
                      "AREAL_LIKE_ADMIN_API_KEY": sv.admin_api_key or ""}
        role = self.procs.start(name, argv, server_env)
        return f"http://{url_host(reach_host(host))}:{port}", role

    def _start_aux(self, env) -> dict[str, list]:
        """The judge and teacher components' servers (`judge<i>` / `teacher<i>`, their model_path): started
        before the generation servers, so they load meanwhile; `_wait_aux` waits for them."""
        out: dict[str, list] = {}
        for r in AUX_ROLES:
            comp = aux_component(self.alloc, r)
            if comp is None:
                continue
            path = getattr(self.cfg, r).model_path
            if comp.backend == "sglang":
                out[r] = self._start_sglang_aux(comp, path, env)
            else:
                out[r] = [self._start_embedded_server(f"{r}{i}", path, seed=self.cfg.seed + i, env=env, port=None,
                                                      aux=r) for i in range(comp.num_servers)]
        return out

    def _start_sglang_aux(self, comp, model_path: str, env) -> list:
        """A judge's or teacher's SGLang servers (`sglang[judge]:d2t2`): `model_path` served as it is — no weight
        group, no LoRA, no delta loader (nothing is ever pushed to them), SGLang's own dtype for the model; the
        keys in a 0600 `--config` file of their own, as the rollout servers'. → [(url, role)]."""
        from areal_like.engine.sglang_args import SGLangArgsError, SGLangNotInstalled, build_sglang_servers, sglang_server_flags

        cfg, r = self.cfg, comp.role
        names = [f"{r}{i}" for i in range(comp.num_servers)]
        ray = self.procs.backend == "ray"
        node_hosts = self._sglang_node_hosts(names)
        try:
            servers = build_sglang_servers(
                self.plan, component=comp.name, model_path=model_path, ports=[self.procs.free_port(n) for n in names],
                seeds=cfg.seed, api_key=cfg.server.api_key, host=None if ray else cfg.server.host,
                node_hosts=node_hosts, supported_flags=sglang_server_flags(cfg.server.python),
                enable_metrics=cfg.metrics.prometheus, python=_server_python(cfg), weight_update=None,
                mem_fraction_static=cfg.server.mem_fraction_static,
                # a judge reads its grading prompts (judge.max_context_len); a teacher scores the policy's sequences
                extra_args=["--context-length", str(cfg.judge.max_context_len if r == "judge"
                                                    else cfg.resolved_max_context_len())],
                secrets_file=os.path.join(self.run_dir, f"sglang-secrets-{r}.yaml"))
        except (SGLangArgsError, SGLangNotInstalled) as e:
            raise RunError(f"{comp.backend}[{comp.name}]: {e}") from None
        return [(srv.url, role) for srv, role in zip(servers, self._start_sglang_processes(servers, names, env))]

    def _sglang_node_hosts(self, names: list[str]) -> list[str]:
        """Each plan node's address for SGLang servers `names`: locally the address they bind (server.host;
        loopback for a wildcard), which their URLs and the health probe use; under Ray each node's address, as its
        servers' actors report it."""
        if self.procs.backend != "ray":
            return [reach_host(self.cfg.server.host)] * self.plan.nodes
        by_node = {self.procs.placement(n)["node"]: self.procs.host(n) for n in names}
        return [by_node.get(k, "127.0.0.1") for k in range(self.plan.nodes)]

    def _start_sglang_processes(self, servers, names: list[str], env) -> list:
        """Start each SGLang server (one process, on one node) as role `names[i]`, its keys written to its 0600
        --config file first; → the roles."""
        ray = self.procs.backend == "ray"
        roles = []
        for srv, name in zip(servers, names):
            if srv.nnodes > 1:
                raise RunError(f"{name}: SGLang server {srv.index} spans {srv.nnodes} nodes: a server's t×p devices must "
                               "fit on one node (use a smaller t×p, or nodes with more devices)")
            (proc,) = srv.processes
            argv = list(proc.argv)
            if ray:  # its CUDA_VISIBLE_DEVICES holds exactly its devices: they start at 0
                argv[argv.index("--base-gpu-id") + 1] = "0"
            # Local: --base-gpu-id picks its first device, all visible. Ray: only its own are visible.
            proc.write_secrets()
            roles.append(self.procs.start(name, argv, {**env, **proc.env, **self._role_env(name, devices=ray)}))
        return roles

    def _wait_aux(self, started: dict[str, list]) -> dict[str, list[str]]:
        for r, servers in started.items():
            comp = aux_component(self.alloc, r)
            # SGLang: model load and CUDA-graph capture take minutes on real models (as the rollout servers)
            timeout = self.cfg.server.health_timeout_s if comp.backend != "sglang" else max(
                self.cfg.server.health_timeout_s, 900.0)
            for i, (url, role) in enumerate(servers):
                _wait_health(url, timeout, role, f"{r} server {i}")
            print(f"[launcher] {len(servers)} {r} server(s) healthy ({getattr(self.cfg, r).model_path}): "
                  f"{' '.join(u for u, _ in servers)}", flush=True)
        return {r: [u for u, _ in servers] for r, servers in started.items()}

    def _start_servers(self, env, while_loading: Callable[[], None]) -> list[str]:
        """Start the generation servers, call `while_loading` once their processes run (the learner pool
        starts then: its model load overlaps theirs), wait until every one is healthy; their URLs."""
        cfg = self.cfg
        if self.alloc.generation.backend == "sglang":
            return self._start_sglang_servers(env, while_loading)
        urls, roles = [], []
        cuda = cfg.server.device.startswith("cuda")
        for i in range(self.n_servers):
            url, role = self._start_embedded_server(f"server{i}", cfg.model.path, seed=cfg.seed + i, env=env,
                                                    port=cfg.server.base_port + i if cfg.server.base_port else None)
            urls.append(url)
            roles.append(role)
        if cuda:
            self._learner_device = "cuda:0"  # the learner trains on its own plan devices too
        while_loading()
        for i, (url, role) in enumerate(zip(urls, roles)):
            _wait_health(url, cfg.server.health_timeout_s, role, f"generation server {i}")
        print(f"[launcher] {len(urls)} generation server(s) healthy: {' '.join(urls)}", flush=True)
        return urls

    def execute(self) -> int:
        t0 = self._t0 = time.monotonic()
        self._launch = secrets.token_hex(8)  # endpoints.json names it: the learner waits for this launch's file
        rc = 1
        self._rows_before = len(read_metrics(os.path.join(self.run_dir, "metrics.jsonl")))  # a resumed run appends
        self._trained_log_before = _file_size(os.path.join(self.run_dir, "trained.jsonl"))  # see _learner_started
        prev_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.cfg.launcher.backend == "ray":
                self._place_on_ray()
            if not self.cfg.server.admin_api_key:  # only the learner (it reads config.json) may update weights
                # hex: a urlsafe key starting with "-" (1 in 64) is no value to SGLang's argument parser
                self.cfg.server.admin_api_key = secrets.token_hex(32)
            # server.dtype=auto resolved once: the servers load in it and the learner's pushes cast to it
            self.cfg.server.dtype = self.cfg.resolved_server_dtype(sglang=self.alloc.generation.backend == "sglang")
            # rollout.max_concurrent_groups=null: scaled to the servers' capacity, written into config.json
            self.cfg.rollout.max_concurrent_groups = self.cfg.resolved_max_concurrent_groups(
                num_servers=self.n_servers, sglang=self.alloc.generation.backend == "sglang")
            # config.json holds the keys: owner-only, like the Redis password kept out of the run dir
            fd = os.open(os.path.join(self.run_dir, "config.json"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)
            with open(fd, "wb") as f:
                from areal_like.api.config import encode_config

                f.write(encode_config(self.cfg))
            if self.cfg.launcher.forkserver and self.procs.backend == "local":
                # it imports while Redis starts; its environment is the servers' (no Redis secret): it is
                # what /proc/<pid>/environ shows of every role forked from it
                self.procs.open_forkserver(self._server_env(self._child_env("")))
            redis_url = self._redis_url = self._start_redis()
            env = self._child_env(redis_url)
            sglang = self.alloc.generation.backend == "sglang"
            # metrics.prometheus=false: no role gets a metrics port (none serves /metrics).
            prom = self.cfg.metrics.prometheus
            learner_metrics = self.procs.free_port("learner") if prom else None
            rollout_ports = [self.procs.free_port(f"rollout{k}") if prom else None for k in range(self.cfg.rollout.workers)]
            self._learner_env = env
            self._learner_metrics_port = learner_metrics

            def while_loading() -> None:
                # The learner pool and the rollout workers start while the servers load: the pool builds
                # its models and resumes, the workers import and read their data; learner rank 0 and the
                # workers then wait for endpoints.json, written once every server is healthy.
                self._start_learners(incarnation=0)
                for k in range(self.cfg.rollout.workers):
                    port_arg = ["--metrics-port", str(rollout_ports[k])] if rollout_ports[k] else []
                    self.procs.start(f"rollout{k}", [sys.executable, "-m", "areal_like.rollout.worker", "--run-dir",
                                                     self.run_dir, "--index", str(k), "--launch", self._launch,
                                                     *port_arg], {**env, **self._role_env(f"rollout{k}")})

            aux = self._start_aux(self._server_env(env))
            urls = self._server_urls = self._start_servers(self._server_env(env),  # no Redis secret
                                                           while_loading=while_loading)
            aux_urls = self._wait_aux(aux)
            endpoints = Endpoints(
                servers=urls, judge_servers=aux_urls.get("judge", []), teacher_servers=aux_urls.get("teacher", []),
                metrics_ports={"learner": learner_metrics, **{f"rollout{k}": p for k, p in enumerate(rollout_ports)}}
                if prom else {},
                # NCCL between GPU processes for SGLang; gloo for the embedded engine (CPU tensors)
                weight_backend="nccl" if sglang else "gloo",
                server_devices=self._server_devices, learner_device=self._learner_device,
                server_gpus=self._colocated_gpus[0] if self._colocated_gpus else None,
                learner_gpus=self._colocated_gpus[1] if self._colocated_gpus else None,
                learner_host=self.procs.host("learner"), launch=self._launch)
            endpoints.dump(self.run_dir)
            self._write_prometheus_targets(urls, endpoints.metrics_ports, aux_urls)
            rc = self._supervise(t0)
        except RunError as e:
            print(f"launcher run: {e}", file=sys.stderr, flush=True)
            rc = 1
        except KeyboardInterrupt:
            self._stop_reason = self._stop_reason or "interrupted"
            rc = 130
        finally:
            self._final_reward_failures()
            generation = self._scrape_generation(t0)  # before the servers end
            self._shutdown()
            for s, h in prev_handlers.items():
                signal.signal(s, h)
            rows = read_metrics(os.path.join(self.run_dir, "metrics.jsonl"))
            summary = summarize(rows, self.cfg.rollout.max_staleness, time.monotonic() - t0,
                                new_rows=rows[self._rows_before:])
            summary["exit_reason"] = self._stop_reason or ("completed" if rc == 0 else "failed")
            t = self.cfg.train
            if (rc == 0 and not self._stop_reason and rows and rows[-1]["step"] < t.total_steps
                    and reward_reached([r["reward_mean"] for r in rows[self._rows_before:]  # the last learner's
                                        if r.get("incarnation") == rows[-1].get("incarnation")],  # own window
                                       t.stop_reward, t.stop_reward_window) is not None):
                summary["exit_reason"] = "reward_reached"  # the learner ended the run early (train.stop_reward)
            summary["reward_failures"] = dict(self._reward_failures)
            summary["buffer"] = dict(self._buffer_stats)  # over the run dir's whole life (Redis AOF)
            summary["restarts"] = list(self._restarts)
            summary["restart_counts"] = {kind: self._restart_count(kind) for kind in RESTART_KINDS}
            summary["generation"] = generation
            # A start that failed before its learner resumed (preflight, an unusable checkpoint, …) must not
            # replace the previous launch's summary.json and report (issue 24): it trained nothing, and the
            # run dir's files keep describing the run they came from. Its own summary goes beside them.
            summary_path = os.path.join(self.run_dir, "summary.json")
            keep_previous = os.path.exists(summary_path) and not self._learner_started()
            if keep_previous:
                summary_path = os.path.join(self.run_dir, FAILED_START_SUMMARY)
            with open(summary_path, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"[launcher] {summary['exit_reason']}: {json.dumps(summary)}", flush=True)
            if keep_previous:
                print(f"[launcher] this start failed before the learner resumed: the previous summary.json and "
                      f"report of {self.run_dir} are kept unchanged; this attempt's summary: {summary_path}",
                      file=sys.stderr, flush=True)
            elif self.cfg.metrics.report:
                try:  # plots of the run, finished or cut off (`launcher report` makes it again at any time)
                    from areal_like.metrics.report import write_report

                    print(f"[launcher] report: {write_report(self.run_dir)}", flush=True)
                except Exception as e:  # noqa: BLE001 — a report must not change the run's exit code
                    print(f"[launcher] report not written: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            print(f"[launcher] run directory: {self.run_dir}", flush=True)
        return rc

    def _learner_started(self) -> bool:
        """Whether a learner of this launch got past its resume (checkpoint loaded, buffer recovered): it
        then appends a `start` event to trained.jsonl."""
        try:
            with open(os.path.join(self.run_dir, "trained.jsonl"), "rb") as f:
                f.seek(self._trained_log_before)
                return any(b'"event":"start"' in ln.replace(b" ", b"") for ln in f)
        except OSError:
            return False

    def _start_learners(self, incarnation: int) -> None:
        """The learner pool: WORLD_SIZE ranks with the usual torch.distributed environment."""
        world = self.alloc.training.world_size
        env = dict(self._learner_env)
        sender_env: dict[str, str] = {}  # learner rank 0's alone: it sends the weights
        if self.alloc.generation.backend == "sglang":
            from areal_like.engine.sglang_args import TRAINER_WEIGHT_GROUP_ENV, WEIGHT_SENDER_ENV

            env.update(TRAINER_WEIGHT_GROUP_ENV)
            sender_env = WEIGHT_SENDER_ENV
        # Rank 0's node hosts the process group's store and the weight-update group's (fresh ports per
        # incarnation: a dead rank 0's may linger).
        env.update({"WORLD_SIZE": str(world), "MASTER_ADDR": self.procs.host("learner"),
                    "MASTER_PORT": str(self.procs.free_port("learner"))})
        weight_port = self.procs.free_port("learner")
        critic_link = self._start_critic_pool(incarnation)  # its rank 0's address, for learner rank 0
        on_node: dict[int, int] = {}
        for rank in range(world):
            name = learner_role(rank)
            argv = [sys.executable, "-m", "areal_like.learner.main", "--run-dir", self.run_dir,
                    "--incarnation", str(incarnation), "--weight-sync-port", str(weight_port),
                    "--device", self._learner_device, "--launch", self._launch]
            if rank == 0 and self._learner_metrics_port:
                argv += ["--metrics-port", str(self._learner_metrics_port)]
            if rank == 0 and critic_link:
                argv += ["--critic-link", critic_link]
            node = self.procs.placement(name).get("node", 0)
            local_rank = on_node[node] = on_node.get(node, -1) + 1  # rank among the learner ranks of its node
            self.procs.start(name, argv, {**env, **(sender_env if rank == 0 else {}), **self._role_env(name),
                                          "RANK": str(rank), "LOCAL_RANK": str(local_rank)})
        self._incarnation = incarnation

    def _start_critic_pool(self, incarnation: int) -> str | None:
        """A critic component's pool (learner/critic_pool.py): its own torch.distributed world, rank 0 hosting
        the store the actor's rank 0 reaches it through. Returns that address (HOST:PORT), or None."""
        comp = critic_component(self.alloc)
        if comp is None:
            return None
        from launcher.procs import critic_role

        host = self.procs.host(critic_role(0))
        env = {**self._learner_env, "WORLD_SIZE": str(comp.world_size), "MASTER_ADDR": host,
               "MASTER_PORT": str(self.procs.free_port(critic_role(0)))}
        link_port = self.procs.free_port(critic_role(0))
        on_node: dict[int, int] = {}
        for rank in range(comp.world_size):
            name = critic_role(rank)
            node = self.procs.placement(name).get("node", 0)
            local_rank = on_node[node] = on_node.get(node, -1) + 1
            self.procs.start(name, [sys.executable, "-m", "areal_like.learner.critic_pool", "--run-dir", self.run_dir,
                                    "--incarnation", str(incarnation), "--link-port", str(link_port),
                                    "--device", self._learner_device],
                             {**env, **self._role_env(name), "RANK": str(rank), "LOCAL_RANK": str(local_rank)})
        return f"{host}:{link_port}"

    def _restart_learners(self, dead: Role) -> None:
        self._incarnation += 1
        self._record_restart("learner", dead, "restarting the learner pool" + (" and the critic pool" if critic_component(
            self.alloc) else "") + " from its latest checkpoint")
        self._restart_servers_left_in_a_push()
        for role in [r for r in self.procs.roles if role_kind(r.name) in ("learner", "critic")]:
            self.procs.stop(role, timeout_s=10.0)
            self.procs.forget(role)
        self._start_learners(self._incarnation)

    # ---- supervision: one policy for every role ---------------------------------------------------
    def _restart_count(self, kind: str, name: str | None = None) -> int:
        """Restarts so far of `kind`; with `name`, those its budget counts (`_budget_scope`)."""
        scope = None if name is None else _budget_scope(kind, name)
        return sum(1 for r in self._restarts if r["kind"] == kind and (scope is None or r["budget_scope"] == scope))

    def _budget(self, kind: str) -> int:
        b = self.cfg.launcher.max_restarts
        return {"learner": b.learner, "server": b.server, "rollout": b.rollout, "judge": b.judge, "teacher": b.teacher,
                "redis": b.redis}[kind]

    def _record_restart(self, kind: str, dead: Role | None, what: str, exit_code: int | None = None,
                        notify: bool = True) -> None:
        """summary.json's `restarts` gets one entry; the console gets the reason and the log tail. `notify`:
        count it in Redis now (a restarted server is counted once it is up: `_check_restarting`)."""
        code = dead.proc.returncode if dead is not None else exit_code
        name = dead.name if dead is not None else kind
        entry = {"role": name, "kind": kind, "exit_code": code, "at_s": round(time.monotonic() - self._t0, 2),
                 "restart": self._restart_count(kind, name) + 1, "budget": self._budget(kind),
                 "budget_scope": _budget_scope(kind, name)}
        self._restarts.append(entry)
        tail = f"; last lines of {dead.log_path}:\n{dead.tail(5)}" if dead is not None else ""
        per = f" for {entry['budget_scope']}" if entry["budget_scope"] != kind else ""
        print(f"\n[launcher] {name} exited with code {code}: {what} (restart {entry['restart']} of "
              f"{entry['budget']}{per}, launcher.max_restarts.{kind}){tail}", file=sys.stderr, flush=True)
        if notify:
            self._count_restart(kind)

    def _count_restart(self, kind: str) -> None:
        try:
            self._view().run.count_restart(kind)  # the learner watches restarts:server to re-sync that server
        except Exception as e:  # noqa: BLE001 — the restart itself must go on; the learner also re-syncs on a failed push
            print(f"[launcher] could not count the restart in Redis: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _status_tail(self) -> str:
        """The progress line's end: reward and workflow failures and restarts so far (empty while there are none)."""
        tail = _reward_failures_text(self._reward_failures)
        wf = {k: n for k, n in (self._buffer_stats.get("workflow_failures") or {}).items() if n}
        if wf:
            tail += "  workflow failures: " + ", ".join(f"{k} {n}" for k, n in wf.items())
        if self._restarts:
            tail += "  restarts: " + ", ".join(f"{k} {self._restart_count(k)}" for k in RESTART_KINDS
                                             if self._restart_count(k))
        return tail

    def _view(self):
        """The launcher's read-mostly view of the buffer (progress line, restart counters)."""
        if self._buffer is None:
            from areal_like.buffer.redis_client import RedisEndpoint
            from areal_like.buffer.replay_buffer import ReplayBuffer

            # Short retries: the supervision loop must notice a dead Redis (and restart it), not wait on it.
            b = self.cfg.buffer
            ep = RedisEndpoint(self._redis_url, password_env=b.password_env, socket_timeout_s=b.socket_timeout_s,
                               retries=2, reconnect_timeout_s=2.0)
            self._buffer = ReplayBuffer.from_config(b, url=self._redis_url, endpoint=ep)
        return self._buffer

    def _restart_server(self, dead: Role) -> None:
        """Same port, devices and seed; started paused (the embedded engine's --start-paused), so it serves
        nothing until the learner — told through `restarts:server` once it is up — re-forms the weight
        group with it and pushes the current weights (that push's /continue_generation un-pauses it). Its
        requests failed over meanwhile, and the rollout clients take it back only once it serves the run's
        weight_version (engine/client.py): SGLang has no start-paused flag and answers /health holding the
        base model. The health wait (minutes for SGLang) does not block supervision (issue 40 item 10): the
        loop checks it each tick (`_check_restarting`) while it watches every other role."""
        sglang = self.alloc.generation.backend == "sglang"
        role = self.procs.restart(dead, [] if sglang else ["--start-paused"])
        index = int(dead.name.removeprefix("server"))
        url = self._server_urls[index]
        wait_s = max(self.cfg.server.health_timeout_s, 900.0) if sglang else self.cfg.server.health_timeout_s
        self._restarting[role.name] = (role, url, time.monotonic() + wait_s)
        self._record_restart("server", dead, f"restarting on {url}; paused until the learner re-syncs its weights",
                             notify=False)

    def _restart_aux(self, dead: Role) -> None:
        """A judge or teacher server: same port, devices and seed, serving its model_path again: nothing to
        re-sync (the learner never updates it). Its requests fail over to the pool's other servers meanwhile,
        or wait for it (engine/client.py); a grading past judge.timeout_s counts as a reward failure, a scoring
        past teacher.timeout_s fails its group (the prompt is retried)."""
        kind = role_kind(dead.name)
        self.procs.restart(dead)
        self._record_restart(kind, dead, f"restarted on its port with {kind}.model_path")

    def _restart_servers_left_in_a_push(self) -> None:
        """A learner that died inside an NCCL weight push (its rank 0 marks one in Redis from the pause to
        the end) leaves every server waiting in a broadcast whose sender is gone — for torch's default 30
        minutes on SGLang's side, which no route ends: they are restarted (each counts one restart of its
        own budget) and the new learner re-syncs them. Gloo groups time out on both sides: nothing to do."""
        try:
            push = self._view().run.push_in_flight()
            if push is not None:
                self._view().run.mark_push(None)
        except Exception as e:  # noqa: BLE001 — Redis down: its restart comes first; the servers time out at worst
            print(f"[launcher] could not read the weight push under way: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            return
        if not push or push.get("backend") != "nccl":
            return
        servers = [r for r in self.procs.roles if r.name.startswith("server") and r.proc.poll() is None]
        print(f"[launcher] the learner died inside the NCCL push of version {push.get('version')}: restarting "
              f"{len(servers)} server(s) left waiting in its broadcast", file=sys.stderr, flush=True)
        for role in servers:
            self.procs.stop(role, timeout_s=5.0)  # → dead() → restarted within its budget, re-synced

    def _take_restart_requests(self) -> None:
        """The learner's requests (Redis `restart_requests`): a server stuck in an NCCL broadcast after a failed
        push is stopped here; the death path restarts it within its own budget (`_on_death`)."""
        try:
            requests = self._view().run.take_restart_requests()
        except Exception:  # noqa: BLE001 — Redis down: the supervision loop restarts it; asked again later
            return
        for req in requests:
            role = next((r for r in self.procs.roles if r.name == req.get("role")), None)
            if role is None or not role.name.startswith("server") or role.proc.poll() is not None:
                continue
            print(f"\n[launcher] the learner asks for a restart of {role.name}: {req.get('reason')}", file=sys.stderr,
                  flush=True)
            self.procs.stop(role, timeout_s=5.0)

    def _check_restarting(self) -> None:
        """One look at every restarted server still loading: up → (SGLang) paused, then counted in Redis so
        the learner re-syncs it; past its health wait → RunError. One that dies meanwhile is a death like
        any other (`procs.dead()`)."""
        for name, (role, url, deadline) in list(self._restarting.items()):
            if role.proc.poll() is not None:
                del self._restarting[name]
                continue
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    healthy = r.status == 200
            except Exception:  # noqa: BLE001 — still loading
                healthy = False
            if healthy:
                if self.alloc.generation.backend == "sglang":  # before the learner's re-sync
                    try:
                        self._pause_server(url)
                    except Exception as e:  # noqa: BLE001 — still starting up: again next tick, until its deadline
                        if time.monotonic() > deadline:
                            raise RunError(f"restarted generation server {name} at {url} answers /health but cannot "
                                           f"be paused ({type(e).__name__}: {e}); log {role.log_path}") from None
                        continue
                del self._restarting[name]
                self._count_restart("server")
                print(f"[launcher] {name} is up again on {url}; the learner re-syncs its weights", flush=True)
            elif time.monotonic() > deadline:
                raise RunError(f"restarted generation server {name} at {url} not healthy in time (server.health_timeout_s); "
                               f"log {role.log_path}:\n{role.tail()}")

    def _pause_server(self, url: str) -> None:
        req = urllib.request.Request(url + "/pause_generation", data=json.dumps({"mode": "abort"}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {self.cfg.server.admin_api_key}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def _restart_rollout(self, dead: Role) -> None:
        """Its gate slots are freed first (the groups it had in flight never arrive: counted as
        `lost_in_flight`); it resumes at its saved group number and prompt cursor."""
        index = int(dead.name.removeprefix("rollout"))
        if self._gate is None:
            from areal_like.rollout.gate import StalenessGate

            self._gate = StalenessGate.from_config(self.cfg.buffer, max_staleness=self.cfg.rollout.max_staleness,
                                                   batch_size=self.cfg.train.batch_size, url=self._redis_url,
                                                   endpoint=self._view().endpoint)
        lost = self._gate.release_worker(index)
        self.procs.restart(dead)
        self._record_restart("rollout", dead, f"restarted; {lost} group(s) it had in flight counted as lost_in_flight")

    def _restart_redis(self) -> None:
        """Same port, data directory and password: Redis reloads its AOF; every role reconnects."""
        code = self.redis.proc.returncode if self.redis.proc is not None else None
        self.redis.restart()
        self.procs.add_service("redis", self.redis.pid)
        self._record_restart("redis", None, f"redis-server restarted on 127.0.0.1:{self.redis.port} from its AOF",
                             exit_code=code)

    def _on_death(self, role: Role) -> int | object | None:
        """A role ended before the run did: restart it within its budget (None: the table changed),
        `_IGNORED` (a learner rank that finished with rank 0), or the run's exit code (0: done)."""
        rc = role.proc.returncode
        kind = role_kind(role.name) or "rollout"
        if kind == "critic":  # a critic pool's rank: one restart unit with the learner pool, one budget
            if rc == 0:
                return _IGNORED  # told to stop by learner rank 0, which ends the run
            kind = "learner"
        if kind == "learner":
            if role.name != "learner" and rc == 0:
                return _IGNORED  # a non-zero rank finished with rank 0; rank 0's exit ends the run
            if rc == 0:
                return 0
        from areal_like.rollout.worker import EXIT_BAD_DATA, EXIT_REWARD_FAILURES, EXIT_WORKFLOW_FAILURES

        if kind == "rollout" and rc == EXIT_BAD_DATA:  # its data files cannot be used: a restart reads the same
            self._stop_reason = f"{role.name} stopped: its data files cannot be used (data.train_files / data.val_files)"
        elif kind == "rollout" and rc == EXIT_REWARD_FAILURES:  # restarting would fail the same way
            self._stop_reason = f"{role.name} stopped: too many reward failures"
        elif kind == "rollout" and rc == EXIT_WORKFLOW_FAILURES:  # likewise (rollout.max_failure_fraction)
            self._stop_reason = (f"{role.name} stopped: too many groups failed in workflow {self.cfg.rollout.workflow} "
                                 f"(rollout.max_failure_fraction)")
        elif self._restart_count(kind, role.name) < self._budget(kind):
            {"learner": self._restart_learners, "server": self._restart_server, "rollout": self._restart_rollout,
             "judge": self._restart_aux, "teacher": self._restart_aux}[kind](role)
            return None
        else:
            budget = self._budget(kind)
            scope = _budget_scope(kind, role.name)
            self._stop_reason = (f"{role.name} exited with code {rc}"
                                 + (f" after {budget} restart(s)" + (f" of {scope}" if scope != kind else "")
                                    + f" (launcher.max_restarts.{kind}={budget})" if budget else ""))
        print(f"\n[launcher] {self._stop_reason}; last lines of {role.log_path}:\n{role.tail()}",
              file=sys.stderr, flush=True)
        return 1

    def _write_prometheus_targets(self, urls: list[str], ports: dict[str, int],
                                  aux_urls: dict[str, list[str]] | None = None) -> None:
        """file_sd targets for dashboards/prometheus.yml: every role's /metrics (and the Redis exporter's)
        labelled experiment, run, role (server0, learner, rollout0, redis) and kind (server, learner,
        rollout, redis) — the dashboard's variables and every panel's selector use them.

        With metrics.prometheus=false no role serves /metrics: the file holds an empty list."""
        if not self.cfg.metrics.prometheus:
            with open(os.path.join(self.run_dir, "prometheus_targets.json"), "w") as f:
                json.dump([], f)  # and nothing in metrics.file_sd_dir
            print("[launcher] metrics.prometheus=false: no role serves /metrics (prometheus_targets.json is empty)",
                  flush=True)
            return
        run_name = os.path.basename(os.path.abspath(self.run_dir))

        def target(address: str, role: str) -> dict:
            return {"targets": [address], "labels": {"experiment": self.cfg.experiment_name, "run": run_name,
                                                     "role": role, "kind": role_kind(role)}}

        targets = [target(u.split("://", 1)[1], f"server{i}") for i, u in enumerate(urls)]
        for r, aux in (aux_urls or {}).items():  # judge<i>, teacher<i>
            targets += [target(u.split("://", 1)[1], f"{r}{i}") for i, u in enumerate(aux)]
        targets += [target(f"{self.procs.host(name)}:{p}", name) for name, p in ports.items()]
        if self.redis_exporter is not None:
            targets.append(target(self.redis_exporter.address, "redis"))
        text = json.dumps(targets, indent=1)
        with open(os.path.join(self.run_dir, "prometheus_targets.json"), "w") as f:
            f.write(text)
        sd_dir = self.cfg.metrics.file_sd_dir or os.path.dirname(os.path.abspath(self.run_dir))
        try:
            os.makedirs(sd_dir, exist_ok=True)
            path = os.path.join(sd_dir, f"{run_name}.targets.json")
            with open(path + ".tmp", "w") as f:  # Prometheus never reads a half-written file
                f.write(text)
            os.replace(path + ".tmp", path)
        except OSError as e:
            raise RunError(f"metrics.file_sd_dir={sd_dir}: cannot write the Prometheus targets there ({e}); "
                           "set metrics.file_sd_dir to a writable directory") from None
        self._file_sd_path = path

    def _on_signal(self, signum, frame):
        self._stop_reason = f"stopped by {signal.Signals(signum).name}"
        raise KeyboardInterrupt

    def _buffer_depth(self) -> str:
        """The buffer depth for the progress line; also refreshes the reward failure totals and prints
        the first failure of each kind (with its traceback) once."""
        try:
            st = self._view().stats()
            self._buffer_stats = {k: st[k] for k in ("added", "duplicates", "dropped", "stale_kept", "lost_in_flight",
                                                     "lost_after_restart", "depth", "pending",
                                                     "agent_completions_refused", "workflow_failures",
                                                     "dropped_in_flight_at_stop") if k in st}
            self._reward_failures.update(st.get("reward_failures", {}))
            self._show_first_reward_failures()
            return str(st["depth"])
        except Exception as e:  # the progress line must never stop the run
            return f"? ({type(e).__name__})"

    def _show_first_reward_failures(self) -> None:
        new = [k for k, n in self._reward_failures.items() if n and k not in self._reward_failures_shown]
        if not new:
            return
        _, first = self._buffer.run.reward_failure_details()
        for kind in new:
            self._reward_failures_shown.add(kind)
            text = first.get(kind, "(no details recorded)")
            print(f"\n[launcher] first reward failure of kind {kind} (scored 0; counted in summary.json and "
                  f"metrics.jsonl as reward_failures/{kind}; further ones only counted):\n{text}",
                  file=sys.stderr, flush=True)

    def _scrape_generation(self, t0: float) -> dict:
        """summary.json's `generation`, read from /metrics just before the servers end: `busy_seconds`
        (Σ `areal_like_server_busy_seconds_total` over the servers that answered), `busy_fraction` =
        busy_seconds / (servers_scraped × wall seconds since the launcher started), `servers_scraped`, and
        `gate_refusals` (Σ `areal_like_gate_rejections_total` over the rollout workers that answered; the
        counter of a restarted role restarts at 0). null where nothing answered or metrics.prometheus=false
        (SGLang servers export no busy counter: null too)."""
        wall = time.monotonic() - t0
        out = {"busy_seconds": None, "busy_fraction": None, "servers_scraped": 0, "gate_refusals": None,
               "wall_s": round(wall, 3)}
        if not self.cfg.metrics.prometheus:
            return out

        def scrape(url: str, name: str) -> float | None:
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=2.0) as r:
                    text = r.read().decode("utf-8", "replace")
            except Exception:  # noqa: BLE001 — a role that does not answer is skipped
                return None
            vals = [float(line.split()[-1]) for line in text.splitlines()
                    if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{")]
            return sum(vals) if vals else None

        try:  # never in the way of the shutdown that follows
            busy = [b for b in (scrape(u, "areal_like_server_busy_seconds_total")
                                for u in getattr(self, "_server_urls", [])) if b is not None]
            if busy:
                out.update(busy_seconds=round(sum(busy), 3), servers_scraped=len(busy),
                           busy_fraction=round(sum(busy) / (len(busy) * wall), 4) if wall > 0 else None)
            ports = Endpoints.load(self.run_dir).metrics_ports  # FileNotFoundError: it ended before starting roles
            refusals = [scrape(f"http://{self.procs.host(n)}:{p}", "areal_like_gate_rejections_total")
                        for n, p in ports.items() if n.startswith("rollout") and p]
            refusals = [x for x in refusals if x is not None]
            if refusals:
                out["gate_refusals"] = int(sum(refusals))
        except Exception:  # noqa: BLE001
            pass
        return out

    def _final_reward_failures(self) -> None:
        """Before Redis stops: the final totals for summary.json, and any first failure not printed yet."""
        if self._redis_url is None or (self.redis is not None and not self.redis.is_running()):
            return  # no Redis (or ours is dead): keep the last totals read rather than wait for it
        self._buffer_depth()

    def _supervise(self, t0: float) -> int:
        """Watch every role until the run ends; progress: one bar on a terminal, else a plain line
        every 10 s (launcher/progress.py)."""
        from launcher.progress import open_progress

        metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        last_print = last_requests = 0.0
        with open_progress(self.cfg.train.total_steps, t0) as progress:
            while True:
                if self.redis is not None and not self.redis.is_running():
                    if self._restart_count("redis") >= self._budget("redis"):
                        self._stop_reason = (f"redis-server (pid {self.redis.pid}) died after "
                                             f"{self._restart_count('redis')} restart(s) (launcher.max_restarts.redis)")
                        print(f"\n[launcher] {self._stop_reason}; its log: {self.redis.log_path}", file=sys.stderr,
                              flush=True)
                        return 1
                    self._restart_redis()
                self._check_restarting()
                if self._redis_url is not None and time.monotonic() - last_requests >= 1.0:
                    self._take_restart_requests()
                    last_requests = time.monotonic()
                for role in self.procs.dead():
                    self._restarting.pop(role.name, None)
                    rc = self._on_death(role)
                    if rc == 0:
                        progress.finish(read_metrics(metrics_path), self._buffer_depth(), self._status_tail())
                        return 0
                    if rc is _IGNORED:
                        continue
                    if rc is not None:
                        return rc
                    break  # restarted: the table changed, look again
                now = time.monotonic()
                if now - last_print >= progress.interval_s:
                    progress.update(read_metrics(metrics_path), self._buffer_depth(), self._status_tail())
                    last_print = now
                time.sleep(0.2)

    def _shutdown(self) -> None:
        # Rollouts first (no new work), then the learner (it checkpoints and commits), servers, Redis.
        for role in [r for r in self.procs.roles if r.name.startswith("rollout")]:
            self.procs.stop(role, timeout_s=15.0)
        # What the stopped workers counted last (groups dropped in flight, workflow failures) → summary.json
        self._final_reward_failures()
        # Rank 0 first: it tells the other ranks to stop (they would wait for it otherwise), then all
        # ranks checkpoint together; the other ranks normally exit on their own meanwhile.
        ranks = sorted((r for r in self.procs.roles if r.name.startswith("learner")), key=lambda r: r.name != "learner")
        for role in ranks:
            self.procs.stop(role, timeout_s=self.cfg.launcher.stop_timeout_s)
        self.procs.stop_all(timeout_s=15.0)  # servers and anything left
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        self._gate = None  # shares the view's endpoint, closed with it
        if self._file_sd_path is not None:  # Prometheus stops scraping the ended roles
            with contextlib.suppress(OSError):
                os.remove(self._file_sd_path)
            self._file_sd_path = None
        if self.redis_exporter is not None:
            self.redis_exporter.stop()
            self.redis_exporter = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        self.procs.close()  # Ray: this run's actors and placement groups (nothing else on the cluster)


RESTART_KINDS = ("learner", "server", "rollout", "judge", "teacher", "redis")


def _budget_scope(kind: str, name: str) -> str:
    """What one `launcher.max_restarts.<kind>` budget counts: each generation server and each rollout
    worker and each judge or teacher server has its own (`server3`, `rollout0`, `judge1`, `teacher0`); the learner
    pool (all its ranks restart together) and Redis have one for the run."""
    return name if kind in ("server", "rollout", "judge", "teacher") else kind
FAILED_START_SUMMARY = "summary.failed_start.json"  # a failed start's summary when summary.json exists


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


_IGNORED = object()  # `_on_death`: nothing to do


def status_record(run_dir: str) -> dict:
    """`launcher status --json`: every role with its pid, node, devices and (Ray) its ray_node_id, the
    last step and summary.json — from the run directory, so it also answers after the run ended."""
    with open(os.path.join(run_dir, "pids.json")) as f:
        pids = json.load(f)
    placement = pids.get("placement", {})
    launcher_alive = bool(pids.get("launcher")) and process_running(pids["launcher"])
    ended = os.path.exists(os.path.join(run_dir, "summary.json"))
    roles = []
    for name in dict.fromkeys([*pids["roles"], *placement]):
        pid = pids["roles"].get(name)
        where = placement.get(name, {})
        if pids.get("backend", "local") == "local":
            state = "running" if pid and process_running(pid) else "ended"
        else:  # pids on other nodes: the launcher's record is the truth (it ends every role with the run)
            state = "ended" if ended or not launcher_alive else ("running" if pid else "not started")
        roles.append({"name": name, "pid": pid, "state": state, **where})
    out = {"run_dir": os.path.abspath(run_dir), "backend": pids.get("backend", "local"), "launcher_pid": pids.get("launcher"),
           "launcher_running": launcher_alive, "roles": roles}
    if "ray_run_id" in pids:
        out["ray_run_id"] = pids["ray_run_id"]
        out["placement_groups"] = pids.get("placement_groups", [])
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    if rows:
        r = rows[-1]
        out["last_step"] = {"step": r["step"], "version": r["version"], "reward_mean": r["reward_mean"]}
    if ended:
        with open(os.path.join(run_dir, "summary.json")) as f:
            out["summary"] = json.load(f)
    return out


def cmd_status(args) -> int:
    run_dir = args.run_dir
    pids_path = os.path.join(run_dir, "pids.json")
    if not os.path.exists(pids_path):
        print(f"launcher status: {run_dir} has no pids.json: is it a run directory of `launcher run`?", file=sys.stderr)
        return 2
    rec = status_record(run_dir)
    if getattr(args, "json", False):
        print(json.dumps(rec))
        return 0
    print(f"backend {rec['backend']}  launcher pid {rec['launcher_pid']} "
          f"{'running' if rec['launcher_running'] else 'ended'}")
    for r in rec["roles"]:
        devs = ",".join(str(d) for d in r.get("devices", [])) or "-"
        where = f"node {r.get('node', 0)} ({r.get('node_ip', '?')}) devices {devs}"
        if r.get("ray_node_id"):
            where += f" ray node {r['ray_node_id'][:12]}"
        pid = r["pid"] if r["pid"] is not None else 0
        print(f"{r['name']:12s} pid {pid:7d} {where}  {r['state']}")
    if "last_step" in rec:
        r = rec["last_step"]
        print(f"step {r['step']}  version {r['version']}  reward {r['reward_mean']:.3f}")
    if "summary" in rec:
        print("summary:", json.dumps(rec["summary"]))
    return 0


def cmd_stop(args) -> int:
    """Ask the run's launcher to stop (SIGTERM: it ends its roles); if it is gone, end the roles."""
    pids_path = os.path.join(args.run_dir, "pids.json")
    if not os.path.exists(pids_path):
        print(f"launcher stop: {args.run_dir} has no pids.json", file=sys.stderr)
        return 2
    with open(pids_path) as f:
        pids = json.load(f)
    lp = pids.get("launcher")
    if lp and process_running(lp):
        os.kill(lp, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while process_running(lp) and time.monotonic() < deadline:
            time.sleep(0.2)
        return 0
    if pids.get("backend", "local") == "ray":
        # The pids are on the cluster's nodes, not here: Ray ended the run's actors with their driver (the
        # launcher), and each role's watchdog ended its process with its actor.
        print(f"launcher stop: the launcher of {args.run_dir} is gone; under Ray its actors and roles ended with it",
              file=sys.stderr)
        return 0
    for name, pid in pids["roles"].items():
        end_process_group(pid, None, 10.0)  # only ends groups we created (pgid == pid), redis included
    return 0
