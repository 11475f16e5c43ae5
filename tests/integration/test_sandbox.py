"""The python tool's sandbox contains what a model's code can do, with real processes (nothing mocked):
an endless loop, a 10 GB allocation, a fork bomb, a huge file and a TCP connection to the host each end
as an error observation of the right kind, leave no process and no scratch directory behind, and the
next call works (the run goes on)."""

import asyncio
import json
import re
import os
import socket
import sys
import tempfile
import textwrap
import time

import pytest

from areal_like.metrics import REGISTRY
from areal_like.tools import ToolSet, run_python, run_python_sync
from areal_like.tools import sandbox

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux-only")]


def _write_config(tmp_path, **config) -> str:
    cfg = {"timeout_s": 2, "cpu_s": 5, "memory_mb": 256, "file_mb": 4, "max_procs": 16, "output_chars": 1024,
           "network": False, **config}
    body = "tools:\n  - class_name: python\n    config:\n" + "".join(
        f"      {k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in cfg.items())
    path = tmp_path / "tools.yaml"
    path.write_text(body)
    return str(path)


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc: no psutil needed)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(name))
    return out


def _our_sandbox_uid_processes() -> list[int]:
    """Processes running as one of the one-off uids this test process's runs use (root only)."""
    lo = sandbox._UID_BASE + (os.getpid() % (1 << 20)) * 256
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, StopIteration):
            continue
        if lo <= uid < lo + 256:
            out.append(int(name))
    return out


def _scratch_dirs() -> set[str]:
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith(sandbox.SCRATCH_PREFIX)}


def _snapshot() -> tuple[set[str], set[int]]:
    """Scratch dirs and children of this process before a call (earlier tests of the same session may
    have left long-lived children of their own, e.g. multiprocessing's resource tracker)."""
    return _scratch_dirs(), set(_children(os.getpid()))


def _assert_clean(before: tuple[set[str], set[int]]) -> None:
    before_dirs, before_children = before
    new_children = lambda: set(_children(os.getpid())) - before_children  # noqa: E731
    deadline = time.monotonic() + 2.0  # a SIGKILLed process may take a moment to be reaped
    while time.monotonic() < deadline and (new_children() or _our_sandbox_uid_processes()):
        time.sleep(0.05)
    assert new_children() == set(), "a sandboxed process outlived its call"
    assert _our_sandbox_uid_processes() == [], "a process with a sandbox uid outlived its call"
    assert _scratch_dirs() - before_dirs == set(), "a scratch directory was left behind"


@pytest.fixture(scope="module")
def probe():
    """Fail loudly (not skip) where the OS cannot make a network namespace: the tool would refuse there."""
    r = run_python_sync("print('ok')", timeout_s=10)
    if r.error == "refused":
        pytest.fail(f"the sandbox refuses to run on this host: {r.message}", pytrace=False)
    assert r.error is None and r.stdout == "ok\n", r


async def _ok_after(tools: ToolSet) -> None:
    """The run goes on: a normal call right after works."""
    r = await tools.call("python", {"code": "print(6 * 7)"})
    assert (r.error, r.text) == (None, "42\n")


def _count(outcome: str) -> float:
    return REGISTRY.get_sample_value("areal_like_tool_calls_total", {"tool": "python", "outcome": outcome}) or 0.0


HOSTILE = {
    "timeout": "while True:\n    pass\n",
    "memory": "x = bytearray(10 * 1024 ** 3)\nprint('allocated')\n",
    "process_limit": "import os\nwhile True:\n    os.fork()\n",
    "output_limit": "with open('big.bin', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n",
}


@pytest.mark.parametrize("kind", list(HOSTILE))
async def test_hostile_code_is_stopped_and_the_run_goes_on(kind, tmp_path, probe):
    before = _snapshot()
    tools = ToolSet.from_config(_write_config(tmp_path, timeout_s=1.5))
    counted = _count(kind)
    t0 = time.monotonic()
    r = await tools.call("python", {"code": HOSTILE[kind]})
    assert r.error == kind, r
    assert r.text.startswith("Error") or f"Error ({kind})" in r.text, r.text
    assert "allocated" not in r.text
    assert time.monotonic() - t0 < 6.0  # bounded: timeout 1.5 s plus process start and clean-up
    assert _count(kind) == counted + 1
    _assert_clean(before)
    await _ok_after(tools)
    _assert_clean(before)


