"""What a run on CUDA devices needs of this machine, checked before anything starts (issue 40).

- `cuda_gpus`: this machine's GPUs as the roles will see them — `nvidia-smi`'s list (the launcher never
  imports torch to ask), narrowed by the launcher's own CUDA_VISIBLE_DEVICES.
- `check_local_devices`: the local backend places the whole allocation on this one machine; an
  allocation that needs more GPUs than it has (a multi-node one: `sglang.d16p1m1+d8p2m1` is 32) is
  refused naming `--backend ray`, and SGLang on a machine without a GPU is refused too (it used to start
  the servers and fail a minute later on a server's import error).
- `check_torch_pairing`: the learner and the SGLang servers meet in one NCCL group (the weight
  broadcast) and, co-located, in CUDA-IPC payloads pickled by one torch and opened by the other; both
  must be the same torch release. The learner's is this interpreter's (`sys.executable` starts every
  learner rank), the servers' is `server.python`'s.

Pure subprocess/metadata reads; raises `DeviceCheckError` naming the key or flag to change.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass


class DeviceCheckError(ValueError):
    """The run cannot use this machine's devices as configured: the message names what to change."""


@dataclass(frozen=True)
class Gpu:
    index: str  # as CUDA_VISIBLE_DEVICES names it
    memory_bytes: int


def cuda_gpus(nvidia_smi: str | None = None) -> list[Gpu] | None:
    """This machine's GPUs as the roles see them (nvidia-smi's, narrowed by CUDA_VISIBLE_DEVICES when the
    launcher runs under one); None where there is no nvidia-smi or it answers nothing usable."""
    exe = nvidia_smi or shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        gpus = []
        for line in out.splitlines():
            if line.strip():
                idx, mib = (x.strip() for x in line.split(",")[:2])
                gpus.append(Gpu(idx, int(float(mib)) * 2**20))
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = [v.strip() for v in visible.split(",") if v.strip()]
        by_index = {g.index: g for g in gpus}
        # indices select; anything else (GPU-UUIDs, MIG names) is taken as one visible device each
        gpus = [by_index[n] if n in by_index else Gpu(n, min((g.memory_bytes for g in gpus), default=0))
                for n in names if n != "-1"]
    return gpus


def uses_cuda(cfg, alloc) -> bool:
    """Whether the run's roles run on CUDA devices: SGLang servers (rollout, judge or teacher), or the embedded
    engine on cuda (the learner then trains on its plan devices too)."""
    gen = alloc.generation
    return gen is not None and (any(c.backend == "sglang" for c in alloc.generation_components)
                                or cfg.server.device.startswith("cuda"))


def check_local_devices(cfg, alloc, gpus: list[Gpu] | None) -> None:
    """The local backend runs every role on this machine: refuse an allocation that needs more GPUs
    than it has, before anything starts. Nothing to check on CPU or under `--backend ray` (the Ray
    placement checks the cluster)."""
    if cfg.launcher.backend != "local" or not uses_cuda(cfg, alloc):
        return
    need = alloc.total_devices
    have = len(gpus) if gpus else 0
    if have >= need:
        return
    what = ("SGLang servers" if any(c.backend == "sglang" for c in alloc.generation_components)
            else f"server.device={cfg.server.device}")
    if have == 0:
        seen = "nvidia-smi is not on PATH" if gpus is None else "nvidia-smi lists none"
        cpu = ("use the embedded engine on CPU (--allocation embedded.…, server.device=cpu)"
               if alloc.generation.backend == "sglang" else "set server.device=cpu")
        raise DeviceCheckError(
            f"allocation {cfg.allocation!r} runs {what} on {need} CUDA GPU(s), but this machine has none "
            f"({seen}): {cpu}, or run on a GPU machine or cluster (--backend ray)")
    raise DeviceCheckError(
        f"allocation {cfg.allocation!r} needs {need} GPUs and the local backend places all of them on this "
        f"machine, which has {have} (CUDA_VISIBLE_DEVICES / nvidia-smi): run it across nodes with --backend ray "
        f"(a Ray cluster, or `launcher sbatch` under Slurm), or shrink the allocation to {have} device(s) "
        "(`launcher plan --allocation … --nodes 1 --devices-per-node N` shows where each role lands)")


_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)")
_TORCH_SCRIPT = ("import importlib.metadata as m\ntry: print(m.version('torch'))\n"
                 "except m.PackageNotFoundError: print('<absent>')")


def torch_release(version: str) -> tuple[int, int, int] | None:
    """"2.14.1+cu128" → (2, 14, 1): the release, without the local build tag (CPU and CUDA builds of one
    release speak the same pickles and NCCL group protocol)."""
    m = _VERSION.match(version)
    return tuple(int(x) for x in m.groups()) if m else None  # type: ignore[return-value]


def torch_version_of(python: str, timeout_s: float = 120.0) -> str:
    """The torch version installed for interpreter `python` (`<absent>` when there is none)."""
    from areal_like.engine.sglang_args import SGLangNotInstalled, run_in_python

    try:
        return run_in_python(python, _TORCH_SCRIPT, "reporting its torch version", timeout_s) or "<absent>"
    except SGLangNotInstalled as e:
        raise DeviceCheckError(str(e)) from None


def learner_torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def check_torch_pairing(server_python: str) -> tuple[str, str]:
    """Refuse SGLang servers whose torch release differs from the learner's: their NCCL libraries meet in
    the weight group and, co-located, one torch unpickles the other's CUDA-IPC handles (the payload
    hard-codes an argument position of torch's tensor reduction). Returns (learner's, servers') versions."""
    mine = learner_torch_version()  # every learner rank runs this interpreter (sys.executable)
    theirs = torch_version_of(server_python)
    if theirs == "<absent>":
        raise DeviceCheckError(f"server.python = {server_python!r} has no torch: build the SGLang environment with "
                               "scripts/setup.sh --sglang")
    if torch_release(mine) != torch_release(theirs):
        raise DeviceCheckError(
            f"the learner runs torch {mine} ({sys.executable}) but the SGLang servers torch {theirs} (server.python = "
            f"{server_python}): they meet in one NCCL weight group and in CUDA-IPC payloads, which need one torch "
            "release on both sides. Run the launcher from the SGLang environment, which then trains with SGLang's "
            "torch: `scripts/setup.sh --sglang` installs areal_like into .venv-sglang; start the run with "
            "`.venv-sglang/bin/python -m launcher run … server.python=.venv-sglang/bin/python`")
    return mine, theirs


def colocated_ray_refusal(allocation: str, *, cuda: bool) -> str | None:
    """Why a co-located allocation on CUDA cannot run under `--backend ray` (None when it can): Ray reserves
    each role's GPU for it alone, so a server and the learner rank that share a GPU ask twice for it (the
    node's placement group never becomes ready). (The CUDA-IPC handoff goes from each learner rank to the
    server on its own GPU, named by UUID, so it would not need the roles to see each other's devices.)"""
    from allocation import parse_allocation

    alloc = parse_allocation(allocation)
    if not (alloc.colocated and cuda):
        return None
    plus = allocation.replace("|", "+")
    return (f"allocation {allocation!r} co-locates generation and training on the same GPUs, which --backend ray "
            "does not run (Ray would reserve every shared GPU twice: once for the server, once for the learner "
            "rank): run it on one node with the local backend (drop "
            f"--backend ray / launcher.backend=ray), or disaggregate it across nodes ({plus!r}: '+' for '|')")
