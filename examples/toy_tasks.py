"""Toy verl-format datasets for the agentic examples — built in code, nothing downloaded.

    arithmetic_rows(n, seed, style)   "What is 37*48?"-style questions; ground truth the number
    qa_rows_and_corpus(n, seed)       questions about made-up entities whose answers are only in a
                                      generated corpus (so a retriever is needed), Search-R1 style

Each example's build_data.py writes them as parquet with the columns verl uses (`prompt` as chat
messages, `data_source`, `reward_model.ground_truth`, `extra_info` with `index` and, where the
example uses tools, `tools_kwargs`). Replace them with your own data for a real run.
"""

from __future__ import annotations

import json
import random


def arithmetic_rows(n: int, seed: int, *, system: str, question: str, data_source: str,
                    agent_name: str | None = None) -> list[dict]:
    """`question` is formatted with {a}, {b}, {op}; ground truth is the exact integer result."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, op = rng.randint(12, 99), rng.randint(3, 99), rng.choice("+-*")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        row = {"prompt": [{"role": "system", "content": system},
                          {"role": "user", "content": question.format(a=a, b=b, op=op)}],
               "data_source": data_source,
               "reward_model": {"ground_truth": str(value), "style": "rule"},
               "extra_info": {"index": i, "expression": f"{a}{op}{b}"}}
        if agent_name:
            row["agent_name"] = agent_name
        rows.append(row)
    return rows


_SYL = ["ka", "zo", "mi", "tu", "re", "lo", "na", "vi", "pe", "su", "do", "ga"]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYL) for _ in range(2)) + str(rng.randint(1, 9))


def qa_rows_and_corpus(n: int, seed: int, *, system: str, data_source: str = "searchR1_nq",
                       distractors: int = 3) -> tuple[list[dict], list[dict]]:
    """(rows, corpus): one fact per entity ("the capital of kazo3 is mivi7."), plus distractor passages."""
    rng = random.Random(seed)
    rows, corpus, used = [], [], set()
    for i in range(n):
        ent = _name(rng)
        while ent in used:
            ent = _name(rng)
        used.add(ent)
        rel = rng.choice(["capital", "river", "king"])
        ans = _name(rng)
        corpus.append({"id": f"d{len(corpus)}", "text": f"the {rel} of {ent} is {ans}."})
        for _ in range(distractors):
            corpus.append({"id": f"d{len(corpus)}", "text": f"the {rng.choice(['capital', 'river', 'king'])} of "
                                                            f"{_name(rng)} is {_name(rng)}."})
        rows.append({"prompt": [{"role": "system", "content": system},
                                {"role": "user", "content": f"what is the {rel} of {ent}?"}],
                     "data_source": data_source,
                     "reward_model": {"ground_truth": json.dumps({"target": [ans]}), "style": "rule"},
                     "extra_info": {"index": i}})
    rng.shuffle(corpus)
    return rows, corpus


def build_arithmetic(out: str, n: int, *, system: str, question: str, data_source: str) -> str:
    """`out`/train.parquet (n rows) and `out`/val.parquet (32 rows of another seed) of arithmetic_rows."""
    import os

    for split, rows, seed in (("train", n, 1), ("val", 32, 2)):
        write_parquet(arithmetic_rows(rows, seed, system=system, question=question, data_source=data_source),
                      os.path.join(out, f"{split}.parquet"))
    return f"wrote {out}/train.parquet ({n} rows), {out}/val.parquet (32 rows)"


def write_parquet(rows: list[dict], path: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def cli(doc: str, build, argv=None) -> None:
    """`build_data.py --out DIR [--n N]`: call `build(out_dir, n)` and print what it wrote."""
    import argparse
    import os

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--n", type=int, default=512, help="training rows")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    print(build(a.out, a.n))