async def test_cpu_limit_stops_a_busy_loop(tmp_path, probe):
    tools = ToolSet.from_config(_write_config(tmp_path, timeout_s=5, cpu_s=1))
    r = await tools.call("python", {"code": "while True:\n    pass\n"})
    assert r.error == "cpu", r
    await _ok_after(tools)


async def test_no_network_not_even_the_hosts_loopback(tmp_path, probe):
    before = _snapshot()
    tools = ToolSet.from_config(_write_config(tmp_path, timeout_s=3))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        code = textwrap.dedent(f"""
            import socket
            s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
            print("CONNECTED")
        """)
        r = await tools.call("python", {"code": code})
        assert r.error == "network", r
        assert "CONNECTED" not in r.text
        with pytest.raises(BlockingIOError):  # the listener never saw a connection
            listener.accept()
    _assert_clean(before)
    await _ok_after(tools)


async def test_detached_processes_die_with_the_call(tmp_path, probe):
    """A daemon that leaves the process group (double fork + setsid) is still ended."""
    before = _snapshot()
    tools = ToolSet.from_config(_write_config(tmp_path))
    code = textwrap.dedent("""
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """)
    r = await tools.call("python", {"code": code})
    assert (r.error, r.text) == (None, "parent done\n")
    _assert_clean(before)


async def test_cancelled_call_leaves_nothing(probe):
    before = _snapshot()
    task = asyncio.ensure_future(run_python("import time\ntime.sleep(30)\n", timeout_s=30))
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    _assert_clean(before)


async def test_runs_unprivileged_with_a_private_tmp(probe):
    """As root the code runs under a one-off uid: it cannot write root's files (here: in this
    interpreter's prefix, root-owned 0755), and what it writes to /tmp vanishes with the call."""
    target = os.path.join(sys.prefix, "areal_like_sandbox_write_test")
    code = textwrap.dedent(f"""
        import os
        print(os.getuid())
        try:
            open({target!r}, "w")
            print("WROTE")
        except OSError as e:  # EACCES (root's file), or EROFS (everything but the private mounts is read-only)
            print("denied" if e.errno in (13, 30) else e)
        open("/tmp/areal_like_sandbox_leak_test", "w").write("x")
    """)
    try:
        r = await run_python(code, timeout_s=5)
        assert r.error is None, r
        uid, verdict = r.stdout.split()
        if os.geteuid() == 0:
            assert int(uid) != 0
            assert verdict == "denied"
            assert not os.path.exists("/tmp/areal_like_sandbox_leak_test")
    finally:
        for leftover in (target, "/tmp/areal_like_sandbox_leak_test"):
            if os.path.exists(leftover):
                os.remove(leftover)


async def test_concurrent_calls_do_not_share_a_process_limit(tmp_path, probe):
    """A fork bomb in one call does not starve the calls running beside it (each has its own uid)."""
    tools = ToolSet.from_config(_write_config(tmp_path, timeout_s=3))
    results = await asyncio.gather(
        tools.call("python", {"code": HOSTILE["process_limit"]}),
        *[tools.call("python", {"code": f"print({i})"}) for i in range(3)])
    assert results[0].error == "process_limit"
    assert [(r.error, r.text) for r in results[1:]] == [(None, f"{i}\n") for i in range(3)]


def test_sync_wrapper_stdin_files_and_output_truncation(probe):
    before = _snapshot()
    code = "import sys\nprint(sys.stdin.read().upper(), open('data/in.txt').read())\nprint('y' * 5000)\n"
    r = run_python_sync(code, timeout_s=5, stdin="hello", files={"data/in.txt": "from a file"}, output_chars=200)
    assert r.error is None and r.exit_code == 0
    assert r.stdout.startswith("HELLO from a file")
    assert "truncated" in r.stdout and len(r.stdout) < 300
    r = run_python_sync("raise SystemExit(3)", timeout_s=5)
    assert (r.error, r.exit_code) == ("exception", 3)
    _assert_clean(before)


async def test_sync_wrapper_inside_a_running_loop(probe):
    """A sync reward function may be called from async code: the run gets its own thread and loop."""
    r = run_python_sync("print('inner')", timeout_s=5)
    assert r.stdout == "inner\n"


