"""Checks of the paths a run depends on, before anything starts; demo names resolved to the cache.

Every model and data path in the config is either a demo name (`demo:tiny-qwen2`, `demo:next-digit`,
`demo:next-digit-val`: built once in `$AREAL_LIKE_CACHE/demo`, default ~/.cache/areal_like/demo) or a
path the user gives — which is checked and never created or written. A failure names the key, the
path and the fix. Nothing here starts a process.
"""

from __future__ import annotations

import os
import re

from areal_like.api.config import ExperimentConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PreflightError(ValueError):
    """A path of the config that cannot work: the message names the key, the path and the fix."""


def _resolve(value: str, key: str, log) -> str:
    from areal_like.data.demo_task import resolve_demo_name

    if not value.startswith("demo:"):
        return value
    try:
        path = resolve_demo_name(value, key)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    log(f"{key}={value} → {path}")
    return path


def check_model_dir(path: str, key: str) -> None:
    if not path:
        raise PreflightError(f"{key} is not set: set {key}=/path/to/hf_model_dir (or {key}=demo:tiny-qwen2 "
                             "for the demo's tiny model)")
    if not os.path.isdir(path):
        if _HUB_ID.match(path) and not os.path.exists(path):
            name = path.rsplit("/", 1)[1]
            raise PreflightError(f"{key}={path} is not a local directory, and areal_like downloads nothing at run "
                                 f"time: download it first, e.g. `huggingface-cli download {path} --local-dir "
                                 f"models/{name}`, then pass {key}=models/{name}")
        raise PreflightError(f"{key}={path} does not exist: point {key} at an HF model directory "
                             "(config.json, safetensors, tokenizer files)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PreflightError(f"{key}={path} is not an HF model directory (no config.json): point {key} at the "
                             "directory `save_pretrained` wrote")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                "tokenizer.model")):
        raise PreflightError(f"{key}={path} has no tokenizer files (tokenizer.json / tokenizer_config.json): "
                             "save the tokenizer into the model directory")


def _generation_backend(cfg: ExperimentConfig) -> str | None:
    from allocation import AllocationError, parse_allocation

    try:
        gen = parse_allocation(cfg.allocation).generation
    except AllocationError:
        return None  # reported where the allocation is checked
    return gen.backend if gen is not None else None


def _colocated(cfg: ExperimentConfig) -> bool:
    from allocation import AllocationError, parse_allocation

    try:
        return parse_allocation(cfg.allocation).colocated
    except AllocationError:
        return False  # reported where the allocation is checked


def _training_ep(cfg: ExperimentConfig) -> int:
    """The expert-parallel size of the allocation's first training component (1 where it has none)."""
    from allocation import AllocationError, parse_allocation

    try:
        tr = parse_allocation(cfg.allocation).training
    except AllocationError:
        return 1  # reported where the allocation is checked
    return tr.ep if tr is not None else 1


