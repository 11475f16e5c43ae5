"""metrics.redis_exporter: the launcher's own Redis metrics endpoint (issue 24, item 1; item 11's server env).

The dashboards' buffer row reads Redis's memory and command rate (`redis_memory_used_bytes`,
`redis_commands_processed_total`, …) from role/kind `redis` in prometheus_targets.json. That endpoint
used to be Debian's prometheus-redis-exporter, which honours `GET /scrape?target=HOST:PORT`: any local
user could point it at a listener of theirs and receive `AUTH <password>`, then read and write the
buffer. The launcher now serves the Redis metrics itself (a thread of the launcher): INFO on the run's
own Redis only (host, port and password fixed at start, never taken from a request), only at /metrics.

The probe's chain is replayed as another account (`setpriv --reuid=65534`, nobody) against a live
`launcher run`: the endpoint must not connect to the attacker's listener, must not return the password,
and Redis itself refuses nobody's writes (NOAUTH). The generation server's environment holds no Redis
password (it never uses Redis).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from _uid import as_nobody, open_base_dir
from conftest import launcher_finish, launcher_spawn

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DECOY = "decoy-redis-secret-from-the-users-env"  # AREAL_LIKE_REDIS_PASSWORD / REDIS_PASSWORD in the launcher's env

# Run as uid nobody with the system python (stdlib only): an attacker's listener on 127.0.0.1, then GETs
# on the run's Redis metrics endpoint pointing it there; then a write to Redis with whatever was learnt.
PROBE = r'''
import json, socket, sys, threading, urllib.request
endpoint, redis_host, redis_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
lsock = socket.socket(); lsock.bind(("127.0.0.1", 0)); lsock.listen(8); lsock.settimeout(0.2)
trap = "127.0.0.1:%d" % lsock.getsockname()[1]
got, stop = [], threading.Event()
def listen():
    while not stop.is_set():
        try:
            c, _ = lsock.accept()
        except socket.timeout:
            continue
        c.settimeout(2.0)
        data = b""
        try:
            data = c.recv(65536)
        except OSError:
            pass
        got.append(data.decode("latin-1"))
        try:
            c.sendall(b"-ERR nope\r\n")
        except OSError:
            pass
        c.close()
t = threading.Thread(target=listen); t.start()
bodies = {}
for path in ("/scrape?target=" + trap, "/scrape?target=redis://" + trap, "/metrics?target=" + trap,
             "/metrics?target=redis://" + trap, "/metrics", "/"):
    try:
        with urllib.request.urlopen("http://" + endpoint + path, timeout=20) as r:
            bodies[path] = [r.status, r.read().decode("latin-1")]
    except urllib.error.HTTPError as e:
        bodies[path] = [e.code, e.read().decode("latin-1")]
    except OSError as e:
        bodies[path] = [None, repr(e)]
stop.set(); t.join()
# what an attacker does next: AUTH with whatever the trap caught (nothing, we hope), then write
learnt = []
for data in got:
    parts = data.split("\r\n")
    for i, p in enumerate(parts):
        if p.upper() == "AUTH":
            learnt += [a for a in parts[i + 1:] if a and a[0] not in "$*"]
s = socket.create_connection((redis_host, redis_port), timeout=5)
f = s.makefile("rb")
for pw in learnt:
    s.sendall(("*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)).encode()); f.readline()
s.sendall(b"*3\r\n$3\r\nSET\r\n$19\r\nareal_like:injected\r\n$1\r\n1\r\n")
write_reply = f.readline().decode("latin-1"); s.close()
print(json.dumps({"trap_received": got, "bodies": bodies, "learnt": learnt, "write_reply": write_reply}))
'''


def _redis_conf(run_dir: str) -> dict[str, str]:
    """port and requirepass of the run's redis-server, as root reads them from its 0600 config."""
    out = {}
    with open(os.path.join(run_dir, "redis", "redis.conf")) as f:
        for line in f:
            k, _, v = line.strip().partition(" ")
            if k in ("port", "requirepass", "bind"):
                out[k] = v
    return out


