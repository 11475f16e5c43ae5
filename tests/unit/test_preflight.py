"""No silent fallbacks: every model and data path is checked before a run starts, demo names resolve
to the cache, and a path the user gives is never created (unit level; `launcher run` in
tests/integration/test_preflight_run.py)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_like.api.config import load_config
from launcher.preflight import PreflightError, resolve_and_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg_with(*overrides):
    return load_config(os.path.join(ROOT, "configs/demo.yaml"), list(overrides))


def test_demo_names_resolve_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path / "cache"))
    cfg = cfg_with()
    resolve_and_check(cfg)
    assert cfg.model.path == str(tmp_path / "cache" / "demo" / "tiny-qwen2")
    assert os.path.isfile(os.path.join(cfg.model.path, "config.json"))
    assert cfg.data.train_files[0].startswith(str(tmp_path / "cache")) and os.path.isfile(cfg.data.train_files[0])
    assert cfg.data.val_files[0].startswith(str(tmp_path / "cache")) and os.path.isfile(cfg.data.val_files[0])
    with pytest.raises(PreflightError, match="demo:next-digit-val"):
        resolve_and_check(cfg_with("model.path=demo:tiny-llama"))  # the message lists the known names


@pytest.mark.parametrize("path,fix", [("Qwen/Qwen2.5-0.5B", "huggingface-cli download Qwen/Qwen2.5-0.5B"),
                                      ("/no/such/model_dir", "does not exist"),
                                      ("", "model.path is not set")])
def test_bad_model_path_is_refused_and_never_created(tmp_path, monkeypatch, path, fix):
    monkeypatch.chdir(tmp_path)
    cfg = cfg_with(f"model.path={path}" if path else "model.path=''")
    with pytest.raises(PreflightError, match="model.path") as e:
        resolve_and_check(cfg)
    assert fix in str(e.value)
    assert os.listdir(tmp_path) == []  # nothing built at the typo (or under ./Qwen)


def test_model_dir_without_config_or_tokenizer(tmp_path, demo_assets):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="no config.json"):
        resolve_and_check(cfg_with(f"model.path={tmp_path / 'empty'}"))
    model, _ = demo_assets
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(open(os.path.join(model, "config.json")).read())
    with pytest.raises(PreflightError, match="tokenizer"):
        resolve_and_check(cfg_with(f"model.path={bare}"))


def test_data_files_are_checked_for_existence_and_columns(tmp_path, demo_assets):
    model, data = demo_assets
    with pytest.raises(PreflightError, match=r"data.train_files\[1\]=.*missing.parquet does not exist"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{data},{tmp_path / 'missing.parquet'}]"))
    assert not (tmp_path / "missing.parquet").exists()
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"question": ["1+1"], "reward_model": [{"ground_truth": "2"}]}), wrong)
    with pytest.raises(PreflightError, match=r"data.train_files\[0\].*no column 'prompt'.*data.prompt_key"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{wrong}]"))
    resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{wrong}]", "data.prompt_key=question",
                               "data.val_files=[]", "train.test_freq=0"))
    no_gt = tmp_path / "no_gt.parquet"
    pq.write_table(pa.table({"prompt": ["1+1"], "reward_model": [{"answer": "2"}]}), no_gt)
    with pytest.raises(PreflightError, match="ground_truth"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.val_files=[{no_gt}]"))
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(PreflightError, match="not a parquet file"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{not_parquet}]"))
    with pytest.raises(PreflightError, match=r"data.train_files is empty"):
        resolve_and_check(cfg_with(f"model.path={model}", "data.train_files=[]"))


# ---- issue 24 item 11 / Deliver 2: what the rollout workers read, checked before anything starts -------

from launcher.preflight import check_rollout_inputs  # noqa: E402


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _row(prompt, **extra):
    return {"prompt": prompt, "reward_model": {"ground_truth": "1", "style": "rule"}, **extra}


def _checked(model, train, *overrides):
    cfg = cfg_with(f"model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]", "train.test_freq=0",
                   *overrides)
    resolve_and_check(cfg)
    check_rollout_inputs(cfg)


@pytest.mark.parametrize("cell,problem", [
    (None, "column 'prompt' is null"),
    ("", "column 'prompt' is an empty string"),
    ([], "column 'prompt' is an empty chat list"),
    ([{"role": "user", "content": None}], "column 'prompt' message 0 (user) has content NoneType, want a str"),
    ([{"role": "", "content": "hi"}], "column 'prompt' message 0 has no role"),
])
def test_bad_prompt_cells_name_the_key_file_and_row(tmp_path, demo_assets, cell, problem):
    model, _ = demo_assets
    good = [{"role": "user", "content": "2+2"}] if isinstance(cell, list) else "2+2"
    path = _write(tmp_path / "t.parquet", [_row(good), _row(good), _row(cell), _row(good)])
    with pytest.raises(PreflightError) as e:
        _checked(model, path)
    assert f"data.train_files[0]={path} row 2: {problem}" in str(e.value)


def test_val_file_rows_are_checked_and_an_empty_file_is_not_a_length_problem(tmp_path, demo_assets):
    model, data = demo_assets
    val = _write(tmp_path / "v.parquet", [_row("1"), _row(None)])
    cfg = cfg_with(f"model.path={model}", f"data.val_files=[{data},{val}]")
    resolve_and_check(cfg)
    with pytest.raises(PreflightError, match=rf"data.val_files\[1\]={val} row 1: column 'prompt' is null"):
        check_rollout_inputs(cfg)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(data).slice(0, 0), empty)
    cfg = cfg_with(f"model.path={model}", f"data.val_files=[{empty}]")
    resolve_and_check(cfg)
    with pytest.raises(PreflightError) as e:
        check_rollout_inputs(cfg)
    assert f"data.val_files[0]={empty} has no rows" in str(e.value) and "max_prompt_length" not in str(e.value)
    with pytest.raises(PreflightError, match=rf"data.train_files\[0\]={empty} has no rows"):
        _checked(model, empty)


def test_agent_names_of_rows_and_extra_info_are_resolved(tmp_path, demo_assets):
    model, _ = demo_assets
    ok = _write(tmp_path / "ok.parquet", [_row("1", agent_name="rlvr"), _row("2", agent_name="single_turn_agent")])
    _checked(model, ok)
    typo = _write(tmp_path / "typo.parquet", [_row("1", extra_info={"index": 0, "agent_name": "rlvr"}),
                                              _row("2", extra_info={"index": 1, "agent_name": "multi_trun"})])
    with pytest.raises(PreflightError, match=rf"data.train_files\[0\]={typo} row 1 agent_name='multi_trun': .*not "
                                             "known: use one of rlvr"):
        _checked(model, typo)
    tools = _write(tmp_path / "tools.parquet", [_row("1", agent_name="tool_agent")])
    with pytest.raises(PreflightError, match=r"row 0 agent_name='tool_agent' needs tools: set rollout.tools_config"):
        _checked(model, tools)


def test_user_workflow_and_tools_yaml_are_loaded(tmp_path, demo_assets):
    model, data = demo_assets
    wf = tmp_path / "flows.py"
    wf.write_text("async def my_flow(ctx, row):\n    return None\n")
    _checked(model, data, f"rollout.workflow={wf}:my_flow")
    with pytest.raises(PreflightError, match=rf"rollout.workflow={wf}:my_flwo: .* defines no 'my_flwo' \(it defines: "
                                             "my_flow\\)"):
        _checked(model, data, f"rollout.workflow={wf}:my_flwo")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_xyz\n")
    with pytest.raises(PreflightError, match=rf"rollout.workflow={broken}:f: importing .* ModuleNotFoundError"):
        _checked(model, data, f"rollout.workflow={broken}:f")
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: python\n    config: {timeout: 5}\n")
    with pytest.raises(PreflightError) as e:
        _checked(model, data, f"rollout.tools_config={tools}", "rollout.workflow=tool_agent")
    assert str(e.value).startswith(f"rollout.tools_config={tools}: tools[0] (python).config: unknown key(s) "
                                   "['timeout']"), e.value
    tools.write_text("tools: [{class_name: python}\n")
    with pytest.raises(PreflightError, match=rf"rollout.tools_config={tools} is not valid YAML"):
        _checked(model, data, f"rollout.tools_config={tools}", "rollout.workflow=tool_agent")
    tools.write_text("tools:\n  - class_name: python\n")
    _checked(model, data, f"rollout.tools_config={tools}", "rollout.workflow=tool_agent")


def test_rollout_worker_dataset_tells_an_empty_file_from_prompts_too_long(tmp_path, demo_assets):
    """The worker's own check (PromptDataset) names the key it was given and says "raise
    data.max_prompt_length" only when prompts were dropped for length, never for an empty file."""
    from transformers import AutoTokenizer

    from areal_like.data.dataset import PromptDataset

    model, data = demo_assets
    tok = AutoTokenizer.from_pretrained(model)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(data).slice(0, 0), empty)
    with pytest.raises(ValueError) as e:
        PromptDataset([str(empty)], tok, key="data.val_files")
    assert f"data.val_files=['{empty}'] have no rows" in str(e.value) and "max_prompt_length" not in str(e.value)
    with pytest.raises(ValueError, match=r"data.val_files=.*all 2048 are longer than data.max_prompt_length=0 "
                                         r"tokens: raise data.max_prompt_length"):
        PromptDataset([data], tok, max_prompt_length=0, key="data.val_files")
    null = _write(tmp_path / "null.parquet", [_row("1"), _row(None)])
    with pytest.raises(ValueError, match=rf"data.val_files\[0\]={null} row 1: column 'prompt' is null"):
        PromptDataset([null], tok, key="data.val_files")


