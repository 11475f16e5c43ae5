"""Toy data for the tool-integrated-reasoning example: arithmetic to be computed with Python code.

    python examples/math_tir/build_data.py --out data/math_tir    → train.parquet, val.parquet
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from toy_tasks import build_arithmetic, cli  # noqa: E402

SYSTEM = "write ```python code``` to compute, then answer as \\boxed{n}."


def build(out: str, n: int) -> str:
    return build_arithmetic(out, n, system=SYSTEM, question="compute {a}{op}{b}.", data_source="lighteval/MATH")


if __name__ == "__main__":
    cli(__doc__, build)
