
# ---- ranks of multi-process tests: forked from a fork server that imported torch once ----------------
# `mp.start_processes(…, start_method=RANK_START)` / `mp.get_context(RANK_START)`: Python's forkserver (one
# per test process, started at first use) imports these once; each rank is then a fork of it instead of a
# fresh interpreter importing torch and transformers again (~3.5 CPU-s a rank, dozens of ranks a run).
# A rank still gets a clean process: the fork server never runs a test's code. Ranks whose glibc or
# memory a test measures (test_sharded_memory) keep "spawn".
import multiprocessing as _mp

RANK_START = "forkserver"
_mp.set_forkserver_preload(["torch", "torch.distributed", "transformers", "transformers.modeling_utils",
                            "areal_like.learner.parallel.spawn", "areal_like.learner.trainer"])

# ---- demo cache: `demo:` names resolve under a per-session tmp dir, never the user's ~/.cache ----------
def pytest_configure(config):
    import os
    import tempfile

    os.environ.setdefault("AREAL_LIKE_CACHE", tempfile.mkdtemp(prefix="areal_like-test-cache-"))
    # Ray reads this when imported: a cluster on 127.0.0.1 stays on loopback (no interface address).
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray ≥ 2.5x turns token auth on for a new local cluster and saves the token in ~/.ray: tests must
    # neither write the user's home nor depend on which test started a cluster first.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


# ---- redis_server: one real redis-server per test module (buffer/gate engineer) -------------------
import pytest as _pytest_redis


@_pytest_redis.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real `redis-server` (AOF on, password, 127.0.0.1, free port) in a tmp dir; stopped by PID.

    Tests share it within a module, so each test should use its own stream prefix (see
    `redis_stream`).
    """
    import shutil

    from areal_like.buffer.redis_server import RedisServer

    if shutil.which("redis-server") is None:
        # CI always installs it; a silent skip would hide a broken set-up
        _pytest_redis.fail("redis-server is not on PATH: run `bash scripts/setup.sh` (installs it with apt-get)",
                           pytrace=False)
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@_pytest_redis.fixture
def redis_stream(request) -> str:
    """A stream prefix unique to the test (keys `{prefix}:…`), so tests sharing a server never meet."""
    import re
    import uuid

    return re.sub(r"[^A-Za-z0-9_.-]", "_", request.node.name)[:60] + "-" + uuid.uuid4().hex[:6]


# ---- engine: tiny model dir, free ports, embedded generation servers (engine/weights engineer) ---
import pytest as _pytest_engine


from areal_like.api.net import free_port  # noqa: E402,F401  (tests import it from here)


@_pytest_engine.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A random tiny Qwen2 + char tokenizer HF dir (safetensors), built once per session."""
    from areal_like.data.tiny_model import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny_model") / "model"))


_SESSION_FORKSERVER = []


def session_forkserver():
    """The launcher's fork server (launcher/forkserver.py) for this test process, started at first use and
    ended with the session: test fixtures start their embedded servers from it, as `launcher run` does."""
    if not _SESSION_FORKSERVER:
        import atexit
        import os

        from launcher.forkserver import ForkServer

        log = os.path.join(os.environ["AREAL_LIKE_CACHE"], f"forkserver-{os.getpid()}.log")  # pytest_configure's
        _SESSION_FORKSERVER.append(ForkServer(dict(os.environ), log))
        atexit.register(_SESSION_FORKSERVER[0].close)
    return _SESSION_FORKSERVER[0]


class EngineServer:
    """An embedded generation server subprocess on 127.0.0.1; stopped by its PID."""

    def __init__(self, model_dir: str, log_dir, *args: str, port: int | None = None):
        import os
        import sys

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false")
        self.log_path = os.path.join(str(log_dir), f"engine-{self.port}.log")
        self._log = open(self.log_path, "w")
        # forked by the session's fork server, as `launcher run` starts its embedded servers
        self.proc = session_forkserver().spawn(
            [sys.executable, "-m", "areal_like.engine.server", "--model-path", model_dir, "--host", "127.0.0.1",
             "--port", str(self.port), "--torch-threads", "1", "--random-seed", "0", *args], env, self.log_path, None)

    def wait_ready(self, timeout_s: float = 90.0) -> "EngineServer":
        import time
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine server on port {self.port} exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"engine server on port {self.port} not healthy in {timeout_s}s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