def test_rows_a_reward_model_grades_need_a_judge_whose_grade_is_the_reward(tmp_path, demo_assets):
    """verl's `reward_model.style: model` rows (here without a reference answer): the built-in rule has nothing to
    compare a response with, so a run that would score them with it is refused, naming the fix; a judge whose
    grade alone is the reward (judge.rule_weight=0), or the user's own reward function, is accepted."""
    model, _ = demo_assets
    open_row = {"prompt": "123", "reward_model": {"ground_truth": None, "style": "model"}}
    path = _write(tmp_path / "open.parquet", [_row("1"), _row("2"), open_row])
    judged = ("allocation=embedded[rollout]:d1+fsdp[actor]:d1+embedded[judge]:d1", f"judge.model_path={model}")
    with pytest.raises(PreflightError) as e:
        _checked(model, path)
    assert f"data.train_files[0]={path} row 2 has reward_model.style=model" in str(e.value)
    assert "the run has no judge: add a judge component" in str(e.value)
    with pytest.raises(PreflightError, match=r"judge.rule_weight=0.5 .* set judge.rule_weight=0"):
        _checked(model, path, *judged, "judge.rule_weight=0.5")
    _checked(model, path, *judged, "judge.rule_weight=0")
    script = tmp_path / "grade.py"
    script.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    _checked(model, path, f"custom_reward_function.path={script}")
    # rows graded by their rule are not concerned (every other test here)
    _checked(model, _write(tmp_path / "rule.parquet", [_row("1")]))