def _redis_target(run_dir: str) -> str:
    with open(os.path.join(run_dir, "prometheus_targets.json")) as f:
        targets = json.load(f)
    (redis,) = [t for t in targets if t["labels"]["role"] == "redis"]
    assert redis["labels"]["kind"] == "redis"
    return redis["targets"][0]


def _scrape(address: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=20) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.fixture(scope="module")
def live_run(demo_assets):
    """A real `launcher run` of the demo that keeps training while the tests probe it (Ctrl-C at the end).
    Its run dir sits under a 0755 base so only the run dir's own modes guard it. The launcher's
    environment carries decoy Redis secrets, as a user's shell might."""
    base = open_base_dir()
    run_dir = os.path.join(base, "run")
    model, data = demo_assets
    proc = launcher_spawn("run", "--config", "configs/demo.yaml", "--allocation", "embedded.d1p1t1+d1p1t1",
                          "--run-dir", run_dir, f"model.path={model}", f"data.train_files=[{data}]",
                          "train.total_steps=100000",
                          # the server's own environment, read from /proc: a process of its own (a role forked by
                          # launcher.forkserver shows the fork server's, which holds no Redis secret either)
                          "launcher.forkserver=false",
                          env={"AREAL_LIKE_REDIS_PASSWORD": DECOY, "REDIS_PASSWORD": DECOY})
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not os.path.exists(metrics):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.2)
        assert os.path.exists(metrics), "the run trained no step in 300 s"
        yield run_dir, proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        launcher_finish(proc, timeout=300)
        shutil.rmtree(base, ignore_errors=True)