def _is_moe_dir(path: str) -> bool:
    """Whether the HF model dir's config.json describes a mixture-of-experts model (transformers' MoE configs
    name their expert count num_experts, num_local_experts or n_routed_experts)."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    c = c.get("text_config", c)
    return any(int(c.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def resolve_and_check(cfg: ExperimentConfig, log=lambda msg: None) -> None:
    """Resolve demo names in `cfg` (in place, so every role reads real paths from config.json) and
    check every model and data path; raises PreflightError."""
    from areal_like.data.dataset import check_verl_parquet

    cfg.model.path = _resolve(cfg.model.path, "model.path", log)
    check_model_dir(cfg.model.path, "model.path")
    if _is_moe_dir(cfg.model.path) and _generation_backend(cfg) == "sglang" and _colocated(cfg):
        raise PreflightError(f"model.path={cfg.model.path} is a mixture-of-experts model and the generation servers are "
                             "SGLang's, co-located with the learner: the per-GPU handoff of the learner's fused experts "
                             "into SGLang's per-expert layout is not implemented (the disaggregated push splits them); "
                             "use separate devices (`sglang.…+megatron:…`) or embedded servers")
    if cfg.train.routing_replay != "off" and not _is_moe_dir(cfg.model.path):
        raise PreflightError(f"train.routing_replay={cfg.train.routing_replay} replays a mixture-of-experts model's "
                             f"expert choices, and model.path={cfg.model.path} has no experts (its config.json names "
                             "no num_experts): set train.routing_replay=off")
    ep = _training_ep(cfg)
    if ep > 1 and not _is_moe_dir(cfg.model.path):
        raise PreflightError(f"the allocation's training side has expert parallel e{ep} ({cfg.allocation!r}) and "
                             f"model.path={cfg.model.path} has no experts (its config.json names no num_experts): "
                             "remove e from the allocation's training side")
    for key, sec in (("critic.path", cfg.critic), ("ref.path", cfg.ref)):
        if sec.path is not None:
            sec.path = _resolve(sec.path, key, log)
            check_model_dir(sec.path, key)
    for key, sec in (("judge.model_path", cfg.judge), ("teacher.model_path", cfg.teacher)):
        if sec.model_path is not None:
            sec.model_path = _resolve(sec.model_path, key, log)
            check_model_dir(sec.model_path, key)
    if not cfg.data.train_files:
        raise PreflightError("data.train_files is empty: set data.train_files=[path/to/train.parquet] "
                             "(or [demo:next-digit] for the demo task)")
    for name, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for i, f in enumerate(files):
            key = f"{name}[{i}]"
            files[i] = path = _resolve(f, key, log)
            try:
                check_verl_parquet(path, prompt_key=cfg.data.prompt_key, where=f"{key}={path}")
            except (FileNotFoundError, ValueError) as e:
                raise PreflightError(str(e)) from None
    r = cfg.custom_reward_function
    if r.path is not None and not os.path.isfile(r.path):
        raise PreflightError(f"custom_reward_function.path={r.path} does not exist: point it at the .py file that "
                             f"defines {r.name}")


def check_rollout_inputs(cfg: ExperimentConfig, log=lambda msg: None) -> None:
    """What the rollout workers read from files, checked once before anything starts (issue 24): every
    prompt cell of data.train_files / data.val_files (a null, empty or malformed prompt names the file
    and the row), empty files, the tools YAML (rollout.tools_config, built as the worker builds it), and
    every workflow the run can use — rollout.workflow and each row's `agent_name` — imported as the
    worker imports them. Run after `resolve_and_check` (paths resolved, columns checked); raises
    PreflightError. A failure here used to surface only in the rollout worker, after Redis, the servers
    and the learner had started, and after the launcher restarted the worker in vain."""
    from areal_like.data.dataset import check_prompt_cells, first_model_graded_row

    agents: dict[str, str] = {}  # agent_name → where it was first seen ("data.train_files[0]=x row 3")
    for name, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for i, path in enumerate(files):
            where = f"{name}[{i}]={path}"
            try:
                n, names = check_prompt_cells(path, prompt_key=cfg.data.prompt_key, where=where)
            except ValueError as e:
                raise PreflightError(str(e)) from None
            if n == 0:
                what = "validation" if name == "data.val_files" else "training"
                raise PreflightError(f"{where} has no rows: an empty {what} file; add prompts to it, or drop it from "
                                     f"{name}" + (" (data.val_files=[] runs no validation)"
                                                  if name == "data.val_files" else ""))
            for a, row in names.items():
                agents.setdefault(a, f"{where} row {row}")
            _check_model_graded(cfg, where, first_model_graded_row(path))
    tools = None
    if cfg.rollout.tools_config:
        from areal_like.tools.config import load_tools

        try:
            tools = load_tools(cfg.rollout.tools_config)
        except ValueError as e:
            msg, head = str(e), f"tool config {cfg.rollout.tools_config}"
            msg = msg[len(head):] if msg.startswith(head) else f": {msg}"  # ": tools[0] …" or " is not valid YAML"
            raise PreflightError(f"rollout.tools_config={cfg.rollout.tools_config}{msg}") from None
        log(f"rollout.tools_config={cfg.rollout.tools_config}: {', '.join(t.name for t in tools)}")
    from areal_like.api.workflow import WorkflowLoadError
    from areal_like.rollout.workflows import load_workflow
    from areal_like.workflow.tool_agent import tool_agent

    uses = [(cfg.rollout.workflow, "rollout.workflow")] + [(a, f"{w} agent_name") for a, w in agents.items()]
    for name, where in uses:
        try:
            wf = load_workflow(name)
        except WorkflowLoadError as e:
            msg = str(e)
            if not msg.startswith(f"{where}="):
                msg = f"{where}={name!r}: {msg}"
            raise PreflightError(msg) from None
        if wf.obj is tool_agent and tools is None:
            raise PreflightError(f"{where}={name!r} needs tools: set rollout.tools_config=path/to/tools.yaml")


def _check_model_graded(cfg: ExperimentConfig, where: str, row: int | None) -> None:
    """Rows a reward model grades (verl's `reward_model.style: model`, often without a reference answer) need one:
    a judge component whose grade alone is the reward (judge.rule_weight=0), or the user's own reward function
    (which may call the judge itself). The built-in rule would score them against an empty reference — a
    silent 0 for every sample."""
    if row is None or cfg.custom_reward_function.path is not None:
        return
    j = cfg.judge
    if not j.model_path:
        raise PreflightError(f"{where} row {row} has reward_model.style=model (graded by a reward model) but the run has "
                             "no judge: add a judge component, e.g. --allocation "
                             "'embedded[rollout]:d1+fsdp[actor]:d1+embedded[judge]:d1' with judge.model_path=<judge "
                             "model> and judge.rule_weight=0, or a custom_reward_function.path that grades such rows")
    if j.rule_weight != 0 or j.weight == 0:
        raise PreflightError(f"{where} row {row} has reward_model.style=model (graded by a reward model) but "
                             f"judge.rule_weight={j.rule_weight:g} and judge.weight={j.weight:g} score it with the "
                             "built-in rule, against its reference answer: set judge.rule_weight=0 and judge.weight > 0 "
                             "(e.g. 1), or a custom_reward_function.path that grades such rows")
