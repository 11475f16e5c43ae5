"""`launcher tune`: the same experiment once per η (`rollout.max_staleness`), then a table, a figure
and the recommended η.

    launcher tune --config F --eta 0,1,2,4,8 --steps N [--out DIR] [overrides]

Each η is a real `launcher run` (a subprocess, one after the other, so the runs do not share the
cores) in `DIR/eta<η>/` with `train.total_steps=N rollout.max_staleness=η` after the overrides. Then:

    DIR/tune.md    per η: trained samples/s, generation busy fraction, gate refusals, dropped groups,
                   max staleness observed, reward over the last k steps (± its standard error) and
                   reward at an equal sample count; the rule; the recommendation
    DIR/tune.png   reward vs wall time, reward vs trained samples (one curve per η), throughput vs η

Recommendation rule (also in tune.md and README.md, "Tuning η"). The reference is η = 0 (synchronous
training), or the smallest η given when 0 is not among them. Let `k = max(2, min(20, N // 4))` and,
for each run, `m` = mean and `se` = standard deviation / √k of its last k per-step rewards (each step's
`reward_mean`: a fresh batch, so the step-to-step spread is the sampling noise of the reward plus
what the policy still changes). A run is *within noise* of the reference when
`m ≥ m_ref − 2·√(se_ref² + se²)` (a one-sided two-standard-error test on the difference of the two
means; a higher reward always passes). The recommended η is the one with the highest steady-state
trained samples/s among the runs within noise (the reference always is). Steady-state samples/s =
samples trained after the first step / (time of the last row − time of the first row), from
metrics.jsonl's `time`: the start-up (Redis, servers, learner) costs the same for every η and is left
out; without `time` (older files) summary.json's `samples_per_s` is used.

The pure parts (`analyze`, `recommend`, `reward_at_samples`) take rows and summaries, not processes:
tests/unit/test_tune.py drives them on synthetic rows.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

RESERVED = ("rollout.max_staleness", "train.total_steps")  # set by tune itself, per run


class TuneError(ValueError):
    pass


# ---- input ---------------------------------------------------------------------------------------
def parse_etas(text: str) -> list[int]:
    """"0,1,2,4" → [0, 1, 2, 4]; anything else (not integers, negative, repeated, empty) is a TuneError."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(not p for p in parts):
        raise TuneError(f"--eta {text!r}: a comma-separated list of integers ≥ 0, e.g. --eta 0,1,2,4")
    etas = []
    for p in parts:
        try:
            e = int(p)
        except ValueError:
            raise TuneError(f"--eta {text!r}: {p!r} is not an integer (e.g. --eta 0,1,2,4)") from None
        if e < 0:
            raise TuneError(f"--eta {text!r}: η must be ≥ 0, got {e}")
        if e in etas:
            raise TuneError(f"--eta {text!r}: η = {e} is given twice")
        etas.append(e)
    return etas


# ---- analysis (pure) -----------------------------------------------------------------------------
def dedup_rows(rows: list[dict]) -> list[dict]:
    """One row per step, the last written (a restarted learner redoes steps), in step order."""
    return sorted({r["step"]: r for r in rows if "step" in r}.values(), key=lambda r: r["step"])


