"""`--backend ray`: the roles of a run as processes owned by Ray actors, on the nodes the plan gives them.

    launcher (driver, on the head node: Redis, supervision, summary.json)
      │  one placement group per plan node, its bundles pinned to that node (label ray.io/node-id):
      ├─ node 0 ── [server0: t×p devices] [server1 …] [rollout0: CPU] … [spare devices]
      └─ node 1 ── [learner rank 0: 1 device] [learner rank 1 …] …
                     └─ RoleHost actor ──owns──▶ the role's process (its own session) + a watchdog

Every role is the same process the local backend starts (same argv, same environment on top of the
node's), started by a small `RoleHost` actor in the role's bundle: the actor reports the node's
address, picks free ports on that node, starts the process with the plan's devices in
CUDA_VISIBLE_DEVICES and its log in the run directory, and answers poll/stop. A watchdog process
ends the role's process group when its actor dies, so `ray.kill` of the actor (or of the driver)
never leaves a role behind. Supervision and restarts are `launcher.run.Run`'s, unchanged: this
table only answers the same questions as `ProcessTable` (start, restart, stop, dead).

A placement group reserves all of its node's devices (a spare bundle holds those the plan leaves
free), so the plan's device numbers are the node's own and no other Ray work shares them.

The run directory must be on storage every node mounts (as on Slurm clusters): roles read
config.json and write logs, checkpoints and metrics there; the launcher checks it from every node
before it starts anything. Stopping removes exactly the actors and placement groups this run
created (named `<run id>:…` in namespace `areal_like`); nothing else on the cluster is touched.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from dataclasses import dataclass, field

from launcher.procs import ProcessTable, Role, critic_role, learner_role

RAY_NAMESPACE = "areal_like"


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RayBackendError(RuntimeError):
    pass


# ---- the actor -----------------------------------------------------------------------------------
class RoleHost:
    """Owns one role's process on its node (decorated with `ray.remote` at first use)."""

    def __init__(self, name: str):
        self.name = name
        self.proc = None
        self.watchdog = None

    def info(self) -> dict:
        import socket

        import ray

        ctx = ray.get_runtime_context()
        try:
            gpu_ids = [int(g) for g in ray.get_gpu_ids()]
        except (TypeError, ValueError):  # ids given as UUIDs: keep them as text
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(),
                "actor_pid": os.getpid(), "gpu_ids": gpu_ids}

    def free_port(self, host: str, avoid: list[int]) -> int:
        from areal_like.api.net import free_port

        return free_port(host, avoid)

    def read_token(self, path: str) -> str | None:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    def wait_group_gone(self, pgid: int, timeout_s: float) -> bool:
        """A restarted role on this node waits for the last one's process group (its port) to end."""
        from launcher.procs import _group_alive

        deadline = time.monotonic() + timeout_s
        while _group_alive(pgid):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def start(self, argv: list[str], env_delta: dict[str, str], log_path: str, executable: str) -> int:
        """Start the role's process in its own session, its output appended to `log_path`."""
        import subprocess

        if argv and argv[0] == executable:  # the launcher's interpreter → this node's (same environment)
            argv = [sys.executable, *argv[1:]]
        # the node's own, then the role's (the driver's, less node-local ones). Redis variables come from the
        # driver only: a node's own (a user's REDIS_PASSWORD, …) never reach a role — a generation server
        # gets none at all (issue 24), the others get the driver's in the delta.
        env = {**{k: v for k, v in os.environ.items() if "REDIS" not in k.upper()}, **env_delta}
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "ab", buffering=0) as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        # The watchdog ends the role's process group once this actor is gone (ray.kill, node agent
        # restart, driver exit): Ray ends the actor's process, not the sessions it started.
        script = (f"while kill -0 {os.getpid()} 2>/dev/null && kill -0 -{self.proc.pid} 2>/dev/null; do sleep 0.3; done; "
                  f"kill -KILL -{self.proc.pid} 2>/dev/null; exit 0")
        self.watchdog = subprocess.Popen(["/bin/sh", "-c", script], start_new_session=True,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        from launcher.procs import end_process_group

        if self.proc is None:
            return None
        end_process_group(self.proc.pid, self.proc, timeout_s)
        return self.proc.poll()


_REMOTE = {}
_NODE_LOCAL = {"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TMPDIR", "DISPLAY", "CUDA_VISIBLE_DEVICES"}


def _node_local(key: str) -> bool:
    """Variables of the driver's environment that describe its own node or session (not sent to a role
    on another node: it keeps its node's own); the role's own CUDA_VISIBLE_DEVICES is set per role."""
    return key in _NODE_LOCAL or key.startswith(("RAY_", "SLURM_", "SSH_", "XDG_"))


def _role_host_class():
    import ray

    if "cls" not in _REMOTE:
        _REMOTE["cls"] = ray.remote(max_restarts=0, max_concurrency=4)(RoleHost)
    return _REMOTE["cls"]


# ---- a role's process, seen through its actor ----------------------------------------------------
class RayProc:
    """The `subprocess.Popen` subset supervision uses (poll, returncode, pid, wait), over an actor.
    An actor that died (killed, node lost) counts as a process killed by SIGKILL (-9)."""

    def __init__(self, actor, pid: int, timeout_s: float, where: str):
        self.actor, self.pid, self.timeout_s, self.where = actor, pid, timeout_s, where
        self.returncode: int | None = None
        self.actor_died = False

    def _settle(self, ref) -> int | None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            rc = ray.get(ref, timeout=self.timeout_s)
        except RayActorError:
            self.actor_died = True
            rc = -9
        except GetTimeoutError:
            print(f"[launcher] role actor {self.where} did not answer a poll within {self.timeout_s:.0f}s "
                  "(launcher.ray.call_timeout_s); taken as running", file=sys.stderr, flush=True)
            return None
        if rc is not None:
            self.returncode = rc
        return rc

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        return self._settle(self.actor.poll.remote())

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                return None
            time.sleep(0.1)
        return self.returncode


@dataclass
class Slot:
    """Where a role runs: its plan node and devices, the bundle reserving them, and (once its actor
    exists) what Ray reports about it."""

    name: str
    node: int  # plan node index (= its placement group)
    devices: tuple[int, ...]
    bundle: int
    ray_node_id: str = ""
    ip: str = ""
    hostname: str = ""
    ray_gpu_ids: list = field(default_factory=list)
    actor: object = None

    def record(self) -> dict:
        return {"node": self.node, "devices": list(self.devices), "node_ip": self.ip, "hostname": self.hostname,
                "ray_node_id": self.ray_node_id, "ray_gpu_ids": list(self.ray_gpu_ids)}


# ---- the cluster ---------------------------------------------------------------------------------
def connect(address: str | None, *, devices_needed: int, roles_needed: int, device_resource: str, cpu_run: bool,
            log=print) -> bool:
    """ray.init on `address` (or $RAY_ADDRESS), or a local cluster; True when we started that cluster.

    Loopback addresses stay on loopback (node address 127.0.0.1; Ray would otherwise rewrite them to
    the interface address). $AREAL_LIKE_NODE_IP names this node's address where the first one of the
    host name is not the right interface."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or None
    node_ip = os.environ.get("AREAL_LIKE_NODE_IP") or None
    kw = dict(namespace=RAY_NAMESPACE, log_to_driver=False, configure_logging=False)
    if address:
        host = address.split("://", 1)[-1].rsplit(":", 1)[0]
        if node_ip is None and is_loopback(host):
            node_ip = "127.0.0.1" if host == "localhost" else host
        if node_ip:
            kw["_node_ip_address"] = node_ip
        try:
            ray.init(address=address, **kw)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RayBackendError(f"cannot connect to the Ray cluster at {address!r} (--ray-address / "
                                  f"launcher.ray.address / $RAY_ADDRESS): {e}") from None
        return False
    import torch

    has = torch.cuda.device_count() if device_resource == "GPU" else 0
    resources, num_gpus = {}, None
    if has == 0:
        if not cpu_run:
            raise RayBackendError(f"no {device_resource} on this machine for a local Ray cluster, and the run is not a CPU "
                                  "run (server.device is not cpu): start a Ray cluster on GPU nodes and pass --ray-address")
        if device_resource == "GPU":
            num_gpus = devices_needed
        else:
            resources = {device_resource: devices_needed}
        log(f"local Ray cluster: no {device_resource} here; {devices_needed} logical device(s) declared for the CPU run")
    # "local": always a new cluster of our own, never one found through /tmp/ray's current-cluster file
    # CPUs: one per role's bundle (a slot, not a core count); a small machine still takes every role
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, roles_needed), num_gpus=num_gpus, resources=resources or None, include_dashboard=False,
             _node_ip_address=node_ip or "127.0.0.1", **kw)
    return True


def cluster_nodes(device_resource: str) -> list[dict]:
    """Alive nodes declaring `device_resource`, the driver's node first, then by address and id."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(device_resource, 0) >= 1]
    nodes.sort(key=lambda n: (n["NodeID"] != here, n.get("NodeManagerAddress", ""), n["NodeID"]))
    return nodes


class RayProcessTable(ProcessTable):
    """`ProcessTable` over Ray: the same start/restart/stop/dead, each role in its bundle."""

    def __init__(self, run_dir: str, plan, nodes: list[dict], *, n_rollouts: int, device_resource: str,
                 placement_timeout_s: float, call_timeout_s: float):
        super().__init__(run_dir)
        self.backend = "ray"
        self.plan, self.nodes, self.device_resource = plan, nodes, device_resource
        self.placement_timeout_s, self.call_timeout_s = placement_timeout_s, call_timeout_s
        self.run_id = f"{os.path.basename(run_dir.rstrip('/'))}-{secrets.token_hex(3)}"
        self.slots: dict[str, Slot] = {}
        self.pgs: dict[int, object] = {}
        self._ports_handed: dict[str, set[int]] = {}  # node address → ports given to its roles (free_port)
        self._layout(n_rollouts)

    # ---- placement ------------------------------------------------------------------------------
    def _layout(self, n_rollouts: int) -> None:
        """Bundles per plan node: servers, judge and teacher servers, learner ranks, rollout workers (on their
        server's node)."""

        per_node: dict[int, list[Slot]] = {}

        def add(name: str, node: int, devices: tuple[int, ...]) -> None:
            bundles = per_node.setdefault(node, [])
            s = Slot(name, node, devices, len(bundles))
            bundles.append(s)
            self.slots[name] = s

        for sp in self.plan.servers:
            if len(set(sp.nodes)) > 1:
                raise RayBackendError(f"generation server {sp.index} spans nodes {sorted(set(sp.nodes))}: under --backend ray "
                                      "a server's t×p devices are one bundle on one node; use t×p ≤ devices per node")
            add(f"server{sp.index}", sp.nodes[0], tuple(sp.devices))
        for g in self.plan.generation:  # judge and teacher components' servers (launcher run: judge<i>, teacher<i>)
            if g.spec.role in ("judge", "teacher"):
                for sp in g.servers:
                    add(f"{g.spec.role}{sp.index}", sp.nodes[0], tuple(sp.devices))
        for r in self.plan.ranks:
            add(learner_role(r.rank), r.node, (r.device,))
        for c in self.plan.training:  # a critic pool's ranks (critic<r>)
            if c.spec.role == "critic":
                for r in c.ranks:
                    if any(r.device in s.devices for s in per_node.get(r.node, [])):
                        raise RayBackendError(f"critic component {c.spec.name!r} is co-located (`|`) with the actor: "
                                              "under --backend ray each device is one role's bundle; write the "
                                              f"critic as a pool of its own (`+{c.spec.backend}[{c.spec.name}]:…`)")
                    add(critic_role(r.rank), r.node, (r.device,))
        servers = self.plan.servers
        for k in range(n_rollouts):
            add(f"rollout{k}", servers[k % len(servers)].nodes[0] if servers else 0, ())
        self._per_node = per_node

    def reserve(self) -> None:
        """One placement group per plan node, pinned to its Ray node; all of the node's devices."""
        import ray
        from ray.util import placement_group

        g = self.plan.devices_per_node
        for node, slots in sorted(self._per_node.items()):
            ray_node = self.nodes[node]
            bundles = []
            for s in slots:
                b = {"CPU": 1.0}
                if s.devices:
                    b[self.device_resource] = float(len(s.devices))
                bundles.append(b)
            used = sum(len(s.devices) for s in slots)
            if used < g:
                bundles.append({self.device_resource: float(g - used)})  # the node's other devices: ours too
            selector = [{"ray.io/node-id": ray_node["NodeID"]}] * len(bundles)
            self.pgs[node] = placement_group(bundles, strategy="STRICT_PACK", name=f"{self.run_id}:node{node}",
                                             bundle_label_selector=selector)
        self._record()
        refs = {node: pg.ready() for node, pg in self.pgs.items()}
        _, not_ready = ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.placement_timeout_s)
        if not_ready:
            missing = [n for n, ref in refs.items() if ref in not_ready]
            desc = "; ".join(f"node {n} (Ray node {self.nodes[n]['NodeID'][:12]} at {self.node_address(n)}): "
                             f"{self.plan.devices_per_node} {self.device_resource} and {len(self._per_node[n])} CPU "
                             f"for {len(self._per_node[n])} role(s)" for n in missing)
            raise RayBackendError(f"placement group(s) not ready after {self.placement_timeout_s:.0f}s "
                                  f"(launcher.ray.placement_timeout_s) — {desc}: is another job holding those devices "
                                  "or CPUs, or does the node declare fewer?")
        for node in self.pgs:
            table = ray.util.placement_group_table(self.pgs[node])
            want = self.nodes[node]["NodeID"]
            got = set(table.get("bundles_to_node_id", {}).values())
            if got != {want}:
                raise RayBackendError(f"placement group of node {node} landed on {got}, not on Ray node {want}")

    def node_address(self, node: int) -> str:
        return self.nodes[node].get("NodeManagerAddress", "127.0.0.1")

    def _actor(self, name: str):
        """The role's actor, created in its bundle when missing (first start, or after it died)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s = self.slots[name]
        if s.actor is None:
            opts = dict(num_cpus=1, name=f"{self.run_id}:{name}", namespace=RAY_NAMESPACE,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(self.pgs[s.node],
                                                                             placement_group_bundle_index=s.bundle))
            if s.devices:
                if self.device_resource == "GPU":
                    opts["num_gpus"] = len(s.devices)
                else:
                    opts["resources"] = {self.device_resource: len(s.devices)}
            s.actor = _role_host_class().options(**opts).remote(name)
            info = self._call(s, s.actor.info.remote(), "report its node")
            s.ray_node_id, s.ip, s.hostname, s.ray_gpu_ids = info["node_id"], info["ip"], info["hostname"], info["gpu_ids"]
        return s.actor

    def _call(self, s: Slot, ref, what: str, timeout_s: float | None = None):
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(ref, timeout=timeout_s or self.call_timeout_s)
        except GetTimeoutError:
            raise RayBackendError(f"role actor {s.name} on node {s.node} ({s.ip or 'not placed yet'}) did not "
                                  f"{what} within {timeout_s or self.call_timeout_s:.0f}s "
                                  "(launcher.ray.call_timeout_s)") from None

    def check_shared_run_dir(self) -> None:
        """Every node that runs a role must see the run directory (config, logs, checkpoints)."""
        token = secrets.token_hex(8)
        path = os.path.join(self.run_dir, ".ray_shared_check")
        with open(path, "w") as f:
            f.write(token)
        seen: set[str] = set()
        for name, s in self.slots.items():
            if s.node in seen:
                continue
            seen.add(s.node)
            got = self._call(s, self._actor(name).read_token.remote(path), "read the run directory")
            if got != token:
                raise RayBackendError(f"the run directory {self.run_dir} is not visible from Ray node {s.ray_node_id[:12]} "
                                      f"({s.ip}, plan node {s.node}): under --backend ray it must be on storage every "
                                      "node mounts (pass --run-dir on shared storage)")

    # ---- the ProcessTable questions --------------------------------------------------------------
    def host(self, name: str) -> str:
        self._actor(name)
        return self.slots[name].ip

    def free_port(self, name: str) -> int:
        """A free port on `name`'s node, never one this run handed out before on that node."""
        s = self.slots[name]
        host = self.host(name)
        handed = self._ports_handed.setdefault(host, set())
        port = self._call(s, self._actor(name).free_port.remote(host, sorted(handed)), "pick a free port")
        handed.add(port)
        return port

    def device_env(self, name: str) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES of a role: the devices Ray gave its actor (= the plan's, the node being
        ours); from the plan where the device resource is not Ray's GPU."""
        s = self.slots[name]
        if not s.devices:
            return {}
        self._actor(name)
        ids = s.ray_gpu_ids if self.device_resource == "GPU" and s.ray_gpu_ids else list(s.devices)
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in ids)}

    def placement(self, name: str) -> dict:
        s = self.slots.get(name)
        return s.record() if s is not None else {}

    def start(self, name: str, argv: list[str], env: dict[str, str], *, critical: bool = True) -> Role:
        s = self.slots[name]
        actor = self._actor(name)
        log_path = os.path.join(self.run_dir, "logs", f"{name}.log")
        delta = {k: v for k, v in env.items() if not _node_local(k)} | self.device_env(name)
        pid = self._call(s, actor.start.remote(list(argv), delta, log_path, sys.executable), "start its process")
        proc = RayProc(actor, pid, self.call_timeout_s, f"{name} (node {s.node}, {s.ip})")
        role = Role(name, proc, log_path, critical, list(argv), dict(env))
        self.roles.append(role)
        self._record()
        return role

    def restart(self, role: Role, extra_argv: list[str] = ()) -> Role:
        """Same bundle (node, devices), same argv (+ `extra_argv`): a new actor when the old one died."""
        s = self.slots[role.name]
        self._end(role, 5.0)
        self.roles.remove(role)
        # The old process group (its port) may still be ending: the watchdog kills it within ~0.3 s.
        self._call(s, self._actor(role.name).wait_group_gone.remote(role.pid, 15.0), "see the old process end", 30.0)
        return self.start(role.name, [*role.argv, *extra_argv], role.env, critical=role.critical)

    def stop(self, role: Role, timeout_s: float = 10.0) -> None:
        self._end(role, timeout_s)

    def _end(self, role: Role, timeout_s: float) -> None:
        """TERM/KILL the role's process group through its actor, then remove the actor."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        s = self.slots[role.name]
        actor = role.proc.actor
        if not role.proc.actor_died and role.proc.returncode is None:
            try:
                rc = ray.get(actor.stop.remote(timeout_s), timeout=timeout_s + self.call_timeout_s)
                if rc is not None:
                    role.proc.returncode = rc
            except (RayActorError, GetTimeoutError):
                pass  # gone or stuck: killing the actor ends the role (watchdog)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 — already dead
            pass
        if role.proc.returncode is None:
            role.proc.returncode = -9
        if s.actor is actor:
            s.actor = None

    def dead(self) -> list[Role]:
        """Roles whose process ended or whose actor died — one batched poll of every actor."""
        import ray
        from ray.exceptions import RayActorError

        live = [r for r in self.roles if r.proc.returncode is None]
        if live:
            refs = [r.proc.actor.poll.remote() for r in live]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.call_timeout_s)
            for r, ref in zip(live, refs):
                if ref in ready:
                    try:
                        rc = ray.get(ref)
                    except RayActorError:
                        r.proc.actor_died, rc = True, -9
                    if rc is not None:
                        r.proc.returncode = rc
        return [r for r in self.roles if r.proc.returncode is not None]

    def close(self) -> None:
        """Remove this run's actors and placement groups (only those); end a cluster we started."""
        import ray
        from ray.util import remove_placement_group

        for s in self.slots.values():
            if s.actor is not None:
                try:
                    ray.kill(s.actor, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
                s.actor = None
        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 — removed already
                pass
        self.pgs = {}
        if ray.is_initialized():
            ray.shutdown()  # a cluster we started (no address) ends with the driver

    def _record(self) -> None:
        super()._record(extra={"backend": "ray", "ray_run_id": self.run_id,
                               "placement_groups": [f"{self.run_id}:node{n}" for n in sorted(self._per_node)],
                               "placement": {n: s.record() for n, s in self.slots.items()}
                               | {n: self._driver_record() for n in self.services}})

    def _driver_record(self) -> dict:
        """Where services the launcher started itself run (its redis-server): the driver's node."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        node = next((k for k, n in enumerate(self.nodes) if n["NodeID"] == here), None)
        return {"node": node, "devices": [], "node_ip": ray.util.get_node_ip_address(), "ray_node_id": here}
