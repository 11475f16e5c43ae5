"""Child-process bookkeeping for the launcher: start, watch, and end only what we started.

Every role runs in its own session (process group), so ending a role also ends the helpers it
spawned (reward worker pools, gloo threads) — by process-group id, never by process name. The PIDs
are written to `<run-dir>/pids.json` so `launcher stop` can end a run from another shell.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

from areal_like.api.net import free_port


@dataclass
class Role:
    name: str  # "server0", "learner", "rollout1", …
    proc: subprocess.Popen  # or what stands for one: launcher.forkserver.ForkedProcess, Ray's actor handle
    log_path: str
    critical: bool = True  # its death (before the run is done) stops the run
    argv: list[str] = field(default_factory=list)  # how it was started: a restart starts it the same way
    env: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                lines = f.read().decode("utf-8", "replace").splitlines()
            return "\n".join(lines[-n:])
        except OSError:
            return ""


@dataclass
class ProcessTable:
    """The local backend: every role a process of this machine. `launcher.ray_procs.RayProcessTable`
    answers the same questions (start, restart, stop, dead, host, free_port, device_env) on Ray."""

    run_dir: str
    roles: list[Role] = field(default_factory=list)
    services: dict[str, int] = field(default_factory=dict)  # started elsewhere (redis-server): name → pid
    plan: object = None  # allocation.Placement: the devices of each server and learner rank
    backend: str = "local"
    bind_host: str = "127.0.0.1"
    cpu_affinity: dict[str, set[int]] = field(default_factory=dict)
    """`launcher.cpu_affinity` parsed (`cpu_sets`): role kind → CPUs; empty = no pinning."""
    ports_handed: set[int] = field(default_factory=set)
    """Every port `free_port` gave a role of this run (see there)."""
    forkserver: object = None
    """`launcher.forkserver.ForkServer` once `open_forkserver` started it: areal_like roles are forked there."""

    # ---- where a role runs (one node: this machine) -----------------------------------------------
    def host(self, name: str) -> str:
        """The address other roles reach `name` at."""
        return self.bind_host

    def free_port(self, name: str) -> int:
        """A free port for `name` to bind, never one this run handed out before (two roles starting
        together could otherwise be given the same one: it was free for both picks)."""
        port = free_port(self.bind_host, avoid=self.ports_handed)
        self.ports_handed.add(port)
        return port

    def devices(self, name: str) -> tuple[int, ...]:
        return role_devices(self.plan, name)

    def device_env(self, name: str) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES of a role with devices: the plan's, mapped through this machine's own
        CUDA_VISIBLE_DEVICES when the launcher runs under one (plan device i = the i-th visible)."""
        devs = self.devices(name)
        if not devs:
            return {}
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        ids = [visible[d] if d < len(visible) else str(d) for d in devs] if visible else [str(d) for d in devs]
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}

    def placement(self, name: str) -> dict:
        devs = self.devices(name)
        return {"node": 0, "devices": list(devs), "node_ip": self.bind_host, "hostname": os.uname().nodename}

    def reserve(self) -> None:
        """Nothing to reserve on one machine."""

    def check_shared_run_dir(self) -> None:
        """One machine: the run directory is local."""

    def open_forkserver(self, env: dict[str, str]) -> None:
        """Start the run's fork server (`launcher.forkserver`) with environment `env`; it imports while
        the launcher goes on. Every later `start` of an areal_like role is a fork of it."""
        from launcher.forkserver import ForkServer

        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        self.forkserver = ForkServer(env, os.path.join(self.run_dir, "logs", "forkserver.log"))

    def close(self) -> None:
        """End the fork server, if any (the roles themselves were ended by the run)."""
        if self.forkserver is not None:
            self.forkserver.close()
            self.forkserver = None

    # ---- CPU pinning (launcher.cpu_affinity) --------------------------------------------------------
    def cpus(self, name: str) -> set[int] | None:
        """The CPUs role `name` is pinned to (by its kind: server, learner, rollout, redis; a critic pool's
        ranks are learner ranks), or None."""
        kind = {"critic": "learner"}.get(role_kind(name), role_kind(name))
        return self.cpu_affinity.get(kind) if kind else None

    def start(self, name: str, argv: list[str], env: dict[str, str], *, critical: bool = True) -> Role:
        log_path = os.path.join(self.run_dir, "logs", f"{name}.log")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        cpus = self.cpus(name)
        from launcher.forkserver import forkable

        if self.forkserver is not None and (forkable(argv) or "").startswith("areal_like."):
            proc = self.forkserver.spawn(argv, env, log_path, cpus)  # same session, log, env and CPUs
        else:
            log = open(log_path, "ab", buffering=0)
            proc = subprocess.Popen(
                pinned_argv(argv, cpus) if cpus else argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # own process group: we end the role and its children together
            )
            log.close()
        role = Role(name, proc, log_path, critical, list(argv), dict(env))
        self.roles.append(role)
        self._record()
        return role

    def _record(self, extra: dict | None = None) -> None:
        """pids.json: the launcher, every role's pid, and where each role runs (`launcher status`)."""
        pids = {r.name: r.pid for r in self.roles} | self.services
        if extra is None:
            extra = {"backend": "local", "placement": {r.name: self.placement(r.name) for r in self.roles}
                     | {n: {"node": 0, "devices": [], "node_ip": self.bind_host} for n in self.services}}
        tmp = os.path.join(self.run_dir, "pids.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"launcher": os.getpid(), "roles": pids, **extra}, f)
        os.replace(tmp, os.path.join(self.run_dir, "pids.json"))

    def restart(self, role: Role, extra_argv: list[str] = ()) -> Role:
        """Start a dead role again under its name, with its argv (+ `extra_argv`) and environment; what
        is left of its process group (helpers the dead process spawned) is ended first."""
        end_process_group(role.pid, role.proc, 5.0)
        self.roles.remove(role)
        return self.start(role.name, [*role.argv, *extra_argv], role.env, critical=role.critical)

    def forget(self, role: Role) -> None:
        """Drop an ended role from the table (a restarted learner rank gets a new entry)."""
        self.roles.remove(role)
        self._record()

    def add_service(self, name: str, pid: int) -> None:
        """A process the launcher started itself (its redis-server), pinned here (every thread of it)
        when `launcher.cpu_affinity` names its kind."""
        cpus = self.cpus(name)
        if cpus:
            pin_running(pid, cpus)
        self.services[name] = pid
        self._record()

    def dead(self) -> list[Role]:
        return [r for r in self.roles if r.proc.poll() is not None]

    def stop(self, role: Role, timeout_s: float = 10.0) -> None:
        """SIGTERM the role's process group, then SIGKILL what is left after `timeout_s`."""
        end_process_group(role.pid, role.proc, timeout_s)

    def stop_all(self, order: list[str] | None = None, timeout_s: float = 10.0) -> None:
        """Stop roles in reverse start order (or by name prefixes in `order` first)."""
        roles = list(reversed(self.roles))
        if order:
            ranked = []
            for prefix in order:
                ranked += [r for r in roles if r.name.startswith(prefix) and r not in ranked]
            roles = ranked + [r for r in roles if r not in ranked]
        for r in roles:
            self.stop(r, timeout_s)


def end_process_group(pid: int, proc: subprocess.Popen | None = None, timeout_s: float = 10.0) -> None:
    """End the process group led by `pid` (a session we created): TERM, wait, KILL."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        pgid = None
    if pgid is not None and pgid == pid:  # only groups we created (start_new_session) are ours
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    elif proc is not None and proc.poll() is None:
        proc.terminate()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None and not _group_alive(pid):
                return
        elif not _group_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def learner_role(rank: int) -> str:
    """The role name of learner rank `rank`: "learner" for rank 0, "learner<r>" for the others."""
    return "learner" if rank == 0 else f"learner{rank}"


def critic_role(rank: int) -> str:
    """The role name of rank `rank` of a critic pool (a critic component): "critic", "critic<r>"."""
    return "critic" if rank == 0 else f"critic{rank}"


def role_devices(plan, name: str) -> tuple[int, ...]:
    """The plan's devices of a role: `server<i>` → its server's, `judge<i>` / `teacher<i>` → that component's
    server i's, `learner`/`learner<r>` → rank r's."""
    if plan is None:
        return ()
    if name.startswith("server"):
        i = int(name.removeprefix("server"))
        return tuple(plan.servers[i].devices) if i < len(plan.servers) else ()
    for aux in ("judge", "teacher"):  # `judge<i>` / `teacher<i>`: that component's server i
        if name.startswith(aux):
            i = int(name.removeprefix(aux))
            comp = next((g for g in plan.generation if g.spec.role == aux), None)
            return tuple(comp.servers[i].devices) if comp is not None and i < len(comp.servers) else ()
    if name.startswith("learner"):
        r = int(name.removeprefix("learner") or 0)
        ranks = plan.ranks
        return (ranks[r].device,) if r < len(ranks) else ()
    if name.startswith("critic"):  # `critic<r>`: rank r of the critic component
        r = int(name.removeprefix("critic") or 0)
        comp = next((c for c in plan.training if c.spec.role == "critic"), None)
        return (comp.ranks[r].device,) if comp is not None and r < len(comp.ranks) else ()
    return ()


# ---- CPU pinning ----------------------------------------------------------------------------------
# The child pins itself, then execs the role: affinity is inherited through exec and by everything the
# role spawns, and nothing runs in the launcher's forked child (no preexec_fn, which is unsafe once the
# launcher has threads — the progress bar's refresh thread when a role is restarted).
_PIN = "import os,sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); os.execv(sys.argv[2], sys.argv[2:])"


def role_kind(name: str) -> str | None:
    """"server0" → "server", "learner"/"learner3" → "learner", "rollout1" → "rollout", "judge0" → "judge",
    "teacher0" → "teacher", "critic"/"critic1" → "critic" (a critic pool's ranks), "redis" → "redis"."""
    for kind in ("server", "learner", "rollout", "judge", "teacher", "critic", "redis"):
        if name.startswith(kind) and name[len(kind):].isdigit() or name == kind:
            return kind
    return None


def pinned_argv(argv: list[str], cpus: set[int]) -> list[str]:
    """`argv` run on `cpus` only: a small Python prelude sets the affinity and execs argv (same pid).
    argv[0] is resolved on $PATH here, as Popen would."""
    import shutil
    import sys

    exe = argv[0] if os.sep in argv[0] else (shutil.which(argv[0]) or argv[0])
    return [sys.executable, "-S", "-c", _PIN, ",".join(map(str, sorted(cpus))), exe, *argv[1:]]


def pin_running(pid: int, cpus: set[int]) -> None:
    """Pin every thread of a running process (a thread's affinity is its own)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that just ended
            pass
