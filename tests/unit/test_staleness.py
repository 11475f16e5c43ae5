"""buffer/staleness.py — the one owner of the staleness policy: its pure functions (capacity, a group's
staleness, the consume-time split, what a learner step takes), and a check over the package's source
that nothing else computes staleness. No Redis here (tests/integration/test_gate.py and
test_stale_credit.py run the Lua scripts against a real redis-server)."""

from __future__ import annotations

import ast
import pathlib
import re
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import areal_like
from areal_like.api.trajectory import TrajectoryGroup
from areal_like.buffer import staleness as S
from test_buffer_logic import _group  # one builder of test groups


# ---- capacity -------------------------------------------------------------------------------------
def test_capacity_is_eta_plus_v_plus_one_batches_plus_credit():
    assert S.capacity(0, 0, 4) == 4  # η = 0, v = 0: exactly the B groups of step 0
    assert S.capacity(0, 3, 4) == 16
    assert S.capacity(2, 0, 4) == 12
    assert S.capacity(2, 5, 3, credit=2) == 26
    assert S.StalenessPolicy(max_staleness=2, batch_size=3, limit=2).capacity(5, credit=2) == 26


@given(eta=st.integers(0, 8), v=st.integers(0, 100), b=st.integers(1, 32), credit=st.integers(0, 50),
       accepted=st.integers(0, 5000), running=st.integers(0, 200))
def test_allowed_is_one_more_within_capacity(eta, v, b, credit, accepted, running):
    cap = S.capacity(eta, v, b, credit)
    assert cap == (eta + v + 1) * b + credit
    assert S.allowed(accepted, running, eta, v, b, credit) == (accepted + running + 1 <= cap)
    assert S.capacity(eta, v + 1, b, credit) - cap == b  # each published version frees B slots


def test_bounds_are_checked():
    S.check_bounds(0, 1)  # η = 0 is synchronous RL, not an error
    with pytest.raises(ValueError, match="max_staleness"):
        S.check_bounds(-1, 1)
    with pytest.raises(ValueError, match="batch_size"):
        S.check_bounds(0, 0)
    with pytest.raises(ValueError, match="stale policy"):
        S.check_policy("maybe")
    with pytest.raises(ValueError):
        S.StalenessPolicy(max_staleness=-1, batch_size=2, limit=0)


# ---- a group's staleness ----------------------------------------------------------------------------
def test_staleness_is_versions_since_the_oldest_generated_token():
    g = _group("g", [[3, 4], [2, 5]])
    assert [S.staleness(g, v) for v in (2, 3, 7)] == [0, 1, 5]
    assert S.staleness(_group("empty", [[]]), 100) == 0  # no generated token: no policy behind it


def test_trained_staleness_skips_groups_without_generated_tokens():
    groups = [_group("a", [[1, 2]]), _group("b", [[]]), _group("c", [[3]])]
    assert S.trained_staleness(groups, 4) == [3, 1]
    assert S.max_trained_staleness(groups, 4) == 3
    assert S.max_trained_staleness([_group("b", [[]])], 4) == 0
    assert S.max_trained_staleness([], 4, default=-1) == -1  # the trainer's version_lag_max when none


def test_consume_limit_defaults_to_eta():
    assert S.consume_limit(2, None) == 2
    assert S.consume_limit(2, 5) == 5
    assert S.consume_limit(0, 0) == 0


# ---- the consume-time split ---------------------------------------------------------------------------
def test_split_keeps_exactly_the_bound_in_order():
    entries = [(f"{v}-0", _group(f"g{v}", [[v]])) for v in (4, 0, 3, 1, 2)]
    fresh, stale = S.split_stale(entries, current_version=4, max_staleness=2)
    assert [g.group_id for _, g in fresh] == ["g4", "g3", "g2"]
    assert [g.group_id for _, g in stale] == ["g0", "g1"]
    pol = S.StalenessPolicy(max_staleness=2, batch_size=5, limit=2)
    assert pol.split(entries, 4) == (fresh, stale)


def test_split_at_eta_0_keeps_only_the_current_version():
    entries = [(str(v), _group(f"g{v}", [[v]])) for v in range(3)] + [("e", _group("empty", [[]]))]
    fresh, stale = S.split_stale(entries, current_version=2, max_staleness=0)
    assert [g.group_id for _, g in fresh] == ["g2", "empty"]
    assert [g.group_id for _, g in stale] == ["g0", "g1"]


