"""What crosses a process boundary as a file of the run directory, as typed records.

    endpoints.json   `Endpoints`   written by the launcher once every server is healthy, before the
                                   rollout workers start; read by learner rank 0 (servers to push to:
                                   the pool started while the servers loaded and waits for the file
                                   of its launch) and rollout workers
    metrics.jsonl    `StepMetrics` one line per learner step, appended by learner rank 0; read by
                                   the launcher (progress line, summary.json) and by users

Both are JSON through msgspec (never pickle, DESIGN invariant 6). A field added here is seen by
every reader; a reader of an older file gets the defaults.
"""

from __future__ import annotations

import json
import os
import time
from typing import Annotated

import msgspec

from areal_like.api.step_stats import Published, PushResult, TrainStats, published, published_fields

ENDPOINTS_FILE = "endpoints.json"
METRICS_FILE = "metrics.jsonl"


class Endpoints(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    servers: list[str]
    """Base URLs of the generation servers, in data-parallel order."""
    judge_servers: list[str] = msgspec.field(default_factory=list)
    """Base URLs of the judge servers (the allocation's judge component; judge.*), empty without one."""
    teacher_servers: list[str] = msgspec.field(default_factory=list)
    """Base URLs of the teacher servers (the allocation's teacher component; teacher.*), empty without one."""
    metrics_ports: dict[str, int] = msgspec.field(default_factory=dict)
    """role name → its /metrics port (on its node's address, `prometheus_targets.json`)."""
    weight_backend: str = "gloo"
    """torch.distributed backend of the weight-update group: nccl (SGLang on GPUs) or gloo."""
    server_devices: list[int] | None = None
    """Devices (= ranks in the weight-update group) of each server; None = one rank per server."""
    server_gpus: list[list[list[int]]] | None = None
    """Co-located SGLang runs: each server's (node, device) per TP rank, in TP-rank order (the plan's)."""
    learner_gpus: list[list[int]] | None = None
    """Co-located SGLang runs: each learner rank's (node, device) (the plan's). With `server_gpus`, each
    learner rank hands its own GPU's weights to the server TP rank on that GPU (weights/ipc.py)."""
    learner_device: str = "cpu"
    """torch device of every learner rank; on CUDA each rank's CUDA_VISIBLE_DEVICES holds its own
    device from the plan, so this is `cuda:0` for all of them."""
    learner_host: str = "127.0.0.1"
    """Address of learner rank 0's node: it hosts the weight-update group's store there."""
    launch: str = ""
    """Which `launcher run` wrote it (a token it also gives the learner): a learner started while the
    servers load waits for the file of its own launch, not the one a previous launch left in the run dir."""

    def dump(self, run_dir: str) -> None:
        tmp = os.path.join(run_dir, ENDPOINTS_FILE + ".tmp")
        with open(tmp, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(self), indent=1))
        os.replace(tmp, os.path.join(run_dir, ENDPOINTS_FILE))

    @classmethod
    def wait(cls, run_dir: str, launch: str, timeout_s: float) -> "Endpoints":
        """The endpoints of launch `launch`, once the launcher wrote them (after every server is healthy)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ep = cls.load(run_dir)
                if ep.launch == launch:
                    return ep
            except (FileNotFoundError, msgspec.DecodeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{os.path.join(run_dir, ENDPOINTS_FILE)} of launch {launch} did not appear within "
                                   f"{timeout_s:.0f} s: the launcher writes it once every generation server is "
                                   "healthy (see the launcher's output and logs/server*.log)")
            time.sleep(0.1)

    @classmethod
    def load(cls, run_dir: str) -> "Endpoints":
        path = os.path.join(run_dir, ENDPOINTS_FILE)
        try:
            with open(path, "rb") as f:
                return msgspec.json.decode(f.read(), type=cls)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} is missing: roles are started by `launcher run`, which writes it "
                                    "first") from None


class StepMetrics(msgspec.Struct, kw_only=True):
    """One learner step as `metrics.jsonl` records it: the step's run fields (version, staleness, drops,
    fetch, …), then its `TrainStats` and `PushResult` fields (api/step_stats.py; a field's `published`
    annotation names its row key, tracker name and Prometheus series). Every step trained B groups; a
    statistic the step's algorithm does not compute is NaN or null."""

    step: Annotated[int, published("Learner step (1, 2, …); the trackers' x axis.", tracker=None)]
    version: Annotated[int, published("Policy version after this step's weights landed on every server.",
                                      tracker="train/version")]
    staleness_max: Annotated[int, published("Largest staleness (versions behind the weights it was trained with) "
                                            "of the step's B groups.", tracker="rollout/staleness_max")] = 0
    staleness_mean: Annotated[float, published("Mean staleness of the step's B groups.",
                                               tracker="rollout/staleness_mean")] = float("nan")
    dropped_stale: Annotated[int, published("Groups dropped as too stale while filling this step (replaced).",
                                            tracker="rollout/dropped_stale")] = 0
    filtered: Annotated[int, published("Groups dropped by DAPO dynamic sampling (all rewards equal) while filling "
                                       "this step.", tracker="rollout/filtered")] = 0
    fetch_s: Annotated[float, published("Seconds rank 0 waited for the step's B groups.",
                                        tracker="perf/fetch_s")] = 0.0
    incarnation: Annotated[int, published("How many times the launcher restarted the learner pool before this "
                                          "row's learner.", tracker="train/incarnation")] = 0
    time: Annotated[float | None, published("Unix seconds when learner rank 0 made this row (the step's weights "
                                            "had landed); the trackers keep their own.", tracker=None)] = None
    reward_failures: Annotated[dict[str, int], published(
        "Reward calls that failed so far in the run, by kind (exception, timeout, non_finite, not_a_number), "
        "over every rollout worker: `reward_failures/<kind>` keys in the file.",
        tracker="rollout/reward_failures/")] = msgspec.field(default_factory=dict)
    val: Annotated[dict[str, float], published(
        "Validation results of this step: `val/<data_source>/<metric>` keys in the file.",
        tracker="val/")] = msgspec.field(default_factory=dict)
    train: TrainStats = msgspec.field(default_factory=TrainStats)
    push: PushResult = msgspec.field(default_factory=PushResult)

    def to_row(self) -> dict:
        """The metrics.jsonl line: run fields, then the train and push fields under their row keys, the
        dict fields flattened (`reward_failures/<kind>`, `val/…`)."""
        row = {f.name: getattr(self, f.name) for f in RUN_FIELDS if f.name not in ("reward_failures", "val")}
        for part, fields in ((self.train, TRAIN_FIELDS), (self.push, PUSH_FIELDS)):
            row.update({f.row: getattr(part, f.name) for f in fields if f.row is not None})
        row.update({f"reward_failures/{k}": v for k, v in self.reward_failures.items()})
        row.update(self.val)
        return msgspec.to_builtins(row)

    @classmethod
    def from_row(cls, row: dict) -> StepMetrics:
        """A row back as a StepMetrics (a held row kept in a checkpoint); keys it does not know are left out,
        missing ones take their defaults. Also reads the nested `val`/`reward_failures` of older files."""
        run = {f.name: row[f.name] for f in RUN_FIELDS if f.name in row and f.name not in ("reward_failures", "val")}
        val = dict(row.get("val") or {}) | {k: v for k, v in row.items() if k.startswith("val/")}
        failures = dict(row.get("reward_failures") or {}) | {
            k.removeprefix("reward_failures/"): v for k, v in row.items() if k.startswith("reward_failures/")}
        parts = {name: {f.name: row[f.row] for f in fields if f.row is not None and f.row in row}
                 for name, fields in (("train", TRAIN_FIELDS), ("push", PUSH_FIELDS))}
        return msgspec.convert({**run, "val": val, "reward_failures": failures, **parts}, cls, strict=False)


