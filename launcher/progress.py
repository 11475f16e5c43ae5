"""`launcher run`'s progress display: one updating bar on a terminal, a plain periodic line otherwise.

    stdout is a terminal   one rich bar, redrawn in place (one line, cut to the terminal's width):
                           [launcher] step 12/300 ━╸━━━━━━━━━━━━━   4% ETA 0:03:41  elapsed 0:00:09
                           reward 0.031  samples/s 84.2  staleness max 1  buffer 6
    stdout is not          "[launcher] step 12/300  version 12  reward 0.031  samples/s 84.2  staleness max 1
    (CI logs, files)       buffer 6  step 0.03s push 0.01s", every 10 s and once at the end

What the launcher prints meanwhile (restarts, the first reward failure of each kind: `print` to stderr)
goes above the bar: while the bar is shown, rich's Live display stands in for sys.stdout (and for
sys.stderr when that is the same kind of terminal) and prints each completed line above itself, so no
call site needs to know about the bar. The bar is closed (left at its last state, cursor restored) on
every way out of the supervision loop, Ctrl-C included.
"""

from __future__ import annotations

import sys
import time

PLAIN_INTERVAL_S = 10.0  # CI logs and files: one line every 10 s
BAR_INTERVAL_S = 1.0  # terminal: metrics.jsonl and the buffer are read once a second; rich redraws in between


def samples_per_s(rows: list[dict], elapsed_s: float) -> float:
    return sum(x.get("samples", 0) for x in rows) / max(elapsed_s, 1e-9)


def plain_line(rows: list[dict], t0: float, total: int, depth: str, tail: str = "") -> str:
    """The plain progress line (non-terminal stdout; tests and CI logs read it)."""
    if not rows:
        return f"[launcher] waiting for the first step… ({time.monotonic() - t0:.0f}s){tail}"
    r = rows[-1]
    sps = samples_per_s(rows, time.monotonic() - t0)
    return (f"[launcher] step {r['step']}/{total}  version {r['version']}  reward {r['reward_mean']:.3f}  "
            f"samples/s {sps:.1f}  staleness max {max(x['staleness_max'] for x in rows)}  buffer {depth}  "
            f"step {r['step_s']:.2f}s push {r['push_s']:.2f}s{tail}")


def _hms(seconds: float | None) -> str:
    if seconds is None:
        return "-:--:--"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class PlainProgress:
    """A plain line every `PLAIN_INTERVAL_S`, and the final one."""

    interval_s = PLAIN_INTERVAL_S

    def __init__(self, total: int, t0: float):
        self.total, self.t0 = total, t0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, rows: list[dict], depth: str, tail: str = "") -> None:
        print(plain_line(rows, self.t0, self.total, depth, tail), flush=True)

    finish = update


class BarProgress:
    """One rich progress bar: step/total, ETA, elapsed, reward, samples/s, staleness max, buffer depth."""

    interval_s = BAR_INTERVAL_S

    def __init__(self, total: int, t0: float):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
        from rich.table import Column

        self.total, self.t0 = total, t0
        self._steps: list[tuple[float, int]] = []  # (when first seen, step): the step rate for the ETA
        self._progress = Progress(
            TextColumn(r"\[launcher] step {task.completed:.0f}/{task.total:.0f}"),
            BarColumn(bar_width=30),
            TaskProgressColumn(),
            TextColumn("ETA {task.fields[eta]}  elapsed"),
            TimeElapsedColumn(),
            # one line, whatever the terminal's width: the end is cut ("…"), never wrapped
            TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
            console=Console(), refresh_per_second=4, transient=False,
            redirect_stdout=True, redirect_stderr=sys.stderr.isatty())
        self._task = self._progress.add_task("run", total=max(total, 1), eta=_hms(None),
                                             stats="waiting for the first step…")

    def __enter__(self):
        self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._progress.stop()  # the bar stays at its last state; the cursor comes back

    def _eta(self, step: int, now: float) -> float | None:
        if not self._steps or self._steps[-1][1] != step:
            self._steps.append((now, step))
        if step >= self.total:
            return 0.0
        (t_a, s_a), (t_b, s_b) = self._steps[0], self._steps[-1]
        if s_b > s_a:  # steps seen by this launch (a resumed run starts past 0)
            rate = (s_b - s_a) / max(t_b - t_a, 1e-9)
            return max((self.total - step) / rate - (now - t_b), 0.0)
        return None

    def update(self, rows: list[dict], depth: str, tail: str = "") -> None:
        now = time.monotonic()
        if not rows:
            self._progress.update(self._task, completed=0, eta=_hms(None),
                                  stats=f"waiting for the first step…  buffer {depth}{tail}")
            return
        r = rows[-1]
        stats = (f"reward {r['reward_mean']:.3f}  samples/s {samples_per_s(rows, now - self.t0):.1f}  "
                 f"staleness max {max(x['staleness_max'] for x in rows)}  buffer {depth}{tail}")
        self._progress.update(self._task, completed=min(r["step"], self.total), eta=_hms(self._eta(r["step"], now)),
                              stats=stats)

    def finish(self, rows: list[dict], depth: str, tail: str = "") -> None:
        self.update(rows, depth, tail)
        self._progress.refresh()


def open_progress(total: int, t0: float, tty: bool | None = None) -> PlainProgress | BarProgress:
    """The bar when stdout is a terminal (`tty` overrides the check), else the plain line. Use it as a
    context manager around the supervision loop; call `update` every `interval_s` and `finish` at the end."""
    if tty is None:
        tty = sys.stdout.isatty()
    return BarProgress(total, t0) if tty else PlainProgress(total, t0)
