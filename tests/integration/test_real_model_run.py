"""The real pretrained model through `launcher run` (configs/real_model.yaml, a few steps — the learning run
itself is benchmarks/real_model_learns.py's and the README's): SmolLM2-135M-Instruct's ChatML template
on every prompt, `<|im_end|>` ending the replies that stop, the loss mask on exactly the generated tokens,
the whole model pushed to the server after each step, a validation row for the pushed version."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
IM_END = 2  # <|im_end|>: the GGUF's EOS id


def test_the_real_model_runs_under_launcher(tmp_path):
    from conftest import launcher_cli

    run_dir = tmp_path / "run"
    rc, out = launcher_cli(
        "run", "--config", "configs/real_model.yaml", "--run-dir", str(run_dir),
        "train.total_steps=2", "train.batch_size=2", "generation.n=4", "generation.max_new_tokens=32",
        "train.test_freq=2", "eval.max_prompts=4", "eval.n=2", "rollout.dump_dir=dump", timeout=500)
    assert rc == 0, out[-4000:]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["path"].endswith("smollm2-135m-instruct-v1")  # the demo name, resolved in the cache

    groups = [json.loads(line) for line in (run_dir / "dump" / "rollout0.jsonl").read_text().splitlines()]
    trajs = [t for g in groups for t in g["trajectories"]]
    assert len(groups) >= 4 and len(trajs) == 4 * len(groups)
    stopped = 0
    for t in trajs:
        n, p = len(t["input_ids"]), t["prompt_len"]
        # the chat template: SmolLM2's default system prompt, the question as the user turn, the assistant's turn open
        assert t["prompt_text"].startswith(SYSTEM + "<|im_start|>user\n"), t["prompt_text"]
        assert t["prompt_text"].endswith("<|im_end|>\n<|im_start|>assistant\n"), t["prompt_text"]
        # the loss mask covers exactly the generated tokens; prompt tokens carry version −1
        assert t["loss_mask"] == [0] * p + [1] * (n - p)
        assert t["versions"][:p] == [-1] * p and min(t["versions"][p:]) >= 0
        assert 1 <= n - p <= 32
        response = t["input_ids"][p:]
        if t["finish_reason"] == "stop":  # <|im_end|> ended the reply, and is trained as its last token
            stopped += 1
            assert response[-1] == IM_END and IM_END not in response[:-1]
        else:
            assert t["finish_reason"] == "length" and n - p == 32 and IM_END not in response
        assert t["reward"] in (0.0, 1.0)
    assert stopped > 0, "no reply ended with <|im_end|>"  # ~40 % of the base model's replies stop within 32 tokens

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["push_bytes"] == 134_515_008 * 4  # every parameter, fp32 (tied head sent once)
        assert r["samples"] == 8
    # the learner's loss tokens are the generated tokens of the groups it trained on in that step
    trained = [json.loads(line) for line in (run_dir / "trained.jsonl").read_text().splitlines()]
    by_group = {g["group_id"]: g for g in groups}
    for ev in (e for e in trained if e["event"] == "trained"):
        gen = sum(sum(t["loss_mask"]) for gid in ev["groups"] for t in by_group[gid]["trajectories"])
        assert rows[ev["step"] - 1]["loss_tokens"] == gen, ev
    val = [r for r in rows if "val/all/mean@2" in r]
    assert [r["val/version"] for r in val] == [0, 2]  # val_before_train, then the version pushed after step 2
    assert all(r["val/samples"] == 8 and r["val/version_mismatch_tokens"] == 0 for r in val)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["steps"] == 2
