"""Experiment trackers (`metrics.loggers`): TensorBoard event files and Weights & Biases runs, fed by
learner rank 0 with the same row it appends to metrics.jsonl.

    StepMetrics row (metrics.jsonl keys) ──namespaced()──► {"train/loss": …, "rollout/reward_mean": …,
                                                            "val/all/mean@4": …, "perf/step_s": …,
                                                            "buffer/depth": …}  ──► every logger

`namespaced` is the one mapping from a row to tracker keys; every logger writes exactly its output,
so TensorBoard and W&B show the same keys. metrics.jsonl itself is not a logger here: the learner
always writes it (the launcher, `launcher report` and resumed learners read it), `jsonl` listed in
`metrics.loggers` or not.

A logger never stops training: one that cannot start (W&B online without a login, a read-only
directory) or fails while logging is reported once on the learner's log and switched off.
Restarts (the launcher restarting a dead learner from its checkpoint, or `launcher run` resuming a run
dir): each learner process opens its own TensorBoard event file in the same `tensorboard/` dir, marked
as a restart at its first step so TensorBoard shows the redone steps once (see `TensorBoardLogger`),
and its own W&B run — named `<name>-restart<k>` for the launcher's k-th restart of the learner, in the
group `<name>` — rather than resuming one (W&B cannot resume offline runs, and a resumed W&B run
refuses steps lower than its last). Both get the resolved config once per learner process.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable

from areal_like.api.run_files import row_fields

# metrics.jsonl key → tracker key: each row field's `published(tracker=…)` (api/step_stats.py,
# api/run_files.py), and the buffer state the learner adds for the trackers. A key a future row
# carries that is not listed goes to `other/<key>` rather than being lost.
KEY_MAP: dict[str, str] = {f.row: f.tracker for f in row_fields()
                           if f.row is not None and f.tracker is not None and not f.tracker.endswith("/")} | {
    # buffer state when the step's row was made (rows that carry it)
    "buffer_depth": "buffer/depth",
    "buffer_pending": "buffer/pending",
    "buffer_oldest_age_s": "buffer/oldest_age_s",
}
# Row keys that are not a statistic to plot: `step` is the x axis of every logger, `time` (unix seconds)
# the trackers' own, and flags/strings (`tracker=None` in their annotation).
NOT_LOGGED = frozenset(f.row for f in row_fields() if f.row is not None and f.tracker is None)
# row key prefix → tracker namespace: the flattened dict fields (`val/…` keeps its name,
# `reward_failures/<kind>` goes under rollout/), then keys already namespaced
PREFIX_MAP: tuple[tuple[str, str], ...] = tuple(
    (f"{f.name}/", f.tracker) for f in row_fields()
    if f.tracker is not None and f.tracker.endswith("/")) + (
    ("buffer/", "buffer/"),
    ("perf/", "perf/"),
    ("train/", "train/"),
    ("rollout/", "rollout/"),
)
NAMESPACES = ("train", "rollout", "val", "perf", "buffer")


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


def namespaced(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row (`StepMetrics.to_row()`, possibly with `buffer_*` keys) → flat
    `{namespace/key: float}` for the trackers. None and non-numeric values are left out; NaN (a
    statistic the step's algorithm does not compute, or a diverged loss) is kept as NaN. Derived:
    `perf/samples_per_s` = samples / (fetch_s + step_s + push_s) (the learner's time on this step)
    and `perf/train_tokens_per_s` = loss_tokens / step_s."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in NOT_LOGGED:
            continue
        x = _number(value)
        if x is None:
            continue
        name = KEY_MAP.get(key)
        if name is None:
            name = next((ns + key[len(p):] for p, ns in PREFIX_MAP if key.startswith(p)), f"other/{key}")
        out[name] = x
    secs = [_number(row.get(k)) for k in ("fetch_s", "step_s", "push_s")]
    samples = _number(row.get("samples"))
    if samples is not None and all(s is not None for s in secs) and sum(secs) > 0:
        out["perf/samples_per_s"] = samples / sum(secs)
    tokens, step_s = _number(row.get("loss_tokens")), _number(row.get("step_s"))
    if tokens is not None and step_s and step_s > 0:
        out["perf/train_tokens_per_s"] = tokens / step_s
    return out


_SECRET_KEY = re.compile(r"(api_key|secret|password|token)$", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(//[^/:@]*:)[^/@]+@")


def loggable_config(cfg: Any) -> dict:
    """The resolved config as plain JSON-able data with its secrets blanked (server.api_key,
    server.admin_api_key, a password in buffer.redis_url): config.json is owner-only for their sake,
    and a tracker may send what it gets to a server."""
    import msgspec

    def clean(node: Any, key: str = "") -> Any:
        if isinstance(node, dict):
            return {k: clean(v, k) for k, v in node.items()}
        if isinstance(node, list):
            return [clean(v) for v in node]
        if isinstance(node, str):
            if _SECRET_KEY.search(key):
                return "***"
            return _URL_PASSWORD.sub(r"\1***@", node)
        return node

    data = cfg if isinstance(cfg, dict) else msgspec.to_builtins(cfg)
    return clean(data)


class Logger:
    """One tracker. `log(step, values)` with `namespaced` output; `close()` flushes and ends it."""

    name = "logger"

    def log(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardLogger(Logger):
    """Scalars into `<logdir>` (`<run_dir>/tensorboard`) with torch's SummaryWriter (the `tensorboard`
    package's event format); the config as a text summary `config` (JSON in a code block).

    Each process writes its own event file. Before its first row it writes a SessionLog START event at
    that row's step — TensorBoard's restart marker: readers that honour it (EventAccumulator, the
    Python data path) drop the earlier files' points at that step and after, so the steps a learner
    resumed from a checkpoint redid are shown once, as the final model has them."""

    name = "tensorboard"

    def __init__(self, logdir: str, config: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(logdir, exist_ok=True)
        self.writer = SummaryWriter(log_dir=logdir, flush_secs=30)
        self.started = False
        if config is not None:
            self.writer.add_text("config", "```json\n" + json.dumps(config, indent=1, sort_keys=True) + "\n```", 0)
            self.writer.flush()

    def log(self, step: int, values: dict[str, float]) -> None:
        if not self.started:
            import time

            from tensorboard.compat.proto.event_pb2 import Event, SessionLog

            self.writer._get_file_writer().add_event(
                Event(step=step, wall_time=time.time(), session_log=SessionLog(status=SessionLog.START)))
            self.started = True
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # one row per step: a cut-off learner leaves every row it wrote on disk

    def close(self) -> None:
        self.writer.close()


class WandbLogger(Logger):
    """One W&B run per learner process (see the module doc for restarts); the config as the run's
    config; every row logged with `step=` the learner step."""

    name = "wandb"
    FLUSH_S = 2.0

    def __init__(self, *, project: str, mode: str, name: str, group: str, dir: str, entity: str | None = None,
                 config: dict | None = None):
        import wandb

        os.makedirs(dir, exist_ok=True)
        # console off: the learner's stdout already goes to logs/learner.log. The run's `.wandb` file
        # is flushed every FLUSH_S (W&B's default 15 s): a learner killed mid-run loses at most that
        # much of its W&B history (metrics.jsonl has every row).
        settings = {"console": "off"}
        if "x_transaction_log_flush_interval" in getattr(wandb.Settings, "model_fields", {}):  # wandb ≥ 0.2x
            settings["x_transaction_log_flush_interval"] = self.FLUSH_S
        self.run = wandb.init(project=project, entity=entity, name=name, group=group, dir=dir, mode=mode,
                              config=config, settings=wandb.Settings(**settings))

    def log(self, step: int, values: dict[str, float]) -> None:
        # steps only grow within one learner process (a row held for its validation is written
        # before the next step's), as W&B requires; commit: the row is complete (W&B would otherwise
        # keep it open until the next step's)
        self.run.log(values, step=step, commit=True)

    def close(self) -> None:
        self.run.finish()


def make_loggers(cfg: Any, run_dir: str, incarnation: int = 0,
                 on_error=lambda msg: print(f"[learner] {msg}", flush=True)) -> "Loggers":
    """The trackers `cfg.metrics.loggers` names (`jsonl` is the learner's own metrics.jsonl, not made
    here). One that cannot start is reported through `on_error` and left out."""
    m = cfg.metrics
    wanted = [x for x in dict.fromkeys(m.loggers) if x != "jsonl"]
    if not wanted:
        return Loggers([], on_error)
    config = loggable_config(cfg)
    out: list[Logger] = []
    for kind in wanted:
        try:
            if kind == "tensorboard":
                out.append(TensorBoardLogger(os.path.join(run_dir, "tensorboard"), config))
            elif kind == "wandb":
                w = m.wandb
                group = w.name or os.path.basename(os.path.abspath(run_dir))
                out.append(WandbLogger(project=w.project, mode=w.mode, entity=w.entity, group=group,
                                       name=group if incarnation == 0 else f"{group}-restart{incarnation}",
                                       dir=w.dir or run_dir, config=config))
        except Exception as e:  # noqa: BLE001 — a tracker must not stop training; say why it is off
            on_error(f"metrics.loggers: {kind} could not start and is off for this learner: "
                     f"{type(e).__name__}: {e}")
    return Loggers(out, on_error)


class Loggers:
    """The learner's trackers together: `log_row(row)` maps the metrics.jsonl row once (`namespaced`)
    and gives it to each; a tracker that raises is reported once and switched off."""

    def __init__(self, loggers: Iterable[Logger], on_error=lambda msg: print(msg, flush=True)):
        self.loggers = list(loggers)
        self.on_error = on_error

    def __bool__(self) -> bool:
        return bool(self.loggers)

    def log_row(self, row: dict[str, Any]) -> None:
        if not self.loggers:
            return
        step = int(row["step"])
        values = namespaced(row)
        for lg in list(self.loggers):
            try:
                lg.log(step, values)
            except Exception as e:  # noqa: BLE001
                self._drop(lg, f"failed at step {step}", e)

    def close(self) -> None:
        for lg in list(self.loggers):
            try:
                lg.close()
            except Exception as e:  # noqa: BLE001
                self._drop(lg, "failed to close", e)
        self.loggers = []

    def _drop(self, lg: Logger, what: str, e: Exception) -> None:
        self.on_error(f"metrics.loggers: {lg.name} {what} ({type(e).__name__}: {e}); it is off from here on")
        if lg in self.loggers:
            self.loggers.remove(lg)
