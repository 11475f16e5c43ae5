"""Config hygiene: every field of every config section has a doc line, every field is read by some
code outside config.py, the reference docs/config.md is what scripts/gen_config_doc.py writes, and
the built-in workflow names agree between the config check and the registry."""

from __future__ import annotations

import ast
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_PY = os.path.join(ROOT, "areal_like", "api", "config.py")

# Fields read through a generic mechanism rather than as `.name` (none today). Each entry says how.
READ_GENERICALLY: dict[str, str] = {}


def _section_fields() -> list[tuple[str, str, bool]]:
    """(class, field, has a docstring right under it) for every `_Section` subclass in config.py."""
    with open(CONFIG_PY, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out = []
    for cls in tree.body:
        if not (isinstance(cls, ast.ClassDef) and any(isinstance(b, ast.Name) and b.id == "_Section" for b in cls.bases)):
            continue
        for i, st in enumerate(cls.body):
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                nxt = cls.body[i + 1] if i + 1 < len(cls.body) else None
                doc = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                       and isinstance(nxt.value.value, str) and nxt.value.value.strip() != "")
                out.append((cls.name, st.target.id, doc))
    return out


def _property_reads() -> dict[str, set[str]]:
    """field → the `@property`s of its section that read it (`self.field`): reading such a property
    outside config.py reads the field (e.g. `algorithm.kl_loss_on` reads `use_kl_loss`)."""
    with open(CONFIG_PY, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out: dict[str, set[str]] = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and any(isinstance(d, ast.Name) and d.id == "property"
                                                       for d in fn.decorator_list):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                        out.setdefault(node.attr, set()).add(fn.name)
    return out


def _code_outside_config() -> str:
    """Every .py file under areal_like/ and launcher/ except config.py, without import lines
    (so `from areal_like.workflow import …` does not count as reading `rollout.workflow`)."""
    parts = []
    for top in ("areal_like", "launcher"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(dirpath, name)
                if name.endswith(".py") and os.path.abspath(path) != CONFIG_PY:
                    with open(path, encoding="utf-8") as f:
                        parts += [ln for ln in f if not re.match(r"\s*(from\s+\S+\s+)?import\s", ln)]
    return "".join(parts)


def test_config_has_sections():
    classes = {c for c, _, _ in _section_fields()}
    assert {"ExperimentConfig", "TrainConfig", "RolloutConfig", "WeightSyncConfig", "MetricsConfig"} <= classes


def test_every_config_field_has_a_doc_line():
    missing = [f"{c}.{n}" for c, n, doc in _section_fields() if not doc]
    assert not missing, f"fields without a docstring line under them in areal_like/api/config.py: {missing}"


def test_every_config_field_is_read_somewhere():
    code = _code_outside_config()
    via = _property_reads()

    def read(name: str) -> bool:
        return any(re.search(rf"\.{re.escape(a)}\b", code) for a in (name, *via.get(name, ())))

    unread = sorted({f"{c}.{n}" for c, n, _ in _section_fields() if n not in READ_GENERICALLY and not read(n)})
    assert not unread, f"config fields no code under areal_like/ or launcher/ reads (wire or remove them): {unread}"


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_config_doc", os.path.join(ROOT, "scripts", "gen_config_doc.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_docs_config_md_is_generated_from_config_py():
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == _gen_module().render(), \
        "docs/config.md is stale: run `.venv/bin/python scripts/gen_config_doc.py` and commit it"


def test_docs_config_md_lists_every_key():
    text = _gen_module().render()
    for _, name, _ in _section_fields():
        assert re.search(rf"`(\w+\.)*{re.escape(name)}(\.\w+)*`", text), name  # nested sections: a.b.c


def test_workflow_names_match_the_registry():
    from areal_like.api.config import WORKFLOW_NAMES
    from areal_like.workflow import WORKFLOWS, RLVRWorkflow, get_workflow_class

    assert set(WORKFLOW_NAMES) == set(WORKFLOWS)
    assert get_workflow_class("rlvr") is RLVRWorkflow
    with pytest.raises(KeyError, match="rlvr"):
        get_workflow_class("nope")


def test_unknown_workflow_fails_at_load_without_torch():
    """`rollout.workflow` is checked by config load, in a process that never imports torch."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from areal_like.api.config import ConfigError, load_config\n"
            "try:\n"
            "    load_config(None, ['rollout.workflow=multi_turn_nope'])\n"
            "except ConfigError as e:\n"
            "    print(e)\n"
            "assert 'torch' not in sys.modules, 'config load imported torch'\n"
            "load_config(None, ['rollout.workflow=rlvr'])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "rollout.workflow" in r.stdout and "multi_turn_nope" in r.stdout and "rlvr" in r.stdout, r.stdout
