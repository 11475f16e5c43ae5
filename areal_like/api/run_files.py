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

import msgspec

ENDPOINTS_FILE = "endpoints.json"
METRICS_FILE = "metrics.jsonl"


class Endpoints(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    servers: list[str]
    """Base URLs of the generation servers, in data-parallel order."""
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


class StepMetrics(msgspec.Struct, kw_only=True, omit_defaults=False):
    """One learner step as `metrics.jsonl` records it (every step trained B groups; a statistic the
    step's algorithm does not compute is NaN or null)."""

    step: int
    version: int
    """Policy version after this step's weights landed on every server."""
    reward_mean: float
    staleness_max: int
    staleness_mean: float = float("nan")
    """Mean staleness (versions behind the weights it was trained with) of the step's B groups."""
    dropped_stale: int
    filtered: int = 0
    """Groups dropped by DAPO dynamic sampling (all rewards equal) while filling this step."""
    samples: int
    step_s: float
    push_s: float
    pause_window_s: float | None = None
    push_bytes: int | None = None
    """Bytes the step's weight push carried (as sent: in the servers' dtype) — with LoRA
    (`model.lora_rank` > 0) the adapter alone; None for a transport that does not count them."""
    fetch_s: float
    loss: float
    grad_norm: float
    clipfrac: float
    approx_kl: float
    behav_w_min: float = float("nan")
    behav_w_max: float
    behav_tokens_capped: int = 0
    """Loss tokens the behaviour correction acted on: π_prox/π_behav over the cap (capped or masked),
    or outside `train.rejection_sampling`'s range (masked, or clamped)."""
    mismatch_logp_abs_mean: float = float("nan")
    """Training–inference mismatch: mean |log π_learner − log π_behav| over the loss tokens measured,
    π_learner = the learner's logprobs with the step's starting weights (the recomputed π_prox, or
    the first optimizer step's forward), π_behav = the servers'. Includes the policy lag of stale tokens."""
    mismatch_logp_abs_max: float = float("nan")
    """Largest |log π_learner − log π_behav| of the step."""
    mismatch_kl: float = float("nan")
    """KL(π_behav ‖ π_learner) estimated on the sampled tokens (k3: mean of r − 1 − log r, r = π_learner/π_behav)."""
    mismatch_ratio_outside: float = float("nan")
    """Share of the measured tokens whose r = π_learner/π_behav is outside [0.5, 5]."""
    mismatch_tokens: int = 0
    """Loss tokens the mismatch statistics cover (all of the step's, or its first minibatch's when no
    π_prox recompute ran and the step takes several optimizer steps)."""
    kl_ref: float | None = None
    """Mean KL(π_θ ‖ π_ref) over loss tokens (the configured estimator); None without a reference."""
    entropy: float = float("nan")
    value_loss: float | None = None
    """Critic loss (GAE only)."""
    adv_abs_mean: float = float("nan")
    optimizer_steps: int = 1
    loss_tokens: int
    skipped: bool
    incarnation: int
    device_mem_peak_gib: float | None = None
    """Learner rank 0's peak of allocated CUDA memory during the train step (GiB,
    `torch.cuda.max_memory_allocated`, reset at the step's start); None on CPU."""
    time: float | None = None
    """Unix seconds when learner rank 0 made this row (the step's weights had landed); None in older files."""
    reward_failures: dict[str, int] = msgspec.field(default_factory=dict)
    """Reward calls that failed so far in the run, by kind (exception, timeout, non_finite, not_a_number),
    over every rollout worker (flattened to `reward_failures/<kind>` keys in the file)."""
    val: dict[str, float] = msgspec.field(default_factory=dict)
    """Validation results of this step (flattened to `val/<data_source>/<metric>` keys in the file)."""

    def to_row(self) -> dict:
        row = msgspec.to_builtins(self)
        val = row.pop("val")
        row.update({f"reward_failures/{k}": v for k, v in row.pop("reward_failures").items()})
        row.update(val)
        return row


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
