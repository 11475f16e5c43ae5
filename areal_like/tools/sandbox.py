"""Run untrusted Python (a model's tool call, a code-reward test) in a contained process.

    parent (asyncio, this module)          P: bootstrap (root or the user; new session = new pgid)
      mkdtemp scratch, main.py    ──exec──▶  unshare(net, pid, ipc[, mount])   (refuse if net impossible)
      read stdout / stderr (count all,       IPC namespace limits: System V shm ≤ memory_mb, few queues/sets
        keep head and tail)                  [root] private mounts: an empty tmpfs on /tmp, /var/tmp,
      wait ≤ timeout_s for P (pidfd),          /dev/shm, /run/lock, a fresh mqueue on /dev/mqueue, and on any
      else killpg; read the status pipe        directory the sandbox user cannot traverse (e.g. a 0700 /root
      rmtree scratch (always)                  holding the interpreter), with only the needed paths bound
                                               back in; then every other mount read-only (per mount, in this
                                               namespace). [not root] + a user namespace, which grants the
                                               right to make the others; B keeps the user's uid
                                           └─fork─▶ A: pid 1 of the new pid namespace ([root] mounts /proc)
                                                    reaps everything; reports B's wait status + rusage on
                                                    the status pipe; its exit kills every process left
                                                    in the namespace (kernel rule for a pid-ns init)
                                                    └─fork─▶ B: rlimits, [root] drop to a one-off uid,
                                                             no_new_privs, execve(python -E -s main.py)

Why each piece:
- The user's code is never pid 1: the kernel ignores default-action signals (SIGXCPU, SIGXFSZ) sent to
  a namespace's init, so the CPU and file-size limits would not stop it.
- RLIMIT_NPROC does not apply to uid 0, so as root B switches to a uid of its own (one per run, from
  `_UID_BASE`): the process-count limit then counts only this run's processes, concurrent runs cannot
  starve or signal each other, and it cannot write the project's root-owned files.
- The new network namespace has only a loopback interface, down: nothing is reachable, not even the
  host's 127.0.0.1. Without it (no CAP_SYS_ADMIN and no user namespaces) a run with network=False is
  refused, never silently run with network.
- Every process of a run dies with A (pid namespace), with P (PR_SET_PDEATHSIG chain) and with a
  timeout (the parent kills the process group by its pgid). Without a pid namespace (network=True on a
  host that allows no namespaces) A kills its process group when B ends and the parent also kills any
  process left with the run's uid — only a run's own processes ever have it.
- Without a mount namespace, a root run's one-off uid must be able to read the interpreter itself;
  where it cannot (pyenv under a 0700 /root), the run fails as "sandbox_error" with that explanation.
- Calls are fresh and leave nothing (issue 24): the IPC namespace dies with the call's last process, and
  its System V segments, semaphores, message queues and POSIX queues with it (on the host, a segment
  outlives its creator and its mapping, so RLIMIT_AS never bounded it). As root the only directories a
  call can write are its scratch directory (its cwd, removed after the call) and `_PRIVATE_TMP` +
  /dev/mqueue, each an empty mount of its own; everything else is read-only, so a world-writable host
  directory, or a file left by an earlier run of the same one-off uid, cannot be written.

What it does not do: no seccomp filter (every system call reaches the kernel: its attack surface is the
whole syscall ABI, and a kernel bug is a way out), no hiding of what "other" may read (the host's files,
read-only), no limit on the total bytes written to the scratch directory (each file is capped by `file_mb`,
the run by `timeout_s`; the private tmpfs mounts by 4 × file_mb each, /run/lock 1 MB). Memory held outside
RLIMIT_AS: those tmpfs pages and System V shared memory (≤ memory_mb), all freed with the call. Not root:
no mount namespace, so the code writes whatever the user may write, and its IPC namespace keeps the
kernel's default limits (freed with the call). Linux only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field

SCRATCH_PREFIX = "areal_like_sandbox_"
"""Scratch directories are `tempfile.gettempdir()/areal_like_sandbox_*`; each is removed after its run."""

ERROR_KINDS = ("timeout", "cpu", "memory", "output_limit", "process_limit", "network", "exception", "refused",
               "sandbox_error")
"""`SandboxResult.error` values: wall-clock timeout, CPU seconds (SIGXCPU), memory (MemoryError under
RLIMIT_AS), a file over `file_mb` (EFBIG / SIGXFSZ), the process limit (fork/thread refused), the network
(unreachable), another nonzero exit, refused (no network namespace possible), the sandbox itself failed."""

_UID_BASE = 1_000_000_000
"""One-off uids for root runs: _UID_BASE + (pid mod 2**20) * 256 + a per-process counter (mod 256).
Far above any login uid; 2**20 * 256 = 2**28, so the largest is < 2**31."""

_NOBODY = 65534

_ENV_BASE = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    # BLAS/OpenMP start one thread per core at import: on a big node that alone exceeds max_procs
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}

_PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
"""Root runs: each is an empty tmpfs of the call's own (where the host has the directory); with /dev/mqueue
(the call's IPC namespace) and the scratch directory, the only places a call can write."""

# The bootstrap runs as `python -I -S -c _BOOT <json>` (P), then forks A and B. It imports only modules
# that need no site-packages, and reports on the status pipe as JSON lines.
_BOOT = r'''
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
FD = cfg["status_fd"]
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
NEWNS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
# per-mount options kept by the read-only remount (mountinfo field 6)
MNT_OPTS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024, "nodiratime": 2048,
            "relatime": 1 << 21, "strictatime": 1 << 24}


def report(**kv):
    os.write(FD, (json.dumps(kv) + "\n").encode())


def die_with_parent(ppid):
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != ppid:  # the parent died before the line above
        os._exit(1)


def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s: %s" % (dst, os.strerror(e)))


def unescape(path):
    # mountinfo writes space, tab, newline and backslash as \ooo
    out, i = bytearray(), 0
    raw = path.encode()
    while i < len(raw):
        if raw[i:i + 1] == b"\\" and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def private_mounts():
    # first: nothing mounted below may propagate back to the host's mount namespace
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    for target, mode, size, keep in cfg["overlays"]:
        # O_PATH fds keep the real directories reachable once the tmpfs covers their ancestor
        fds = [os.open(p, os.O_PATH | os.O_DIRECTORY) for p in keep]
        mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "mode=%o,size=%d,nr_inodes=8192" % (mode, size))
        for fd, p in zip(fds, keep):
            os.makedirs(p, exist_ok=True)
            mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC)
            os.close(fd)
    for p in cfg["bind_self"]:  # a mount of its own, so the read-only pass below can leave it writable
        mount(p, p, None, MS_BIND)
    keep_rw = set(cfg["writable"])
    if "/dev/mqueue" in keep_rw:
        keep_rw.discard("/dev/mqueue")  # writable only as this call's own, below
        if flags & NEWIPC:
            try:  # the POSIX queues of this call's IPC namespace (the host's /dev/mqueue shows the host's)
                mount("mqueue", "/dev/mqueue", "mqueue", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                keep_rw.add("/dev/mqueue")
            except OSError as e:
                report(warning="%s: read-only" % e)
    # then everything else read-only (per mount, in this namespace only: MS_BIND): whatever the host lets
    # "other" write (a 1777 directory, a file of a uid reused by a later run) cannot be written from here
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    failed = []
    for fields in mounts:
        point = unescape(fields[4])
        if point in keep_rw or "ro" in fields[5].split(","):
            continue
        opts = MS_RDONLY | MS_REMOUNT | MS_BIND
        for o in fields[5].split(","):
            opts |= MNT_OPTS.get(o, 0)
        try:
            mount(None, point, None, opts)
        except OSError as e:
            if e.errno != 2 and os.path.exists(point):  # ENOENT: under a private tmpfs now, unreachable
                failed.append("%s (%s)" % (point, os.strerror(e.errno)))
    if failed:
        report(warning="could not make read-only: " + ", ".join(failed))


def ipc_limits():
    # this call's IPC namespace starts with the kernel's defaults (System V shared memory: no limit); its
    # segments outlive their mapping, so RLIMIT_AS alone does not bound them: cap them at memory_mb
    failed = []
    for path, value in cfg["ipc_sysctls"]:
        try:
            with open(path, "w") as f:
                f.write(value)
        except OSError as e:
            failed.append("%s (%s)" % (path, e.strerror))
    if failed:
        report(warning="IPC limits not set: " + ", ".join(failed))


def run_b():
    """B: the user's code. Nothing here may print to stdout/stderr (they are the user's)."""
    try:
        os.set_inheritable(FD, False)  # closed by execve
        os.chdir(cfg["cwd"])
        for name, value in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), tuple(value))
        if cfg["uid"] is not None:
            os.setgroups([])
            os.setgid(cfg["uid"])
            os.setuid(cfg["uid"])
        die_with_parent(a_pid)  # after setuid: a credential change clears the setting
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries cannot give root back
        exe = cfg["python"]
        # -E -s: no PYTHON* variables, no user site; not -I, so the scratch directory is on sys.path
        os.execve(exe, [exe, "-E", "-s", "-B", "main.py"], cfg["env"])
    except BaseException as e:
        try:
            report(setup_error="%s: %s" % (type(e).__name__, e))
        finally:
            os._exit(127)


die_with_parent(cfg["ppid"])
os.umask(0o022)
is_root = os.geteuid() == 0
tries = cfg["unshare_tries"] if is_root else cfg["unshare_tries_user"]
flags, errors = None, []
for f in tries:
    if f == 0 or libc.unshare(f) == 0:
        flags = f
        break
    errors.append(os.strerror(ctypes.get_errno()))
if flags is None or (not cfg["network"] and not flags & NEWNET):
    report(refused="; ".join(errors) or "no namespace could be created")
    os._exit(0)
pidns = bool(flags & NEWPID)
report(pidns=pidns, ipcns=bool(flags & NEWIPC))
if flags & NEWIPC:
    ipc_limits()
else:
    report(warning="no IPC namespace: System V and POSIX IPC objects are shared with the host and outlive the call")
mounts_ok = False
if flags & NEWNS:
    try:
        private_mounts()
        mounts_ok = True
    except OSError as e:
        report(warning="private mounts: %s" % e)

p_pid = os.getpid()
a_pid = os.fork()
if a_pid == 0:
    die_with_parent(0 if pidns else p_pid)  # P lies outside A's pid namespace: getppid() is 0 there
    a_pid = os.getpid()
    if pidns and mounts_ok:
        try:  # /proc of the new pid namespace: the host's processes are not visible
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        except OSError as e:
            report(warning="mount /proc: %s" % e)
    b = os.fork()
    if b == 0:
        run_b()
    while True:
        try:
            pid, status, ru = os.wait4(-1, 0)
        except InterruptedError:
            continue
        except ChildProcessError:
            os._exit(1)
        if pid == b:
            break
    report(status=status, cpu_s=ru.ru_utime + ru.ru_stime, maxrss_kb=ru.ru_maxrss, pidns=pidns)
    if not pidns:
        os.killpg(0, signal.SIGKILL)  # B's leftovers (and P, and A); P is alive, so the pgid is still ours
    os._exit(0)
while True:
    try:
        os.waitpid(a_pid, 0)
        break
    except InterruptedError:
        continue
os._exit(0)
'''

_NEWNS, _NEWIPC, _NEWUSER, _NEWPID, _NEWNET = 0x00020000, 0x08000000, 0x10000000, 0x20000000, 0x40000000


@dataclass(frozen=True)
class SandboxResult:
    """What a run gave. `stdout`/`stderr` are already truncated to `output_chars` (the text says so);
    `error` is None for a clean exit (code 0), else one of `ERROR_KINDS`, explained by `message`."""

    stdout: str
    stderr: str
    exit_code: int | None  # B's exit code; -N if a signal N ended it; None if it never ran
    timed_out: bool
    error: str | None
    seconds: float
    message: str = ""
    cpu_s: float = 0.0
    max_rss_mb: float = 0.0
    stdout_chars: int = 0  # len(stdout)
    stdout_bytes: int = 0  # every byte the program wrote to stdout (all read, counted; most not kept)
    stderr_bytes: int = 0
    warnings: tuple[str, ...] = field(default=())


def truncate_middle(text: str, limit: int) -> str:
    """Head and tail of `text` within `limit` chars, the note included (output matters at both ends),
    saying how many chars were cut. Text already within the limit is returned as is, so a tool's output
    cut by the tool itself (the sandbox, with its own note) is not cut again."""
    if len(text) <= limit:
        return text
    note = lambda n: f"\n...[{n} chars truncated: over the {limit}-char limit]...\n"  # noqa: E731
    room = max(0, limit - len(note(len(text))))
    head = room * 2 // 3
    tail = room - head
    return text[:head] + note(len(text) - head - tail) + (text[-tail:] if tail else "")


def _decode(raw: bytes) -> str:
    """Bytes as text, one char per undecodable byte (surrogateescape), so the bytes behind any slice
    can be counted exactly (`_nbytes`)."""
    return raw.decode("utf-8", "surrogateescape")


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))


