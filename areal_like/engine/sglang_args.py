"""`python -m sglang.launch_server` commands for the generation servers of a placement.

Pure argument construction: this module imports neither torch nor sglang and knows nothing of the
rollout client. SGLang lives in its own environment (it pins its own torch, the learner pins
another): ``server.python`` names the interpreter that runs ``sglang.launch_server``, and
`require_sglang` / `sglang_server_flags` ask *that* interpreter (a short subprocess) for the
installed release and for the flags of SGLang's own argument parser. The launcher turns each `SGLangProcess` into
one child process on its node and waits for the server's `/health`.

One generation server per data-parallel replica of the generation allocation (``--dp-size 1``:
SGLang's distributed weight update requires it)::

    Placement.servers[k]  ──►  SGLangServer k
        url            http://<node address>:<port k>
        processes      one per node it spans (node-rank 0 serves HTTP; the others only compute)
            argv       python -m sglang.launch_server --model-path … --tp-size t --pp-size p
                       --base-gpu-id <first local device on that node> --random-seed <seed k> …
            env        NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0 SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false
                       (an overlay on the node's environment)

Decisions (see PROTOCOL.md "Launching real SGLang"):

* **Devices by ``--base-gpu-id``, not ``CUDA_VISIBLE_DEVICES``.** The placement's local device
  index is passed as ``--base-gpu-id`` (tp rank j runs on ``base_gpu_id + j``) and
  ``CUDA_VISIBLE_DEVICES`` is neither set nor cleared: device ids then mean the same thing in the
  server, in colocated trainers on the same node and in the placement table, and a scheduler's own
  binding (Slurm's ``--gres``) still applies, as indexes into what it made visible. Narrowing the
  visibility per server would renumber devices inside each server (slime and SGLang's own RL
  examples use base-gpu-id for the same reason).
* **Servers larger than a node** (``t×p > devices_per_node``) run one process per node with
  ``--nnodes N --node-rank r --dist-init-addr <first node>:<dist port>``; the placement starts such
  a server on a node boundary, and SGLang puts ``t×p / N`` devices on every node, so the server
  must fill whole nodes. SGLang also uses a few ports right after the dist-init port for its
  internal sockets: leave a gap of ≥ 8 between the dist-init ports you pass.
* **``--pp-size > 1`` with distributed weight updates is refused**: upstream
  ``update_weights_from_distributed`` does not support pipeline parallelism. With
  ``weight_update="disk"`` it is allowed.
* **Seeds** are distinct per server (``seed + index`` when one base seed is given), so the
  replicas do not sample the same continuations for the same prompt.
* **Release differences**: ``supported_flags`` (from `sglang_server_flags`) drops
  ``--weight-version`` on releases that lack it (0.4.x: the server then reports ``"default"``)
  and refuses an ``--admin-api-key`` that the release cannot enforce.
* **Supported releases** (`SUPPORTED_SGLANG`): the ones whose request types, routes and weight
  receiver the conformance suite (tests/conformance) checks; `require_sglang` refuses others,
  naming the installed version and the range.
* **Keys in a 0600 file, not argv** (issue 24): ``/proc/<pid>/cmdline`` is readable by every
  local user, so ``server.api_key`` / ``server.admin_api_key`` go into a YAML file (``secrets_file``,
  in the 0700 run directory, mode 0600, written by `write_secrets_file`) that SGLang's own
  ``--config`` reads (`prepare_server_args` → ``ConfigArgumentMerger``: ``api-key: "K"`` becomes
  ``--api-key K`` inside the server, not in its command line);
  argv carries only ``--config <file>``. SGLang reads a single ``--config``, so ``extra_args`` with
  its own ``--config`` are refused while a key is set.
* **``/health`` without generation**: SGLang's ``/health`` generates one token, which waits while
  the server is paused for a weight update (then 503 after ~20 s); the servers run with
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false``, so ``/health`` answers 200 while the HTTP
  server is up, paused or not (the embedded server follows the same rule). Liveness of the
  scheduler is then judged by the requests themselves (the client's timeouts).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from areal_like.api.net import url_host

if TYPE_CHECKING:  # only the shapes are used; the launcher hands a Placement in
    from allocation.placement import Placement, ServerPlacement

SGLANG_MODULE = "sglang.launch_server"

WEIGHT_GROUP_ENV: dict[str, str] = {
    # The weight-sync NCCL group spans the trainer and every server; cuMem-backed buffers and NVLS
    # (NVLink SHARP) break or hang that cross-process group, so both sides turn them off.
    "NCCL_CUMEM_ENABLE": "0",
    "NCCL_NVLS_ENABLE": "0",
}
SERVER_ENV: dict[str, str] = {
    **WEIGHT_GROUP_ENV,
    # /health answers without generating a token, so it answers while paused (see the module doc).
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
}
"""Environment overlay for every ``sglang.launch_server`` process."""
SUPPORTED_SGLANG = (">=0.5.21", "<0.5.24")
"""Releases the conformance suite covers (CI runs 0.5.23, what ``.[sglang]`` resolves to): 0.5.21
made ``ServerArgs`` a msgspec Struct and added ``/begin_weight_update``; the range must match
pyproject.toml's ``sglang`` extra."""
TRAINER_WEIGHT_GROUP_ENV: dict[str, str] = {
    **WEIGHT_GROUP_ENV,
    # Under torchrun, rank 0's TCPStore for the weight group must not be the elastic agent's store.
    "TORCHELASTIC_USE_AGENT_STORE": "False",
}
"""Environment overlay for the learner processes (rank 0 joins the weight group)."""
WEIGHT_SENDER_ENV: dict[str, str] = {
    # torch reads it when each NCCL process group is built; its default, 3 (SkipCleanUp), makes the watchdog
    # tear the whole process down when a collective times out or fails. 2 (CleanUpOnly) aborts the group's
    # communicators and raises in the caller instead: a weight broadcast whose server answered early or died
    # ends in a WeightPushError the learner recovers from (re-formed group, restarted server), not in a dead
    # learner. Rank 0 alone sends weights; the other ranks keep torch's default.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}
"""Environment overlay for learner rank 0 of an NCCL (SGLang) run: the weight group's sender."""

SECRET_FLAGS = frozenset({"--api-key", "--admin-api-key"})
"""Flags whose values are secrets: never put in argv (see `secret_config`); redacted by `redact_argv`."""
_SECRET_KEYS = {"--api-key": ("api-key", "server.api_key"),
                "--admin-api-key": ("admin-api-key", "server.admin_api_key")}
"""flag -> (its key in SGLang's --config YAML; the launcher's config key). The YAML key is the flag's
spelling without ``--``: ``ConfigArgumentMerger`` turns ``key: v`` into ``--key v`` verbatim, so the
dest spelling (``api_key``) is an unknown flag to 0.5.23's parser (the conformance suite checks this)."""

# Runtime LoRA (`model.lora_rank` > 0): adapters loaded and unloaded through /load_lora_adapter,
# /load_lora_adapter_from_tensors and /unload_lora_adapter while the server runs.
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch",
              "--max-loaded-loras")

