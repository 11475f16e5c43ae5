"""The η × loss study: reward curves at staleness η ∈ {0, 1, 2, 4, 8} for the decoupled PPO loss and
for standard PPO, same seeds (AReaL's Table 2, in shape). Results and reading: docs/staleness_study.md.

    .venv/bin/python examples/staleness_study.py --seeds 1,2,3 --jobs 2 \\
        --figure docs/images/staleness_study_lr2.5e-4.png

For each loss mode and seed this runs the real command

    launcher tune --config configs/staleness_study.yaml --eta 0,1,2,4,8 --steps N \\
        --out OUT/<mode>-seed<s> train.proximal=<mode> seed=<s> train.seed=<s> [overrides]

(`recompute` = decoupled PPO: the clip is around π_prox, the step's starting weights, and stale samples
are re-weighted by π_prox/π_behav capped at train.behav_imp_weight_cap; `behaviour` = standard PPO:
the clip is around the stale behaviour policy itself). Then it reads every run's metrics.jsonl and writes

    OUT/study.md    per mode × η: the mean reward over the run (how fast and how far it learnt) and
                    the reward over the last k steps (each: mean ± standard error over seeds),
                    the first step whose 10-step running reward reaches --target, the trained groups'
                    mean staleness, the clip fraction and the share of tokens whose behaviour weight
                    hit the cap
    --figure        (default OUT/study.png) reward vs step per η for each loss, and the mean reward
                    over the run vs η

`--jobs 2` runs two tunes side by side. Reward per step depends on the samples, not on the clock, but the
staleness a run actually sees depends on how far generation runs ahead of training: the table reports
it per run, so a reader can check it. `--no-run` only re-reads OUT.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from launcher.run import read_metrics
from launcher.tune import dedup_rows, mean_se

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {"recompute": "decoupled PPO (proximal=recompute)", "behaviour": "standard PPO (proximal=behaviour)"}


# ---- the pure part: rows in, table and figure out --------------------------------------------------
def first_reaching(rewards: list[float], target: float, window: int = 10) -> int | None:
    """The first step (1-based) whose running mean over the last `window` steps reaches `target`."""
    for i in range(window, len(rewards) + 1):
        if sum(rewards[i - window:i]) / window >= target:
            return i
    return None


def run_stats(rows: list[dict], last_k: int, target: float) -> dict:
    """One run's figures from its metrics.jsonl rows (steps in order, one row per step)."""
    rows = [r for r in dedup_rows(rows) if "reward_mean" in r]
    rewards = [float(r["reward_mean"]) for r in rows]
    tokens = sum(r.get("loss_tokens") or 0 for r in rows)
    stal = [r["staleness_mean"] for r in rows if isinstance(r.get("staleness_mean"), (int, float))
            and not math.isnan(r["staleness_mean"])]
    return {
        "steps": len(rows),
        "rewards": rewards,
        "last": sum(rewards[-last_k:]) / max(1, len(rewards[-last_k:])),
        "auc": sum(rewards) / max(1, len(rewards)),  # mean reward over the run: speed and end level in one
        "reach": first_reaching(rewards, target),
        "staleness_mean": sum(stal) / len(stal) if stal else float("nan"),
        "staleness_max": max((r.get("staleness_max", 0) for r in rows), default=0),
        "clipfrac": sum(r.get("clipfrac") or 0.0 for r in rows) / max(1, len(rows)),
        "capped": sum(r.get("behav_tokens_capped") or 0 for r in rows) / max(1, tokens),
    }


