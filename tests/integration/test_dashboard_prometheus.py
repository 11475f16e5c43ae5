"""Every panel of the Grafana dashboard shows data from a real run, read by a real Prometheus.

A real `launcher run` (the agentic demo, tool_agent + calculator, with validation, on a briefly
warm-started agent model so that tools are called) runs under `<tmp>/runs/<run>`, while Debian's
`prometheus` (installed by scripts/setup.sh) scrapes it through the shipped dashboards/prometheus.yml,
copied unchanged to `<tmp>/dashboards/` so that its `../runs/*.targets.json` finds the run's targets
(the launcher writes `<run-dir parent>/<run>.targets.json`, metrics.file_sd_dir's default).
The launcher also serves its Redis's metrics itself (metrics.redis_exporter, on by default), read by the
Redis panels.

No SGLang server can run here (no GPU, not installed), so the panels' `sglang:*` queries are checked
against a stub exporter: it serves SGLang's metric names, types and labels as SGLang 0.5.23's metrics
collector defines them (tokenizer metrics labelled model_name, engine_type; scheduler metrics also
tp_rank, pp_rank), with values that move, listed in its own prometheus_targets.json the way
`launcher run` lists a server. Those targets are marked `areal_like_backend: sglang` in the dashboard.

Each target's query is evaluated over the run's time range through Prometheus's HTTP API
(`/api/v1/query_range`, as Grafana does) with the dashboard variables set to the run
($experiment, $run; $role = All) and $__rate_interval = 4 × the scrape interval: every one must
return at least one series with a number in it. The variable queries must list the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from areal_like.api.net import free_port

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMETHEUS = "/usr/bin/prometheus"
WAIT_S = 180  # the most the run may take to show data on every panel
RUN = "prom-run"
STUB = {"experiment": "sglang_stub", "run": "sglang-stub", "role": "server0", "kind": "server"}


def _get(url: str, timeout: float = 10.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except OSError as e:
        raise AssertionError(f"prometheus at {url.split('/api')[0]}: {e}") from None


class SGLangStub:
    """A /metrics endpoint with SGLang's own metric names (a separate registry: nothing of ours)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        reg = CollectorRegistry()
        tok = ["model_name", "engine_type"]
        sch = ["model_name", "engine_type", "tp_rank", "pp_rank"]
        self.gen = Counter("sglang:generation_tokens_total", "Number of generation tokens processed.",
                           tok + ["is_streaming"], registry=reg)
        self.prompt = Counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                              tok + ["is_streaming"], registry=reg)
        self.aborted = Counter("sglang:num_aborted_requests_total", "Number of requests aborted.", tok, registry=reg)
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              tok + ["is_streaming"], buckets=(0.01, 0.02, 0.04, 0.1, 0.25, 0.5, 1.0, 2.5), registry=reg)
        self.gauges = {name: Gauge(name, doc, sch, registry=reg) for name, doc in (
            ("sglang:num_running_reqs", "The number of running requests."),
            ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
            ("sglang:gen_throughput", "The generation throughput (token/s)."),
            ("sglang:token_usage", "The token usage."),
            ("sglang:num_paused_reqs", "The number of paused requests by async weight sync."))}
        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=reg)
        self.stop = threading.Event()
        self.ticker = threading.Thread(target=self._tick, daemon=True)
        self.ticker.start()

    def _tick(self) -> None:
        m, s = ("tiny-qwen2", "unified"), ("tiny-qwen2", "unified", "0", "0")
        k = 0
        while not self.stop.wait(0.5):
            k += 1
            self.gen.labels(*m, "false").inc(64)
            self.prompt.labels(*m, "false").inc(32)
            self.aborted.labels(*m).inc(k % 2)
            self.ttft.labels(*m, "false").observe(0.03 + 0.01 * (k % 5))
            for i, g in enumerate(self.gauges.values()):
                g.labels(*s).set((k + i) % 7 / (10.0 if "usage" in g._name else 1.0))

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    """(prometheus URL, start, end, dashboard) after a real run scraped by a real Prometheus."""
    if not os.path.exists(PROMETHEUS):
        pytest.fail(f"{PROMETHEUS} is missing: run `bash scripts/setup.sh` (it installs Debian's prometheus)")
    from areal_like.data.agent_task import ensure_calc_agent

    base = tmp_path_factory.mktemp("prom")
    model = ensure_calc_agent(str(base / "model"), steps=150, batch_size=16, p_tool=1.0, p_train_call=1.0,
                              log=lambda msg: None)
    os.makedirs(base / "dashboards")
    shutil.copy(os.path.join(ROOT, "dashboards", "prometheus.yml"), base / "dashboards" / "prometheus.yml")
    scrape_s = int(yaml.safe_load(open(base / "dashboards" / "prometheus.yml"))["global"]["scrape_interval"].rstrip("s"))

    stub = SGLangStub()
    os.makedirs(base / "runs")
    with open(base / "runs" / f"{STUB['run']}.targets.json", "w") as f:  # as `launcher run` lists a server
        json.dump([{"targets": [f"127.0.0.1:{stub.port}"], "labels": STUB}], f)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={base / 'dashboards' / 'prometheus.yml'}",
                             f"--storage.tsdb.path={base / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=open(base / "prometheus.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert prom.poll() is None, f"prometheus exited: {(base / 'prometheus.log').read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"prometheus at {url} not ready in 60 s"
            time.sleep(0.5)
        with open(os.path.join(ROOT, "dashboards", "grafana", "areal_like.json")) as f:
            dash = json.load(f)
        t0 = time.time()
        # A run longer than needed, stopped (SIGTERM, as Ctrl-C) once every panel has shown data or after
        # WAIT_S: how long the roles need to be scraped twice inside a rate window varies with the load.
        log = open(base / "launcher.log", "w+")
        proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", "--config", "configs/agent_demo.yaml",
                                 "--run-dir", str(base / "runs" / RUN), f"model.path={model}",
                                 "train.total_steps=1000", "train.test_freq=4", "train.batch_size=4",
                                 "generation.n=4", "rollout.dump_dir=null"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(5)
                if not _empty_panels(url, dash, t0, time.time(), scrape_s):
                    break
            assert proc.poll() is None, f"the run ended early:\n{_tail(log)}"
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out = _tail(log)
        assert rc == 130, out  # the launcher's exit code for a run stopped by a signal
        assert "Redis metrics at http://" in out and "stopped by SIGTERM" in out, out
        t1 = time.time()
        assert not (base / "runs" / f"{RUN}.targets.json").exists()  # removed when the run ended
        yield url, t0, t1, scrape_s, dash, base
    finally:
        stub.close()
        os.killpg(prom.pid, signal.SIGTERM)
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(prom.pid, signal.SIGKILL)
            prom.wait(10)


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]


