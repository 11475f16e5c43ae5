"""The demo teacher (`demo:next-digit-teacher`, configs/distill_demo.yaml): the demo's tiny model trained on
the next-digit task, so a fresh policy can learn the task from the teacher's logprobs alone (on-policy
distillation, `teacher.*`, with `teacher.reward_weight=0`: no reward signal).

It is the demo's tiny model (random init, seed 13) after supervised fine-tuning (data/sft.py) on the task's
own prompts followed by their answer (the loss on the answer token only). What it knows is checked, not
assumed: `teacher_accuracy` takes its most likely next token after prompts ending in each digit, and the
build records that accuracy in `teacher_train.json` beside the weights.
"""

from __future__ import annotations

import random
import string

DIGITS = string.digits

# The recipe; the cache directory's name carries TEACHER_VERSION: change the recipe → bump it.
TEACHER_VERSION = 1
TEACHER_TRAIN = dict(steps=300, batch_size=64, lr=4e-3, threads=1)
TEACHER_SEED = 13


def _example(tok, rng: random.Random) -> tuple[list[int], list[int]]:
    """One next-digit prompt (data/demo_task.py's: 1–6 random digits; the answer follows the last digit)
    and its answer; the loss on the answer alone."""
    prompt = "".join(rng.choice(DIGITS) for _ in range(rng.randint(1, 6)))
    answer = str((int(prompt[-1]) + 1) % 10)
    p = tok.encode(prompt, add_special_tokens=False)
    a = tok.encode(answer, add_special_tokens=False)
    return p + a, [0] * len(p) + [1] * len(a)


def teacher_accuracy(model_dir: str) -> float:
    """Share of 100 prompts (10 per last digit, 1–6 digits) whose most likely next token is the answer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(0)
    right = total = 0
    with torch.no_grad():
        for last in DIGITS:
            for _ in range(10):
                prompt = "".join(rng.choice(DIGITS) for _ in range(rng.randint(0, 5))) + last
                ids = tok.encode(prompt, add_special_tokens=False)
                want = tok.encode(str((int(last) + 1) % 10), add_special_tokens=False)[0]
                right += int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()) == want
                total += 1
    return right / total


def ensure_demo_teacher(model_dir: str, *, log=None) -> str:
    """The trained demo teacher in `model_dir` unless it has one (~5 s on 2 cores; data/sft.py
    `ensure_trained_demo_model`), its next-digit accuracy in `teacher_train.json`."""
    from areal_like.data.sft import ensure_trained_demo_model

    return ensure_trained_demo_model(model_dir, _example, seed=TEACHER_SEED, train=TEACHER_TRAIN,
                                     accuracy=teacher_accuracy, record="teacher_train.json", what="demo teacher",
                                     version=TEACHER_VERSION, log=log)