def summarize(stats: dict[tuple[str, int], list[dict]]) -> dict[tuple[str, int], dict]:
    """(mode, η) → figures over seeds: mean reward over the run and last-k reward (each mean ± SE),
    median steps to target (None when
    some seed never reached it, with how many did), mean staleness, clip fraction, capped share."""
    out = {}
    for key, runs in stats.items():
        last_m, last_se = mean_se([r["last"] for r in runs])  # (mean, SE); SE 0 for one seed
        auc_m, auc_se = mean_se([r["auc"] for r in runs])
        reached = sorted(r["reach"] for r in runs if r["reach"] is not None)
        out[key] = {
            "seeds": len(runs), "last": last_m, "last_se": last_se, "auc": auc_m, "auc_se": auc_se,
            "reach_median": reached[len(reached) // 2] if len(reached) == len(runs) else None,
            "reached": len(reached),
            "staleness_mean": sum(r["staleness_mean"] for r in runs) / len(runs),
            "staleness_max": max(r["staleness_max"] for r in runs),
            "clipfrac": sum(r["clipfrac"] for r in runs) / len(runs),
            "capped": sum(r["capped"] for r in runs) / len(runs),
        }
    return out


def render_md(summary: dict[tuple[str, int], dict], *, etas: list[int], seeds: list[int], steps: int, last_k: int,
              target: float, command: str) -> str:
    lines = [f"# η × loss study ({len(seeds)} seed(s): {', '.join(map(str, seeds))}; {steps} steps per run)", "",
             f"Command: `{command}`", "",
             f"| loss | η | mean reward over the run (± SE over seeds) | reward, last {last_k} steps (± SE) "
             f"| steps to {target} (median) | staleness mean / max | clip fraction | tokens at the behaviour cap |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for eta in etas:
            s = summary.get((mode, eta))
            if s is None:
                continue
            reach = (str(s["reach_median"]) if s["reach_median"] is not None
                     else f"not reached ({s['reached']}/{s['seeds']} seeds did)")
            lines.append(f"| {MODES[mode]} | {eta} | {s['auc']:.3f} ± {s['auc_se']:.3f} "
                         f"| {s['last']:.3f} ± {s['last_se']:.3f} | {reach} "
                         f"| {s['staleness_mean']:.2f} / {s['staleness_max']} | {s['clipfrac']:.3f} "
                         f"| {100 * s['capped']:.2f}% |")
    return "\n".join(lines) + "\n"


def plot(stats: dict[tuple[str, int], list[dict]], summary: dict, etas: list[int], path: str, smooth: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = plt.get_cmap("viridis")
    for ax, mode in zip(axes[:2], MODES):
        for i, eta in enumerate(etas):
            runs = stats.get((mode, eta))
            if not runs:
                continue
            n = min(len(r["rewards"]) for r in runs)
            avg = [sum(r["rewards"][t] for r in runs) / len(runs) for t in range(n)]
            sm = [sum(avg[max(0, t - smooth + 1):t + 1]) / len(avg[max(0, t - smooth + 1):t + 1]) for t in range(n)]
            ax.plot(range(1, n + 1), sm, color=colors(i / max(1, len(etas) - 1)), label=f"η = {eta}")
        ax.set_title(MODES[mode])
        ax.set_xlabel("learner step (= trained samples / batch)")
        ax.set_ylabel(f"reward ({smooth}-step mean, averaged over seeds)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    ax = axes[2]
    for mode, marker in zip(MODES, "os"):
        xs = [e for e in etas if (mode, e) in summary]
        ax.errorbar(xs, [summary[(mode, e)]["auc"] for e in xs], yerr=[summary[(mode, e)]["auc_se"] for e in xs],
                    marker=marker, capsize=3, label=MODES[mode])
    ax.set_xlabel("max staleness η")
    ax.set_ylabel("mean reward over the run (± SE over seeds)")
    ax.set_xticks(etas)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the runs --------------------------------------------------------------------------------------
def tune_argv(args, mode: str, seed: int) -> list[str]:
    return [sys.executable, "-m", "launcher", "tune", "--config", args.config, "--eta", args.eta,
            "--steps", str(args.steps), "--out", os.path.join(args.out, f"{mode}-seed{seed}"),
            f"train.proximal={mode}", f"seed={seed}", f"train.seed={seed}", *args.overrides]


def run_tune(argv: list[str], log_path: str) -> int:
    print(f"[study] {' '.join(argv[1:])}  (log {log_path})", flush=True)
    t = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    print(f"[study] exit {rc} after {time.monotonic() - t:.0f}s: {log_path}", flush=True)
    return rc


def load(args, etas: list[int], seeds: list[int], modes: list[str], last_k: int) -> dict:
    stats: dict[tuple[str, int], list[dict]] = {}
    for mode in modes:
        for seed in seeds:
            for eta in etas:
                path = os.path.join(args.out, f"{mode}-seed{seed}", f"eta{eta}", "metrics.jsonl")
                if not os.path.exists(path):
                    raise SystemExit(f"staleness_study: {path} is missing (the run failed? see its launcher.log; "
                                     "or drop --no-run to run it)")
                stats.setdefault((mode, eta), []).append(run_stats(read_metrics(path), last_k, args.target))
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "staleness_study.yaml"))
    p.add_argument("--eta", default="0,1,2,4,8", help="comma-separated η values (default 0,1,2,4,8)")
    p.add_argument("--steps", type=int, default=300, help="learner steps per run (default 300)")
    p.add_argument("--seeds", default="1", help="comma-separated seeds, each run for every mode and η (default 1)")
    p.add_argument("--modes", default="recompute,behaviour", help="train.proximal values (default recompute,behaviour)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "staleness-study"), help="study directory")
    p.add_argument("--jobs", type=int, default=1, help="tunes run side by side (default 1)")
    p.add_argument("--last", type=int, default=50, help="reward is averaged over this many last steps (default 50)")
    p.add_argument("--target", type=float, default=0.8, help="reward level for 'steps to target' (default 0.8)")
    p.add_argument("--figure", default=None, help="figure path (default OUT/study.png)")
    p.add_argument("--no-run", action="store_true", help="only read the runs already in OUT")
    p.add_argument("overrides", nargs="*", help="config overrides for every run, a.b.c=value")
    args = p.parse_args(argv)
    try:
        etas = [int(x) for x in args.eta.split(",") if x.strip()]
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--eta {args.eta!r} / --seeds {args.seeds!r}: comma-separated integers, e.g. --eta 0,1,2,4,8")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        p.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    if args.jobs < 1 or args.steps < 1:
        p.error("--jobs and --steps must be ≥ 1")
    for o in args.overrides:
        if o.split("=", 1)[0].strip() in ("seed", "train.seed", "train.proximal"):
            p.error(f"override {o!r}: the study sets seed, train.seed and train.proximal itself (--seeds, --modes)")
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    last_k = min(args.last, args.steps)
    if not args.no_run:
        jobs = [(tune_argv(args, m, s), os.path.join(args.out, f"{m}-seed{s}.log")) for s in seeds for m in modes]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            rcs = list(pool.map(lambda j: run_tune(*j), jobs))
        failed = [log for (_, log), rc in zip(jobs, rcs) if rc != 0]
        if failed:
            print(f"staleness_study: {len(failed)} tune(s) failed: {', '.join(failed)}", file=sys.stderr)
            return 1
    stats = load(args, etas, seeds, modes, last_k)
    summary = summarize(stats)
    command = "python examples/staleness_study.py " + " ".join(
        [f"--eta {args.eta}", f"--steps {args.steps}", f"--seeds {args.seeds}", f"--modes {args.modes}",
         f"--jobs {args.jobs}", *args.overrides])
    md = render_md(summary, etas=etas, seeds=seeds, steps=args.steps, last_k=last_k, target=args.target,
                   command=command)
    with open(os.path.join(args.out, "study.md"), "w") as f:
        f.write(md)
    figure = args.figure or os.path.join(args.out, "study.png")
    plot(stats, summary, etas, figure)
    print(md)
    print(f"[study] {os.path.join(args.out, 'study.md')}, {figure}")
    hi = max(etas)
    parts = [f"{m} {summary[(m, hi)]['auc']:.3f}" for m in modes if (m, hi) in summary]
    print(f"staleness_study: mean reward over the run at η={hi}: " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
