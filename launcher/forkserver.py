"""The fork server (`launcher.forkserver`): one process per run that imports the roles' heavy libraries
once and forks every areal_like role of the run from it.

A role that starts as `python -m areal_like.<role>` spends about 3.5 CPU-seconds importing torch and
transformers before it does anything (measured on the 2-core CPU machine: `import torch` 1.9 s,
`from transformers import AutoTokenizer` 3.4 s with it) — half of what a short run's three roles cost
in all, and the time a restarted role is away. The launcher starts the fork server first, while it writes the
config and starts Redis; each embedded server, learner rank and rollout worker is then a `fork()` of
the host that runs its module as `__main__`, exactly as `python -m` would:

* a session of its own (the launcher ends a role by process group, as before),
* its log file as stdout and stderr, /dev/null as stdin,
* the environment the launcher gave it (`os.environ`; torch's thread count follows its
  OMP_NUM_THREADS, which the OpenMP runtime read once, at the host's import),
* its CPUs (`launcher.cpu_affinity`) set before its code runs,
* numpy's global generator reseeded from the OS (Python's `random` is reseeded by the fork itself),
* exit status: what `python -m` would give — 0, `sys.exit`'s code, or 1 with the traceback printed.

What it does not change: SGLang servers and any role run by another interpreter (`server.python`)
start as their own processes; the Ray backend starts roles in its actors. The host never initializes
CUDA (a CUDA context does not survive a fork) — it checks that before each fork and refuses.
`/proc/<pid>/environ` and `/proc/<pid>/cmdline` of a forked role show the host's (its environment is
the generation servers' — no Redis secret — and its command line names this module).

The protocol is JSON lines over a socket pair: the launcher sends `{"module", "args", "env", "cwd", "log",
"cpus"}` and reads `{"pid"}` (or `{"error"}`); the host sends `{"exit": pid, "code": rc}` when a role
ends (it reaps them). The host ends when the launcher's end of the socket closes, and leaves its
roles running for the launcher to end (the launcher ends them before it closes the socket).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from areal_like.api.process import process_running

HOST_START_TIMEOUT_S = 120.0
"""How long the launcher waits for the host's imports before a role start fails naming its log."""

PRELOAD = ("torch", "torch.distributed", "numpy", "transformers", "aiohttp", "redis", "msgspec", "safetensors")
"""Imported by the host once (the roles' own modules are not: each role imports its own in its fork)."""