@_pytest_engine.fixture(scope="module")
def engine_servers(tmp_path_factory):
    """Factory: `engine_servers(model_dir, n, *extra_args)` starts n servers (in parallel), ready;
    all are stopped by PID at module teardown, also when a test failed."""
    started: list[EngineServer] = []
    log_dir = tmp_path_factory.mktemp("engine_logs")

    def start(model_dir: str, n: int = 1, *args: str) -> list[EngineServer]:
        servers = [EngineServer(model_dir, log_dir, *args) for _ in range(n)]
        started.extend(servers)
        return [s.wait_ready() for s in servers]

    try:
        yield start
    finally:
        for s in started:
            s.stop()


# ---- demo assets: the tiny demo model + parquet, built once per session (launcher run tests) ----
@_pytest_engine.fixture(scope="session")
def demo_assets(tmp_path_factory) -> tuple[str, str]:
    """(model dir, train parquet) of the demo task, as `launcher run` builds them on first use."""
    from areal_like.data.demo_task import ensure_demo_assets

    d = tmp_path_factory.mktemp("assets")
    model, data = str(d / "model"), str(d / "train.parquet")
    ensure_demo_assets(model, data)
    return model, data


def launcher_spawn(*argv: str, env: dict | None = None):
    """`launcher <argv…>` started from the repository root in its own session (output piped); `env` is
    added to this process's environment. Finish it with `launcher_finish`.

    A `launcher run` here writes no report.html at its end (`metrics.report=false`, ~2.5 CPU-s of
    matplotlib per run) unless the test names `metrics.report` itself, as the report's tests do."""
    import os
    import subprocess
    import sys

    if argv[:1] == ("run",) and not any(a.startswith("metrics.report=") for a in argv):
        argv = (*argv, "metrics.report=false")

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen([sys.executable, "-m", "launcher", *argv], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def launcher_finish(proc, timeout: float = 300) -> tuple[int, str]:
    """(exit code, output) of a `launcher_spawn`ed process; its session is killed on timeout."""
    import os
    import signal
    import subprocess

    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # The launcher runs each role in a session of its own: SIGKILL on its session alone would orphan
        # them (still running, competing for the CPU with later tests). Ctrl-C first — it stops what it
        # started — then SIGKILL what is left of its own session.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        _pytest_engine.fail(f"launcher {proc.args[3]} did not finish in {timeout}s:\n{out[-3000:]}")
    return proc.returncode, out


def kill_role_at_step(proc, run_dir, role: str, step: int, timeout: float = 300) -> None:
    """SIGKILL `role` (its pid from pids.json) once the spawned run `proc` wrote `step` rows of metrics.jsonl."""
    import json
    import os
    import signal
    import time

    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        assert proc.poll() is None and time.monotonic() < deadline, f"the run ended before step {step}"
        time.sleep(0.2)
    os.kill(json.loads((run_dir / "pids.json").read_text())["roles"][role], signal.SIGKILL)


def launcher_run_killing(role: str, step: int, run_dir, *argv: str, timeout: float = 600) -> tuple[int, str]:
    """`launcher run --run-dir run_dir <argv…>` to the end, with `role` SIGKILLed once `step` rows are written
    (`kill_role_at_step`) → (exit code, output). The launcher's session is killed if the test fails first."""
    import os
    import signal

    proc = launcher_spawn("run", "--run-dir", str(run_dir), *argv)
    try:
        kill_role_at_step(proc, run_dir, role, step)
        return launcher_finish(proc, timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def launcher_cli(*argv: str, env: dict | None = None, timeout: float = 300) -> tuple[int, str]:
    """`launcher <argv…>` to the end → (exit code, output)."""
    return launcher_finish(launcher_spawn(*argv, env=env), timeout)


@_pytest_engine.fixture
def run_launcher(demo_assets):
    """`run_launcher(run_dir, *overrides, allocation=…, timeout=300)` → (exit code, output): a real
    `launcher run` of configs/demo.yaml on the demo assets, in its own session (killed on timeout)."""
    model, data = demo_assets

    def run(run_dir, *overrides: str, allocation: str = "embedded.d1p1t1+d1p1t1", timeout: float = 300):
        return launcher_cli("run", "--config", "configs/demo.yaml", "--allocation", allocation, "--run-dir",
                            str(run_dir), f"model.path={model}", f"data.train_files=[{data}]", *overrides,
                            timeout=timeout)

    return run
