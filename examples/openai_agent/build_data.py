"""Toy data for the OpenAI-SDK agent example: arithmetic questions the agent may use a calculator for.

    python examples/openai_agent/build_data.py --out data/openai_agent    → train.parquet, val.parquet
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_tasks import arithmetic_rows, cli, write_parquet  # noqa: E402

SYSTEM = "use the calculator tool, then answer with the number."


def build(out: str, n: int) -> str:
    for split, rows, seed in (("train", n, 1), ("val", 32, 2)):
        write_parquet(arithmetic_rows(rows, seed, system=SYSTEM, question="what is {a}{op}{b}?", data_source="calculator"),
                      os.path.join(out, f"{split}.parquet"))
    return f"wrote {out}/train.parquet ({n} rows), {out}/val.parquet (32 rows)"


if __name__ == "__main__":
    cli(__doc__, build)
