"""The agentic demo (configs/agent_demo.yaml) at toy size: a real `launcher run` of the demo config on a
briefly warm-started agent model, whose trajectory dump must show multi-turn tool use with the tool's
output untrained.

The full demo (the 600-step warm start, 300 RL steps: reward ~0.1 → ≥ 0.9 in ~3.5 min on 2 cores) is
measured by hand, not here; this test checks the plumbing: the warm start produces tool calls in the
exact token layout of the `tool_agent` workflow, the calculator answers them, and the learner is handed
every assistant turn with loss mask 1 and every tool response with loss mask 0.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import launcher_cli

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory) -> str:
    """The tiny agent model after a short warm start in which every episode calls the calculator
    (the demo's recipe calls in ~2%: too rare for a 3-step run to show a call reliably)."""
    from areal_like.data.agent_task import ensure_calc_agent

    d = str(tmp_path_factory.mktemp("calc") / "model")
    return ensure_calc_agent(d, steps=150, batch_size=16, p_tool=1.0, p_train_call=1.0, log=lambda msg: None)


def test_agent_demo_config_dumps_multi_turn_tool_episodes(tmp_path, calling_model):
    from transformers import AutoTokenizer

    run_dir, dump = tmp_path / "run", tmp_path / "dump"
    rc, out = launcher_cli("run", "--config", "configs/agent_demo.yaml", "--run-dir", str(run_dir),
                           f"model.path={calling_model}", "train.total_steps=3", "train.batch_size=2",
                           "generation.n=4", f"rollout.dump_dir={dump}", "metrics.prometheus=false", timeout=180)
    assert rc == 0, out[-3000:]
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["steps"] == 3 and summary["exit_reason"] == "completed"

    tok = AutoTokenizer.from_pretrained(calling_model)
    open_id, close_id = tok.convert_tokens_to_ids("<tool_response>"), tok.convert_tokens_to_ids("</tool_response>")
    episodes = [t for name in os.listdir(dump) for line in open(dump / name)
                for t in json.loads(line)["trajectories"]]
    assert episodes
    multi = [t for t in episodes if sum(s["trained"] for s in t["segments"]) >= 2]
    assert multi, [t["segments"] for t in episodes[:4]]
    for t in multi:
        ids, mask = t["input_ids"], t["loss_mask"]
        assert not any(mask[:t["prompt_len"]])  # the prompt is never trained
        # every tool response, markers included, is an observation: in the context, loss mask 0 (the
        # barely trained policy may write a `<tool_response>` token itself: that one is trained, rightly)
        starts = [i for i, x in enumerate(ids) if x == open_id and i >= t["prompt_len"] and not mask[i]]
        assert starts, t["segments"]
        for s in starts:
            e = ids.index(close_id, s)
            assert not any(mask[s:e + 1]), (tok.decode(ids[s:e + 1]), mask[s:e + 1])
        assert any(not s["trained"] and "<tool_response>" in s["text"] for s in t["segments"])
    # the warm start taught the call's format: some calls reach the calculator and return a number
    answered = [t for t in multi for s in t["segments"]
                if not s["trained"] and "<tool_response>" in s["text"] and "Error" not in s["text"]]
    assert answered, [t["segments"] for t in multi[:4]]
