"""The Grafana dashboard and Prometheus config refer only to metrics the roles really export; the
dashboard file is what dashboards/build.py writes; prometheus.yml is valid for Prometheus itself.
(tests/integration/test_dashboard_prometheus.py runs every panel's query against a real run.)"""

import json
import os
import re
import subprocess
import sys

import yaml

from areal_like import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _exported_names() -> set[str]:
    names = set()
    for fam in metrics.REGISTRY.collect():
        for sample in fam.samples:
            names.add(sample.name)
        names.add(fam.name)
    # histograms/counters expose suffixed series; include them even before any observation
    for fam in metrics.REGISTRY.collect():
        if fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
        if fam.type == "counter":
            names.add(fam.name + "_total")
    return names


def test_every_dashboard_query_uses_an_exported_metric():
    dash = json.load(open(os.path.join(ROOT, "dashboards/grafana/areal_like.json")))
    exported = _exported_names()
    used = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", []):  # rows have none
            used |= set(re.findall(r"areal_like_[a-z_]+", target["expr"]))
    assert used, "the dashboard has no areal_like queries"
    missing = used - exported
    assert not missing, f"dashboard queries metrics no role exports: {sorted(missing)}"


def test_prometheus_config_reads_the_launchers_targets():
    cfg = yaml.safe_load(open(os.path.join(ROOT, "dashboards/prometheus.yml")))
    files = cfg["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert files == ["../runs/*.targets.json"]  # relative to the file: <project>/runs, the default run dirs' parent


def test_promtool_accepts_the_prometheus_config():
    """Prometheus refuses a wildcard outside the file name (`../runs/*/x.json` was refused at start)."""
    promtool = "/usr/bin/promtool"
    assert os.path.exists(promtool), f"{promtool} is missing: run `bash scripts/setup.sh` (apt prometheus)"
    r = subprocess.run([promtool, "check", "config", os.path.join(ROOT, "dashboards/prometheus.yml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dashboard_file_is_what_build_py_writes(tmp_path):
    out = tmp_path / "dash.json"
    code = ("import runpy, sys; m = runpy.run_path(sys.argv[1]); m['OUT'] = None; import json; "
            "open(sys.argv[2], 'w').write(json.dumps(m['dashboard'](), indent=1, ensure_ascii=False) + '\\n')")
    subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "dashboards/build.py"), str(out)], check=True,
                   timeout=60)
    with open(os.path.join(ROOT, "dashboards/grafana/areal_like.json")) as f:
        assert f.read() == out.read_text(), "dashboards/grafana/areal_like.json is stale: run `.venv/bin/python dashboards/build.py`"


def test_every_panel_selects_by_the_targets_labels():
    """The variables pick runs: every query selects experiment, run and role, and a kind."""
    dash = json.load(open(os.path.join(ROOT, "dashboards/grafana/areal_like.json")))
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            for needle in ('experiment=~"$experiment"', 'run=~"$run"', 'role=~"$role"', "kind="):
                assert needle in t["expr"], (panel["title"], t["expr"])
