"""Toy data for the OpenAI-SDK agent example: arithmetic questions the agent may use a calculator for.

    python examples/openai_agent/build_data.py --out data/openai_agent    → train.parquet, val.parquet
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_tasks import build_arithmetic, cli  # noqa: E402

SYSTEM = "use the calculator tool, then answer with the number."


def build(out: str, n: int) -> str:
    return build_arithmetic(out, n, system=SYSTEM, question="what is {a}{op}{b}?", data_source="calculator")


if __name__ == "__main__":
    cli(__doc__, build)
