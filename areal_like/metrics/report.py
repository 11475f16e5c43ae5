"""The run report: `<run_dir>/report.html` plus its figures as PNGs in `<run_dir>/report/`, made from
the run directory's files alone — metrics.jsonl (one StepMetrics row per learner step), summary.json
(at exit) and config.json — so it works on a finished run, on one still going and on one cut off.

    write_report(run_dir) -> path of report.html        (`launcher report --run-dir D`; `launcher run` at exit)

The HTML is self-contained (every figure inline as a base64 PNG): it reads in any browser without a
server or the PNG files beside it. A figure whose data the run's files do not hold is replaced by a
short note saying what is missing — nothing is estimated or filled in.

Rows: a learner restarted from a checkpoint redoes the steps after it; the report keeps the last row
written for each step (the one in the final model). Time axis: the rows' own `time` (unix seconds)
or `wall_s` when they carry one; otherwise the learner's seconds per step summed (fetch + train + push
of each step, which leaves out validation waits and checkpoints), and the axis says so.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from areal_like.api.run_files import METRICS_FILE

REPORT_HTML = "report.html"
REPORT_DIR = "report"
# Keys a row may carry for the generation servers' busy fraction (0..1), in order of preference.
BUSY_KEYS = ("gen_busy_fraction", "perf/gen_busy_fraction", "busy_fraction")
BUFFER_KEYS = ("buffer_depth", "buffer_pending")


@dataclass
class RunData:
    run_dir: str
    rows: list[dict] = field(default_factory=list)
    bad_lines: int = 0  # lines of metrics.jsonl that are not JSON (a cut-off write)
    summary: dict | None = None
    config: dict | None = None

    @property
    def eta(self) -> int | None:
        """The staleness bound η: config.json's rollout.max_staleness, else summary.json's max_staleness."""
        if self.config is not None:
            v = (self.config.get("rollout") or {}).get("max_staleness")
            if isinstance(v, int):
                return v
        if self.summary is not None and isinstance(self.summary.get("max_staleness"), int):
            return self.summary["max_staleness"]
        return None


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def load_run(run_dir: str) -> RunData:
    """The run's rows (last row per step, by step), summary.json and config.json when present."""
    data = RunData(run_dir=run_dir, summary=_read_json(os.path.join(run_dir, "summary.json")),
                   config=_read_json(os.path.join(run_dir, "config.json")))
    by_step: dict[int, dict] = {}
    try:
        with open(os.path.join(run_dir, METRICS_FILE)) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    by_step[int(row["step"])] = row
                except (ValueError, KeyError, TypeError):
                    data.bad_lines += 1
    except FileNotFoundError:
        pass
    data.rows = [by_step[s] for s in sorted(by_step)]
    return data


def _num(v: Any) -> float:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return math.nan


def _series(rows: list[dict], key: str) -> list[float]:
    return [_num(r.get(key)) for r in rows]


def _has(rows: list[dict], key: str) -> bool:
    return any(isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
               and math.isfinite(r[key]) for r in rows)


def time_axis(rows: list[dict]) -> tuple[list[float], str]:
    """(x values, axis label) for plots against time (see the module doc)."""
    if rows and all(isinstance(r.get("time"), (int, float)) for r in rows):
        t0 = rows[0]["time"] - sum(_num(rows[0].get(k)) for k in ("fetch_s", "step_s", "push_s")
                                   if math.isfinite(_num(rows[0].get(k))))
        return [r["time"] - t0 for r in rows], "wall time (s)"
    if rows and all(isinstance(r.get("wall_s"), (int, float)) for r in rows):
        return [float(r["wall_s"]) for r in rows], "wall time (s)"
    t, out = 0.0, []
    for r in rows:
        t += sum(x for x in (_num(r.get(k)) for k in ("fetch_s", "step_s", "push_s")) if math.isfinite(x))
        out.append(t)
    return out, "learner time (s): Σ fetch + train + push per step"


# ---- figures ---------------------------------------------------------------------------------------
@dataclass
class Figure:
    name: str  # PNG file stem
    title: str
    caption: str
    png: bytes | None = None  # None: not made; `caption` says why


