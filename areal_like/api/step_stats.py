"""What one learner step measures, as typed fields that say where each is published (issue 41 item 1).

    TrainStats   what `Trainer.train_step` returns (the same on every rank)
    PushResult   what a weight push returns (any transport: `GenerationControl.update`)

Each field is annotated with `published(...)`: its description, its key in metrics.jsonl (the field's
name unless `row=` renames it; `row=None` keeps it out, with the reason in the description), its
experiment-tracker name (`tracker=`, metrics/loggers.py reads it) and, where the dashboards have one,
its Prometheus series (`prom=`, areal_like/metrics builds them). `StepMetrics` (run_files.py) is the
metrics.jsonl row: the step's run fields, then these. docs/metrics.md is generated from the same
annotations (scripts/gen_metrics_doc.py; a test checks it is current). So a new statistic is one
field here and its computation in the trainer; tests/unit/test_step_stats.py walks every field to
all four outputs.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

NAN = float("nan")


@dataclass(frozen=True)
class Prom:
    """A field's Prometheus series: `kind` gauge (set), histogram (observe) or counter (inc by the value);
    `label` = (name, value) of a labelled series."""
    name: str
    help: str
    kind: str = "gauge"
    label: tuple[str, str] | None = None


@dataclass(frozen=True)
class Published:
    name: str
    doc: str
    row: str | None
    tracker: str | None
    prom: Prom | None
    type: str


_KEEP = object()


def published(doc: str, *, tracker: str | None, row: Any = _KEEP, prom: Prom | None = None) -> msgspec.Meta:
    """Where a field goes: `doc` (docs/metrics.md), `row` (its metrics.jsonl key; default: the field's name;
    None: not in the row, `doc` says why), `tracker` (TensorBoard/W&B name; None: not logged) and `prom`."""
    return msgspec.Meta(description=doc, extra={"row": row, "tracker": tracker, "prom": prom})


def published_fields(cls: type, skip: tuple[str, ...] = ()) -> list[Published]:
    """The `published` annotations of a Struct's fields (but `skip`), in declaration order."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for name in (n for n in cls.__struct_fields__ if n not in skip):
        hint = hints[name]
        meta = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)), None)
        if meta is None or meta.extra is None:
            raise TypeError(f"{cls.__name__}.{name} has no published(...) annotation")
        row = name if meta.extra["row"] is _KEEP else meta.extra["row"]
        base = typing.get_args(hint)[0]
        out.append(Published(name, meta.description or "", row, meta.extra["tracker"], meta.extra["prom"],
                             _type_name(base)))
    return out


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "").replace("NoneType", "None")


