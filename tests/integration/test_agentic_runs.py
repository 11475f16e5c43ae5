"""Agentic RLVR through `launcher run` (issue 12): the three examples at toy size, an agent written
with the `openai` package only trained through the proxy, trajectory dumps, and `launcher replay`.

Every run is a real `launcher run` (embedded server, redis-server, learner, rollout worker) on the
tiny tool-use model (`demo:tiny-agent`, built in the test cache) — random weights, so the examples'
tools are rarely called here; the tool paths are covered by tests/unit/test_workflow_api.py,
tests/integration/test_sandbox.py and the agent demo's test.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
from conftest import launcher_cli

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build(example: str, out_dir) -> None:
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", example, "build_data.py"), "--out", str(out_dir),
                    "--n", "32"], check=True, capture_output=True)


def _dump(dump_dir) -> dict[str, dict]:
    groups = {}
    for name in os.listdir(dump_dir):
        for line in open(os.path.join(dump_dir, name)):
            g = json.loads(line)
            groups[g["group_id"]] = g
    return groups


def _trained(run_dir) -> list[str]:
    return [gid for line in open(run_dir / "trained.jsonl") for ev in [json.loads(line)] if ev["event"] == "trained"
            for gid in ev["groups"]]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of trained tokens."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_openai_sdk_agent_is_trained_on_exactly_what_the_server_returned(tmp_path):
    agent_file = os.path.join(ROOT, "examples", "openai_agent", "agent.py")
    imported = {n.names[0].name.split(".")[0] if isinstance(n, ast.Import) else (n.module or "").split(".")[0]
                for n in ast.walk(ast.parse(open(agent_file).read())) if isinstance(n, (ast.Import, ast.ImportFrom))}
    assert "areal_like" not in imported and "openai" in imported  # written with the openai package only
    data, trace = tmp_path / "data", tmp_path / "trace"
    trace.mkdir()
    _build("openai_agent", data)
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    rc, out = launcher_cli("run", "--config", "examples/openai_agent/config.yaml", "--run-dir", str(run_dir),
                        f"data.train_files=[{data}/train.parquet]", "train.total_steps=3", "generation.n=2",
                        "train.batch_size=2", f"rollout.dump_dir={dump}", "metrics.prometheus=false",
                        env={"AGENT_TRACE_DIR": str(trace)})
    assert rc == 0, out[-3000:]
    # what the agent received from the proxy, completion by completion: token ids and logprobs
    returned = []
    for name in os.listdir(trace):
        returned += [json.loads(line) for line in open(trace / name)]
    assert returned and all(r["token_ids"] and len(r["token_ids"]) == len(r["logprobs"]) for r in returned)
    by_tokens: dict[tuple, list] = {}
    for r in returned:
        by_tokens.setdefault(tuple(r["token_ids"]), []).append(r["logprobs"])
    groups = _dump(dump)
    trained = _trained(run_dir)
    assert len(trained) == 3 * 2 and set(trained) <= set(groups)
    n_completions = 0
    for gid in trained:
        for t in groups[gid]["trajectories"]:
            for a, b in _runs(t["loss_mask"]):
                ids, lps = tuple(t["input_ids"][a:b]), t["logprobs"][a:b]
                assert ids in by_tokens, f"trained tokens of {t['traj_id']} [{a}:{b}] were never returned to the agent"
                assert any(max(abs(x - y) for x, y in zip(lps, cand)) < 1e-6 for cand in by_tokens[ids])
                assert all(v >= 0 for v in t["versions"][a:b])  # generated: a policy version per token
                n_completions += 1
            prompt_len = t["prompt_len"]
            assert all(v == -1 for v, m in zip(t["versions"][prompt_len:], t["loss_mask"][prompt_len:]) if not m)
    # the example agent always has ≥ 2 completions per episode (an answer, then a check)
    assert n_completions >= 2 * len(trained) * 2


@pytest.mark.parametrize("example", ["math_tir", "search_r1"])
def test_example_rollout_scripts_run_at_toy_size(tmp_path, example):
    data = tmp_path / "data"
    _build(example, data)
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    extra = []
    if example == "search_r1":  # the tools file names the corpus relative to the repo: point it at ours
        tools = tmp_path / "tools.yaml"
        tools.write_text(open(os.path.join(ROOT, "examples/search_r1/tools.yaml")).read().replace(
            "data/search_r1/corpus.parquet", str(data / "corpus.parquet")))
        extra.append(f"rollout.tools_config={tools}")
    rc, out = launcher_cli("run", "--config", f"examples/{example}/config.yaml", "--run-dir", str(run_dir),
                        f"data.train_files=[{data}/train.parquet]", "train.total_steps=2", "generation.n=2",
                        "train.batch_size=2", f"rollout.dump_dir={dump}", "metrics.prometheus=false", *extra)
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == 2
    groups = _dump(dump)
    assert set(_trained(run_dir)) <= set(groups)
    for g in groups.values():
        for t in g["trajectories"]:
            assert t["segments"] and t["segments"][0]["trained"]  # the first assistant turn follows the prompt
            assert "".join(s["text"] for s in t["segments"]).startswith(t["segments"][0]["text"])


def test_replay_reproduces_the_runs_losses_from_its_dump(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    rc, out = launcher_cli("run", "--config", "configs/demo.yaml", "--run-dir", str(run_dir), f"model.path={model}",
                        f"data.train_files=[{data}]", "data.val_files=[]", "train.test_freq=0", "train.total_steps=3",
                        f"rollout.dump_dir={dump}", "metrics.prometheus=false")
    assert rc == 0, out[-3000:]
    rc, out = launcher_cli("replay", "--dump-dir", str(dump), "--run-dir", str(run_dir), "--out", str(tmp_path / "r.jsonl"))
    assert rc == 0, out[-3000:]
    run_rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    replayed = [json.loads(line) for line in open(tmp_path / "r.jsonl")]
    assert [r["step"] for r in replayed] == [1, 2, 3]
    # Bit-equal, not close: replay runs the run's learner computation in the same configuration (the
    # run's d1p1t1 layout, train.torch_threads, dtype, group order), so every CPU gives the same bits —
    # Intel Xeons included, where a matmul split over another thread count sums in another order.
    assert "1 torch thread(s)" in out, out[-2000:]
    for a, b in zip(run_rows, replayed):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (a["step"], a, b)
    # a dump that lacks the run's groups is refused, naming the flag
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "rollout0.jsonl").write_text("")
    rc, out = launcher_cli("replay", "--dump-dir", str(tmp_path / "empty"), "--run-dir", str(run_dir))
    assert rc == 2 and "lacks" in out and "rollout.dump_dir" in out


def test_multi_turn_feedback_loop_through_launcher_run(tmp_path):
    """`rollout.workflow=multi_turn`: a wrong answer gets the row's feedback turn (untrained) and another
    try, up to rollout.multi_turn.max_assistant_turns — as the dump shows."""
    data = tmp_path / "data"
    _build("openai_agent", data)  # chat prompts with a numeric ground truth; the random model is wrong
    run_dir = tmp_path / "run"
    rc, out = launcher_cli("run", "--config", "examples/openai_agent/config.yaml", "--run-dir", str(run_dir),
                           f"data.train_files=[{data}/train.parquet]", "rollout.workflow=multi_turn",
                           "rollout.multi_turn.max_assistant_turns=2", "rollout.multi_turn.max_tokens_per_turn=8",
                           "train.total_steps=2", "generation.n=2", "train.batch_size=2", "rollout.dump_dir=dump",
                           "metrics.prometheus=false")
    assert rc == 0, out[-3000:]
    groups = _dump(run_dir / "dump")  # a relative dump_dir is inside the run directory
    assert set(_trained(run_dir)) <= set(groups)
    trajs = [t for g in groups.values() for t in g["trajectories"]]
    retried = [t for t in trajs if sum(s["trained"] for s in t["segments"]) == 2]
    assert retried, [t["segments"] for t in trajs[:3]]
    for t in retried:
        assert [s["trained"] for s in t["segments"]] == [True, False, True]
        assert "#U:That is not right. Try again." in t["segments"][1]["text"]
        assert t["finish_reason"] in ("stop", "length", "max_turns", "context_limit")


LOOP_AGENT = '''
import openai


class LoopAgent:
    """Ignores max_turns: keeps asking for completions until the proxy refuses one (at most 20)."""

    async def run(self, data, *, base_url, api_key, model, **kwargs):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
        try:
            for _ in range(20):
                try:
                    await client.chat.completions.create(model=model, max_tokens=4,
                                                         messages=[{"role": "user", "content": "again"}])
                except openai.BadRequestError as e:
                    assert e.body["code"] == "max_completions_per_episode_exceeded", e.body
                    break
        finally:
            await client.close()
        return 1.0
'''


def test_looping_agent_is_capped_and_counted_in_summary(tmp_path):
    """Issue 24 item 7 through `launcher run`: an agent that loops on completions (one made 301 with
    max_assistant_turns 2) gets at most max_assistant_turns completions per episode, so each trained group
    has at most n × 2 samples (each completion is its own sample: the prompts do not chain); the refusals
    reach summary.json (`buffer.agent_completions_refused`)."""
    data = tmp_path / "data"
    _build("openai_agent", data)
    agent = tmp_path / "loop_agent.py"
    agent.write_text(LOOP_AGENT)
    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    rc, out = launcher_cli("run", "--config", "examples/openai_agent/config.yaml", "--run-dir", str(run_dir),
                        f"data.train_files=[{data}/train.parquet]", "train.total_steps=2", "generation.n=2",
                        "train.batch_size=2", f"rollout.dump_dir={dump}", "metrics.prometheus=false",
                        f"rollout.workflow={agent}:LoopAgent", "rollout.multi_turn.max_assistant_turns=2")
    assert rc == 0, out[-3000:]
    groups = _dump(dump)
    trained = _trained(run_dir)
    assert trained and set(trained) <= set(groups)
    for gid in trained:
        assert len(groups[gid]["trajectories"]) == 2 * 2, gid  # n × cap: every episode stopped at the cap
        assert groups[gid]["episode"]["agent_completions_refused"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["buffer"]["agent_completions_refused"] >= 2 * len(trained)
