"""`launcher report --run-dir D`: write D/report.html (self-contained) and D/report/*.png from the run
directory's files (areal_like/metrics/report.py) — for a finished run, one still going, or one cut off.
Reads only files; never talks to the run's processes."""

from __future__ import annotations

import os
import sys


def cmd_report(args) -> int:
    run_dir = args.run_dir
    if not os.path.isdir(run_dir):
        print(f"launcher report: {run_dir} is not a directory", file=sys.stderr)
        return 2
    if not os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and not os.path.exists(
            os.path.join(run_dir, "config.json")):
        print(f"launcher report: {run_dir} has neither metrics.jsonl nor config.json: not a run directory of "
              f"`launcher run`", file=sys.stderr)
        return 2
    from areal_like.metrics.report import write_report

    path = write_report(run_dir)
    print(f"report: {path} (figures in {os.path.join(run_dir, 'report')}/)")
    return 0