def _shown(text: str) -> str:
    """Undecodable bytes as U+FFFD for the reader."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class _Capture:
    """First and last `cap` bytes of a stream, draining (and counting) the rest so the writer never
    blocks; `render` cuts it to the caller's limit with a note giving the exact number of bytes cut."""

    def __init__(self, cap: int):
        self.cap = cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.complete = False  # read to end-of-file (every writer gone), so `total` is the whole output

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while True:
            chunk = await stream.read(1 << 16)
            if not chunk:
                self.complete = True
                return
            self.total += len(chunk)
            room = self.cap - len(self.head)
            if room > 0:
                self.head += chunk[:room]
                chunk = chunk[room:]
            if chunk:
                self.tail += chunk
                if len(self.tail) > self.cap:
                    del self.tail[:len(self.tail) - self.cap]

    def end(self, limit: int) -> str:
        """The last `limit` chars read (for classifying the exit: a traceback's last line)."""
        whole = self.total == len(self.head) + len(self.tail)
        return _shown(_decode(bytes(self.head) + bytes(self.tail) if whole else bytes(self.tail))[-limit:])

    def render(self, limit: int, keep: str = "middle", strip: str = "") -> str:
        """What was read, within `limit` chars: all of it, or its head and tail (keep="middle") or its
        tail (keep="tail"), around a note that says how many bytes were cut, exactly — "at least" when
        the stream was not read to its end (a writer outlived the call). `strip` is removed from the
        shown text (the scratch path), after the cut, so the counts are the program's bytes."""
        whole = self.total == len(self.head) + len(self.tail)  # nothing dropped while reading
        text = _decode(bytes(self.head) + bytes(self.tail)) if whole else None
        if text is not None and len(text) <= limit and self.complete:
            return _shown(text.replace(strip, "") if strip else text)
        least = "" if self.complete else "at least "

        def note(cut: int) -> str:
            return (f"...[{least}{cut} bytes truncated: the output was {least}{self.total} bytes, over the "
                    f"{limit}-char limit]...\n")

        if text is not None and len(text) <= limit:  # all shown, but the stream was not read to its end
            head_s, tail_s = text, ""
        else:
            room = max(0, limit - len(note(self.total)) - 1)
            n_head = room * 2 // 3 if keep == "middle" else 0
            n_tail = room - n_head
            head_s = (text if text is not None else _decode(bytes(self.head)))[:n_head]
            tail_s = (text if text is not None else _decode(bytes(self.tail)))[-n_tail:] if n_tail else ""
        cut = self.total - _nbytes(head_s) - _nbytes(tail_s)
        if strip:
            head_s, tail_s = head_s.replace(strip, ""), tail_s.replace(strip, "")
        return _shown(head_s) + ("\n" if head_s else "") + note(cut) + _shown(tail_s)