# `weights.sync=delta`: SGLang applies a delta with the project's loader (weights/sglang_delta.py `LOADER`; this
# module imports no torch, so the path is spelled here), imported through a directory on its PYTHONPATH that
# holds the package alone (`delta_loader_dir`).
DELTA_LOADER = "areal_like.weights.sglang_delta.load_delta"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def delta_loader_dir(parent: str) -> str:
    """A directory under `parent` holding one entry, `areal_like` (a link to this package), for an SGLang server's
    PYTHONPATH: SGLang imports the delta loader from it and sees nothing else of the learner's environment
    (a non-editable install's whole site-packages on its path would shadow SGLang's own torch)."""
    d = os.path.join(parent, "sglang_pythonpath")
    os.makedirs(d, exist_ok=True)
    link = os.path.join(d, "areal_like")
    if os.path.realpath(link) != os.path.realpath(_PACKAGE_DIR):
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(_PACKAGE_DIR, link)
    return d

WeightUpdate = Literal["distributed", "disk", "memory"]


class SGLangArgsError(ValueError):
    """The plan cannot be launched as SGLang servers; the message says which setting to change."""


class SGLangNotInstalled(RuntimeError):
    """``server.python`` cannot run sglang (absent, unsupported release, or the interpreter fails)."""


@dataclass(frozen=True)
class SGLangProcess:
    """One ``sglang.launch_server`` process: a whole server, or one node's share of a larger one."""

    node: int
    node_rank: int
    argv: tuple[str, ...]
    env: dict[str, str]
    """Variables to add to the node's environment (not a full environment)."""
    secrets_file: str | None = None
    """The ``--config`` YAML file in argv, which must hold `secrets` (`write_secrets_file`) before start."""
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    """SGLang settings that must not appear in argv (``api-key``, ``admin-api-key``), by flag name."""

    def write_secrets(self) -> None:
        """Write `secrets` to `secrets_file` (mode 0600); nothing when the process has none."""
        if self.secrets_file is not None:
            write_secrets_file(self.secrets_file, self.secrets)

    def shell(self, *, redact: bool = True) -> str:
        """The command line as a shell string; API keys shown as ``***`` unless ``redact=False``."""
        return shlex.join(redact_argv(self.argv) if redact else self.argv)


