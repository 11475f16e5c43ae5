"""Rollout routing replay (R3) on a small MoE at random init through `launcher run` (issue 44 item 4).

configs/moe_demo.yaml (the demo's tiny model with Qwen3-MoE's structure — 8 experts, top-2, both layers sparse —
bfloat16 embedded server, float32 learner), synchronous (`rollout.max_staleness=0`, so every sample comes from
the weights the learner starts its step from and the mismatch below is the training–inference gap alone), the
same seed, `--steps` steps each, alternating `--repeats` times:

    off      train.routing_replay=off      the learner routes every position itself
    rollout  train.routing_replay=rollout  the learner replays the experts the server chose

Per run, from metrics.jsonl (the learner's logprobs at the step's start against the server's): mean |Δ log p|
(`mismatch_logp_abs_mean`), KL(π_behav ‖ π_learner) (`mismatch_kl`), the share of tokens IcePop would mask
(`mismatch_ratio_outside`: π_learner/π_behav outside [0.5, 5]), the routing agreement (replay runs: the share
of replayed (position, layer) choices the learner's own router agrees with), the learner's step seconds and
samples/s. The rollout runs also measure (`train.routing_replay_measure`) the mismatch of the very same tokens with the
same weights both ways — the learner routing as the server did, and with its own router — which isolates
what replay removes from the run-to-run noise of two separate trainings. The buffer cost of the routes: bytes
per token of a trajectory (msgpack) with and without them. The last line is `replay_vs_off_mean_abs_dlogp:
<ratio>`: mean |Δ log p| with replay over without, on the same tokens (median of the rollout runs; < 1: replay
shrinks the mismatch).

    .venv/bin/python benchmarks/moe_routing_replay.py [--steps 40] [--repeats 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics

from _common import alternate, launcher_run, samples_per_s  # first: puts the repository root on sys.path

KEYS = ("mismatch_logp_abs_mean", "mismatch_kl", "mismatch_ratio_outside")


def run(mode: str, steps: int, run_dir: str) -> dict:
    rows, _ = launcher_run(run_dir, "--config", "configs/moe_demo.yaml", f"train.total_steps={steps}",
                           "train.test_freq=0", "rollout.max_staleness=0", "metrics.report=false",
                           f"train.routing_replay={mode}",
                           *(["train.routing_replay_measure=true"] if mode == "rollout" else []), what=mode)
    out = {"mode": mode, **{k: statistics.mean(r[k] for r in rows) for k in KEYS}}
    agree = [r["routing_agreement"] for r in rows if r.get("routing_agreement") is not None]
    out["routing_agreement"] = statistics.mean(agree) if agree else None
    for k in ("routing_dlogp_replayed", "routing_dlogp_own"):  # the same tokens, with and without replay
        vals = [r[k] for r in rows if r.get(k) is not None]
        out[k] = statistics.mean(vals) if vals else None
    out["step_s_median"] = statistics.median(r["step_s"] for r in rows[1:])
    out["samples_per_s"] = samples_per_s(rows)
    out["reward_last10"] = statistics.mean(r["reward_mean"] for r in rows[-10:])
    return out


def route_bytes_per_token() -> dict:
    """A demo-sized trajectory (6 tokens) and a long one (2,048), msgpack-encoded with and without routes of the
    tiny model (2 layers × top-2) and of Qwen3-30B-A3B's shape (48 layers × top-8, 128 experts)."""
    import numpy as np

    from areal_like.api.trajectory import Trajectory, TrajectoryGroup, encode_group

    def size(n: int, width: int | None) -> int:
        t = Trajectory.build(traj_id="t", group_id="g", prompt_id="p", prompt_ids=[1] * (n // 2),
                             output_ids=[2] * (n - n // 2), output_logprobs=[-1.0] * (n - n // 2),
                             output_versions=[0] * (n - n // 2), reward=0.0, finish_reason="stop")
        if width:
            t = t.with_routes(np.full((n - 1, width), 7))
        return len(encode_group(TrajectoryGroup(group_id="g", prompt_id="p", trajectories=[t], created_at=0.0)))

    out = {}
    for name, width in (("tiny (2 layers × top-2)", 4), ("Qwen3-30B-A3B (48 layers × top-8)", 384)):
        for n in (6, 2048):
            out[f"{name}, {n} tokens"] = round((size(n, width) - size(n, None)) / n, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", help="keep the run directories here")
    args = ap.parse_args()
    results = alternate(("off", "rollout"), run, steps=args.steps, repeats=args.repeats, keep=args.keep, prefix="moe_replay-", digits=5)
    print("route bytes per token in the buffer:", json.dumps(route_bytes_per_token()))
    med = {m: statistics.median(r["mismatch_logp_abs_mean"] for r in v) for m, v in results.items()}
    print(f"mean |Δ log p| of the training forward (median of runs): off {med['off']:.5f}, rollout {med['rollout']:.5f} "
          "(different runs: each trains on its own samples)")
    rep_ = statistics.median(r["routing_dlogp_replayed"] for r in results["rollout"])
    own = statistics.median(r["routing_dlogp_own"] for r in results["rollout"])
    print(f"mean |Δ log p| on the same tokens, same weights (median of the rollout runs): with replay {rep_:.6f}, "
          f"own routing {own:.6f}")
    print(f"replay_vs_off_mean_abs_dlogp: {rep_ / own:.3f}")


if __name__ == "__main__":
    main()