# ---- issue 24 item 5: a call leaves nothing behind, and sees nothing of an earlier call ------------
PRIVATE_DIRS = ("/dev/mqueue", "/dev/shm", "/run/lock", "/tmp", "/var/tmp")
"""The directories a call may write besides its scratch directory (which is its cwd): each is a fresh,
empty mount of this call only (tmpfs; mqueue for /dev/mqueue), where the host has it."""

_IPC_KEY = 0x24A5_0000 + os.getpid() % 0xFFFF  # SysV key: unlikely to clash with anyone else's

LEAVE_IPC_AND_FILES = textwrap.dedent("""
    import ctypes, os, shutil, stat, sys
    libc = ctypes.CDLL(None, use_errno=True)
    KEY, TAG = {key}, {tag!r}
    IPC_CREAT = 0o1000
    libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    libc.shmat.restype = ctypes.c_void_p
    libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    libc.shmdt.argtypes = [ctypes.c_void_p]
    libc.mq_open.restype = ctypes.c_int
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    # System V shared memory: 3 segments of 64 MB, each touched (resident) then detached, never removed
    shm = []
    for i in range(3):
        sid = libc.shmget(KEY + i, 64 << 20, IPC_CREAT | 0o666)
        if sid < 0:
            shm.append("shmget: " + os.strerror(ctypes.get_errno()))
            continue
        addr = libc.shmat(sid, None, 0)
        ctypes.memset(addr, 1, 64 << 20)
        libc.shmdt(addr)
        shm.append(sid)
    sem = libc.semget(KEY, 4, IPC_CREAT | 0o666)
    msg = libc.msgget(KEY, IPC_CREAT | 0o666)
    mq = libc.mq_open(("/" + TAG).encode(), os.O_CREAT | os.O_RDWR, 0o666, None)  # POSIX message queue
    with open("/dev/shm/" + TAG, "wb") as f:  # what shm_open makes
        f.write(b"x" * 4096)
    planted = []
    for d in ("/run/lock", "/tmp", "/var/tmp", "/dev/shm"):
        try:
            path = os.path.join(d, TAG + ".setuid")
            shutil.copy(sys.executable, path)  # a setuid-to-the-sandbox-uid binary
            os.chmod(path, 0o4755)
            planted.append(path)
        except OSError as e:
            planted.append(d + ": " + type(e).__name__)
    print(shm, sem, msg, mq, planted)
""")

LOOK_FOR_LEFTOVERS = textwrap.dedent("""
    import ctypes, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    KEY, TAG = {key}, {tag!r}
    libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    seen = {{
        "shm": [libc.shmget(KEY + i, 0, 0) for i in range(3)],
        "sem": libc.semget(KEY, 0, 0),
        "msg": libc.msgget(KEY, 0),
        "mq": libc.mq_open(("/" + TAG).encode(), os.O_RDONLY),
        # what the first call left in the writable directories (its files carry TAG; other entries are
        # the call's own: its scratch directory, and the path to an interpreter bound back in when it
        # lives under /tmp, e.g. a venv of a checkout in /tmp)
        "dirs": {{d: sorted(n for n in os.listdir(d) if TAG in n) for d in {dirs!r} if os.path.isdir(d)}},
    }}
    print(json.dumps(seen))
""")


def _host_sysv_keys() -> dict[str, set[int]]:
    """The host's System V objects by key (its IPC namespace), from /proc/sysvipc."""
    out = {}
    for kind in ("shm", "sem", "msg"):
        with open(f"/proc/sysvipc/{kind}") as f:
            next(f)
            out[kind] = {int(line.split()[0]) for line in f if line.strip()}
    return out


def _host_mq_exists(name: str) -> bool:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    fd = libc.mq_open(("/" + name).encode(), os.O_RDONLY)
    if fd >= 0:
        libc.mq_close(fd)
        libc.mq_unlink(("/" + name).encode())  # the leak: remove it, so a failing run cleans up after itself
        return True
    return False