def _new_figure(ncols: int = 1, width: float = 10.0, height: float = 3.6):
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(width, height), dpi=100)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    _margins(fig, 1, ncols)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _margins(fig, nrows: int, ncols: int, titled: bool = False) -> None:
    """Fixed margins in inches around and between the axes: room for tick labels, axis labels and
    (`titled`) a title above each. The figures' sizes are fixed, so this is what matplotlib's
    constrained layout would find, without its solver (which took half the report's time, paid at
    the end of every run)."""
    w, h = fig.get_size_inches()
    left, right, bottom, top = 0.8, 0.25, 0.55, 0.45 if titled else 0.2
    gap_w, gap_h = 0.85, bottom + top
    ax_w = (w - left - right - gap_w * (ncols - 1)) / ncols
    ax_h = (h - bottom - top - gap_h * (nrows - 1)) / nrows
    fig.subplots_adjust(left=left / w, right=1 - right / w, bottom=bottom / h, top=1 - top / h,
                        wspace=gap_w / ax_w, hspace=gap_h / ax_h)


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _restarts(ax, rows: list[dict]) -> None:
    """Dotted vertical lines where a restarted learner's rows begin."""
    labelled = False
    for prev, row in zip(rows, rows[1:]):
        if row.get("incarnation") != prev.get("incarnation"):
            ax.axvline(row["step"], color="grey", linestyle=":", label=None if labelled else "learner restart")
            labelled = True


def fig_reward(d: RunData) -> Figure:
    f = Figure("reward", "Reward", "Mean reward of the groups each step trained, against step and time.")
    if not _has(d.rows, "reward_mean"):
        f.caption = "No step has a reward yet (metrics.jsonl has no rows)."
        return f
    steps, (t, tlabel) = [r["step"] for r in d.rows], time_axis(d.rows)
    fig, (a, b) = _new_figure(2)
    a.plot(steps, _series(d.rows, "reward_mean"), color="C0")
    _restarts(a, d.rows)
    a.set_xlabel("step")
    a.set_ylabel("reward mean")
    if a.get_legend_handles_labels()[0]:
        a.legend(loc="best", fontsize="small")
    b.plot(t, _series(d.rows, "reward_mean"), color="C0")
    b.set_xlabel(tlabel)
    f.png = _png(fig)
    return f


def _val_keys(rows: list[dict]) -> list[str]:
    keys: dict[str, None] = {}
    for r in rows:
        for k in r:
            # val/<data_source>/<metric>; val/version, val/step, val/samples … have no data_source
            if k.startswith("val/") and "/" in k[len("val/"):] and ("mean@" in k or "pass@" in k):
                keys[k] = None
    return sorted(keys, key=lambda k: (not k.startswith("val/all/"), k))[:8]


def fig_validation(d: RunData) -> Figure:
    f = Figure("validation", "Validation", "Validation scores (`val/<data_source>/mean@k`, `pass@k`) of the "
               "weights each validated step produced, against step and time.")
    keys = _val_keys(d.rows)
    if not keys:
        f.caption = ("No validation results in metrics.jsonl (data.val_files empty, train.test_freq = 0, or no "
                     "validated step yet).")
        return f
    t, tlabel = time_axis(d.rows)
    fig, (a, b) = _new_figure(2)
    for i, k in enumerate(keys):
        pts = [(r["step"], x, r[k]) for r, x in zip(d.rows, t) if isinstance(r.get(k), (int, float))]
        a.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", ms=3, color=f"C{i}", label=k[len("val/"):])
        b.plot([p[1] for p in pts], [p[2] for p in pts], marker="o", ms=3, color=f"C{i}")
    a.set_xlabel("step")
    a.set_ylabel("score")
    b.set_xlabel(tlabel)
    a.legend(loc="best", fontsize="small")
    f.png = _png(fig)
    return f