RUN_FIELDS = published_fields(StepMetrics, skip=("train", "push"))
TRAIN_FIELDS = published_fields(TrainStats)
PUSH_FIELDS = published_fields(PushResult)


def row_fields() -> list[Published]:
    """Every published field of a metrics.jsonl row in the row's order (run, train, push) — docs/metrics.md,
    the trackers' names and the field-walking test read this."""
    return RUN_FIELDS + TRAIN_FIELDS + PUSH_FIELDS


def append_metrics(run_dir: str, m: StepMetrics) -> None:
    # json (not msgspec) writes NaN as NaN, as earlier files and every reader (json.loads) expect.
    with open(os.path.join(run_dir, METRICS_FILE), "a") as f:
        f.write(json.dumps(m.to_row()) + "\n")


def trained_steps(trained_log: str) -> dict[int, list[str]]:
    """Group ids per step as the run's final model contains them, from `trained.jsonl`: each learner
    incarnation ("start" event) resumed from a checkpoint step and redid what came after it, so its
    steps replace the earlier incarnation's from there on."""
    steps: dict[int, list[str]] = {}
    with open(trained_log) as f:
        for line in f:
            ev = json.loads(line)
            if ev.get("event") == "start":
                for s in [s for s in steps if s > ev["resumed_from_step"]]:
                    del steps[s]
            elif ev.get("event") == "trained":
                steps[int(ev["step"])] = list(ev["groups"])
    return dict(sorted(steps.items()))


def reward_reached(rewards: list[float], target: float | None, window: int) -> float | None:
    """`train.stop_reward`: the mean reward of the last `window` steps when it reaches `target` (the
    learner then stops, and the launcher's summary says `reward_reached`), else None. Fewer steps than
    the window never reach it; a NaN reward keeps the mean below any target."""
    if target is None or len(rewards) < window:
        return None
    mean = sum(rewards[-window:]) / window
    return mean if mean >= target else None
