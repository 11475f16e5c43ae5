"""The agentic demo task: exact two-digit multiplication, which a tiny model can only get right by
calling the `calculator` tool (`configs/agent_demo.yaml`).

    prompt  "#S:tools: calculator(expression)\\n#U:47*83=?\\n#A:"        (the agent chat template)
    turn 1  <tool_call>{"name": "calculator", "arguments": {"expression": "47*83"}}</tool_call><eos>
    tool    \\n#T:<tool_response>3901</tool_response>\\n#A:                (observation: loss mask 0)
    turn 2  3901<eos>                                                    reward 1 (exact match of "3901")

Both factors are in [32, 99], so every product has four digits and every episode that calls the tool
has the same token layout: copying the expression into the call and the result into the answer are
fixed-offset copies a 2-layer model learns in a minute. Multiplying in its head it cannot (there
are 68 × 68 = 4,624 questions): answering without the tool scores ~0.

Warm start (`warm_start`, run once when `demo:calc-agent` is first resolved; `WARM_START` is the recipe).
RL from a random model would have to discover a 60-character JSON call by sampling — hopeless — so a
short supervised run (~1 min on 2 cores) teaches the *formats*: how a calculator call and an answer
look. It deliberately does not teach the *policy*: in its data the tool episodes are 80% (so the
copying is learnt) but their first token — the decision to call — is trained in only 2% of them, and
the other 20% answer directly with a "mental" estimate (the product rounded to hundreds: wrong). The
warm-started model thus mostly guesses: measured, P(first token = <tool_call>) ≈ 0.04 and ~9% of
sampled first turns call the tool, while a forced call is copied right end to end in ~85% of episodes.
The first RL steps score ≈ 0.1 (the product of the two); RL has to find out that calling pays.

This module writes the parquet files and the warm-started model; it knows nothing of the RL loop.
"""

from __future__ import annotations

import json
import os
import random
import sys

from areal_like.data.publish import write_parquet_atomic

CALC_DATA_SOURCE = "exact"  # built-in exact match (areal_like/reward/builtin.py) of the last turn's text
LO, HI = 32, 99  # factor range: 32*32 = 1024 … 99*99 = 9801, always four digits
TOOL_NAME = "calculator"


def make_question(rng: random.Random) -> tuple[str, str]:
    """(the expression, its exact value): e.g. ("47*83", "3901")."""
    a, b = rng.randint(LO, HI), rng.randint(LO, HI)
    return f"{a}*{b}", str(a * b)


def user_message(expr: str) -> dict:
    return {"role": "user", "content": f"{expr}=?"}


def call_text(expr: str) -> str:
    """The assistant's tool-call turn (without <eos>), exactly as the agent chat template renders it."""
    body = json.dumps({"name": TOOL_NAME, "arguments": {"expression": expr}})
    return f"<tool_call>{body}</tool_call>"


def estimate(expr: str) -> str:
    """A 'mental' answer: the product rounded to hundreds (exactly right only when it ends in 00)."""
    a, b = (int(x) for x in expr.split("*"))
    return str(max(1000, round(a * b, -2)))