def fig_throughput(d: RunData) -> Figure:
    f = Figure("samples_per_s", "Samples per second",
               "Samples trained per learner second of each step (samples / (fetch + train + push)).")
    rows = [r for r in d.rows if isinstance(r.get("samples"), (int, float))]
    pts = []
    for r in rows:
        secs = sum(_num(r.get(k)) for k in ("fetch_s", "step_s", "push_s"))
        if math.isfinite(secs) and secs > 0:
            pts.append((r["step"], r["samples"] / secs))
    if not pts:
        f.caption = "No step with samples and seconds in metrics.jsonl yet."
        return f
    fig, (a,) = _new_figure(1)
    a.plot([p[0] for p in pts], [p[1] for p in pts], color="C2", label="per step")
    sps = (d.summary or {}).get("samples_per_s")
    if isinstance(sps, (int, float)):
        a.axhline(sps, color="C3", linestyle="--", label=f"run: {sps:.1f}/s (summary.json)")
        f.caption += " Dashed: the run's samples per second of wall time (summary.json)."
    a.set_xlabel("step")
    a.set_ylabel("samples / s")
    a.legend(loc="best", fontsize="small")
    f.png = _png(fig)
    return f


def fig_staleness(d: RunData) -> Figure:
    eta = d.eta
    f = Figure("staleness", "Staleness", "Largest staleness (policy versions between a trained group's oldest "
               "token and the learner) of each step, against the bound η, and how many steps had each maximum. "
               "Per-group staleness is in Prometheus (`areal_like_staleness`), not in metrics.jsonl."
               + ("" if eta is not None else " η is unknown: no config.json or summary.json."))
    if not _has(d.rows, "staleness_max"):
        f.caption = "No step in metrics.jsonl yet."
        return f
    rows = [r for r in d.rows if _has([r], "staleness_max")]  # finite numbers only (a NaN row is skipped)
    vals = [int(r["staleness_max"]) for r in rows]
    fig, (a, b) = _new_figure(2)
    a.plot([r["step"] for r in rows], vals, ".", ms=4,
           color="C0", alpha=0.6, label="max staleness of the step")
    top = max(vals + [eta or 0])
    if eta is not None:
        a.axhline(eta, color="C3", linestyle="--", label=f"η = {eta}")
        b.axvline(eta, color="C3", linestyle="--", label=f"η = {eta}")
    a.set_ylim(-0.3, top + 0.7)
    a.set_xlabel("step")
    a.set_ylabel("staleness (versions)")
    a.legend(loc="best", fontsize="small")
    counts = [vals.count(v) for v in range(top + 1)]
    b.bar(range(top + 1), counts, color="C0", width=0.6)
    b.set_xticks(range(top + 1))
    b.set_xlabel("max staleness of a step")
    b.set_ylabel("steps")
    if eta is not None:
        b.legend(loc="best", fontsize="small")
    f.png = _png(fig)
    return f


def fig_busy(d: RunData) -> Figure:
    key = next((k for k in BUSY_KEYS if _has(d.rows, k)), None)
    f = Figure("gen_busy_fraction", "Generation busy fraction",
               "Fraction of time the generation servers spent computing, per step.")
    if key is None:
        f.caption = ("Not in this run's metrics.jsonl: the servers export it to Prometheus only "
                     "(rate of `areal_like_server_busy_seconds`; see the Grafana dashboard).")
        return f
    fig, (a,) = _new_figure(1)
    a.plot([r["step"] for r in d.rows], _series(d.rows, key), color="C4")
    a.set_ylim(0, 1.05)
    a.set_xlabel("step")
    a.set_ylabel("busy fraction")
    f.png = _png(fig)
    return f


def fig_seconds(d: RunData) -> Figure:
    f = Figure("seconds", "Push, fetch and step seconds",
               "Per step: weight push (pause → buckets → continue), the generation pause window when recorded, "
               "fetch (waiting for B groups from the buffer) and the training step itself.")
    keys = [(k, lbl) for k, lbl in (("push_s", "push"), ("pause_window_s", "pause window"), ("fetch_s", "fetch"),
                                    ("step_s", "train step")) if _has(d.rows, k)]
    if not keys:
        f.caption = "No step in metrics.jsonl yet."
        return f
    fig, (a,) = _new_figure(1)
    steps = [r["step"] for r in d.rows]
    for i, (k, lbl) in enumerate(keys):
        a.plot(steps, _series(d.rows, k), color=f"C{i}", label=lbl)
    a.set_xlabel("step")
    a.set_ylabel("seconds")
    a.legend(loc="best", fontsize="small")
    f.png = _png(fig)
    return f