class TrainStats(msgspec.Struct, kw_only=True):
    """One `Trainer.train_step`: means over its optimizer steps (token-weighted within each), maxima over
    all of them, counts summed. A statistic the step's algorithm does not compute is NaN or None."""

    loss: Annotated[float, published("Actor loss (decoupled PPO, DESIGN invariant 5) averaged over the step's "
                                     "optimizer steps.", tracker="train/loss",
                                     prom=Prom("areal_like_loss", "Loss of the last training step"))] = NAN
    reward_mean: Annotated[float, published("Mean reward of the step's samples (before overlong shaping).",
                                            tracker="rollout/reward_mean",
                                            prom=Prom("areal_like_reward_mean",
                                                      "Mean reward of the last training batch"))] = NAN
    reward_std: Annotated[float, published("Standard deviation of the step's sample rewards.",
                                           tracker="rollout/reward_std")] = NAN
    score_mean: Annotated[float, published("Mean reward after DAPO's overlong penalty (= reward_mean without "
                                           "`reward.overlong_buffer_len`): what the advantages were computed from.",
                                           tracker="rollout/score_mean")] = NAN
    adv_abs_mean: Annotated[float, published("Mean |advantage| over loss tokens.", tracker="train/adv_abs_mean")] = NAN
    grad_norm: Annotated[float, published("Actor gradient norm before clipping (mean over the applied optimizer "
                                          "steps).", tracker="train/grad_norm",
                                          prom=Prom("areal_like_learner_grad_norm",
                                                    "Actor gradient norm before clipping, last step"))] = NAN
    clipfrac: Annotated[float, published("Fraction of loss tokens where the PPO clip was active.",
                                         tracker="train/clipfrac",
                                         prom=Prom("areal_like_learner_clipfrac", "Fraction of loss tokens where "
                                                   "the PPO clip was active, last step"))] = NAN
    dual_clipfrac: Annotated[float, published("Fraction of loss tokens where dual-clip PPO's lower bound "
                                              "(`algorithm.clip_ratio_c`) was active.",
                                              tracker="train/dual_clipfrac")] = NAN
    approx_kl: Annotated[float, published("k3 estimate of KL(π_prox ‖ π_θ) over loss tokens.",
                                          tracker="train/approx_kl",
                                          prom=Prom("areal_like_learner_approx_kl",
                                                    "k3 estimate of KL(π_prox ‖ π_θ) over the last step"))] = NAN
    ratio_mean: Annotated[float, published("Mean importance ratio π_θ/π_prox over loss tokens.",
                                           tracker="train/ratio_mean")] = NAN
    ratio_max: Annotated[float, published("Largest importance ratio π_θ/π_prox of the step.",
                                          tracker="train/ratio_max")] = NAN
    behav_w_mean: Annotated[float, published("Mean behaviour weight π_prox/π_behav over loss tokens (after the "
                                             "cap).", tracker="train/behav_w_mean")] = NAN
    behav_w_max: Annotated[float, published("Largest behaviour weight π_prox/π_behav of the step.",
                                            tracker="train/behav_w_max",
                                            prom=Prom("areal_like_learner_behav_weight_max",
                                                      "Largest π_prox/π_behav behaviour weight, last step"))] = NAN
    behav_w_min: Annotated[float, published("Smallest behaviour weight π_prox/π_behav of the step.",
                                            tracker="train/behav_w_min")] = NAN
    behav_tokens_capped: Annotated[int, published(
        "Loss tokens the behaviour correction acted on: π_prox/π_behav over the cap (capped or masked), or "
        "outside `train.rejection_sampling`'s range (masked, or clamped).", tracker="train/behav_tokens_capped",
        prom=Prom("areal_like_learner_behav_tokens_corrected", "Loss tokens the behaviour correction acted on "
                  "in the last step (capped, masked or clamped)"))] = 0
    mismatch_logp_abs_mean: Annotated[float, published(
        "Training–inference mismatch: mean |log π_learner − log π_behav| over the loss tokens measured, "
        "π_learner = the learner's logprobs with the step's starting weights, π_behav = the servers'. Includes "
        "the policy lag of stale tokens.", tracker="train/mismatch_logp_abs_mean",
        prom=Prom("areal_like_learner_mismatch", "Training–inference mismatch of the last step between the "
                  "learner's logprobs (step-start weights) and the servers' on the same tokens: stat = "
                  "logp_abs_mean, logp_abs_max, kl (KL(π_behav‖π_learner), k3) or ratio_outside (share of tokens "
                  "with π_learner/π_behav outside [0.5, 5])", label=("stat", "logp_abs_mean")))] = NAN
    mismatch_logp_abs_max: Annotated[float, published(
        "Largest |log π_learner − log π_behav| of the step.", tracker="train/mismatch_logp_abs_max",
        prom=Prom("areal_like_learner_mismatch", "", label=("stat", "logp_abs_max")))] = NAN
    mismatch_kl: Annotated[float, published(
        "KL(π_behav ‖ π_learner) estimated on the sampled tokens (k3: mean of r − 1 − log r, "
        "r = π_learner/π_behav).", tracker="train/mismatch_kl",
        prom=Prom("areal_like_learner_mismatch", "", label=("stat", "kl")))] = NAN
    mismatch_ratio_outside: Annotated[float, published(
        "Share of the measured tokens whose r = π_learner/π_behav is outside [0.5, 5].",
        tracker="train/mismatch_ratio_outside",
        prom=Prom("areal_like_learner_mismatch", "", label=("stat", "ratio_outside")))] = NAN
    mismatch_tokens: Annotated[int, published(
        "Loss tokens the mismatch statistics cover (all of the step's, or its first minibatch's when no π_prox "
        "recompute ran and the step takes several optimizer steps).", tracker="train/mismatch_tokens")] = 0
    entropy: Annotated[float, published(
        "Mean policy entropy over loss tokens (NaN with `train.compute_entropy=false` and no entropy bonus).",
        tracker="train/entropy", prom=Prom("areal_like_learner_entropy",
                                           "Mean policy entropy over loss tokens, last step"))] = NAN
    kl_ref: Annotated[float | None, published(
        "Mean KL(π_θ ‖ π_ref) over loss tokens (the configured estimator); None without a reference.",
        tracker="train/kl_ref", prom=Prom("areal_like_learner_kl_ref",
                                          "Mean KL(π_θ ‖ π_ref) to the reference model, last step"))] = None
    teacher_kl: Annotated[float | None, published(
        "On-policy distillation: mean per-token reverse KL to the teacher, log π_behav − log π_teacher, over the "
        "step's loss tokens (what teacher.kl_coef weighs into the advantage); None without a teacher.",
        tracker="train/teacher_kl", prom=Prom("areal_like_learner_teacher_kl",
                                              "Mean per-token reverse KL to the teacher, last step"))] = None
    routing_agreement: Annotated[float | None, published(
        "MoE routing replay (train.routing_replay): the share of replayed (position, layer) pairs whose replayed "
        "experts are the ones the learner's own router would choose (1 = no routing mismatch); None without replay.",
        tracker="train/routing_agreement", prom=Prom("areal_like_learner_routing_agreement",
                                                     "Share of replayed expert choices the learner's router agrees with, "
                                                     "last step"))] = None
    routing_dlogp_replayed: Annotated[float | None, published(
        "train.routing_replay_measure: mean |log π_learner − log π_behav| over the loss tokens of samples with routes, "
        "the learner routing as the servers did (the step's starting weights); None unless measured.",
        tracker="train/routing_dlogp_replayed")] = None
    routing_dlogp_own: Annotated[float | None, published(
        "train.routing_replay_measure: the same tokens' mean |log π_learner − log π_behav| with the learner's own "
        "router (what the mismatch would be without replay); None unless measured.",
        tracker="train/routing_dlogp_own")] = None
    value_loss: Annotated[float | None, published(
        "Critic loss (GAE only; mean over the step's optimizer steps).", tracker="train/value_loss",
        prom=Prom("areal_like_learner_value_loss", "Critic value loss, last step (GAE only)"))] = None
    critic_grad_norm: Annotated[float | None, published("Critic gradient norm before clipping (GAE only).",
                                                        tracker="train/critic_grad_norm")] = None
    lr: Annotated[float, published("Actor learning rate of the step's last optimizer step (`train.lr_schedule`).",
                                   tracker="train/lr",
                                   prom=Prom("areal_like_learner_lr", "Actor learning rate, last step"))] = NAN
    critic_lr: Annotated[float | None, published("Critic learning rate of the step's last optimizer step (GAE "
                                                 "only).", tracker="train/critic_lr")] = None
    num_tokens: Annotated[int, published("Tokens of the step's samples, prompts included.",
                                         tracker="rollout/num_tokens")] = 0
    loss_tokens: Annotated[int, published("Loss tokens (generated tokens) the step trained on.",
                                          tracker="train/loss_tokens",
                                          prom=Prom("areal_like_trained_tokens", "Loss tokens trained on",
                                                    kind="counter"))] = 0
    num_groups: Annotated[int, published("Groups the step trained (B, `train.batch_size`).",
                                         tracker="rollout/groups")] = 0
    num_samples: Annotated[int, published("Samples the step trained (B × `generation.n`).", row="samples",
                                          tracker="rollout/samples")] = 0
    optimizer_steps: Annotated[int, published("Optimizer steps applied (epochs × minibatches, less the skipped).",
                                              tracker="train/optimizer_steps")] = 0
    num_minibatches: Annotated[int, published("Minibatches per epoch (`train.ppo_minibatches`, at most the samples).",
                                              tracker="train/minibatches")] = 0
    version_lag_max: Annotated[int, published("Largest policy lag of a trained token: the step's version minus "
                                              "the oldest token version (-1: no generated token).",
                                              tracker="train/version_lag_max")] = -1
    skipped: Annotated[bool, published("No optimizer step was applied (non-finite gradient or loss, or no loss "
                                       "tokens); the weights are unchanged.", tracker="train/skipped")] = False
    skip_reason: Annotated[str, published("Why the first skipped optimizer step was skipped (empty: none was).",
                                          tracker=None)] = ""
    step: Annotated[int, published("The trainer's own step count. Not in the row: equal to the row's `step`, "
                                   "which the learner keeps across restarts.", row=None, tracker=None)] = 0
    step_s: Annotated[float, published("Seconds of the train step (excluding the push).", tracker="perf/step_s",
                                       prom=Prom("areal_like_learner_step_seconds", "Seconds of one training step "
                                                 "(excluding push)", kind="histogram"))] = NAN
    layout: Annotated[str, published("The pool's layout (d·p·t). Not in the row: fixed for the run, in "
                                     "config.json and the learner log.", row=None, tracker=None)] = ""
    device_mem_peak_gib: Annotated[float | None, published(
        "Learner rank 0's peak of allocated CUDA memory during the train step (GiB, "
        "`torch.cuda.max_memory_allocated`, reset at the step's start); None on CPU.",
        tracker="perf/device_mem_peak_gib")] = None