_counter = 0


def _run_uid() -> int | None:
    """The uid B runs as: None when not root (B keeps the user's uid; its user namespace, if any,
    shows it as nobody). A one-off uid when the uid map allows it, else nobody (shared by every run:
    concurrent runs then share one process-count limit)."""
    global _counter
    if os.geteuid() != 0:
        return None
    _counter = (_counter + 1) % 256
    uid = _UID_BASE + (os.getpid() % (1 << 20)) * 256 + _counter
    try:
        with open("/proc/self/uid_map") as f:
            extents = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
    except OSError:
        extents = []
    mapped = lambda u: any(lo <= u < lo + n for lo, _, n in extents)  # noqa: E731
    if mapped(uid):
        return uid
    return _NOBODY


def _topmost_closed_ancestor(path: str) -> str | None:
    """The highest directory on `path` (itself included) that "other" may not traverse, or None."""
    parts = path.strip("/").split("/")
    cur = ""
    for part in parts:
        cur = f"{cur}/{part}"
        try:
            st = os.stat(cur)
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & stat.S_IXOTH:
            return cur
    return None


def _overlay_plan(scratch: str, python: str, tmpfs_bytes: int) -> list[tuple[str, int, int, list[str]]]:
    """Root runs only: the tmpfs mounts P makes in its private mount namespace, as
    (target, mode, size, paths bound back in). Private /tmp, /var/tmp, /dev/shm, /run/lock (files written
    there vanish with the run); and a 0755 tmpfs on any directory the sandbox uid cannot traverse on the way to
    the interpreter or the scratch directory, so B can exec the same Python (e.g. pyenv under a 0700
    /root) while everything else there stays hidden."""
    needed = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.base_exec_prefix, sys.exec_prefix,
                                            os.path.dirname(os.path.realpath(python)),
                                            os.path.dirname(os.path.abspath(python)))}
    needed.add(os.path.realpath(scratch))
    # keep only the outermost of nested paths (binding the outer one brings the inner along)
    roots = sorted(needed)
    outer = [p for p in roots if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in roots)]
    plan: dict[str, list[str]] = {t: [] for t in _PRIVATE_TMP if os.path.isdir(t) and not os.path.islink(t)}
    for p in outer:
        cands = [t for t in plan if p.startswith(t + "/")]
        closed = _topmost_closed_ancestor(p)
        if closed is not None and closed != p:
            cands.append(closed)
        if not cands:
            continue
        target = min(cands, key=len)
        plan.setdefault(target, []).append(p)
    out = []
    for target in sorted(plan, key=lambda t: t.count("/")):
        mode = 0o1777 if target in _PRIVATE_TMP else 0o755
        # /run/lock holds lock files: 1 MB (tmpfs pages are memory outside RLIMIT_AS)
        size = tmpfs_bytes if target in _PRIVATE_TMP and target != "/run/lock" else 1 << 20
        out.append((target, mode, size, plan[target]))
    return out


