"""Command line: `launcher plan|run|replay|status|stop|sbatch|tune|report`.

Each sub-command lives in its own module; this file only parses arguments and dispatches, so that
`launcher plan` never imports torch (the plan is pure and must answer instantly on a login node).
"""

from __future__ import annotations

import argparse
import sys


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launcher", description="areal_like launcher")
    sub = p.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="show where every server and learner rank of an allocation lands")
    plan.add_argument("--allocation", required=True, help="e.g. 'sglang.d16p1m1+d8p2m1' or 'sglang:d4t2+fsdp:d8'")
    plan.add_argument("--nodes", type=int, default=None, help="number of nodes (default: one node, just big enough)")
    plan.add_argument("--devices-per-node", type=int, default=None, help="devices per node (default 8 with --nodes)")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    plan.add_argument("--model", default=None,
                      help="HF model dir or config.json: add the memory of every device (learner state, activations, "
                           "servers' weights and KV cache) and whether it fits")
    plan.add_argument("--config", default=None, help="YAML experiment config the memory plan reads (default: defaults)")
    plan.add_argument("--seq-len", type=int, default=None,
                      help="longest sequence, tokens (default: the config's resolved max context length)")
    plan.add_argument("--micro-batch-tokens", type=int, default=None, help="default: train.micro_batch_tokens")
    plan.add_argument("--device-memory", default="80GB", help="memory of one device, e.g. 80GB, 80GiB, 141GB")
    plan.add_argument("overrides", nargs="*", help="config overrides, a.b.c=value (as `launcher run`)")

    run = sub.add_parser("run", help="start a training run and supervise it until it ends")
    run.add_argument("--allocation", default=None, help="allocation string (default: the config's `allocation`)")
    run.add_argument("--config", default=None,
                     help="YAML experiment config (default: configs/demo.yaml, the CPU demo; with an SGLang "
                          "--allocation, the defaults, which a GPU run completes with verl's values)")
    run.add_argument("--run-dir", default=None, help="where logs, metrics.jsonl and summary.json go")
    run.add_argument("--backend", default=None, choices=["local", "ray"],
                     help="where roles run: local processes, or Ray actors across nodes (default: launcher.backend)")
    run.add_argument("--ray-address", default=None,
                     help="Ray cluster address for --backend ray (default: launcher.ray.address, $RAY_ADDRESS, "
                          "else a local cluster)")
    run.add_argument("overrides", nargs="*", help="config overrides, a.b.c=value")

    rep = sub.add_parser("replay", help="train the learner alone on a trajectory dump (rollout.dump_dir)")
    rep.add_argument("--dump-dir", required=True, help="a run's rollout.dump_dir")
    rep.add_argument("--run-dir", default=None,
                     help="replay that run: its config.json and its step order (trained.jsonl)")
    rep.add_argument("--config", default="configs/demo.yaml", help="YAML config (without --run-dir)")
    rep.add_argument("--steps", type=int, default=None, help="replay only the first N steps")
    rep.add_argument("--out", default=None, help="metrics rows per step (default DUMP_DIR/replay.jsonl)")
    rep.add_argument("--device", default="cpu", help="torch device of the learner (cpu, cuda)")
    rep.add_argument("overrides", nargs="*", help="config overrides, a.b.c=value (with --config)")

    status = sub.add_parser("status", help="show the state of a run from its run directory")
    status.add_argument("--run-dir", required=True)
    status.add_argument("--json", action="store_true",
                        help="one JSON object: every role with its node, devices and (Ray) ray_node_id")

    stop = sub.add_parser("stop", help="stop a run started by `launcher run` (by its recorded PIDs)")
    stop.add_argument("--run-dir", required=True)

    sb = sub.add_parser("sbatch", help="write (or submit) a Slurm batch script: a Ray cluster on the job's nodes, "
                        "then `launcher run --backend ray`")
    sb.add_argument("--allocation", required=True, help="e.g. 'sglang.d16p1m1+d8p2m1'")
    sb.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    sb.add_argument("--devices-per-node", type=int, required=True, help="GPUs per node (--gpus-per-node)")
    sb.add_argument("--config", required=True, help="YAML experiment config (path as seen from the job)")
    sb.add_argument("--run-dir", default=None, help="run directory, on storage every node mounts")
    sb.add_argument("--partition", default=None)
    sb.add_argument("--time", default=None, help="Slurm time limit, e.g. 24:00:00")
    sb.add_argument("--account", default=None)
    sb.add_argument("--job-name", default=None)
    sb.add_argument("--log", default=None, help="the job's output file (#SBATCH --output)")
    sb.add_argument("--ray-port", type=int, default=6379, help="port of the Ray head (GCS) on the first node")
    sb.add_argument("--ray-start-args", default=None, help="extra arguments for every `ray start`, one string")
    sb.add_argument("--join-timeout", type=float, default=300.0, help="seconds for the Ray nodes to come up")
    sb.add_argument("--output", default=None, help="write the script here (default: stdout)")
    sb.add_argument("--submit", action="store_true", help="submit it with `sbatch`")
    sb.add_argument("overrides", nargs="*", help="config overrides, a.b.c=value")

    tune = sub.add_parser("tune", help="run the same experiment once per η (rollout.max_staleness) and recommend "
                          "the fastest η whose reward stays within noise of η = 0's (tune.md, tune.png)")
    tune.add_argument("--config", required=True, help="YAML experiment config")
    tune.add_argument("--eta", required=True, help="comma-separated η values, e.g. 0,1,2,4,8")
    tune.add_argument("--steps", required=True, type=int, help="train.total_steps of every run")
    tune.add_argument("--out", default=None, help="tune directory: one run directory per η, tune.md, tune.png "
                      "(default runs/tune-<experiment>-<date>)")
    tune.add_argument("--allocation", default=None, help="allocation string (default: the config's `allocation`)")
    tune.add_argument("overrides", nargs="*", help="config overrides for every run, a.b.c=value")

    report = sub.add_parser("report", help="write report.html and its PNG figures into a run directory "
                            "(finished, still going or cut off)")
    report.add_argument("--run-dir", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _dispatch(argv)
    except BrokenPipeError:  # `launcher plan … | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """`parse_args`, except that `key=value` overrides may stand anywhere among a sub-command's options
    (`launcher run --run-dir X a=1 --config c.yaml b=2`): argparse takes only the first run of positionals
    into `overrides` and calls the rest unrecognized. They are appended in command-line order (a later
    override of the same key wins, as with the first run); anything else left over is still an error."""
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [a for a in extra if a.startswith("-") or "=" not in a]
        if stray or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.overrides = list(args.overrides or []) + extra
    return args


def _dispatch(argv: list[str] | None) -> int:
    args = _parse(argv)
    if args.command == "plan":
        from launcher.plan import cmd_plan

        return cmd_plan(args)
    if args.command == "run":
        from launcher.run import cmd_run

        return cmd_run(args)
    if args.command == "replay":
        from launcher.replay import cmd_replay

        return cmd_replay(args)
    if args.command == "status":
        from launcher.run import cmd_status

        return cmd_status(args)
    if args.command == "stop":
        from launcher.run import cmd_stop

        return cmd_stop(args)
    if args.command == "sbatch":
        from launcher.sbatch import cmd_sbatch

        return cmd_sbatch(args)
    if args.command == "tune":
        from launcher.tune import cmd_tune

        return cmd_tune(args)
    if args.command == "report":
        from launcher.report import cmd_report

        return cmd_report(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