@dataclass(frozen=True)
class SGLangServer:
    """One generation server (one data-parallel replica) and how to start it."""

    index: int
    url: str
    host: str
    """The address the HTTP server binds to (``--host``)."""
    port: int
    tp: int
    pp: int
    seed: int
    processes: tuple[SGLangProcess, ...]
    """One per node the server spans; ``processes[0]`` (node-rank 0) serves HTTP."""

    @property
    def node(self) -> int:
        return self.processes[0].node

    @property
    def devices(self) -> int:
        """Devices of this server, t×p: its share of the weight-update group."""
        return self.tp * self.pp

    @property
    def nnodes(self) -> int:
        return len(self.processes)


# ------------------------------------------------------------------------------------- building
def build_sglang_servers(
    placement: Placement,
    *,
    model_path: str,
    ports: Sequence[int],
    seeds: int | Sequence[int],
    api_key: str | None = None,
    admin_api_key: str | None = None,
    enable_metrics: bool = True,
    node_hosts: Sequence[str] | None = None,
    host: str | None = None,
    dist_init_ports: Sequence[int] | None = None,
    mem_fraction_static: float | None = None,
    dtype: str | None = None,
    fp32_lm_head: bool = False,
    weight_update: WeightUpdate | None = "distributed",
    memory_saver: bool = False,
    weight_version: str = "0",
    lora_rank: int = 0,
    lora_targets: Sequence[str] = (),
    delta_loader: str | None = None,
    extra_args: Sequence[str] = (),
    python: str = sys.executable,
    supported_flags: Collection[str] | None = None,
    secrets_file: str | None = None,
    component: str | None = None,
    return_routed_experts: bool = False,
) -> list[SGLangServer]:
    """The launch commands of every generation server of ``placement``, in server order.

    ``component``: the generation component whose servers these are (default: the rollout servers); a judge's or
    a teacher's (`sglang[judge]:…`) serves a fixed model — ``weight_update`` None: no weight group, nothing
    pushed, so no weight-update constraint applies.
    ``ports[k]``: HTTP port of server k. ``seeds``: one per server, or a base seed (server k gets
    ``seed + k``). ``node_hosts[n]``: the address of node n, used in URLs and ``--dist-init-addr``
    (default ``127.0.0.1``, allowed only while every server is on node 0). ``host``: bind address
    (default: the node's address). ``dist_init_ports[k]``: required for servers spanning nodes.
    ``fp32_lm_head``: ``--enable-fp32-lm-head`` (`model.fp32_lm_head`).
    ``weight_update`` ``memory``: co-located servers, updated through /update_weights_from_tensor (CUDA
    IPC); ``memory_saver``: ``--enable-memory-saver``, so /release_memory_occupation frees GPU memory
    (co-located runs with ``colocate.release_memory``; SGLang needs its ``torch_memory_saver`` package).
    ``lora_rank`` > 0 (`model.lora_rank`): runtime LoRA — ``--enable-lora --max-lora-rank r
    --lora-target-modules lora_targets… --max-loras-per-batch 2 --max-loaded-loras 2`` (the run's one
    adapter, replaced by every push, plus room for the base model's rows); no adapter is loaded at
    start: the learner's first push loads it.
    ``delta_loader`` (`weights.sync=delta`): a `delta_loader_dir`; ``--custom-weight-loader`` names the project's
    delta loader (weights/sglang_delta.py) and that directory goes first on the server's PYTHONPATH.
    ``return_routed_experts`` (`train.routing_replay=rollout`, MoE): ``--enable-return-routed-experts``, so
    /generate answers `return_routed_experts` with each position's routed experts.
    ``supported_flags``: the release's flags (`sglang_server_flags`); None = assume a current
    release. ``secrets_file``: where the keys go (required when a key is set): argv gets
    ``--config secrets_file`` and each process's `SGLangProcess.write_secrets` writes the keys there
    (0600) — never in argv, which every local user can read. Raises `SGLangArgsError` naming the
    setting to change.
    """
    alloc = placement.allocation
    gen = alloc.generation if component is None else next(
        (c for c in alloc.generation_components if c.name == component), None)
    if gen is None:
        raise SGLangArgsError(f"allocation {alloc} has no generation part{'' if component is None else ' ' + repr(component)}"
                              ": nothing to launch")
    if gen.backend != "sglang":
        raise SGLangArgsError(f"generation backend is {gen.backend!r}, not 'sglang': use the {gen.backend} launcher")
    if weight_update is not None and weight_update not in ("distributed", "disk", "memory"):
        raise SGLangArgsError(f"weight_update must be 'distributed', 'disk' or 'memory', got {weight_update!r}")
    if gen.pp > 1 and weight_update == "memory":
        raise SGLangArgsError(f"generation {gen} uses pipeline parallelism (p{gen.pp}); the co-located handoff "
                              "(update_weights_from_tensor, one payload per TP rank) supports tensor parallelism "
                              f"only: use sglang:d{gen.dp}t{gen.tp * gen.pp}")
    if gen.pp > 1 and weight_update == "distributed":
        raise SGLangArgsError(
            f"generation {gen} uses pipeline parallelism (p{gen.pp}), but SGLang's "
            "update_weights_from_distributed does not support pp>1: use tensor parallelism instead "
            f"(e.g. sglang:d{gen.dp}t{gen.tp * gen.pp}) or update weights from disk"
        )
    servers = placement.servers if component is None else placement.component(component).servers
    n = len(servers)
    ports = _per_server("ports", ports, n)
    seed_list = [seeds + k for k in range(n)] if isinstance(seeds, int) else _per_server("seeds", seeds, n)
    if len(set(seed_list)) != n:
        raise SGLangArgsError(f"seeds must differ per server (replicas would sample alike), got {seed_list}")
    g = placement.devices_per_node
    used_nodes = sorted({node for s in servers for node in s.nodes})
    if node_hosts is None:
        if used_nodes and used_nodes != [0]:
            raise SGLangArgsError(
                f"the generation servers run on nodes {used_nodes}: pass node_hosts (one address per node) "
                "so that URLs and --dist-init-addr reach them"
            )
        node_hosts = ["127.0.0.1"] * max(1, placement.nodes)
    if len(node_hosts) < placement.nodes:
        raise SGLangArgsError(f"node_hosts has {len(node_hosts)} addresses for {placement.nodes} nodes")
    _check_ports(servers, ports)
    if dist_init_ports is not None:
        dist_init_ports = _per_server("dist_init_ports", dist_init_ports, n)
    flags = None if supported_flags is None else frozenset(supported_flags)
    if memory_saver and flags is not None and "--enable-memory-saver" not in flags:
        raise SGLangArgsError("co-located SGLang servers release their GPU memory through --enable-memory-saver, "
                              "which this SGLang release lacks: upgrade sglang or set colocate.release_memory=false")
    if flags is not None:
        for flag, value in (("--api-key", api_key), ("--admin-api-key", admin_api_key)):
            if value and flag not in flags:
                raise SGLangArgsError(
                    f"this SGLang release has no {flag}: the server would run unauthenticated; "
                    "upgrade sglang or unset the key"
                )
    lora: list[str] = []
    if lora_rank > 0:
        if not lora_targets:
            raise SGLangArgsError("lora_rank > 0 needs lora_targets (model.target_modules as module names)")
        missing = [f for f in LORA_FLAGS if flags is not None and f not in flags]
        if missing:
            raise SGLangArgsError(f"model.lora_rank={lora_rank} needs SGLang's runtime LoRA ({', '.join(missing)}), "
                                  "which this SGLang release lacks: upgrade sglang or set model.lora_rank=0")
        lora = ["--enable-lora", "--max-lora-rank", str(lora_rank), "--lora-target-modules", *lora_targets,
                "--max-loras-per-batch", "2", "--max-loaded-loras", "2"]
    delta: list[str] = []
    server_env = dict(SERVER_ENV)
    if delta_loader:
        if flags is not None and "--custom-weight-loader" not in flags:
            raise SGLangArgsError("weights.sync=delta reaches SGLang through its --custom-weight-loader, which this "
                                  "SGLang release lacks: upgrade sglang or set weights.sync=full")
        delta = ["--custom-weight-loader", DELTA_LOADER]
        path = os.environ.get("PYTHONPATH")
        server_env["PYTHONPATH"] = delta_loader + (os.pathsep + path if path else "")
    secrets = {_SECRET_KEYS[f][0]: v for f, v in (("--api-key", api_key), ("--admin-api-key", admin_api_key)) if v}
    if secrets:
        names = " and ".join(_SECRET_KEYS[f][1] for f, v in (("--api-key", api_key), ("--admin-api-key", admin_api_key))
                             if v)
        for f, v in (("--api-key", api_key), ("--admin-api-key", admin_api_key)):
            if v and v.startswith("-"):  # `--api-key -…` after SGLang's --config merge: "expected one argument"
                raise SGLangArgsError(f"{_SECRET_KEYS[f][1]} starts with '-', which SGLang's argument parser takes for "
                                      "a flag (the server would not start): choose a key that does not")
        if secrets_file is None:
            raise SGLangArgsError(f"{names} set but no secrets_file: the keys go into a 0600 --config file, never argv")
        if not secrets_file.endswith((".yaml", ".yml")):
            raise SGLangArgsError(f"secrets_file {secrets_file!r} must end in .yaml (SGLang's --config reads only "
                                  "YAML)")
        if flags is not None and "--config" not in flags:
            raise SGLangArgsError(f"this SGLang release has no --config: {names} would have to go on the command "
                                  "line, readable by every local user; upgrade sglang or unset the key")
        extra = list(extra_args)
        for i, a in enumerate(extra):
            if a == "--config" or a.startswith("--config="):
                user_file = a.split("=", 1)[1] if "=" in a else (extra[i + 1] if i + 1 < len(extra) else "?")
                raise SGLangArgsError(
                    f"the SGLang arguments already have --config {user_file}, but SGLang reads one config file and "
                    f"the launcher's ({secrets_file}) carries {names}: move that file's settings to flags, or unset "
                    "the key")
            if a in SECRET_FLAGS or a.split("=", 1)[0] in SECRET_FLAGS:
                raise SGLangArgsError(f"the SGLang arguments contain {a.split('=', 1)[0]}: keys never go on the "
                                      f"command line (every local user can read it); set {names} instead")

    out: list[SGLangServer] = []
    for k, sp in enumerate(servers):
        shares = _node_shares(sp, g, gen)
        node_addr = node_hosts[sp.node]
        bind = host or node_addr
        # --host is set per process below: a node-rank > 0 process runs on another node (and binds nothing
        # in current releases), so it gets its own node's address, never node 0's.
        head = [python, "-m", SGLANG_MODULE, "--model-path", model_path]
        common = ["--port", str(ports[k]), "--tp-size", str(gen.tp), "--pp-size", str(gen.pp), "--dp-size", "1",
                  "--random-seed", str(seed_list[k])]
        if flags is None or "--weight-version" in flags:
            common += ["--weight-version", weight_version]
        common.append("--skip-server-warmup")  # the launcher's /health wait is the warm-up
        if enable_metrics:
            common.append("--enable-metrics")
        if mem_fraction_static is not None:
            if not 0.0 < mem_fraction_static < 1.0:
                raise SGLangArgsError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
            common += ["--mem-fraction-static", repr(float(mem_fraction_static))]
        if memory_saver:  # co-located: /release_memory_occupation gives the GPU memory to the learner
            common.append("--enable-memory-saver")
        if dtype is not None:  # the learner's dtype: weights pushed to the server arrive in it
            common += ["--dtype", dtype]
        if fp32_lm_head:
            if flags is not None and "--enable-fp32-lm-head" not in flags:
                raise SGLangArgsError("model.fp32_lm_head=true needs SGLang's --enable-fp32-lm-head, which this "
                                      "SGLang release lacks: upgrade sglang or set model.fp32_lm_head=false")
            common.append("--enable-fp32-lm-head")
        common += lora
        common += delta
        if return_routed_experts:
            if flags is not None and "--enable-return-routed-experts" not in flags:
                raise SGLangArgsError("train.routing_replay=rollout needs SGLang's --enable-return-routed-experts, which "
                                      "this SGLang release lacks: upgrade sglang or set train.routing_replay=behaviour")
            common.append("--enable-return-routed-experts")
        if secrets:  # the keys themselves go into the 0600 file; argv names only the file
            common += ["--config", secrets_file]
        procs = []
        for rank, (node, base) in enumerate(shares):
            argv = [*head, "--host", host or node_hosts[node], *common, "--base-gpu-id", str(base)]
            if len(shares) > 1:
                if dist_init_ports is None:
                    raise SGLangArgsError(
                        f"generation server {k} (t{gen.tp}×p{gen.pp} = {len(sp.slots)} devices) spans "
                        f"{len(shares)} nodes of {g}: pass dist_init_ports (one free port per server)"
                    )
                argv += ["--dist-init-addr", f"{node_hosts[shares[0][0]]}:{dist_init_ports[k]}",
                         "--nnodes", str(len(shares)), "--node-rank", str(rank)]
            argv += list(extra_args)
            procs.append(SGLangProcess(node=node, node_rank=rank, argv=tuple(argv), env=dict(server_env),
                                       secrets_file=secrets_file if secrets else None, secrets=dict(secrets)))
        out.append(SGLangServer(index=sp.index, url=f"http://{url_host(node_addr)}:{ports[k]}", host=bind,
                                port=ports[k], tp=gen.tp, pp=gen.pp, seed=seed_list[k], processes=tuple(procs)))
    return out