def _ipc_sysctls(memory_mb: int) -> list[tuple[str, str]]:
    """Limits of a call's own IPC namespace (it starts with the kernel's defaults, where System V shared
    memory is unlimited and a segment outlives its mapping, out of RLIMIT_AS's reach): shared memory
    memory_mb in all, a few message queues and semaphore sets. POSIX queues are bounded by the uid's
    RLIMIT_MSGQUEUE (800 KB by default)."""
    page = os.sysconf("SC_PAGE_SIZE")
    return [("/proc/sys/kernel/shmmax", str(memory_mb << 20)),
            ("/proc/sys/kernel/shmall", str((memory_mb << 20) // page)),
            ("/proc/sys/kernel/shmmni", "64"),
            ("/proc/sys/kernel/msgmni", "16"),  # x msgmnb (16 KB each)
            ("/proc/sys/kernel/sem", "250 4000 32 16")]  # semmsl semmns semopm semmni


def _kill_uid(uid: int) -> int:
    """SIGKILL every process whose real uid is `uid` (a run's one-off uid: only its processes have it).
    Through a pidfd, so a pid reused between the check and the kill is never hit."""
    killed = 0
    for _ in range(20):  # a fork bomb may still be forking: repeat until none is left
        found = 0
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                pidfd = os.pidfd_open(int(name))
            except OSError:
                continue
            try:
                with open(f"/proc/{name}/status") as f:
                    real_uid = next((int(line.split()[1]) for line in f if line.startswith("Uid:")), None)
                if real_uid == uid:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    found += 1
            except (OSError, StopIteration):
                pass
            finally:
                os.close(pidfd)
        killed += found
        if not found:
            break
        time.sleep(0.01)
    return killed


def _rmtree(path: str) -> None:
    """Remove a scratch directory even where the sandboxed code took away its own permissions."""
    def onerror(func, p, exc):  # noqa: ARG001
        try:
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass
    shutil.rmtree(path, onerror=onerror)


def _safe_name(name: str) -> str:
    norm = os.path.normpath(name)
    if os.path.isabs(norm) or norm.startswith("..") or norm in (".", ""):
        raise ValueError(f"sandbox file name {name!r} must be a relative path inside the scratch directory")
    return norm


_LAST_LINE_NET = re.compile(r"Network is unreachable|\[Errno 101\]|name resolution|Name or service not known|"
                            r"\[Errno -[235]\]|No address associated")


def _classify(report: dict, timed_out: bool, stderr_tail: str, lim: dict) -> tuple[str | None, str]:
    """(error kind, message) from B's wait status and the end of its stderr; `lim` holds the limits
    (timeout_s, cpu_s as enforced, memory_mb, file_mb, max_procs) for the message."""
    if timed_out:
        return "timeout", f"wall-clock limit of {lim['timeout_s']:g}s exceeded"
    cpu_limit = lim["cpu_s"]
    status = report.get("status")
    if status is None:
        lines = [ln for ln in stderr_tail.strip().splitlines() if ln.strip()]
        return "sandbox_error", ("the sandbox ended without reporting the program's exit"
                                 + (f" ({lines[-1].strip()})" if lines else ""))
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and report.get("cpu_s", 0.0) >= cpu_limit * 0.95):
            return "cpu", f"CPU time limit of {cpu_limit:g}s exceeded"
        if sig == signal.SIGXFSZ:
            return "output_limit", f"a file reached the {lim['file_mb']} MB limit"
        if sig == signal.SIGKILL:
            return "memory", "killed (SIGKILL), most likely by the kernel's out-of-memory killer"
        return "exception", f"killed by signal {name}"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return None, ""
    lines = [ln for ln in stderr_tail.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if re.match(r"^[\w.]*MemoryError\b", last):
        return "memory", f"memory limit of {lim['memory_mb']} MB exceeded"
    if "File too large" in last or "[Errno 27]" in last:
        return "output_limit", f"a file reached the {lim['file_mb']} MB limit"
    # Anywhere in the tail, not only its last line: a fork bomb's processes share one stderr, and the
    # last line written may belong to another process's interleaved traceback (seen in CI under load).
    if ("can't start new thread" in stderr_tail
            or ("Resource temporarily unavailable" in stderr_tail or "[Errno 11]" in stderr_tail)
            and ("fork" in stderr_tail or "Thread" in stderr_tail or "subprocess" in stderr_tail)):
        return "process_limit", f"limit of {lim['max_procs']} processes/threads reached"
    if _LAST_LINE_NET.search(last):
        return "network", "no network in the sandbox"
    return "exception", f"exit code {code}"


async def run_python(code: str, *, timeout_s: float = 5.0, cpu_s: float = 5.0, memory_mb: int = 512,
                     file_mb: int = 16, max_procs: int = 16, output_chars: int = 1024, network: bool = False,
                     stdin: str | None = None, files: dict[str, str] | None = None,
                     python: str | None = None) -> SandboxResult:
    """Run `code` as `python -E -s main.py` in a fresh scratch directory under the limits above (see the
    module docstring). Never raises for anything the code does; raises ValueError for bad limits or
    file names, and re-raises cancellation after killing the run and removing its directory.

    `files` are written into the scratch directory first (relative names); `python` defaults to this
    interpreter, so the code sees the same installed packages."""
    for name, value in (("timeout_s", timeout_s), ("cpu_s", cpu_s), ("memory_mb", memory_mb),
                        ("file_mb", file_mb), ("max_procs", max_procs), ("output_chars", output_chars)):
        if not value > 0:
            raise ValueError(f"sandbox {name}={value!r} must be > 0")
    t0 = time.monotonic()
    if not sys.platform.startswith("linux"):
        return SandboxResult("", "", None, False, "refused", 0.0,
                             message="the Python sandbox needs Linux (namespaces, rlimits, /proc)")
    python = python or sys.executable
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    proc: asyncio.subprocess.Process | None = None
    status_r = status_w = -1
    readers: list[asyncio.Future] = []
    watch: _ExitWatch | None = None
    uid = _run_uid()
    try:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        for name, content in (files or {}).items():
            path = os.path.join(scratch, _safe_name(name))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(content)
            if uid is not None:
                os.chown(path, uid, uid)  # the code may rewrite its own inputs; main.py stays root's
        if uid is not None:
            for dirpath, dirnames, _ in os.walk(scratch):
                for d in [dirpath] + [os.path.join(dirpath, n) for n in dirnames]:
                    os.chown(d, uid, uid)
        os.chmod(scratch, 0o700)

        net = 0 if network else _NEWNET
        cpu_limit = max(1, math.ceil(cpu_s))  # RLIMIT_CPU counts whole seconds
        tmpfs_bytes = max(16, 4 * int(file_mb)) << 20
        overlays = _overlay_plan(scratch, python, tmpfs_bytes) if uid is not None else []
        cfg = {
            "status_fd": 0,  # set below
            "ppid": os.getpid(),
            "network": bool(network),
            # root: mount namespace too (private writable directories, the rest read-only, interpreter
            # reachable) and an IPC namespace (System V and POSIX IPC die with the call); each step down
            # drops one (a missing IPC namespace is reported as a warning)
            "unshare_tries": [_NEWNS | _NEWPID | _NEWIPC | net, _NEWNS | _NEWPID | net, _NEWPID | net, net],
            # not root: a user namespace gives the rights to create the others
            "unshare_tries_user": [_NEWUSER | _NEWPID | _NEWIPC | net, _NEWUSER | _NEWPID | net, _NEWUSER | net]
            + ([0] if network else []),
            "overlays": overlays,
            # what stays writable in the mount namespace: the private tmpfs mounts and the scratch directory
            "writable": [t for t, _, _, _ in overlays if t in _PRIVATE_TMP] + [os.path.realpath(scratch)]
            + (["/dev/mqueue"] if os.path.isdir("/dev/mqueue") else []),
            # the scratch directory is a mount point: bound back under a tmpfs, else onto itself
            "bind_self": [] if not overlays or any(os.path.realpath(scratch) in keep for _, _, _, keep in overlays)
            else [os.path.realpath(scratch)],
            "ipc_sysctls": _ipc_sysctls(int(memory_mb)),
            "cwd": scratch,
            "uid": uid,
            "python": python,
            "env": {**_ENV_BASE, "HOME": scratch, "TMPDIR": scratch},
            "rlimits": [
                ("RLIMIT_CORE", (0, 0)),
                # soft limit → SIGXCPU (classified "cpu"); the hard one, a second later, → SIGKILL
                ("RLIMIT_CPU", (cpu_limit, cpu_limit + 1)),
                ("RLIMIT_AS", (int(memory_mb) << 20,) * 2),
                ("RLIMIT_FSIZE", (int(file_mb) << 20,) * 2),
                ("RLIMIT_NPROC", (int(max_procs),) * 2),
                ("RLIMIT_NOFILE", (256, 256)),
            ],
        }
        status_r, status_w = os.pipe()
        os.set_blocking(status_r, False)
        cfg["status_fd"] = status_w
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(cfg),
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, pass_fds=(status_w,), cwd=scratch, env={"PATH": _ENV_BASE["PATH"]})
        watch = _ExitWatch(proc)
        os.close(status_w)
        status_w = -1
        out_cap, err_cap = _Capture(4 * output_chars + 64), _Capture(max(8192, 4 * output_chars))
        readers += [asyncio.ensure_future(out_cap.drain(proc.stdout)),  # type: ignore[arg-type]
                    asyncio.ensure_future(err_cap.drain(proc.stderr))]  # type: ignore[arg-type]
        if stdin is not None:
            readers.append(asyncio.ensure_future(_feed(proc, stdin)))
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(watch.exited), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            _killpg(proc, watch)
            try:
                await asyncio.wait_for(asyncio.shield(watch.exited), 5.0)  # after SIGKILL: prompt
            except asyncio.TimeoutError:
                pass
        report = _read_reports(status_r)
        if report.get("pidns") is not True and uid is not None and uid != _NOBODY:
            await asyncio.to_thread(_kill_uid, uid)  # processes that left the process group
        # every writer of the pipes is dead now (pid namespace / process group / uid): drain to EOF
        await asyncio.wait(readers, timeout=2.0)
        await _reap(proc)
        seconds = time.monotonic() - t0
        stdout = out_cap.render(output_chars)
        # tracebacks read `File "main.py", line 3`
        stderr = err_cap.render(output_chars, keep="tail", strip=scratch + "/")
        stderr_end = err_cap.end(4096).replace(scratch + "/", "")
        if "refused" in report:
            return SandboxResult("", "", None, False, "refused", seconds, message=(
                f"could not isolate the network ({report['refused']}): the tool config has network: false. "
                "Allow namespaces (run as root or with CAP_SYS_ADMIN, or enable user namespaces: "
                "sysctl user.max_user_namespaces=15000 / kernel.unprivileged_userns_clone=1), "
                "or set `network: true` in the tool config to run without network isolation"))
        if "setup_error" in report:
            hint = ""
            if "Permission denied" in report["setup_error"]:
                hint = ("; the sandbox user cannot reach the interpreter: install Python where other users "
                        "may read it (not under a 0700 home directory), or allow mount namespaces (root "
                        "with CAP_SYS_ADMIN), which let the sandbox reach it")
            return SandboxResult("", stderr, None, False, "sandbox_error",
                                 seconds, message=f"could not start the program: {report['setup_error']} "
                                 f"(interpreter {python}, sandbox uid {uid}){hint}")
        kind, message = _classify(report, timed_out, stderr_end, {
            "timeout_s": timeout_s, "cpu_s": float(cpu_limit), "memory_mb": memory_mb, "file_mb": file_mb,
            "max_procs": max_procs})
        status = report.get("status")
        exit_code = None
        if status is not None:
            exit_code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return SandboxResult(
            stdout=stdout, stderr=stderr,
            exit_code=exit_code, timed_out=timed_out, error=kind, seconds=seconds, message=message,
            cpu_s=float(report.get("cpu_s", 0.0)), max_rss_mb=float(report.get("maxrss_kb", 0)) / 1024.0,
            stdout_chars=len(stdout), stdout_bytes=out_cap.total, stderr_bytes=err_cap.total,
            warnings=tuple(report.get("warnings", ())))
    finally:
        if proc is not None and proc.returncode is None:
            _killpg(proc, watch)  # cancelled (or an error above): the run must not outlive its call
            try:
                await _reap(proc)
            except asyncio.CancelledError:
                pass  # cancelled again while cleaning up: the kill is sent, asyncio reaps P later
        if watch is not None:
            watch.close()
        for t in readers:
            t.cancel()
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        _rmtree(scratch)


class _ExitWatch:
    """`exited` is done when P exits — not when its pipes close, as asyncio's `Process.wait()` is on
    Python 3.11: that also waits for every holder of stdout/stderr, e.g. a daemon that left the process
    group, and would turn a finished run into a timeout. A pidfd (Linux >= 5.3) says when P itself ends."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self._loop = asyncio.get_running_loop()
        self._fd = -1
        try:
            self._fd = os.pidfd_open(proc.pid)
        except ProcessLookupError:  # already gone
            self.exited: asyncio.Future = self._loop.create_future()
            self.exited.set_result(None)
        except (OSError, AttributeError):  # no pidfd here: Process.wait() it is
            self.exited = asyncio.ensure_future(proc.wait())
        else:
            self.exited = self._loop.create_future()
            self._loop.add_reader(self._fd, self._ready)

    def _ready(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        if not self.exited.done():
            self.exited.cancel()


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Let asyncio collect P and close its transport; bounded, in case a pipe is still held open."""
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
    except asyncio.TimeoutError:
        pass


def _killpg(proc: asyncio.subprocess.Process, watch: "_ExitWatch | None" = None) -> None:
    """SIGKILL the run's process group, by its pgid (= P's pid: P leads its own session). Only while P has
    not exited, so the pgid cannot have been freed and reused by someone else."""
    if proc.returncode is not None or (watch is not None and watch.exited.done()):
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _feed(proc: asyncio.subprocess.Process, data: str) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(data.encode())
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the program did not read all of it
    finally:
        try:
            proc.stdin.close()
        except Exception:
            pass


def _read_reports(fd: int) -> dict:
    """The JSON lines P/A/B wrote on the status pipe, merged (warnings collected)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    out: dict = {"warnings": []}
    for line in b"".join(chunks).decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if "warning" in item:
            out["warnings"].append(item.pop("warning"))
        out.update(item)
    return out


def run_python_sync(code: str, **kwargs) -> SandboxResult:
    """`run_python` for synchronous callers (a reward function in a reward worker process). Safe to call
    from code that is itself inside a running event loop: the run then gets a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_python(code, **kwargs))
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sandbox") as ex:
        return ex.submit(asyncio.run, run_python(code, **kwargs)).result()
