"""Writing the built-on-first-use assets (demo models, demo parquet files) so that a reader never sees
half of one: each is written under a temporary name beside its target and renamed into place, and two
launchers racing on first use both end up with one complete copy. Standard library only at import."""

from __future__ import annotations

import os
from typing import Any, Callable


def write_parquet_atomic(table: Any, out_path: str) -> str:
    """`pyarrow.parquet.write_table(table)` to `out_path` through a temporary name; returns the path."""
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = f"{out_path}.tmp.{os.getpid()}"
    pq.write_table(table, tmp)
    os.replace(tmp, out_path)
    return out_path


def build_model_dir_atomic(model_dir: str, build: Callable[[str], Any], *, prefix: str) -> str:
    """`build(tmp_dir)` writes an HF model directory; it becomes `model_dir` unless that already holds
    one (has config.json), in which case nothing is built."""
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return model_dir
    import shutil
    import tempfile

    parent = os.path.dirname(os.path.abspath(model_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        build(tmp)
        if os.path.isdir(model_dir) and not os.listdir(model_dir):
            os.rmdir(model_dir)
        try:
            os.rename(tmp, model_dir)
        except OSError:  # another launcher published it first
            if not os.path.exists(os.path.join(model_dir, "config.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return model_dir