def fig_buffer(d: RunData) -> Figure:
    keys = [k for k in BUFFER_KEYS if _has(d.rows, k)]
    f = Figure("buffer_depth", "Buffer depth", "Groups in the replay buffer not yet consumed (and delivered "
               "but not acknowledged), when each step's row was written.")
    if not keys:
        f.caption = ("Not in this run's metrics.jsonl (its rows have no `buffer_depth`): the depth is exported to "
                     "Prometheus (`areal_like_buffer_depth`) and to the TensorBoard/W&B loggers (`buffer/depth`).")
        return f
    fig, (a,) = _new_figure(1)
    steps = [r["step"] for r in d.rows]
    for i, k in enumerate(keys):
        a.plot(steps, _series(d.rows, k), color=f"C{i}", label=k.replace("buffer_", ""))
    a.set_xlabel("step")
    a.set_ylabel("groups")
    a.legend(loc="best", fontsize="small")
    f.png = _png(fig)
    return f


def fig_drops(d: RunData) -> Figure:
    f = Figure("drops", "Drops", "Groups dropped while filling each step: older than the consume-time limit "
               "(`dropped_stale`, ~0 when the gate works) and DAPO-filtered (`filtered`, all rewards equal); "
               "right: cumulative.")
    if not d.rows:
        f.caption = "No step in metrics.jsonl yet."
        return f
    fig, (a, b) = _new_figure(2)
    steps = [r["step"] for r in d.rows]
    for i, (k, lbl) in enumerate((("dropped_stale", "stale"), ("filtered", "filtered"))):
        ys = [0.0 if not math.isfinite(x) else x for x in _series(d.rows, k)]
        a.plot(steps, ys, color=f"C{i + 3}", label=lbl, drawstyle="steps-mid")
        cum, acc = [], 0.0
        for y in ys:
            acc += y
            cum.append(acc)
        b.plot(steps, cum, color=f"C{i + 3}", label=lbl)
    a.set_xlabel("step")
    a.set_ylabel("groups")
    b.set_xlabel("step")
    b.set_ylabel("groups (cumulative)")
    a.legend(loc="best", fontsize="small")
    f.png = _png(fig)
    return f


# Panels of the learner figure that are computed from a row rather than read from one key.
_DERIVED = {"response tokens / sample": lambda r: _num(r.get("loss_tokens")) / r["samples"] if r.get("samples") else math.nan}


def fig_training(d: RunData) -> Figure:
    keys = [k for k in ("loss", "grad_norm", "approx_kl", "clipfrac", "entropy", "kl_ref", "mismatch_logp_abs_mean",
                        "mismatch_kl") if _has(d.rows, k)]
    if _has(d.rows, "loss_tokens") and _has(d.rows, "samples"):
        keys.append("response tokens / sample")
    f = Figure("training", "Learner statistics", "Loss, gradient norm, KL(π_prox ‖ π_θ), clip fraction, entropy, "
               "KL to the reference (when the run has one), the training–inference mismatch (mean |Δ log p| and "
               "KL between the servers' and the learner's log-probabilities of the sampled tokens) and the mean "
               "response length (trained tokens per sample) per step.")
    if not keys:
        f.caption = "No step in metrics.jsonl yet."
        return f
    from matplotlib.figure import Figure as MplFigure

    ncols = min(3, len(keys))
    nrows = (len(keys) + ncols - 1) // ncols
    fig = MplFigure(figsize=(10.0, 2.8 * nrows), dpi=100)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    _margins(fig, nrows, ncols, titled=True)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    steps = [r["step"] for r in d.rows]
    for i, (ax, k) in enumerate(zip(axes, keys)):
        ax.grid(True, alpha=0.3)
        ys = [_DERIVED[k](r) for r in d.rows] if k in _DERIVED else _series(d.rows, k)
        ax.plot(steps, ys, color=f"C{i % 10}")
        ax.set_title(k, fontsize="medium")
        ax.set_xlabel("step")
    f.png = _png(fig)
    return f


FIGURES = (fig_reward, fig_validation, fig_throughput, fig_staleness, fig_busy, fig_seconds, fig_buffer,
           fig_drops, fig_training)