def _remove_host_leftovers(tag: str) -> None:
    """If the sandbox leaked (the bug), undo it so later tests and runs see a clean host."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for i in range(3):
        sid = libc.shmget(ctypes.c_int(_IPC_KEY + i), ctypes.c_size_t(0), 0)
        if sid >= 0:
            libc.shmctl(sid, 0, None)  # IPC_RMID
    for get, ctl in (("semget", "semctl"), ("msgget", "msgctl")):
        ident = getattr(libc, get)(_IPC_KEY, 0, 0) if get == "semget" else libc.msgget(_IPC_KEY, 0)
        if ident >= 0:
            getattr(libc, ctl)(ident, 0, 0) if ctl == "semctl" else libc.msgctl(ident, 0, None)
    _host_mq_exists(tag)
    for d in PRIVATE_DIRS:
        for suffix in ("", ".setuid"):
            p = os.path.join(d, tag + suffix)
            if os.path.isfile(p):
                os.remove(p)


async def test_a_call_leaves_no_ipc_objects_or_files_and_the_next_sees_none(probe):
    """The probe's leak: a 5 s call left 1.76 GB of System V shared memory (limit 512 MB), POSIX queues and a
    setuid binary in /run/lock behind. Now a call has its own IPC namespace and private writable
    directories: the host sees none of it after the call, nor does the next call."""
    tag = f"areal_like_ipc_leak_{os.getpid()}"
    before = _snapshot()
    try:
        r = await run_python(LEAVE_IPC_AND_FILES.format(key=_IPC_KEY, tag=tag), timeout_s=20, memory_mb=256)
        assert r.error is None, r
        _assert_clean(before)
        # the host: no SysV object with the call's keys, no POSIX queue, no file in a shared directory
        keys = _host_sysv_keys()
        leaked = {kind: [k for k in range(_IPC_KEY, _IPC_KEY + 3) if k in keys[kind]] for kind in keys}
        assert leaked == {"shm": [], "sem": [], "msg": []}, f"System V objects left on the host: {leaked}"
        assert not _host_mq_exists(tag), f"POSIX message queue /{tag} left on the host"
        left = [os.path.join(d, n) for d in PRIVATE_DIRS if os.path.isdir(d) for n in os.listdir(d) if tag in n]
        assert left == [], f"files left on the host by the call: {left}"
        # the next call: sees nothing of the first
        r2 = await run_python(LOOK_FOR_LEFTOVERS.format(key=_IPC_KEY, tag=tag, dirs=PRIVATE_DIRS), timeout_s=20)
        assert r2.error is None, r2
        seen = json.loads(r2.stdout)
        assert (seen["shm"], seen["sem"], seen["msg"], seen["mq"]) == ([-1, -1, -1], -1, -1, -1), seen
        assert all(names == [] for names in seen["dirs"].values()), f"the next call sees: {seen['dirs']}"
    finally:
        _remove_host_leftovers(tag)


async def test_system_v_shared_memory_counts_against_the_memory_limit(probe):
    """Segments outlive their mapping, so RLIMIT_AS alone does not bound them (the probe held 1.76 GB with
    memory_mb=512): the call's IPC namespace allows memory_mb of System V shared memory in all."""
    code = textwrap.dedent("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmget.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int]
        got = 0
        for i in range(32):
            if libc.shmget(0, 64 << 20, 0o1000 | 0o600) < 0:  # IPC_PRIVATE
                break
            got += 64
        print(got)
    """)
    try:
        r = await run_python(code, timeout_s=20, memory_mb=256)
        assert r.error is None, r
        assert int(r.stdout) <= 256, f"the call created {r.stdout.strip()} MB of System V shared memory (limit 256 MB)"
    finally:  # without the call's own IPC namespace the segments stay on the host: remove ours
        lo = sandbox._UID_BASE + (os.getpid() % (1 << 20)) * 256
        with open("/proc/sysvipc/shm") as f:
            next(f)
            ours = [int(line.split()[1]) for line in f if lo <= int(line.split()[7]) < lo + 256]
        if ours and os.geteuid() == 0:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            for shmid in ours:
                libc.shmctl(shmid, 0, None)  # IPC_RMID


WRITABLE_DIRS = textwrap.dedent("""
    import json, os
    tag = {tag!r}
    found = []
    for root, dirs, files in os.walk("/"):
        if root == "/":
            dirs[:] = [d for d in dirs if d not in ("proc", "sys")]  # pseudo-filesystems: no files made there
        probe = os.path.join(root, tag)
        try:
            fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except OSError:
            continue
        os.close(fd)  # left in place: the host must not see it after the call
        found.append(root)
    print(json.dumps({{"cwd": os.getcwd(), "writable": sorted(found)}}))
""")


async def test_every_directory_the_sandbox_can_write_is_private_to_the_call(probe):
    """Walk the whole filesystem inside the sandbox and try to create a file in every directory: the
    only directories that take one are the call's own fresh mounts and its scratch directory, and none
    of the files made there is on the host afterwards."""
    if os.geteuid() != 0:
        pytest.skip("private mounts need root (CAP_SYS_ADMIN): a non-root sandbox keeps the user's uid and "
                    "can write what the user can")
    tag = f"areal_like_write_probe_{os.getpid()}"
    # a directory any local user may write, as hosts have (/var/crash, a shared cache): not in the sandbox
    shared = f"/var/lib/areal_like_world_writable_{os.getpid()}"
    os.makedirs(shared, exist_ok=True)
    os.chmod(shared, 0o1777)
    before = _snapshot()
    try:
        r = await run_python(WRITABLE_DIRS.format(tag=tag), timeout_s=120, cpu_s=120, output_chars=1 << 16)
        assert r.error is None, r
        got = json.loads(r.stdout)
        expected = sorted([d for d in PRIVATE_DIRS if os.path.isdir(d) and not os.path.islink(d)]
                          + [got["cwd"]])
        assert got["writable"] == expected, (
            f"the sandbox can write {got['writable']}; expected exactly its private directories {expected}")
        _assert_clean(before)  # the scratch directory (cwd) is gone
        on_host = [d for d in got["writable"] if os.path.exists(os.path.join(d, tag))]
        assert on_host == [], f"files the call made are on the host: {on_host}"
    finally:
        for d in PRIVATE_DIRS + (shared,):
            if os.path.isfile(os.path.join(d, tag)):
                os.remove(os.path.join(d, tag))
        os.rmdir(shared)


_NOTE = re.compile(r"\n?\.\.\.\[(at least )?(\d+) bytes truncated: the output was (\d+) bytes[^\]]*\]\.\.\.\n")


def _shown_and_cut(text: str) -> tuple[int, int, int]:
    """(bytes shown around the note, bytes the note says were cut, total the note gives)."""
    m = _NOTE.search(text)
    assert m and not m.group(1), f"no exact truncation note in {text[:120]!r}...{text[-120:]!r}"
    shown = len(text.encode()) - len(m.group(0).encode())
    return shown, int(m.group(2)), int(m.group(3))


async def test_the_truncation_note_counts_every_byte_cut(tmp_path, probe):
    """Issue 24 item 11: 100 MB printed, 1024 chars shown, and the note said ~7 KB were cut."""
    code = "import sys\nsys.stdout.write('x' * (100 << 20))\nprint('END')\n"
    total = (100 << 20) + len("END\n")
    r = await run_python(code, timeout_s=60, output_chars=1024)
    assert r.error is None, r
    assert r.stdout.startswith("xxx") and r.stdout.endswith("xEND\n") and len(r.stdout) <= 1024, r.stdout
    shown, cut, said_total = _shown_and_cut(r.stdout)
    assert (said_total, cut) == (total, total - shown)
    assert r.stdout_bytes == total
    # through the python tool: the same single note (the tool set does not cut it again)
    tools = ToolSet.from_config(_write_config(tmp_path, timeout_s=60, output_chars=1024))
    t = await tools.call("python", {"code": code})
    assert t.error is None and t.text.count("truncated") == 1, t.text
    assert _shown_and_cut(t.text)[1:] == (total - shown, total)
    # stderr keeps its end (a traceback's last lines), with the same count
    r = await run_python("import sys\nsys.stderr.write('e' * (10 << 20))\nraise SystemExit(1)\n", timeout_s=60,
                         output_chars=512)
    assert r.error == "exception" and len(r.stderr) <= 512 and r.stderr.endswith("e"), r
    shown, cut, said_total = _shown_and_cut(r.stderr)
    assert (said_total, cut) == (10 << 20, (10 << 20) - shown)
