"""The Grafana dashboard is valid against Grafana's own dashboard schema.

Grafana publishes its dashboard schema (the CUE kinds of the Grafana repository) as the TypeScript
types of `@grafana/schema` on npm: the dashboard, panel, variable and target shapes, and each panel
plugin's `Options`/`FieldConfig`. tests/dashboards/package.json pins it and the TypeScript compiler;
`scripts/setup.sh` installs both with `npm ci`. The test writes the dashboard JSON as typed TypeScript
constants — the whole dashboard as `Dashboard`, each timeseries panel's options and field config as the
timeseries plugin's types, the heatmap's options as the heatmap plugin's — and `tsc --strict` must
accept them: an unknown key, a missing required field or a wrong value ("modes": "lines") fails with
the line of the generated file and the schema's own message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "tests", "dashboards")
DASHBOARD = os.path.join(ROOT, "dashboards", "grafana", "areal_like.json")
SCHEMA = "@grafana/schema/dist/esm/raw"

# A dashboard file holds JSON strings where Grafana's types have string enums (`LegendDisplayMode.List`
# is "list"): compare the JSON against the enums' values, everything else unchanged.
JSON_OF = ("type Json<T> = T extends string ? `${T}` : T extends number | boolean | null | undefined ? T"
           " : T extends Array<infer U> ? Array<Json<U>> : T extends object ? { [K in keyof T]: Json<T[K]> } : T;")


def typed_source(dash: dict) -> str:
    out = [f'import type * as D from "{SCHEMA}/dashboard/x/Dashboard_types.gen";',
           f'import type * as TS from "{SCHEMA}/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen";',
           f'import type * as HM from "{SCHEMA}/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen";',
           JSON_OF,
           f"export const dashboard: Json<D.Dashboard> = {json.dumps(dash, indent=1, ensure_ascii=False)};"]
    for p in dash["panels"]:
        if p["type"] == "timeseries":
            out.append(f"export const options_{p['id']}: Json<TS.Options> = {json.dumps(p['options'])};")
            out.append(f"export const custom_{p['id']}: Json<TS.FieldConfig> = "
                       f"{json.dumps(p['fieldConfig']['defaults'].get('custom', {}))};")
        elif p["type"] == "heatmap":
            out.append(f"export const options_{p['id']}: Json<HM.Options> = {json.dumps(p['options'])};")
        elif p["type"] != "row":
            raise AssertionError(f"panel {p['title']!r}: type {p['type']} has no schema check here; add its plugin's types")
    return "\n".join(out) + "\n"


def tsc(tmp_path, dash: dict) -> subprocess.CompletedProcess:
    binary = os.path.join(PKG, "node_modules", ".bin", "tsc")
    if shutil.which("node") is None or not os.path.exists(binary):
        pytest.fail(f"{binary} is missing: run `bash scripts/setup.sh` (it runs `npm ci` in tests/dashboards)")
    # the generated file lives beside node_modules so that module resolution finds @grafana/schema
    src = os.path.join(PKG, f"_check_{os.getpid()}_{tmp_path.name}.ts")
    cfg = os.path.join(PKG, f"_tsconfig_{os.getpid()}_{tmp_path.name}.json")
    with open(src, "w") as f:
        f.write(typed_source(dash))
    with open(cfg, "w") as f:
        json.dump({"compilerOptions": {"strict": True, "noEmit": True, "module": "nodenext",
                                       "moduleResolution": "nodenext", "target": "es2022", "skipLibCheck": True},
                   "files": [os.path.basename(src)]}, f)
    try:
        return subprocess.run([binary, "-p", cfg], capture_output=True, text=True, timeout=180, cwd=PKG)
    finally:
        os.remove(src)
        os.remove(cfg)


def test_dashboard_matches_grafanas_schema(tmp_path):
    with open(DASHBOARD) as f:
        dash = json.load(f)
    r = tsc(tmp_path, dash)
    assert r.returncode == 0, f"{DASHBOARD} does not match @grafana/schema:\n{r.stdout}{r.stderr}"


def test_schema_check_rejects_what_grafana_would_not_load(tmp_path):
    """The check can fail: a bad legend mode, a variable field the schema lacks, and a heatmap missing a
    required option are each reported."""
    with open(DASHBOARD) as f:
        dash = json.load(f)
    ts = next(p for p in dash["panels"] if p["type"] == "timeseries")
    ts["options"]["legend"]["displayMode"] = "lines"
    dash["templating"]["list"][1]["refreshes"] = 2
    hm = next(p for p in dash["panels"] if p["type"] == "heatmap")
    del hm["options"]["exemplars"]
    r = tsc(tmp_path, dash)
    assert r.returncode != 0
    assert "'\"lines\"' is not assignable" in r.stdout, r.stdout
    assert "'\"refreshes\"' does not exist" in r.stdout, r.stdout
    assert "exemplars" in r.stdout, r.stdout