def window(n_steps: int) -> int:
    """k, the number of last steps the final reward averages over."""
    return max(2, min(20, n_steps // 4))


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """(mean, standard error = sample standard deviation / √n); (None, None) for no values."""
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None, None
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, 0.0
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
    return m, sd / math.sqrt(len(vals))


def _trained(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("samples")]


def reward_last(rows: list[dict], k: int) -> tuple[float | None, float | None]:
    """(mean, standard error) of reward_mean over the last k steps that trained samples."""
    return mean_se([r["reward_mean"] for r in _trained(rows)[-k:]])


def reward_at_samples(rows: list[dict], samples: int, k: int) -> float | None:
    """Mean reward_mean over the k steps ending at the first step where the cumulative trained
    samples reach `samples` (the whole run if it never does)."""
    tr = _trained(rows)
    total, end = 0, len(tr)
    for i, r in enumerate(tr):
        total += r["samples"]
        if total >= samples:
            end = i + 1
            break
    return mean_se([r["reward_mean"] for r in tr[max(0, end - k):end]])[0]


def steady_samples_per_s(rows: list[dict]) -> float | None:
    """Samples trained after the first step / (time of the last row − time of the first); None without
    `time` in every row or with fewer than 2 rows."""
    if len(rows) < 2 or not all(isinstance(r.get("time"), (int, float)) for r in rows):
        return None
    dt = rows[-1]["time"] - rows[0]["time"]
    return sum(r.get("samples", 0) for r in rows[1:]) / dt if dt > 0 else None


@dataclass
class RunResult:
    eta: int
    run_dir: str
    rc: int | None = None
    wall_s: float | None = None  # of the `launcher run` process, start-up included
    rows: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    # filled by analyze()
    samples: int = 0
    sps_run: float | None = None
    sps_steady: float | None = None
    busy: float | None = None
    refusals: int | None = None
    dropped: dict = field(default_factory=dict)
    max_staleness: int | None = None
    reward_last: float | None = None
    reward_se: float | None = None
    reward_equal: float | None = None

    @property
    def ok(self) -> bool:
        return self.rc == 0 and bool(_trained(self.rows))

    @property
    def sps(self) -> float | None:
        """The throughput the recommendation ranks by: steady state, else the whole run's."""
        return self.sps_steady if self.sps_steady is not None else self.sps_run


def analyze(results: list[RunResult], steps: int) -> tuple[int, int]:
    """Fill every result's figures; returns (k, equal sample count S = smallest total over the runs
    that trained something)."""
    k = window(steps)
    totals = []
    for r in results:
        r.rows = dedup_rows(r.rows)
        r.samples = sum(x.get("samples", 0) for x in r.rows)
        s = r.summary
        r.sps_run = s.get("samples_per_s")
        r.sps_steady = steady_samples_per_s(r.rows)
        gen = s.get("generation") or {}
        r.busy, r.refusals = gen.get("busy_fraction"), gen.get("gate_refusals")
        r.dropped = dict((s.get("buffer") or {}).get("dropped") or {})
        r.max_staleness = s.get("max_staleness_observed",
                                max((x.get("staleness_max", 0) for x in r.rows), default=None))
        r.reward_last, r.reward_se = reward_last(r.rows, k)
        if r.samples:
            totals.append(r.samples)
    equal = min(totals) if totals else 0
    for r in results:
        r.reward_equal = reward_at_samples(r.rows, equal, k) if r.samples else None
    return k, equal


@dataclass
class Recommendation:
    eta: int | None
    reference: int | None
    reference_is_zero: bool
    within: dict[int, bool]  # η → within noise of the reference
    tolerance: dict[int, float]  # η → 2·√(se_ref² + se²)
    text: str


def recommend(results: list[RunResult]) -> Recommendation:
    """The rule of the module docstring over the runs that completed (`analyze` first)."""
    done = sorted((r for r in results if r.ok and r.reward_last is not None), key=lambda r: r.eta)
    if not done:
        return Recommendation(None, None, False, {}, {}, "no run completed: no recommendation")
    ref = next((r for r in done if r.eta == 0), None)
    zero = ref is not None
    if ref is None:
        ref = done[0]
    within, tol = {}, {}
    for r in done:
        t = 2.0 * math.sqrt((ref.reward_se or 0.0) ** 2 + (r.reward_se or 0.0) ** 2)
        tol[r.eta] = t
        within[r.eta] = r is ref or r.reward_last >= ref.reward_last - t - 1e-12
    ok = [r for r in done if within[r.eta]]
    best = max(ok, key=lambda r: (r.sps if r.sps is not None else -1.0, -r.eta))
    ref_name = "η = 0" if zero else f"η = {ref.eta} (the smallest η given: η = 0 was not run)"
    if best is ref:
        why = f"no faster η kept its reward within noise of {ref_name}" if len(done) > 1 else "the only run"
    else:
        gain = (best.sps / ref.sps) if best.sps and ref.sps else None
        why = (f"{best.sps:.1f} samples/s" + (f" ({gain:.2f}× {ref_name})" if gain else "")
               + f", reward {best.reward_last:.3f} vs {ref.reward_last:.3f} "
               f"(within noise: ≥ {ref.reward_last - tol[best.eta]:.3f})")
    return Recommendation(best.eta, ref.eta, zero, within, tol, f"recommended η: {best.eta} ({why})")


# ---- output --------------------------------------------------------------------------------------
def _f(x, fmt: str = "{:.3f}", none: str = "–") -> str:
    return none if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def render_md(results: list[RunResult], rec: Recommendation, k: int, equal: int, *, config: str, steps: int,
              overrides: list[str], machine: str) -> str:
    lines = [f"# launcher tune: `{config}`, η ∈ {{{', '.join(str(r.eta) for r in results)}}}, {steps} steps each", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S')} on {machine}; overrides: "
             + (" ".join(f"`{o}`" for o in overrides) if overrides else "none"), "",
             f"| η | samples/s steady | samples/s run | gen busy | gate refusals | dropped groups | max staleness "
             f"| reward last {k} (± se) | reward @ {equal} samples | within noise | wall s | exit |",
             "|---:|---:|---:|---:|---:|---|---:|---:|---:|:---:|---:|---|"]
    for r in sorted(results, key=lambda r: r.eta):
        dropped = sum(r.dropped.values())
        dtext = f"{dropped}" + (f" ({', '.join(f'{k_} {v}' for k_, v in sorted(r.dropped.items()) if v)})" if dropped else "")
        exit_text = (r.summary.get("exit_reason") or ("completed" if r.rc == 0 else "failed")) + (
            f" (rc {r.rc})" if r.rc not in (0, None) else "")
        mark = "ref" if r.eta == rec.reference else ("yes" if rec.within.get(r.eta) else ("no" if r.eta in rec.within else "–"))
        lines.append(f"| {r.eta} | {_f(r.sps_steady, '{:.1f}')} | {_f(r.sps_run, '{:.1f}')} | {_f(r.busy, '{:.2f}')} "
                     f"| {_f(r.refusals, '{}')} | {dtext} | {_f(r.max_staleness, '{}')} "
                     f"| {_f(r.reward_last)} ± {_f(r.reward_se)} | {_f(r.reward_equal)} | {mark} "
                     f"| {_f(r.wall_s, '{:.0f}')} | {exit_text} |")
    ref = ("η = 0" if rec.reference_is_zero else
           f"η = {rec.reference} — η = 0 was not among the values, so the smallest η given is the reference"
           if rec.reference is not None else "none")
    lines += ["", f"**{rec.text}**", "", "## How to read it", "",
              f"- Reference: {ref}.",
              f"- *reward last {k}*: mean of the per-step `reward_mean` over the last k = max(2, min(20, steps // 4)) "
              "= " f"{k} steps; *se* = their standard deviation / √k.",
              "- *within noise*: reward last ≥ reference's − 2·√(se_ref² + se²) (one-sided, two standard errors of "
              "the difference; a higher reward always passes). The recommendation is the highest *samples/s steady* "
              "among the runs within noise.",
              "- *samples/s steady*: samples trained after the first step / (time of the last metrics row − time of "
              "the first), leaving out the start-up that every η pays alike; *samples/s run*: summary.json's "
              "samples_per_s (start-up included).",
              f"- *reward @ {equal} samples*: mean reward over the {k} steps ending where the run had trained "
              f"{equal} samples, the smallest total over the runs (the runs compared at equal data).",
              "- *gen busy*: busy seconds of the generation servers / (servers × the run's wall time, start-up "
              "included) — summary.json `generation.busy_fraction`; *gate refusals*: "
              "`areal_like_gate_rejections_total` summed over the rollout workers at the end of the run "
              "(refused slot polls, not groups).",
              "- *dropped groups*: summary.json `buffer.dropped`, by reason.",
              "", "Run directories: " + ", ".join(f"`{os.path.basename(r.run_dir)}/`" for r in results)
              + "; the figure: `tune.png`.", ""]
    return "\n".join(lines)


def plot(results: list[RunResult], path: str, k: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from areal_like.metrics.report import time_axis

    def smooth(y: list[float]) -> list[float]:
        out = []
        for i in range(len(y)):
            w = y[max(0, i - k + 1):i + 1]
            out.append(sum(w) / len(w))
        return out

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    tlabel = "wall time (s)"
    done = [r for r in sorted(results, key=lambda r: r.eta) if _trained(r.rows)]
    for r in done:
        rows = _trained(r.rows)
        t, tlabel = time_axis(rows)
        y = smooth([x["reward_mean"] for x in rows])
        cum, s = [], 0
        for x in rows:
            s += x["samples"]
            cum.append(s)
        a.plot(t, y, label=f"η = {r.eta}")
        b.plot(cum, y, label=f"η = {r.eta}")
    for ax, xl in ((a, tlabel), (b, "trained samples")):
        ax.set_xlabel(xl)
        ax.set_ylabel(f"reward (mean of last {k} steps)")
        ax.grid(alpha=0.3)
        if done:
            ax.legend()
    a.set_title("reward vs wall time")
    b.set_title("reward vs trained samples")
    xs = [r.eta for r in done]
    if done:
        c.plot(xs, [r.sps_steady if r.sps_steady is not None else float("nan") for r in done], "o-",
               label="steady samples/s")
        c.plot(xs, [r.sps_run if r.sps_run is not None else float("nan") for r in done], "s--",
               label="run samples/s (start-up incl.)")
        c.legend(loc="best")
        c.set_xticks(xs)
        c.set_ylim(bottom=0)
    c.set_xlabel("η (rollout.max_staleness)")
    c.set_ylabel("trained samples/s")
    c.set_title("throughput vs η")
    c.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- running -------------------------------------------------------------------------------------
def _load_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _read_rows(path: str) -> list[dict]:
    from launcher.run import read_metrics

    return read_metrics(path)


def run_one(eta: int, args, run_dir: str) -> RunResult:
    os.makedirs(run_dir, mode=0o700, exist_ok=True)  # owner-only, like `launcher run`'s own run dirs (issue 24)
    log_path = os.path.join(run_dir, "launcher.log")
    argv = [sys.executable, "-m", "launcher", "run", "--config", args.config, "--run-dir", run_dir]
    if args.allocation:
        argv += ["--allocation", args.allocation]
    argv += [*args.overrides, f"train.total_steps={args.steps}", f"rollout.max_staleness={eta}"]
    print(f"[tune] η = {eta}: launcher run → {run_dir} (log {log_path})", flush=True)
    t = time.monotonic()
    res = RunResult(eta=eta, run_dir=run_dir)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            res.rc = proc.wait()
        except KeyboardInterrupt:  # the child got the terminal's SIGINT too: let it end its roles
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.terminate()
                proc.wait(timeout=30)
            raise
    res.wall_s = time.monotonic() - t
    res.rows = _read_rows(os.path.join(run_dir, "metrics.jsonl"))
    res.summary = _load_json(os.path.join(run_dir, "summary.json"))
    if res.rc != 0:
        tail = open(log_path, errors="replace").read().splitlines()[-15:]
        print(f"[tune] η = {eta}: launcher run exited with {res.rc}; last lines of {log_path}:\n  "
              + "\n  ".join(tail), file=sys.stderr, flush=True)
    else:
        s = res.summary
        print(f"[tune] η = {eta}: done in {res.wall_s:.0f}s: {s.get('samples_per_s', 0):.1f} samples/s (run), "
              f"reward_last {s.get('reward_last')}, max staleness {s.get('max_staleness_observed')}, "
              f"gen busy {(s.get('generation') or {}).get('busy_fraction')}", flush=True)
    return res


def _machine() -> str:
    return f"{platform.node() or 'this machine'} ({os.cpu_count()} CPUs, {platform.processor() or platform.machine()})"


def finish(results: list[RunResult], out: str, args) -> Recommendation:
    k, equal = analyze(results, args.steps)
    rec = recommend(results)
    md = render_md(results, rec, k, equal, config=args.config, steps=args.steps, overrides=list(args.overrides),
                   machine=_machine())
    with open(os.path.join(out, "tune.md"), "w") as f:
        f.write(md)
    try:
        plot(results, os.path.join(out, "tune.png"), k)
    except Exception as e:  # noqa: BLE001 — the table stands without the figure
        print(f"[tune] tune.png not written: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    return rec


def cmd_tune(args) -> int:
    try:
        etas = parse_etas(args.eta)
        if args.steps is None or args.steps < 1:
            raise TuneError(f"--steps must be an integer ≥ 1, got {args.steps}")
        if not os.path.isfile(args.config):
            raise TuneError(f"--config {args.config}: no such file")
        for o in args.overrides:
            if o.split("=", 1)[0].strip() in RESERVED:
                raise TuneError(f"override {o!r}: tune sets {' and '.join(RESERVED)} itself (--eta, --steps)")
        from areal_like.api.config import ConfigError, load_config

        try:
            cfg = load_config(args.config, list(args.overrides)
                              + ([f"allocation={args.allocation}"] if args.allocation else []))
        except ConfigError as e:
            raise TuneError(f"--config {args.config}: {e}") from None
    except TuneError as e:
        print(f"launcher tune: {e}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out or os.path.join("runs", f"tune-{cfg.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.makedirs(out, exist_ok=True)
    print(f"[tune] {len(etas)} run(s) of {args.steps} steps, η ∈ {etas}, in {out}", flush=True)
    results: list[RunResult] = []
    interrupted = False
    try:
        for eta in etas:
            results.append(run_one(eta, args, os.path.join(out, f"eta{eta}")))
    except KeyboardInterrupt:
        interrupted = True
        print("\n[tune] interrupted: writing tune.md for the runs so far", file=sys.stderr, flush=True)
    if not results:
        return 130
    rec = finish(results, out, args)
    table = [line for line in open(os.path.join(out, "tune.md")).read().splitlines() if line.startswith("|")]
    print("\n".join(table), flush=True)
    print(f"[tune] {os.path.join(out, 'tune.md')}, {os.path.join(out, 'tune.png')}", flush=True)
    print(rec.text, flush=True)
    if interrupted:
        return 130
    return 0 if all(r.rc == 0 for r in results) else 1
