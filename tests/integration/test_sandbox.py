"""The python tool's sandbox contains what a model's code can do, with real processes (nothing mocked):
an endless loop, a 10 GB allocation, a fork bomb, a huge file and a TCP connection to the host each end
as an error observation of the right kind, leave no process and no scratch directory behind, and the
next call works (the run goes on)."""

import asyncio
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
        except PermissionError:
            print("denied")
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
