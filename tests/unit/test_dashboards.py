"""The Grafana dashboard and Prometheus config refer only to metrics the roles really export."""

import json
import os
import re

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
        for target in panel["targets"]:
            used |= set(re.findall(r"areal_like_[a-z_]+", target["expr"]))
    assert used, "the dashboard has no areal_like queries"
    missing = used - exported
    assert not missing, f"dashboard queries metrics no role exports: {sorted(missing)}"


def test_prometheus_config_reads_the_launchers_targets():
    cfg = yaml.safe_load(open(os.path.join(ROOT, "dashboards/prometheus.yml")))
    files = cfg["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert any("prometheus_targets.json" in f for f in files)