def forkable(argv: list[str]) -> str | None:
    """The module `argv` runs when it is `<this interpreter> -m <module> …`, else None."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m":
        return argv[2]
    return None


class ForkServerError(RuntimeError):
    """The host failed to start, died, or refused a role: the message names its log."""


class ForkedProcess:
    """The `subprocess.Popen` subset the launcher's supervision uses (pid, returncode, poll, wait,
    terminate, kill, send_signal) for a role forked by the host; its exit status comes from the host."""

    def __init__(self, host: "ForkServer", pid: int):
        self._host, self.pid, self.returncode = host, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._host.collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"role pid {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: starts the host process and asks it for roles."""

    def __init__(self, env: dict[str, str], log_path: str):
        self.log_path = log_path
        ours, theirs = socket.socketpair()
        log = open(log_path, "ab", buffering=0)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launcher.forkserver", str(theirs.fileno())], env=env, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True)  # Ctrl-C reaches the launcher only; it ends the roles itself
        finally:
            log.close()
            theirs.close()
        self._sock = ours
        self._buf = b""
        self._lock = threading.Lock()
        self._children: dict[int, ForkedProcess] = {}  # a role's exit comes after its pid: the host reaps
        # only between requests, once it has answered
        self._ready = False
        self._gone = False

    def _fail(self, what: str) -> ForkServerError:
        return ForkServerError(f"the fork server (pid {self.proc.pid}) {what}; see {self.log_path} "
                             "(launcher.forkserver=false starts every role as its own process)")

    def _read_lines(self, timeout: float) -> list[dict]:
        """Messages from the host, waiting at most `timeout` for the first one."""
        out = []
        if self._gone:
            return out
        r, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        while r:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                self._gone = True
                break
            self._buf += chunk
            r, _, _ = select.select([self._sock], [], [], 0)
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if "exit" in msg:
                pid, code = int(msg["exit"]), int(msg["code"])
                child = self._children.pop(pid, None)
                if child is not None:
                    child.returncode = code
            else:
                out.append(msg)
        if self._gone:  # the host died: its roles' statuses are lost; a role no longer running has ended
            for pid, child in list(self._children.items()):
                if not process_running(pid):
                    child.returncode = -9
                    del self._children[pid]
        return out

    def collect(self) -> None:
        """Read the exits the host reported (non-blocking)."""
        with self._lock:
            self._read_lines(0.0)

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str, cpus: set[int] | None) -> ForkedProcess:
        module = forkable(argv)
        assert module is not None, argv
        request = {"module": module, "args": argv[3:], "env": env, "cwd": os.getcwd(), "log": log_path,
                   "cpus": sorted(cpus) if cpus else None}
        with self._lock:
            if not self._ready:
                msgs = self._await(HOST_START_TIMEOUT_S, "finish importing its libraries")
                self._ready = any(m.get("ready") for m in msgs)
            try:
                self._sock.sendall(json.dumps(request).encode() + b"\n")
            except OSError as e:
                raise self._fail(f"cannot be reached ({e})") from None
            (msg,) = self._await(30.0, f"start {module}")
            if "error" in msg:
                raise self._fail(f"cannot start {module}: {msg['error']}")
            child = ForkedProcess(self, int(msg["pid"]))
            self._children[child.pid] = child
            return child

    def _await(self, timeout_s: float, what: str) -> list[dict]:
        """The host's next message(s) other than exits; ForkServerError naming `what` if it died or took
        longer than `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            msgs = self._read_lines(min(1.0, max(0.0, deadline - time.monotonic())))
            if msgs:
                return msgs
            if self._gone:
                raise self._fail(f"exited with {self.proc.poll()} before it could {what}")
            if time.monotonic() >= deadline:
                raise self._fail(f"did not {what} in {timeout_s:.0f} s")

    def close(self, timeout_s: float = 5.0) -> None:
        """End the host (its roles were ended by the launcher already)."""
        try:
            self._sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait(timeout=5)


# ---- the host process ---------------------------------------------------------------------------------
def _run_role(request: dict) -> int:
    """In the forked child: become the role, run its module as `__main__`, return its exit status."""
    import runpy
    import traceback

    os.setsid()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fd = request["log_fd"]
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    if request["cpus"]:
        os.sched_setaffinity(0, set(request["cpus"]))
    import numpy
    import torch

    threads = request["env"].get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    numpy.random.seed()  # a fresh process's numpy draws from the OS; the fork copied the host's state
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # what the interpreter prints for an uncaught exception, and its status
        traceback.print_exc()
        return 1


def _fork_role(request: dict, sock: socket.socket) -> int:
    import torch

    host_pid = os.getpid()
    if torch.cuda.is_initialized():  # a CUDA context does not survive fork(): never fork from one
        raise ForkServerError("CUDA was initialized in the fork server")
    sys.stdout.flush()
    sys.stderr.flush()
    # the log exists once the launcher hears the pid (as with Popen's, opened before the role starts)
    request["log_fd"] = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        pid = os.fork()
    finally:
        if os.getpid() == host_pid:
            os.close(request["log_fd"])
    if pid:
        return pid
    code = 1
    try:
        sock.close()  # the launcher's line to the host is not the role's
        code = _run_role(request)
    except BaseException:  # before its module ran (its log, cwd or CPUs): say why in its log
        import traceback

        traceback.print_exc()
    finally:
        import atexit

        from areal_like.api.process import exit_now

        try:
            atexit._run_exitfuncs()  # what the interpreter's exit would run (a role's own handlers)
        finally:
            exit_now(code)  # never back into the host's loop


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    t0 = time.monotonic()
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (their lazy modules)
    import transformers.modeling_utils  # noqa: F401

    print(f"[forkserver] imported {', '.join(PRELOAD)} in {time.monotonic() - t0:.1f} s (pid {os.getpid()})", flush=True)
    if threading.active_count() != 1:  # fork() copies only the calling thread
        print(f"[forkserver] {threading.active_count()} threads after the imports: cannot fork roles", flush=True)
        return 1
    try:
        _serve(sock)
    except (BrokenPipeError, ConnectionResetError):  # the launcher is gone: the roles are its (or `launcher stop`'s)
        print("[forkserver] the launcher closed the connection", flush=True)
    return 0


def _serve(sock: socket.socket) -> None:
    """Fork a role per request, report every role's exit; return when the launcher closes its end."""
    sock.sendall(b'{"ready": true}\n')
    buf = b""
    while True:
        r, _, _ = select.select([sock], [], [], 0.05)
        if r:
            chunk = sock.recv(65536)
            if not chunk:  # the launcher is gone or done: the roles are its to end
                return
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                request = json.loads(line)
                try:
                    reply = {"pid": _fork_role(request, sock)}
                    print(f"[forkserver] forked pid {reply['pid']}: python -m {request['module']}", flush=True)
                except Exception as e:  # noqa: BLE001 — reported to the launcher, which names it
                    reply = {"error": f"{type(e).__name__}: {e}"}
                sock.sendall(json.dumps(reply).encode() + b"\n")
        while True:  # reap ended roles and report their status
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    from areal_like.api.process import exit_now

    exit_now(main())
