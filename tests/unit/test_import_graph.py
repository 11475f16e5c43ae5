"""The house's imports run one way (issue 41 item 4): no two files of the packages import each other in a loop,
and the arrows that used to run back up a floor stay gone. Read from the code's own import statements
(every one: module level, inside functions, under TYPE_CHECKING), as `farm-studio look` reads them.

No loop remains: the last one (lora ↔ model ↔ parallelize ↔ sharded_model) went when LoRA became a model
converter behind the model-building seam (learner/converters.py). A loop listed in KNOWN_LOOPS is one the
house tolerates until its part of the work closes it: a new loop fails this test, and so does a listed one
closing without its line going."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("areal_like", "launcher", "allocation")

KNOWN_LOOPS: set[frozenset[str]] = set()
# (importing file's folder, imported folder): arrows that ran back up a floor, moved (docs/architecture.md)
NEVER = [
    ("areal_like/engine/openai_api.py", "areal_like/engine/server.py"),  # the routes take the server as a value
    ("areal_like/weights/", "areal_like/engine/"),
    ("areal_like/workflow/", "areal_like/agent/"),
    ("areal_like/workflow/", "areal_like/rollout/"),
    ("areal_like/workflow/", "areal_like/data/"),
    ("allocation/", "launcher/"),
    ("allocation/", "areal_like/"),
    # the model-building seam and the checkpointer call converters through learner/converters.py, never LoRA's module
    ("areal_like/learner/model.py", "areal_like/learner/lora.py"),
    ("areal_like/learner/checkpoint.py", "areal_like/learner/lora.py"),
    ("areal_like/learner/parallel/", "areal_like/learner/lora.py"),
    ("areal_like/learner/converters.py", "areal_like/learner/"),
]


def _module_file(mod: str) -> str | None:
    path = os.path.join(ROOT, *mod.split("."))
    for cand in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.exists(cand):
            return os.path.relpath(cand, ROOT)
    return None


def _graph() -> dict[str, set[str]]:
    files = [os.path.relpath(os.path.join(d, f), ROOT) for top in PACKAGES
             for d, _, fs in os.walk(os.path.join(ROOT, top)) for f in fs if f.endswith(".py")]
    graph: dict[str, set[str]] = {}
    for rel in files:
        pkg = os.path.dirname(rel).replace(os.sep, ".")
        tree = ast.parse(open(os.path.join(ROOT, rel)).read(), rel)
        out = set()
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                mods = [base] + [f"{base}.{a.name}" for a in node.names]
            for m in mods:
                if m.split(".")[0] in PACKAGES:
                    target = _module_file(m)
                    if target and target != rel and not target.endswith("__init__.py"):
                        out.add(target)
        graph[rel] = out
    return graph


def _loops(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, comps, n = {}, {}, [], set(), set(), [0]

    def visit(v: str) -> None:
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.add(frozenset(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_no_new_import_loop_and_the_known_ones_are_still_listed():
    loops = _loops(_graph())
    new = loops - KNOWN_LOOPS
    assert not new, "files that import each other in a loop: " + "; ".join(" ↔ ".join(sorted(c)) for c in new)
    closed = KNOWN_LOOPS - loops
    assert not closed, f"these loops are gone: take them out of KNOWN_LOOPS: {[sorted(c) for c in closed]}"


def test_no_import_runs_back_up_to_where_it_was_moved_from():
    bad = [f"{src} imports {dst}" for src, dsts in _graph().items() for dst in dsts
           for a, b in NEVER if src.startswith(a) and dst.startswith(b)]
    assert not bad, bad
