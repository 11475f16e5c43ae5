"""A real task for a real model: arithmetic questions in natural language, difficulty as a parameter.

Each row is a chat prompt in verl's parquet schema (`prompt` = [{"role": "user", "content": …}],
`data_source` = "areal_like/arithmetic", `reward_model` = {"ground_truth": "<integer>", "style": "rule"},
`extra_info` = {index, split, question, answer}), built in code from a seed — no download. The
difficulty (`ArithmeticSpec`) is:

    digits        operands have this many digits (1: 0–9, 2: 10–99, …)
    ops           any of "+", "-", "*": each question draws one (subtraction keeps the result ≥ 0)
    word_problems phrase the question as a short story ("Mia has 4 apples and gets 5 more. …")
                  instead of an arithmetic question ("What is 4 plus 5?", "Compute 4 + 5.", …)

Demo names spell it: `demo:arithmetic-<digits>d-<ops>[-words]` with ops `add`, `sub`, `mul` joined
(`addsub`, `addsubmul`), and `-val` for the held-out split — e.g. `demo:arithmetic-1d-add` and
`demo:arithmetic-1d-add-val` (configs/real_model.yaml), `demo:arithmetic-2d-addsub-words`. The held-out
split is a fixed fifth of the problems (`held_out`: by a hash of "a op b", whatever the phrasing), so
no held-out problem is ever trained on.

Reward (reward/builtin.py, data_source "areal_like/arithmetic"): verl's gsm8k scorer in its
`flexible` mode — the last number in the reply, compared numerically with the ground truth: 1 if
equal, else 0. The strict "#### <n>" format is not asked for: SmolLM2-135M-Instruct ignores format
instructions (it answers "4 + 5 = 9." or a sentence ending in the number), so a strict format would
score its every reply 0 and leave nothing to learn from.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

from areal_like.data.publish import write_parquet_atomic

ARITHMETIC_DATA_SOURCE = "areal_like/arithmetic"
OPS = {"add": "+", "sub": "-", "mul": "*"}
VAL_SEED = 1_000_003

_NAME_RE = re.compile(r"^demo:arithmetic-(\d)d-((?:add|sub|mul)+)(-words)?(-val)?$")
_WORD = {"+": "plus", "-": "minus", "*": "times"}
_PLAIN = ("What is {a} {w} {b}?", "What is {a} {s} {b}?", "Compute {a} {s} {b}.", "Calculate {a} {w} {b}.",
          "How much is {a} {w} {b}?")
_NAMES = ("Mia", "Noah", "Emma", "Liam", "Ava", "Lucas", "Zoe", "Omar", "Sara", "Ken")
_ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "shells")


@dataclass(frozen=True)
class ArithmeticSpec:
    """The difficulty of the task (see the module docstring)."""

    digits: int = 1
    ops: tuple[str, ...] = ("+",)
    word_problems: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 6:
            raise ValueError(f"arithmetic digits={self.digits}: use 1 to 6")
        bad = [o for o in self.ops if o not in OPS.values()]
        if not self.ops or bad:
            raise ValueError(f"arithmetic ops={self.ops!r}: use a non-empty subset of {sorted(OPS.values())}")


def parse_arithmetic_name(name: str) -> tuple[ArithmeticSpec, bool] | None:
    """(spec, is_val) of a `demo:arithmetic-…` name; None when `name` is not one; ValueError when it
    looks like one but does not parse (naming the grammar)."""
    if not name.startswith("demo:arithmetic"):
        return None
    m = _NAME_RE.match(name)
    if m is None:
        raise ValueError(f"{name}: an arithmetic task is demo:arithmetic-<digits>d-<ops>[-words][-val], digits "
                         f"1-6, ops a run of add/sub/mul (e.g. demo:arithmetic-1d-add, demo:arithmetic-2d-addsub-words-val)")
    ops_text, ops = m.group(2), []
    while ops_text:
        ops.append(OPS[ops_text[:3]])
        ops_text = ops_text[3:]
    return ArithmeticSpec(int(m.group(1)), tuple(dict.fromkeys(ops)), m.group(3) is not None), m.group(4) is not None


def held_out(a: int, op: str, b: int) -> bool:
    """Whether the problem `a op b` belongs to the held-out split: a fixed fifth of all problems, by a
    hash of the problem (not of its phrasing), so no held-out sum is ever trained on in any wording."""
    return zlib.crc32(f"{a}{op}{b}".encode()) % 5 == 0


def make_question(rng: random.Random, spec: ArithmeticSpec, val: bool = False) -> tuple[str, int]:
    """One (question, answer) of the training (`val` False) or held-out problems."""
    lo, hi = (0 if spec.digits == 1 else 10 ** (spec.digits - 1)), 10 ** spec.digits - 1
    while True:
        op = rng.choice(spec.ops)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if op == "-" and b > a:
            a, b = b, a
        if held_out(a, op, b) == val:
            break
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    if not spec.word_problems:
        return rng.choice(_PLAIN).format(a=a, b=b, w=_WORD[op], s=op), answer
    who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if op == "+":
        q = f"{who} has {a} {item} and gets {b} more. How many {item} does {who} have now?"
    elif op == "-":
        q = f"{who} has {a} {item} and gives away {b}. How many {item} does {who} have left?"
    else:
        q = f"{who} has {a} bags with {b} {item} in each bag. How many {item} does {who} have in all?"
    return q, answer


def arithmetic_rows(spec: ArithmeticSpec, n: int, seed: int, *, val: bool = False) -> list[tuple[str, int]]:
    """`n` questions of the training problems (repeats allowed: a small spec has few), or with `val` up
    to `n` distinct questions of the held-out problems."""
    rng = random.Random(seed)
    if not val:
        return [make_question(rng, spec) for _ in range(n)]
    seen: dict[str, int] = {}
    for _ in range(50 * n):
        q, a = make_question(rng, spec, val=True)
        seen.setdefault(q, a)
        if len(seen) == n:
            break
    return list(seen.items())


def build_arithmetic(out_path: str, spec: ArithmeticSpec, *, split: str = "train", n_train: int = 2048,
                     n_val: int = 64, seed: int = 0, val_seed: int = VAL_SEED) -> str:
    """The `split` ("train" or "val") of `spec` as verl parquet at `out_path` (`held_out` decides which
    problems belong to which; the val split has its own seed)."""
    import pyarrow as pa

    if split not in ("train", "val"):
        raise ValueError(f"arithmetic split {split!r}: use 'train' or 'val'")
    rows = (arithmetic_rows(spec, n_train, seed) if split == "train"
            else arithmetic_rows(spec, n_val, val_seed, val=True))
    table = pa.table({
        "prompt": [[{"role": "user", "content": q}] for q, _ in rows],
        "data_source": [ARITHMETIC_DATA_SOURCE] * len(rows),
        "reward_model": [{"ground_truth": str(a), "style": "rule"} for _, a in rows],
        "extra_info": [{"index": i, "split": split, "question": q, "answer": str(a)} for i, (q, a) in enumerate(rows)],
    })
    return write_parquet_atomic(table, out_path)
