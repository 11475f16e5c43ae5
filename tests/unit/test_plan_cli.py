"""`launcher plan` through a real subprocess: table, --json schema, defaults, exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    exe = str(PYTHON) if PYTHON.exists() else sys.executable
    return subprocess.run(
        [exe, "-m", "launcher", "plan", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def _plan_json(*args: str) -> dict[str, Any]:
    proc = _run(*args, "--json")
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)  # exactly one object
    return out


def _assert_schema(d: dict[str, Any]) -> None:
    assert isinstance(d["total_devices"], int)
    assert d["kind"] in ("decoupled", "train_only", "generation_only", "colocated")
    gen, train = d["generation"], d["training"]
    if gen is not None:
        assert {"backend", "dp", "tp", "pp", "servers"} <= set(gen)
        for s in gen["servers"]:
            assert {"index", "node", "devices"} <= set(s)
            assert all(isinstance(x, int) for x in s["devices"])
    if train is not None:
        assert {"backend", "dp", "pp", "tp", "cp", "ep", "ranks"} <= set(train)
        for r in train["ranks"]:
            assert {"rank", "node", "device", "dp_rank", "pp_rank", "tp_rank"} <= set(r)


def _slots(d: dict[str, Any]) -> list[tuple[int, int]]:
    slots: list[tuple[int, int]] = []
    if d["generation"]:
        for s in d["generation"]["servers"]:
            slots.extend(zip(s["nodes"], s["devices"]))
    if d["training"]:
        slots.extend((r["node"], r["device"]) for r in d["training"]["ranks"])
    return slots


def test_done_when_example_json() -> None:
    d = _plan_json("--allocation", "sglang.d16p1m1+d8p2m1", "--nodes", "4", "--devices-per-node", "8")
    _assert_schema(d)
    assert d["kind"] == "decoupled" and d["total_devices"] == 32
    servers = d["generation"]["servers"]
    assert len(servers) == 16 and all(len(s["devices"]) == 1 for s in servers)
    ranks = d["training"]["ranks"]
    assert len(ranks) == 16 and (d["training"]["dp"], d["training"]["pp"]) == (8, 2)
    assert {(r["dp_rank"], r["pp_rank"]) for r in ranks} == {(i, j) for i in range(8) for j in range(2)}
    slots = _slots(d)
    assert len(slots) == len(set(slots)) == 32


def test_done_when_example_table() -> None:
    proc = _run("--allocation", "sglang.d16p1m1+d8p2m1", "--nodes", "4", "--devices-per-node", "8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(1 for ln in lines if ln.startswith("generation/")) == 16
    assert sum(1 for ln in lines if ln.startswith("training/")) == 16
    assert "dp 8 × pp 2 × tp 1" in proc.stdout
    assert "32 devices needed" in proc.stdout


@pytest.mark.parametrize(
    ("text", "total"),
    [
        ("sglang.d4p1m1 + d2p2m1", 8),
        ("sglang.d16p1m1 + d8p2m1", 32),
        ("sglang.d64p1m1 + d32p2m1", 128),
        ("sglang.d8m8p1 + d4p4m4", 128),
        ("d32p1m4", 128),
        ("sglang.d8p1t1+d8p1t1", 16),
    ],
)
def test_totals(text: str, total: int) -> None:
    d = _plan_json("--allocation", text)
    _assert_schema(d)
    assert d["total_devices"] == total
    assert (d["nodes"], d["devices_per_node"]) == (1, total)  # default: one node, just big enough
    slots = _slots(d)
    assert len(slots) == len(set(slots)) == total


def test_kinds_and_nulls() -> None:
    g = _plan_json("--allocation", "sglang:d4")
    assert g["kind"] == "generation_only" and g["training"] is None
    t = _plan_json("--allocation", "d32p1m4", "--nodes", "16")
    assert t["kind"] == "train_only" and t["generation"] is None and t["devices_per_node"] == 8
    assert t["training"]["backend"] == "megatron" and t["training"]["tp"] == 4
    c = _plan_json("--allocation", "sglang:d2t2|fsdp:d4")
    assert c["kind"] == "colocated" and c["total_devices"] == 4
    h = _plan_json("--allocation", "sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)")
    _assert_schema(h)
    assert (h["training"]["cp"], h["training"]["ep"]) == (2, 2)


def test_devices_per_node_without_nodes() -> None:
    d = _plan_json("--allocation", "sglang.d16p1m1+d8p2m1", "--devices-per-node", "8")
    assert (d["nodes"], d["devices_per_node"]) == (4, 8)


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (["--allocation", "sglang:d0"], "sizes start at 1"),
        (["--allocation", "sglang:d4+"], "dangling '+'"),
        (["--allocation", "foo:d4", "--json"], "unknown backend"),
        (["--allocation", "sglang.d16p1m1+d8p2m1", "--nodes", "2"], "pass --nodes 4"),
        (["--allocation", "sglang:d2", "--nodes", "0"], "--nodes 1 or more"),
    ],
)
def test_bad_input_exits_2_with_message(args: list[str], word: str) -> None:
    proc = _run(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert word in proc.stderr
    assert "^" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_named_components_each_printed_with_role_pool_and_devices() -> None:
    text = "sglang[rollout]:d2t2 + fsdp[actor]:d4|fsdp[critic]:d4 + sglang[judge]:d1t2 + sglang[teacher]:d2"
    proc = _run("--allocation", text, "--devices-per-node", "8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    rows = [ln.split() for ln in lines if ln.startswith(("generation/", "training/"))]
    assert [(r[0], r[1]) for r in rows].count(("generation/judge", "judge")) == 1
    assert [(r[0], r[1]) for r in rows].count(("training/critic", "critic")) == 4
    assert [(r[0], r[1], r[4]) for r in rows if r[0] == "generation/teacher"] == [
        ("generation/teacher", "teacher", "2"), ("generation/teacher", "teacher", "3")]
    summary = [ln for ln in lines if ln.startswith(("generation:", "training:"))]
    assert [ln.split()[1] for ln in summary] == ["rollout", "actor", "critic", "judge", "teacher"]
    assert "[pool 1, shared with critic]" in summary[1] and "[pool 3]" in summary[4]
    assert "total:      12 devices needed, 12 used of 16" in lines
    d = _plan_json("--allocation", text, "--devices-per-node", "8")
    assert [(c["name"], c["role"], c["pool"]) for c in d["components"]] == [
        ("rollout", "rollout", 0), ("actor", "actor", 1), ("critic", "critic", 1), ("judge", "judge", 2),
        ("teacher", "teacher", 3)]
    # three or more components: every one named (AReaL's rule), the message says so and where
    proc = _run("--allocation", "sglang:d2+fsdp[actor]:d4+sglang[judge]:d1")
    assert proc.returncode == 2 and "all must have names" in proc.stderr and "Traceback" not in proc.stderr