# ---- HTML --------------------------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em}table{border-collapse:collapse;font-size:.9em}
td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}img{max-width:100%;border:1px solid #eee}
figcaption,.note{color:#555;font-size:.9em}.note{background:#f6f6f6;padding:.5em .8em;border-left:3px solid #bbb}"""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return str(v)


def _table(items: list[tuple[str, Any]]) -> str:
    return "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
                               for k, v in items) + "</table>"


def _overview(d: RunData) -> str:
    parts = []
    rows = d.rows
    if d.summary is not None:
        parts.append(f"<p>Finished: <b>{html.escape(str(d.summary.get('exit_reason', '?')))}</b> "
                     f"after {html.escape(str(d.summary.get('steps', '?')))} step(s).</p>")
        parts.append(_table([(k, v) for k, v in d.summary.items() if not isinstance(v, dict)]
                            + [(k, v) for k, v in d.summary.items() if isinstance(v, dict)]))
    else:
        last = rows[-1]["step"] if rows else None
        parts.append('<p class="note">No summary.json: the run is still going or was cut off. '
                     + (f"{len(rows)} step(s) recorded so far, the last is step {last}." if rows
                        else "No step recorded yet.") + "</p>")
    if d.bad_lines:
        parts.append(f'<p class="note">{d.bad_lines} line(s) of metrics.jsonl are not complete JSON rows '
                     f"(a write cut off) and were skipped.</p>")
    if d.config is not None:
        c = d.config
        pick = [("allocation", c.get("allocation")),
                ("η (rollout.max_staleness)", (c.get("rollout") or {}).get("max_staleness")),
                ("B (train.batch_size, groups/step)", (c.get("train") or {}).get("batch_size")),
                ("n (generation.n, samples/group)", (c.get("generation") or {}).get("n")),
                ("train.total_steps", (c.get("train") or {}).get("total_steps")),
                ("algorithm.adv_estimator", (c.get("algorithm") or {}).get("adv_estimator")),
                ("model.path", (c.get("model") or {}).get("path"))]
        parts.append("<h2>Configuration</h2>" + _table([(k, v) for k, v in pick if v is not None]))
    else:
        parts.append('<p class="note">No readable config.json in the run directory.</p>')
    return "\n".join(parts)


def render_html(d: RunData, figures: list[Figure]) -> str:
    name = os.path.basename(os.path.abspath(d.run_dir))
    body = [f"<h1>Run report: {html.escape(name)}</h1>",
            f"<p class=\"note\">{html.escape(os.path.abspath(d.run_dir))} — from metrics.jsonl"
            f"{', summary.json' if d.summary is not None else ''}{', config.json' if d.config is not None else ''}."
            f" Figures are also in <code>{REPORT_DIR}/</code>.</p>",
            _overview(d)]
    for f in figures:
        body.append(f"<h2 id=\"{f.name}\">{html.escape(f.title)}</h2>")
        if f.png is None:
            body.append(f'<p class="note">{html.escape(f.caption)}</p>')
        else:
            src = "data:image/png;base64," + base64.b64encode(f.png).decode("ascii")
            body.append(f'<figure><img src="{src}" alt="{html.escape(f.title)}" data-file="{REPORT_DIR}/{f.name}.png">'
                        f"<figcaption>{html.escape(f.caption)}</figcaption></figure>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(name)} — areal_like run report</title><style>{_CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _atomic_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_report(run_dir: str) -> str:
    """Write `<run_dir>/report/*.png` and the self-contained `<run_dir>/report.html`; returns the HTML's
    path. Works at any point of a run's life; a figure without data gets a note instead (its old PNG,
    if any, is removed). Raises FileNotFoundError if `run_dir` is not a directory."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"{run_dir} is not a directory")
    d = load_run(run_dir)
    figures = [make(d) for make in FIGURES]
    out_dir = os.path.join(run_dir, REPORT_DIR)
    os.makedirs(out_dir, exist_ok=True)
    for f in figures:
        path = os.path.join(out_dir, f.name + ".png")
        if f.png is not None:
            _atomic_write(path, f.png)
        elif os.path.exists(path):
            os.remove(path)
    html_path = os.path.join(run_dir, REPORT_HTML)
    _atomic_write(html_path, render_html(d, figures).encode("utf-8"))
    return html_path
