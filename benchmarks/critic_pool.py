"""A critic on its own pool against the critic inside the actor's ranks (issue 43 item 2), on the 2-core machine.

Side by side in one run, `--repeats` times each, alternating: the demo task (configs/demo.yaml) with GAE
(`algorithm.adv_estimator=gae`, train.lr 2e-3, critic.lr 1e-2), the same seed, `--steps` steps each (no early
stop), on

- **inside**: `embedded[rollout]:d1+fsdp[actor]:d1` — the critic trains in the actor's process, after the actor
  in each minibatch;
- **pool**: `embedded[rollout]:d1+fsdp[actor]:d1+fsdp[critic]:d1` — the critic is a process of its own, asked for
  V_old by the actor's step and trained on the returns while the actor trains.

Per run, from metrics.jsonl: steady-state trained samples/s (rows after the first, by their times, as
`launcher tune` reads them), the median learner step seconds (`step_s`: for the pool run this includes the
wait for the critic's values and stats), the median value loss over the last 20 steps and the last 20 steps'
mean reward. The last line is `pool_vs_inside_samples_per_s: <ratio>` (median pool run over median inside run).

    .venv/bin/python benchmarks/critic_pool.py [--steps 100] [--repeats 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import statistics

from _common import alternate, launcher_run, samples_per_s  # first: puts the repository root on sys.path

ALLOCATIONS = {"inside": "embedded[rollout]:d1+fsdp[actor]:d1",
               "pool": "embedded[rollout]:d1+fsdp[actor]:d1+fsdp[critic]:d1"}
GAE = ["algorithm.adv_estimator=gae", "critic.lr=1e-2", "train.lr=2e-3", "train.test_freq=0", "metrics.report=false"]


def run(kind: str, steps: int, run_dir: str) -> dict:
    rows, wall = launcher_run(run_dir, "--config", "configs/demo.yaml", "--allocation", ALLOCATIONS[kind],
                              f"train.total_steps={steps}", *GAE, what=kind)
    last = rows[-20:]
    return {"kind": kind, "steps": len(rows), "wall_s": round(wall, 1), "samples_per_s": round(samples_per_s(rows), 1),
            "step_s_median": round(statistics.median(r["step_s"] for r in rows[1:]), 4),
            "value_loss_last20_median": round(statistics.median(r["value_loss"] for r in last), 4),
            "reward_last20": round(sum(r["reward_mean"] for r in last) / len(last), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", help="keep the run directories here")
    a = ap.parse_args()
    results = alternate(ALLOCATIONS, run, steps=a.steps, repeats=a.repeats, keep=a.keep, prefix="critic-pool-", digits=4)
    med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in results.items()}
    step = {k: statistics.median(r["step_s_median"] for r in v) for k, v in results.items()}
    print(f"median samples/s: inside {med['inside']:.1f}, pool {med['pool']:.1f}; median step_s: inside "
          f"{step['inside']:.4f}, pool {step['pool']:.4f}")
    print(f"pool_vs_inside_samples_per_s: {med['pool'] / med['inside']:.3f}")


if __name__ == "__main__":
    main()