# ---- the verl-format prompts ---------------------------------------------------------------------
def questions(n: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """`n` (expression, value) pairs from `seed`'s stream, skipping expressions in `exclude`."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    while len(out) < n:
        q = make_question(rng)
        if q[0] not in exclude:
            out.append(q)
    return out


def build_calc_task(out_path: str, n: int = 2048, seed: int = 0, split: str = "train",
                    exclude: frozenset[str] = frozenset()) -> str:
    """Write `n` questions (none in `exclude`) as verl-format parquet (prompt = chat messages,
    data_source "exact", reward_model.ground_truth = the product); temporary name + rename, like demo_task."""
    import pyarrow as pa

    rows = questions(n, seed, exclude)
    table = pa.table({
        "prompt": [[user_message(e)] for e, _ in rows],
        "data_source": [CALC_DATA_SOURCE] * n,
        "reward_model": [{"ground_truth": v, "style": "rule"} for _, v in rows],
        "extra_info": [{"index": i, "split": split} for i in range(n)],
    })
    return write_parquet_atomic(table, out_path)


# ---- the supervised warm start ------------------------------------------------------------------
def _tool_schemas() -> list[dict]:
    from areal_like.tools.calculator import CalculatorTool

    return [CalculatorTool.default_schema]


def sft_example(tok, schemas, rng: random.Random, *, p_tool: float, p_train_call: float) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one warm-start episode, built with the same token arithmetic as the
    `tool_agent` workflow (workflow/chat.py), so SFT and RL see identical sequences.

    With probability `p_tool` the episode calls the calculator and copies its result; else it answers
    with `estimate` (wrong). In a tool episode the first token (`<tool_call>`) is trained only with probability
    `p_train_call`: the call's format is learnt from every tool episode, the prior to call is
    ≈ p_tool·p_train_call / (1 − p_tool + p_tool·p_train_call)."""
    from areal_like.workflow import chat

    expr, value = make_question(rng)
    ids = chat.prompt_ids(tok, [user_message(expr)], schemas)
    mask = [0] * len(ids)
    eos = tok.eos_token_id

    def gen(text: str, *, skip_first: bool = False) -> None:
        t = chat.encode(tok, text) + [eos]
        ids.extend(t)
        mask.extend([0 if skip_first and i == 0 else 1 for i in range(len(t))])

    if rng.random() < p_tool:
        gen(call_text(expr), skip_first=rng.random() >= p_train_call)
        obs = chat.observation_ids(tok, [{"role": "tool", "content": value, "name": TOOL_NAME}], ended_with_eos=True)
        ids.extend(obs)
        mask.extend([0] * len(obs))
        gen(value)
    else:
        gen(estimate(expr))
    return ids, mask


def warm_start(model_dir: str, *, steps: int = 300, batch_size: int = 32, lr: float = 3e-3, p_tool: float = 0.5,
               p_train_call: float = 0.1, seed: int = 0, threads: int = 2, log=None) -> dict:
    """Supervised warm start of the HF model in `model_dir`, in place (data/sft.py): cross-entropy on the
    assistant tokens only (loss mask 1). Returns {"steps", "loss", "seconds"}."""
    from areal_like.data.sft import supervised_finetune

    schemas = _tool_schemas()
    return supervised_finetune(
        model_dir, lambda tok, rng: sft_example(tok, schemas, rng, p_tool=p_tool, p_train_call=p_train_call),
        steps=steps, batch_size=batch_size, lr=lr, seed=seed, threads=threads, log=log)


# ---- the demo assets ----------------------------------------------------------------------------
CALC_VAL_SEED = 1_000_003  # validation questions come from their own stream, and are left out of the train file
N_TRAIN, N_VAL = 2048, 32

# The recipe `demo:calc-agent` is built with. The cache directory's name carries WARM_START_VERSION:
# change the recipe → bump it, or a cache built by the old recipe would be used silently.
WARM_START_VERSION = 1
WARM_START = dict(steps=600, batch_size=32, lr=3e-3, p_tool=0.8, p_train_call=0.02, threads=1)


def ensure_calc_agent(model_dir: str, *, seed: int = 0, log=None, **overrides) -> str:
    """The warm-started agent model in `model_dir` unless it has one: the tiny agent model
    (`tiny_model.build_tiny_model(agent=True)`) after `warm_start(**WARM_START)` (~1 min on 2 cores).
    Built in a temporary directory and renamed, so two launchers racing on first use never load a
    half-trained model; the recipe and its final loss are kept in `warm_start.json` next to the weights."""
    from areal_like.data.tiny_model import ensure_tiny_model

    if os.path.exists(os.path.join(model_dir, "config.json")):
        return model_dir
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    recipe = {**WARM_START, **overrides}
    log(f"building the warm-started agent model in {model_dir} (once; ~1 min on 2 cores): {recipe}")

    def train(tmp: str) -> None:
        stats = warm_start(tmp, seed=seed, log=log, **recipe)
        with open(os.path.join(tmp, "warm_start.json"), "w") as f:
            json.dump({"version": WARM_START_VERSION, "seed": seed, **recipe, **stats}, f, indent=1)

    return ensure_tiny_model(model_dir, seed=seed, agent=True, then=train)


def ensure_calc_data(path: str, split: str) -> str:
    """The train (N_TRAIN questions) or val (N_VAL held-out questions) parquet at `path` unless it exists."""
    if not os.path.exists(path):
        if split == "train":
            held_out = frozenset(e for e, _ in questions(N_VAL, CALC_VAL_SEED))
            build_calc_task(path, n=N_TRAIN, seed=0, split="train", exclude=held_out)
        else:
            build_calc_task(path, n=N_VAL, seed=CALC_VAL_SEED, split="val")
    return path
