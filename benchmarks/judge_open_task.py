"""A task a rule reward cannot grade, learned from a judge through `launcher run` (issue 43 item 6b).

The training prompts of `demo:next-digit-open` are the demo task's, written without their answers
(`reward_model: {ground_truth: null, style: model}` — verl's mark of rows a reward model grades): no rule
reward has anything to compare a response with, and `launcher run` refuses such rows without a judge. The
demo judge (configs/judge_demo.yaml: `demo:next-digit-judge`, `judge.rule_weight=0`) grades them. Side by
side in one run, `--repeats` times each, alternating, `--steps` steps each (no early stop), train.lr 2e-3:

- **open**: judge_demo.yaml on `demo:next-digit-open` — the reward is the judge's grade alone;
- **reference**: the same prompts with their answers (`demo:next-digit`), rewarded by the task's rule
  (configs/demo.yaml with judge_demo.yaml's estimator, dr_grpo) — what the task reaches when a rule can grade.

Both validate every 10 steps on the 32 held-out prompts × 4 (`demo:next-digit-val`), each with its own reward:
the judge's grades for `open` (the judge grades the next-digit pairs with accuracy 1.0, recorded when it was
built), the rule for `reference`. Per run: the held-out curve, the first validation ≥ 0.8, samples/s. The last
line is `open_vs_reference_steps_to_0.8: <ratio>` (medians).

    .venv/bin/python benchmarks/judge_open_task.py [--steps 150] [--repeats 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import statistics

from _common import alternate, launcher_run, samples_per_s  # first: puts the repository root on sys.path

COMMON = ["train.lr=2e-3", "train.test_freq=10", "data.val_files=[demo:next-digit-val]", "metrics.report=false"]
KINDS = {"open": ["--config", "configs/judge_demo.yaml", "data.train_files=[demo:next-digit-open]"],
         "reference": ["--config", "configs/demo.yaml", "data.train_files=[demo:next-digit]",
                       "algorithm.adv_estimator=dr_grpo"]}
KEY = "val/all/mean@4"


def run(kind: str, steps: int, run_dir: str) -> dict:
    rows, _ = launcher_run(run_dir, *KINDS[kind], *COMMON, f"train.total_steps={steps}", what=kind)
    val = {r["step"]: round(r[KEY], 3) for r in rows if KEY in r}
    return {"kind": kind, "val": val, "first_val_0.8_at": next((s for s, v in val.items() if v >= 0.8), None),
            "samples_per_s": round(samples_per_s(rows), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", help="keep the run directories here")
    args = ap.parse_args()
    results = alternate(KINDS, run, steps=args.steps, repeats=args.repeats, keep=args.keep, prefix="judge_open-", digits=4)
    never = args.steps + 10  # a run that never reached 0.8 counts as one step past the end
    med = {k: statistics.median(r["first_val_0.8_at"] or never for r in v) for k, v in results.items()}
    print(f"first held-out validation ≥ 0.8 (median step): open {med['open']}, reference {med['reference']}")
    print(f"open_vs_reference_steps_to_0.8: {med['open'] / med['reference']:.3f}")


if __name__ == "__main__":
    main()
