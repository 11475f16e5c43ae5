"""Build the demo assets: a random tiny Qwen2 + char tokenizer, and the "next digit" task parquet.

    python examples/build_demo.py --out runs/_assets

writes OUT/tiny_model/, OUT/demo_train.parquet and OUT/demo_val.parquet (32 validation prompts of their
own seed) — existing ones are kept; --force rebuilds. Pass them as `model.path=OUT/tiny_model
data.train_files=[OUT/demo_train.parquet]`. The demo config names the same assets `demo:tiny-qwen2`,
`demo:next-digit` and `demo:next-digit-val`, which `launcher run` builds itself in its cache dir
($AREAL_LIKE_CACHE/demo); this script is for a copy elsewhere. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from areal_like.data.demo_task import ensure_demo_assets  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--n-train", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true", help="rebuild even if the files exist")
    args = ap.parse_args(argv)
    model_dir = os.path.join(args.out, "tiny_model")
    train_file = os.path.join(args.out, "demo_train.parquet")
    val_file = os.path.join(args.out, "demo_val.parquet")
    if args.force:
        shutil.rmtree(model_dir, ignore_errors=True)
        for f in (train_file, val_file):
            if os.path.exists(f):
                os.remove(f)
    ensure_demo_assets(model_dir, train_file, n_train=args.n_train, seed=args.seed, val_file=val_file)
    print(f"model: {model_dir}\ntrain: {train_file}\nval: {val_file}")


if __name__ == "__main__":
    main()