def test_routing_replay_needs_a_moe_model_and_a_moe_model_needs_embedded_servers(tmp_path, demo_assets):
    """Issue 44: `train.routing_replay` on a dense model, and a MoE model on co-located SGLang servers (whose per-GPU
    handoff does not split the fused experts), are refused before anything starts, naming the key."""
    from areal_like.data.tiny_model import build_tiny_model

    model, data = demo_assets
    with pytest.raises(PreflightError, match=r"train.routing_replay=rollout .* has no experts .* "
                                             r"set train.routing_replay=off"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{data}]", "train.routing_replay=rollout"))
    moe = build_tiny_model(str(tmp_path / "moe"), arch="qwen3_moe")
    resolve_and_check(cfg_with(f"model.path={moe}", f"data.train_files=[{data}]", "train.routing_replay=rollout"))
    # SGLang servers get each expert's tensors (learner/moe.py PerExpertWeights); co-located ones are refused
    resolve_and_check(cfg_with(f"model.path={moe}", f"data.train_files=[{data}]", "allocation=sglang.d1p1t1+d1p1t1"))
    with pytest.raises(PreflightError, match=r"mixture-of-experts model .* SGLang's, co-located .* not implemented"):
        resolve_and_check(cfg_with(f"model.path={moe}", f"data.train_files=[{data}]", "allocation=sglang.d2|fsdp.d2"))
    # expert parallel (e) splits experts: a dense model has none
    with pytest.raises(PreflightError, match=r"expert parallel e2 .* has no experts .* remove e from the allocation"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{data}]",
                                   "allocation=embedded.d1+megatron:d2e2"))
    resolve_and_check(cfg_with(f"model.path={moe}", f"data.train_files=[{data}]", "allocation=embedded.d1+megatron:d2e2"))
