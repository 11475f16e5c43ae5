"""Toy data for the Search-R1 example: questions about made-up entities, answerable only from a
generated corpus (so the policy has to search).

    python examples/search_r1/build_data.py --out data/search_r1   → train.parquet, val.parquet, corpus.parquet
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_tasks import cli, qa_rows_and_corpus, write_parquet  # noqa: E402

SYSTEM = "search with <search>query</search>, then answer as <answer>x</answer>."


def build(out: str, n: int) -> str:
    rows, corpus = qa_rows_and_corpus(n + 32, 1, system=SYSTEM)
    write_parquet(rows[:n], os.path.join(out, "train.parquet"))
    write_parquet(rows[n:], os.path.join(out, "val.parquet"))
    write_parquet(corpus, os.path.join(out, "corpus.parquet"))
    return f"wrote {out}/train.parquet ({n} rows), val.parquet (32), corpus.parquet ({len(corpus)} passages)"


if __name__ == "__main__":
    cli(__doc__, build)