@given(versions=st.lists(st.integers(-1, 20), max_size=30), v=st.integers(0, 25), limit=st.integers(0, 6))
def test_split_partitions_by_staleness(versions, v, limit):
    entries = [(str(i), _group(f"g{i}", [[mv]] if mv >= 0 else [[]])) for i, mv in enumerate(versions)]
    fresh, stale = S.split_stale(entries, v, limit)
    assert sorted(fresh + stale, key=lambda e: int(e[0])) == entries
    assert all(S.staleness(g, v) <= limit for _, g in fresh)
    assert all(S.staleness(g, v) > limit for _, g in stale)


# ---- what a learner step takes -------------------------------------------------------------------------
def test_step_takes_b_and_replaces_every_credited_drop():
    take = S.StalenessPolicy(max_staleness=1, batch_size=3, limit=1, filter_budget=2).step()
    assert take.need == 3
    take.read(3)
    take.replace_stale(2)  # two stale groups dropped: two more reads
    assert take.need == 2 and take.dropped_stale == 2
    take.read(2)
    assert take.filter_room == 2
    take.replace_filtered(2)
    assert take.need == 2 and take.filtered == 2 and take.filter_room == 0
    take.read(2)
    assert take.need == 0


def test_policy_from_config():
    cfg = SimpleNamespace(rollout=SimpleNamespace(max_staleness=2),
                          train=SimpleNamespace(batch_size=4, max_consume_staleness=None, consume_stale_policy="keep"),
                          algorithm=SimpleNamespace(filter_groups=False, filter_groups_max_extra=7))
    pol = S.StalenessPolicy.from_config(cfg)
    assert (pol.max_staleness, pol.batch_size, pol.limit, pol.stale_policy, pol.filter_budget) == (2, 4, 2, "keep", 0)
    cfg.algorithm.filter_groups, cfg.train.max_consume_staleness = True, 3
    pol = S.StalenessPolicy.from_config(cfg)
    assert (pol.limit, pol.filter_budget) == (3, 7)


@given(b=st.integers(1, 6),
       actions=st.lists(st.tuples(st.sampled_from(["start", "finish", "fail", "learn"]), st.integers(0, 63)),
                        max_size=300))
def test_eta0_through_the_policy_trains_only_fresh_groups(b, actions):
    """η = 0 through the same functions the gate and the learner use: the gate's check, then a learner
    step of B groups split at its version — nothing is ever stale, so nothing is dropped."""
    pol = S.StalenessPolicy(max_staleness=0, batch_size=b, limit=0)
    v, accepted = 0, 0
    running: list[int] = []
    stream: list[tuple[str, TrajectoryGroup]] = []
    for action, pick in actions:
        if action == "start" and S.allowed(accepted, len(running), pol.max_staleness, v, b):
            running.append(v)
        elif action in ("finish", "fail") and running:
            sv = running.pop(pick % len(running))
            if action == "finish":
                accepted += 1
                stream.append((str(accepted), _group(f"g{accepted}", [[sv]])))
        elif action == "learn" and len(stream) >= b:
            take = pol.step()
            got, stream = stream[:take.need], stream[take.need:]
            take.read(len(got))
            fresh, stale = pol.split(got, v)
            assert not stale and take.need == 0 and S.max_trained_staleness([g for _, g in fresh], v) == 0
            v += 1
        assert accepted + len(running) <= pol.capacity(v)


# ---- the lifecycle is drawn -----------------------------------------------------------------------
def test_module_docstring_draws_the_lifecycle_and_who_waits_on_what():
    doc = S.__doc__ or ""
    for state in ("WAITING", "IN FLIGHT", "ACCEPTED", "TRAINED", "DROPPED"):
        assert state in doc, state
    assert "rollout worker waits" in doc and "learner waits" in doc


def test_credited_drops_are_what_the_ack_script_credits():
    for reason in S.CREDITED_DROPS:
        assert f"'dropped:{reason}'" in S.ACK.source
    assert S.ACK.source.count("dropped:") == len(S.CREDITED_DROPS)


