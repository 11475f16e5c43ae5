"""The demo judge (`demo:next-digit-judge`, configs/judge_demo.yaml): a tiny model trained to grade the
next-digit task, so a policy can learn that task from a judge's verdicts alone (no rule reward).

It is the demo's tiny model (random init, seed 11) after supervised fine-tuning (data/sft.py) on
grading prompts `JUDGE_TEMPLATE` = "{question}={response}?" followed by its verdict, "Y" when the
response is the question's answer and "N" otherwise. Responses in training: the answer (40%), another
digit (45%), any other character of the vocabulary, or nothing (an empty reply). A run reads its grade with
`judge.score_rule=verdict`, `judge.verdict_tokens=[Y, N]`: p(Y) / (p(Y) + p(N)) at the first reply token.

What it grades is checked, not assumed: `judge_accuracy` scores it on every (last digit, response)
pair, and the build records that accuracy in `judge_train.json` beside the weights.
"""

from __future__ import annotations

import random
import string

from areal_like.data.tiny_model import CHARSET

DIGITS = string.digits

JUDGE_TEMPLATE = "{question}={response}?"
"""The grading prompt the judge was trained on: judge.prompt_template of configs/judge_demo.yaml."""
VERDICT_TOKENS = ("Y", "N")

# The recipe; the cache directory's name carries JUDGE_VERSION: change the recipe → bump it.
JUDGE_VERSION = 2
JUDGE_TRAIN = dict(steps=700, batch_size=64, lr=4e-3, threads=1)
JUDGE_SEED = 11


def grading_example(rng: random.Random) -> tuple[str, str]:
    """(grading prompt, verdict) of one random question and response. The questions are the next-digit
    task's (data/demo_task.py, which imports this module: the rule is restated here, and
    tests/unit/test_judge.py checks the verdicts against the task's own scorer)."""
    question = "".join(rng.choice(DIGITS) for _ in range(rng.randint(1, 6)))
    answer = str((int(question[-1]) + 1) % 10)
    r = rng.random()
    if r < 0.4:
        response = answer
    elif r < 0.85:
        response = rng.choice([d for d in DIGITS if d != answer])
    elif r < 0.95:
        response = rng.choice([c for c in CHARSET if c not in DIGITS and c != "\n"])
    else:
        response = ""
    verdict = VERDICT_TOKENS[0] if response == answer else VERDICT_TOKENS[1]
    return JUDGE_TEMPLATE.format(question=question, response=response), verdict


def _example(tok, rng: random.Random) -> tuple[list[int], list[int]]:
    prompt, verdict = grading_example(rng)
    ids = tok.encode(prompt + verdict, add_special_tokens=False)
    return ids, [0] * (len(ids) - 1) + [1]


def judge_accuracy(model_dir: str) -> float:
    """Share of the 10 × (10 digits + 3 other replies) grading prompts whose more likely verdict is right."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yes, no = (tok.encode(v, add_special_tokens=False)[0] for v in VERDICT_TOKENS)
    right = total = 0
    with torch.no_grad():
        for last in DIGITS:
            answer = str((int(last) + 1) % 10)
            for response in [*DIGITS, "a", "+", ""]:
                ids = tok.encode(JUDGE_TEMPLATE.format(question="40" + last, response=response),
                                 add_special_tokens=False)
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
                says_yes = bool(logits[yes] > logits[no])
                right += says_yes == (response == answer)
                total += 1
    return right / total


def ensure_demo_judge(model_dir: str, *, log=None) -> str:
    """The trained demo judge in `model_dir` unless it has one (~15 s on 2 cores; data/sft.py
    `ensure_trained_demo_model`), its grading accuracy in `judge_train.json`."""
    from areal_like.data.sft import ensure_trained_demo_model

    return ensure_trained_demo_model(model_dir, _example, seed=JUDGE_SEED, train=JUDGE_TRAIN, accuracy=judge_accuracy,
                                     record="judge_train.json", what="demo judge", version=JUDGE_VERSION,
                                     extra={"template": JUDGE_TEMPLATE}, log=log)