class PushResult(msgspec.Struct, kw_only=True):
    """One weight push (pause → buckets → continue) by any transport. Its seconds go to Prometheus from the
    pushers themselves (`areal_like_weight_push_seconds`, re-syncs included), not from the step's row."""

    push_s: Annotated[float, published("Seconds of the step's weight push (pause → continue).",
                                       tracker="perf/push_s")] = 0.0
    pause_window_s: Annotated[float | None, published(
        "Seconds the servers were paused for the push (None: the transport does not pause).",
        tracker="perf/pause_window_s")] = None
    bytes: Annotated[int | None, published(
        "Bytes the push carried (as sent: in the servers' dtype) — with LoRA the adapter alone; None for a "
        "transport that does not count them.", row="push_bytes", tracker="perf/push_bytes")] = None
    buckets: Annotated[int, published("Buckets (`weights.bucket_mb`) or files the push was sent in.",
                                      row="push_buckets", tracker="perf/push_buckets")] = 0
    write_s: Annotated[float | None, published("Disk and LoRA pushes: seconds writing the files before the servers "
                                               "paused.", row="push_write_s", tracker="perf/push_write_s")] = None
    fill_s: Annotated[float | None, published("Shared-memory pushes: seconds filling the segments.",
                                              row="push_fill_s", tracker="perf/push_fill_s")] = None
    load_s: Annotated[float | None, published("Shared-memory pushes: seconds the servers took to load them.",
                                              row="push_load_s", tracker="perf/push_load_s")] = None
    adapter: Annotated[bool, published("The push carried a LoRA adapter only (`model.lora_rank` > 0).",
                                       row="push_adapter", tracker=None)] = False
    per_rank: Annotated[bool, published("Co-located CUDA-IPC pushes: each learner rank handed its own GPU's copy.",
                                        row="push_per_rank", tracker=None)] = False
    delta: Annotated[bool, published("The push sent only the elements that changed since the version every server "
                                     "held (`weights.sync=delta`); false: the whole model (the first push, after a "
                                     "server restart, a failed push or with `weights.sync=full`).",
                                     row="push_delta", tracker=None)] = False
    changed: Annotated[float | None, published(
        "Delta pushes: the fraction of the model's elements whose bytes (in the servers' dtype) changed since the "
        "previous push.", row="push_changed", tracker="perf/push_changed")] = None
    checked: Annotated[int | None, published(
        "`weights.check_every`: tensors whose checksum on every server was found equal to what a full push of "
        "the version sends (None: not checked at this push).", row="push_checked", tracker=None)] = None
    path: Annotated[str | None, published("Disk pushes: the version directory the servers loaded. Not in the row: "
                                          "a path under the run directory, in the learner log.", row=None,
                                          tracker=None)] = None