# ---- nothing else computes staleness ----------------------------------------------------------------
OWNER = pathlib.Path(S.__file__).resolve()
PACKAGE = pathlib.Path(areal_like.__file__).resolve().parent
_LUA_POLICY = re.compile(r"gate_credit|\+\s*v\s*\+\s*1")  # the credit, or (η + v + 1) in Lua


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr
            for n in ast.walk(node) if isinstance(n, (ast.Name, ast.Attribute))}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def staleness_computations(src: str) -> list[str]:
    """Where `src` computes staleness or the gate's capacity:
      * a subtraction with a version on one side and a non-constant on the other
        (`v - g.min_version`, `version - min(min_versions)`, `current_version - mv`; `version - 1` is
        not one);
      * a sum of a staleness bound (max_staleness, eta) and a version (the capacity (η + v + 1)·B);
      * a call of `staleness(…)` (the split re-done: `staleness(g, v) > limit`);
      * a Lua (non-docstring) string that touches the gate credit or adds v + 1 (the capacity in Redis).
    """
    tree = ast.parse(src)
    docs = _docstrings(tree)
    hits = []
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub):
            left, right = _names(n.left), _names(n.right)
            if (any("version" in x for x in left) and right) or (any("version" in x for x in right) and left):
                hits.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add):
            names = _names(n)
            if any("staleness" in x or x in ("eta", "η") for x in names) and any("version" in x for x in names):
                hits.append(f"{n.lineno}: {ast.unparse(n)}")
        elif isinstance(n, ast.Call) and "staleness" in (getattr(n.func, "id", None), getattr(n.func, "attr", None)):
            hits.append(f"{n.lineno}: {ast.unparse(n)}")
        elif (isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
              and _LUA_POLICY.search(n.value)):
            hits.append(f"{n.lineno}: Lua {n.value.strip().splitlines()[0][:60]!r}…")
    return hits


# What the package computed before buffer/staleness.py owned the policy: each must be caught.
_OLD_SITES = {
    "rollout/gate.py capacity": "def capacity(max_staleness, version, batch_size, credit=0):\n"
                                "    return (max_staleness + version + 1) * batch_size + credit\n",
    "gate Lua (scripts.TRY_ACQUIRE)": 'TRY_ACQUIRE = LuaScript("t", """\n'
                                      "local cap = (tonumber(ARGV[2]) + v + 1) * tonumber(ARGV[3])\n\"\"\")\n",
    "gate Lua (scripts.GATE_STATE credit)": 'S = LuaScript("s", """\n'
                                            "local credit = tonumber(redis.call('HGET', KEYS[2], 'gate_credit'))\n\"\"\")\n",
    "buffer Lua (scripts.ACK credit)": "ACK = LuaScript('ack', \"\"\"\n"
                                       "redis.call('HINCRBY', KEYS[2], 'gate_credit', n)\n\"\"\")\n",
    "replay_buffer.staleness": "def staleness(group, current_version):\n    mv = group.min_version\n"
                               "    return 0 if mv < 0 else current_version - mv\n",
    "replay_buffer.split_stale": "for e in entries:\n"
                                 "    (drop if staleness(e[1], current_version) > max_staleness else keep).append(e)\n",
    "learner/reporter.py report": "staleness = [version - 1 - g.min_version for g in batch.groups "
                                  "if g.min_version >= 0]\n",
    "learner/trainer.py version_lag_max": "lag = (version - min(min_versions)) if min_versions else -1\n",
}


@pytest.mark.parametrize("site", sorted(_OLD_SITES))
def test_the_check_catches_each_former_staleness_site(site):
    assert staleness_computations(_OLD_SITES[site]), site


def test_the_check_passes_version_arithmetic_that_is_not_staleness():
    ok = ('"""Docstring: accepted + running + 1 <= (η + v + 1)·B + gate_credit."""\n'
          "v = version - 1\nnxt = version + 1\npush(version + 1)\n"
          "x = trained_staleness(batch.groups, version - 1)\n")
    assert staleness_computations(ok) == []


def test_the_owner_is_where_staleness_is_computed():
    hits = staleness_computations(OWNER.read_text())
    assert any("current_version - mv" in h for h in hits)
    assert any("max_staleness + version + 1" in h for h in hits)
    assert sum(": Lua " in h for h in hits) >= 3  # TRY_ACQUIRE, GATE_STATE, ACK


def test_nothing_else_in_the_package_computes_staleness():
    files = [p for p in PACKAGE.rglob("*.py") if p.resolve() != OWNER]
    assert len(files) > 50  # the whole package is scanned, not an empty glob
    found = {str(p.relative_to(PACKAGE)): h for p in files if (h := staleness_computations(p.read_text()))}
    assert found == {}, f"staleness computed outside {OWNER.name}: {found}"