def test_redis_endpoint_is_no_password_oracle_for_another_account(live_run):
    """Item 1, the probe's chain as uid nobody: `/scrape?target=<listener>` (and `/metrics?target=…`) on
    the run's Redis metrics endpoint connects nowhere and returns no password; Redis refuses nobody's
    write to the buffer (NOAUTH)."""
    run_dir, _ = live_run
    conf = _redis_conf(run_dir)
    password = conf["requirepass"]
    endpoint = _redis_target(run_dir)
    res = as_nobody("/usr/bin/python3", "-c", PROBE, endpoint, "127.0.0.1", conf["port"], timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    probe = json.loads(res.stdout)
    assert probe["write_reply"].startswith("-NOAUTH"), (
        f"uid nobody wrote to the buffer ({probe['write_reply']!r}) with the password its listener caught: "
        f"{probe['trap_received']}")
    assert probe["trap_received"] == [], f"the Redis metrics endpoint connected to nobody's listener: {probe['trap_received']}"
    for path, (status, body) in probe["bodies"].items():
        assert password not in body, f"GET {path} returned the Redis password"
    # the endpoint still serves its metrics (query strings ignored), and nothing but /metrics
    status, body = probe["bodies"]["/metrics"]
    assert status == 200 and "redis_up 1" in body, body[:500]
    assert probe["bodies"]["/"][0] == 404


def test_redis_endpoint_serves_the_dashboards_metrics(live_run):
    """Item 1 (b): through `launcher run`, the endpoint listed as role/kind `redis` serves what the
    dashboard's buffer row reads, with sane values, and the commands counter grows."""
    run_dir, _ = live_run
    endpoint = _redis_target(run_dir)
    first = _scrape(endpoint)
    assert first["redis_up"] == 1
    assert first["redis_memory_used_bytes"] > 100_000  # a redis-server holding the run's streams
    assert first["redis_connected_clients"] >= 2  # rollout worker, learner, launcher view
    assert first['redis_db_keys{db="db0"}'] >= 1
    assert first["redis_aof_current_size_bytes"] > 0  # AOF on
    n1 = first["redis_commands_processed_total"]
    assert n1 > 0
    second = _scrape(endpoint)
    assert second["redis_commands_processed_total"] > n1


def test_generation_server_environment_holds_no_redis_password(live_run):
    """Item 11: the generation server never uses Redis, so its environment holds neither the run's Redis
    password (AREAL_LIKE_REDIS_URL) nor the user's REDIS_* / AREAL_LIKE_REDIS_PASSWORD secrets."""
    run_dir, _ = live_run
    password = _redis_conf(run_dir)["requirepass"]
    with open(os.path.join(run_dir, "pids.json")) as f:
        pid = json.load(f)["roles"]["server0"]
    with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read()
    names = {kv.split(b"=", 1)[0].decode() for kv in environ.split(b"\0") if kv}
    assert password.encode() not in environ, "the server's environment holds the run's Redis password"
    assert DECOY.encode() not in environ, "the server's environment holds the user's Redis password"
    assert not {n for n in names if "REDIS" in n}, sorted(n for n in names if "REDIS" in n)
    assert "AREAL_LIKE_ADMIN_API_KEY" in names  # what it does need still reaches it


def test_endpoint_reads_only_its_own_redis_and_serves_up_0_when_redis_is_down(tmp_path):
    """The endpoint on a real redis-server: INFO's numbers under the exporter's names; `?target=` is ignored;
    only /metrics is served; a dead Redis gives `redis_up 0` (no error, no crash), a restarted one 1 again."""
    from areal_like.buffer.redis_server import RedisServer
    from areal_like.metrics.redis_info import RedisMetricsEndpoint

    with RedisServer(tmp_path / "redis") as srv:
        ep = RedisMetricsEndpoint(srv.host, srv.port, srv.password).start()
        try:
            m = _scrape(ep.address)
            assert m["redis_up"] == 1 and m["redis_memory_used_bytes"] > 0 and m["redis_commands_processed_total"] > 0
            with urllib.request.urlopen(f"http://{ep.address}/metrics?target=127.0.0.1:1", timeout=20) as r:
                assert b"redis_up 1" in r.read()
            for path in ("/", "/scrape?target=127.0.0.1:1", "/metrics/x"):
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(f"http://{ep.address}{path}", timeout=20)
                assert e.value.code == 404, path
            srv.kill()
            down = _scrape(ep.address)
            assert down == {"redis_up": 0.0}, down
            srv.restart()
            assert _scrape(ep.address)["redis_up"] == 1
        finally:
            ep.stop()


def test_launcher_run_redis_metrics_off_and_auto(tmp_path, run_launcher):
    """`metrics.redis_exporter=false` (users' configs have it) serves none and lists no `redis` target;
    `auto` (older configs) is the same as true: served, listed as role/kind `redis`, gone with the run."""
    rc, out = run_launcher(tmp_path / "off", "train.total_steps=2", "metrics.redis_exporter=false")
    assert rc == 0, out[-3000:]
    targets = json.load(open(tmp_path / "off" / "prometheus_targets.json"))
    assert "redis" not in {t["labels"]["role"] for t in targets}
    assert {t["labels"]["kind"] for t in targets} == {"server", "learner", "rollout"}
    assert "Redis metrics at" not in out

    sd = tmp_path / "file_sd"  # metrics.file_sd_dir: where Prometheus's file discovery looks
    rc, out = run_launcher(tmp_path / "on", "train.total_steps=2", "metrics.redis_exporter=auto",
                           f"metrics.file_sd_dir={sd}")
    assert rc == 0, out[-3000:]
    assert sd.is_dir() and list(sd.iterdir()) == []  # on.targets.json was written there, then removed
    address = _redis_target(str(tmp_path / "on"))
    assert f"Redis metrics at http://{address}/metrics" in out
    pids = json.load(open(tmp_path / "on" / "pids.json"))
    assert "redis_exporter" not in pids["roles"]  # no process of its own: a thread of the launcher
    with pytest.raises(OSError):  # it ended with the run
        urllib.request.urlopen(f"http://{address}/metrics", timeout=10)


# Item 11 under `--backend ray`: tests/integration/test_ray_backend.py (the local-cluster run) checks the
# generation and judge servers' environments and the Redis metrics endpoint of a Ray run.