def _query_range(url: str, expr: str, t0: float, t1: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr, "start": f"{t0:.3f}", "end": f"{t1:.3f}", "step": "2s"})
    body = _get(f"{url}/api/v1/query_range?{q}")
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _bind(expr: str, labels: dict, scrape_s: int) -> str:
    """The dashboard variables as Grafana would substitute them for one run, role = All."""
    return (expr.replace("$experiment", labels["experiment"]).replace("$run", labels["run"])
            .replace("$role", ".*").replace("$__rate_interval", f"{4 * scrape_s}s"))


def _targets(dash: dict) -> list[tuple[str, dict]]:
    return [(panel["title"], t) for panel in dash["panels"] for t in panel.get("targets", [])]


def _empty_panels(url: str, dash: dict, t0: float, t1: float, scrape_s: int) -> list[str]:
    """Every target whose query, bound to the run (or the SGLang stub), has no number in [t0, t1]."""
    run = {"experiment": "agent_demo", "run": RUN}
    empty = []
    for title, t in _targets(dash):
        labels = STUB if t.get("areal_like_backend") == "sglang" else run
        expr = _bind(t["expr"], labels, scrape_s)
        series = _query_range(url, expr, t0, t1)
        if not [v for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]:
            empty.append(f"{title} [{t['refId']}, {labels['run']}]: {expr}")
    return empty


def test_every_panel_query_returns_data_from_a_real_run(scraped_run):
    url, t0, t1, scrape_s, dash, base = scraped_run
    assert len(_targets(dash)) >= 40
    empty = _empty_panels(url, dash, t0, t1, scrape_s)
    assert not empty, ("panels with no data from the run (prometheus log: "
                       f"{base / 'prometheus.log'}):\n" + "\n".join(empty))


def test_dashboard_variables_list_the_run_and_its_roles(scraped_run):
    url, t0, t1, scrape_s, dash, _ = scraped_run
    variables = {v["name"]: v for v in dash["templating"]["list"] if v["type"] == "query"}
    assert set(variables) == {"experiment", "run", "role"}

    def label_values(query: str) -> set[str]:
        # label_values(<selector>, <label>) → Prometheus's /api/v1/label/<label>/values?match[]=<selector>
        inner = query[len("label_values("):-1]
        selector, label = inner.rsplit(",", 1)
        selector = selector.replace("$experiment", "agent_demo").replace("$run", RUN)
        q = urllib.parse.urlencode({"match[]": selector, "start": f"{t0:.3f}", "end": f"{t1:.3f}"})
        body = _get(f"{url}/api/v1/label/{label.strip()}/values?{q}")
        return set(body["data"])

    assert {"agent_demo", "sglang_stub"} <= label_values(variables["experiment"]["query"]["query"])
    assert label_values(variables["run"]["query"]["query"]) == {RUN}
    assert label_values(variables["role"]["query"]["query"]) == {"server0", "learner", "rollout0", "redis"}


def test_a_query_of_a_metric_nobody_exports_is_reported_empty(scraped_run):
    """The check above can fail: a misspelt metric in a panel gives no series."""
    url, t0, t1, scrape_s, _, _ = scraped_run
    assert _query_range(url, _bind('areal_like_rewards_mean{kind="learner", run=~"$run"}',
                                   {"experiment": "agent_demo", "run": RUN}, scrape_s), t0, t1) == []
