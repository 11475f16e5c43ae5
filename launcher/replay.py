"""`launcher replay --dump-dir D`: train the learner on a trajectory dump alone — no servers, no Redis.

A learner bug seen in a run is reproduced from what the rollout workers dumped (`rollout.dump_dir`):

    launcher replay --dump-dir D --run-dir R     the run's own config (R/config.json) and its step order
                                                 (R/trained.jsonl: which groups each step trained), so
                                                 step k's loss is the run's step k loss
    launcher replay --dump-dir D --config C …    any config (overrides as for `launcher run`); steps are
                                                 the dump's groups in order, train.batch_size per step

One process runs the learner's `Trainer` at layout d1p1t1 (the layout-equivalence tests show every
DP×PP×TP layout computes the same step), starting from model.path, step k trained as version k−1 as
in the run. Each step prints one line and appends a row to `--out` (default D/replay.jsonl).
"""

from __future__ import annotations

import json
import os
import sys


class ReplayError(RuntimeError):
    """Bad replay input; the message names the file or flag to fix."""


def _load_cfg(args):
    from areal_like.api.config import ConfigError, decode_config, load_config

    if args.run_dir:
        path = os.path.join(args.run_dir, "config.json")
        if not os.path.exists(path):
            raise ReplayError(f"--run-dir {args.run_dir} has no config.json (is it a `launcher run` run directory?)")
        with open(path, "rb") as f:
            cfg = decode_config(f.read())
        if args.overrides:
            raise ReplayError("overrides apply with --config only (--run-dir replays the run's own config)")
        return cfg
    try:
        cfg = load_config(args.config, list(args.overrides or []))
    except ConfigError as e:
        raise ReplayError(str(e)) from None
    from launcher.preflight import PreflightError, resolve_and_check

    try:
        resolve_and_check(cfg)
    except PreflightError as e:
        raise ReplayError(str(e)) from None
    return cfg


def _run_order(run_dir: str) -> list[list[str]]:
    """Group ids per step as the run's final model trained them."""
    from areal_like.api.run_files import trained_steps

    path = os.path.join(run_dir, "trained.jsonl")
    if not os.path.exists(path):
        raise ReplayError(f"--run-dir {run_dir} has no trained.jsonl: the learner never finished a step there")
    return list(trained_steps(path).values())


def replay(args) -> int:
    from areal_like.learner.trainer import Trainer
    from areal_like.rollout.dump import read_dump

    cfg = _load_cfg(args)
    groups = {}
    for g in read_dump(args.dump_dir):
        groups[g.group_id] = g
    if args.run_dir:
        order = _run_order(args.run_dir)
        missing = sorted({gid for step in order for gid in step} - set(groups))
        if missing:
            raise ReplayError(f"--dump-dir {args.dump_dir} lacks {len(missing)} group(s) the run trained (e.g. "
                              f"{missing[:3]}): was rollout.dump_dir set from the start of the run?")
        steps = [[groups[gid] for gid in step] for step in order]
    else:
        b = cfg.train.batch_size
        ordered = list(groups.values())
        steps = [ordered[i:i + b] for i in range(0, len(ordered) - b + 1, b)]
        if not steps:
            raise ReplayError(f"--dump-dir {args.dump_dir} holds {len(ordered)} group(s), fewer than one step's "
                              f"train.batch_size={b}")
    if args.steps:
        steps = steps[:args.steps]
    out = args.out or os.path.join(args.dump_dir, "replay.jsonl")
    import msgspec
    import torch

    # The run's learner computed with train.torch_threads threads (learner/main.py); a CPU matmul split
    # over another count sums in another order (visibly so on Intel Xeons), and Adam amplifies that.
    torch.set_num_threads(cfg.train.torch_threads)
    trainer = Trainer.from_config(cfg, "d1p1t1", device=args.device)
    print(f"[replay] {len(steps)} step(s) from {args.dump_dir} on {cfg.model.path} ({args.device}, "
          f"{torch.get_num_threads()} torch thread(s)); rows → {out}", flush=True)
    with open(out, "w") as f:
        for k, step_groups in enumerate(steps, 1):
            stats = trainer.train_step(step_groups, k - 1)
            row = {"step": k, "groups": [g.group_id for g in step_groups]}
            row.update({key: v for key, v in msgspec.structs.asdict(stats).items()
                        if isinstance(v, (int, float, bool)) or v is None})
            f.write(json.dumps(row) + "\n")
            print(f"[replay] step {k}: loss {stats.loss:.6g} reward {stats.reward_mean:.3f} "
                  f"samples {stats.num_samples}", flush=True)
    return 0


def cmd_replay(args) -> int:
    try:
        return replay(args)
    except (ReplayError, FileNotFoundError, ValueError) as e:
        print(f"launcher replay: {e}", file=sys.stderr)
        return 2