def weight_update_group_layout(servers: Sequence[SGLangServer]) -> list[tuple[str, int, int]]:
    """``(url, rank_offset, world_size)`` per server for ``/init_weights_update_group``.

    The trainer is rank 0; server k's tp rank j joins as ``rank_offset_k + j`` with
    ``rank_offset_k = 1 + Σ devices of servers before k`` and ``world_size = 1 + all server devices``
    — the same numbers `areal_like.weights.push.WeightPusher` sends given
    ``devices_per_server=[s.devices for s in servers]``.
    """
    world = 1 + sum(s.devices for s in servers)
    out = []
    offset = 1
    for s in servers:
        out.append((s.url, offset, world))
        offset += s.devices
    return out


def processes_on_node(servers: Sequence[SGLangServer], node: int) -> list[tuple[SGLangServer, SGLangProcess]]:
    """The processes node ``node``'s launcher starts (multi-node backends run one launcher per node)."""
    return [(s, p) for s in servers for p in s.processes if p.node == node]


def write_secrets_file(path: str, secrets: dict[str, str]) -> None:
    """Write ``secrets`` as SGLang ``--config`` YAML (``flag-name: "value"``) to ``path``, mode 0600.

    Created 0600 from the start (no window where it is readable), not following a symlink at
    ``path``; an existing file (a re-run) is truncated and set back to 0600. Values are written as
    JSON strings, which YAML reads back as the same strings (a key like ``123`` or ``yes`` stays text).
    """
    body = "".join(f"{k}: {json.dumps(str(v))}\n" for k, v in secrets.items())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, body.encode())
    finally:
        os.close(fd)


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the values of ``--api-key`` / ``--admin-api-key`` replaced by ``***`` (for logs)."""
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a in SECRET_FLAGS:
            out[i + 1] = "***"
    return out


# ---------------------------------------------------------------------------- the real package
_VERSION_SCRIPT = "import importlib.metadata as m; print(m.version('sglang'))"
# SGLang's own parser (from 0.5.21 ServerArgs is a msgspec Struct, so its fields are no longer
# dataclass fields); every ``--flag`` spelling it accepts, aliases included.
_FLAGS_SCRIPT = """\
import argparse, json
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
print(json.dumps(sorted(o for o in p._option_string_actions if o.startswith("--"))))
"""


def run_in_python(python: str, script: str, what: str, timeout_s: float) -> str:
    """stdout of ``python -c script``; errors name ``server.python``, the interpreter and ``what``."""
    try:
        proc = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        raise SGLangNotInstalled(f"server.python = {python!r} does not exist: set it to the interpreter of the "
                                 "SGLang environment (scripts/setup.sh --sglang builds .venv-sglang)") from None
    except subprocess.TimeoutExpired:
        raise SGLangNotInstalled(f"server.python = {python!r} did not finish {what} within {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SGLangNotInstalled(f"server.python = {python!r} failed {what} (exit {proc.returncode}): "
                                 + " | ".join(tail))
    return proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""


def _version_tuple(v: str) -> tuple[int, ...]:
    """The release numbers of ``v`` (``0.5.23rc1`` → ``(0, 5, 23)``); () when it has none."""
    m = re.match(r"\d+(?:\.\d+)*", v.strip())
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def sglang_version_supported(version: str) -> bool:
    """Whether ``version`` lies in `SUPPORTED_SGLANG` (``>=low,<high``, release numbers compared)."""
    low, high = (_version_tuple(b.lstrip("<>=")) for b in SUPPORTED_SGLANG)
    v = _version_tuple(version)
    return bool(v) and low <= v < high


def require_sglang(python: str | None = None, timeout_s: float = 120.0) -> str:
    """The sglang release installed for ``python`` (``server.python``; None = this interpreter).

    Raises `SGLangNotInstalled` naming the key, the interpreter, the installed version and
    `SUPPORTED_SGLANG` when sglang is absent there or its release is outside the range. Runs a
    subprocess: the launcher never imports sglang (it pins another torch than the learner).
    """
    python = python or sys.executable
    script = "import importlib.util\nif importlib.util.find_spec('sglang') is None: print('<absent>')\nelse: " \
        + _VERSION_SCRIPT
    version = run_in_python(python, script, "reporting its sglang version", timeout_s) or "unknown"
    supported = ",".join(SUPPORTED_SGLANG)
    if version == "<absent>":
        raise SGLangNotInstalled(
            f"generation backend 'sglang' needs the sglang package, which server.python = {python!r} cannot "
            f"import: build its environment with scripts/setup.sh --sglang (sglang{supported}) and set "
            "server.python to .venv-sglang/bin/python, or use the embedded backend (--allocation embedded.…)")
    if not sglang_version_supported(version):
        raise SGLangNotInstalled(
            f"server.python = {python!r} has sglang {version}, outside the supported range sglang{supported} "
            f"(the releases the conformance suite checks): pip install 'sglang{supported}' there "
            "(scripts/setup.sh --sglang)")
    return version


def sglang_server_flags(python: str | None = None, timeout_s: float = 300.0) -> frozenset[str]:
    """The ``--flags`` the installed SGLang's ``launch_server`` accepts (for ``supported_flags``).

    Read from SGLang's own argparse parser (``ServerArgs.add_cli_args``) by ``python``
    (``server.python``; None = this interpreter) in a subprocess, never imported here. Run it on
    the machine that runs the servers; importing sglang takes a while, hence the long timeout.
    """
    python = python or sys.executable
    out = run_in_python(python, _FLAGS_SCRIPT, "reading SGLang's command-line flags (ServerArgs.add_cli_args)", timeout_s)
    try:
        flags = json.loads(out)
    except ValueError:
        raise SGLangNotInstalled(f"server.python = {python!r} printed no flag list: {out[:200]!r}") from None
    if "--model-path" not in flags:
        raise SGLangNotInstalled(f"server.python = {python!r}: SGLang's parser has no --model-path ({len(flags)} flags)")
    return frozenset(flags)


# ------------------------------------------------------------------------------------- helpers
def _per_server(what: str, values: Sequence[int], n: int) -> list[int]:
    values = list(values)
    if len(values) != n:
        raise SGLangArgsError(f"{what} has {len(values)} entries for {n} generation servers: give one per server")
    return values


def _check_ports(servers: Sequence[ServerPlacement], ports: Sequence[int]) -> None:
    seen: dict[tuple[int, int], int] = {}
    for sp, port in zip(servers, ports):
        if not 0 < port < 65536:
            raise SGLangArgsError(f"port {port} of generation server {sp.index} is not a TCP port")
        key = (sp.node, port)
        if key in seen:
            raise SGLangArgsError(
                f"generation servers {seen[key]} and {sp.index} both use port {port} on node {sp.node}: "
                "give each server on a node its own port"
            )
        seen[key] = sp.index


def _node_shares(sp: ServerPlacement, g: int, gen) -> list[tuple[int, int]]:
    """``(node, base_gpu_id)`` per node the server spans, checking SGLang's even split."""
    per_node: dict[int, list[int]] = {}
    for node, dev in sp.slots:
        per_node.setdefault(node, []).append(dev)
    shares = []
    for node, devs in per_node.items():
        if devs != list(range(devs[0], devs[0] + len(devs))):
            raise SGLangArgsError(f"generation server {sp.index} has non-consecutive devices {devs} on node {node}")
        shares.append((node, devs[0]))
    if len(per_node) > 1:
        sizes = {len(d) for d in per_node.values()}
        if len(sizes) != 1:
            split = "+".join(str(len(d)) for d in per_node.values())
            raise SGLangArgsError(
                f"generation server {sp.index} (t{gen.tp}×p{gen.pp} = {len(sp.slots)} devices) spans "
                f"{len(per_node)} nodes of {g} devices unevenly ({split}); SGLang puts t×p/nnodes devices "
                f"on every node: make t×p a multiple of {g}"
            )
    return shares

