"""`Trainer`: the one RL trainer — decoupled PPO over a DP × PP × TP learner pool (one process is d1p1t1).

Every rank of the pool runs the same code on the same global batch of groups:

    groups (identical on every rank: rank 0 read them, `broadcast_groups` sent msgpack bytes)
      ─► samples, rewards (+ DAPO overlong shaping) ─► minibatches (train.ppo_minibatches)
      ─► this dp rank's share of every minibatch                  (batching.py; token-balanced)
      ─► forward-only passes over the share, before any update:
           π_prox (train.proximal=recompute, when a step has > 1 optimizer step), π_ref (any KL on),
           V_old (critic, adv_estimator=gae)
      ─► advantages (algorithm.adv_estimator; KL-in-reward; whitening with dp-global moments)
      ─► for each epoch, for each minibatch:                       (train.ppo_epochs × ppo_minibatches)
           actor: forward/backward (micro-batches, or a 1F1B/GPipe schedule when p > 1; TP inside)
                  ─► dp gradient all-reduce ─► global grad norm, clip ─► finite check ─► AdamW step
           critic: the same with the clipped value loss, its own optimizer and LR
      ─► stats reduced over dp and pp

π_prox: `recompute` is AReaL's default — the learner's logprobs with the step's starting weights.
With one optimizer step per train_step the weights being differentiated *are* those weights, so
π_θ.detach() is used and the extra forward pass is skipped (identical up to float rounding).
`loglinear` interpolates from per-token versions (no forward pass); `behaviour` sets π_prox = π_behav.

The actor, the critic (a value head on the same architecture) and the frozen reference share the
layout: `learner/model.py` builds each (load → convert → parallelize) into a `ShardedModel` — this
rank's pipeline stage, TP-sharded and, with `train.dp_sharding=full|grad_op` (FSDP2), dp-sharded,
with its own optimizer and gradient reduction. The converters (learner/converters.py: the critic's
`ValueHead`, the actor's `LoraConverter` with `model.lora_rank` > 0) decide what the step asks of
them: a context for the differentiated forward, the frozen base as the KL reference, what a push
reads. Only the last pipeline stage computes losses, advantages and the outputs of forward-only
passes; the others move activations. Under FSDP every dp rank runs as many micro-batches as the
others (padding batches fill the shorter ones).

Memory: no [tokens × vocab] logits. A language model's last stage returns its final hidden states;
logprobs (and the entropy statistic) run `lm_head` on `train.logits_chunk_tokens` loss positions at
a time, each chunk recomputed in backward (`logprobs.chunked_token_logprobs`); forward-only passes
stream their micro-batches, keeping per-token results only. `model.enable_gradient_checkpointing`
recomputes each decoder layer of the actor and critic in backward (parallelize.py, step 3).

What this module does not do: no buffer reads (the caller passes groups), no weight transport
(`weight_source` lets rank 0's pusher read the actor's full tensors one bucket at a time), no process-group init; batching,
the LR schedule and checkpoints live beside it (batching.py, schedule.py, checkpoint.py).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from areal_like.api.config import (
    AlgorithmConfig,
    CriticConfig,
    ExperimentConfig,
    RefConfig,
    TeacherConfig,
    RewardShapingConfig,
    TrainConfig,
)
from areal_like.api.step_stats import TrainStats
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.buffer.staleness import max_trained_staleness
from areal_like.learner import algorithms as A
from areal_like.learner.batching import (
    CH_ADV,
    CH_BEHAV,
    CH_IDS,
    CH_MASK,
    CH_OLD_VALUE,
    CH_PROX,
    CH_REF,
    CH_RETURN,
    CH_VERSION,
    NUM_CHANNELS,
    MicroBatch,
    SampleArrays,
    dp_share,
    loss_tokens_of,
    minibatches,
    pack,
    step_skip_reason,
    unpack_rows,
)
from areal_like.learner.converters import ValueHead
from areal_like.learner.logprobs import chunked_token_logprobs, fp32_lm_head as use_fp32_lm_head
from areal_like.learner.lora import LoraConverter, LoraSettings
from areal_like.learner.model import build_model, effective_dp_sharding
from areal_like.learner.parallel.layout import LayoutSpec, ParallelLayout
from areal_like.learner.parallel.parallelize import build_pipeline_schedule
from areal_like.learner.parallel.sharded_model import ShardedModel
from areal_like.learner.schedule import lr_at

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Actor stats: token-weighted sums (each micro-batch adds mean × its share of the minibatch's loss
# tokens) and maxima; reduced over pp and dp, then averaged over the step's optimizer steps.
_SUM_STATS = ("loss", "clipfrac", "approx_kl", "ratio_mean", "behav_w_mean", "behav_tokens_capped", "dual_clipfrac",
              "entropy", "kl_ref", "adv_abs_mean", "mm_abs_sum", "mm_k3_sum", "mm_outside", "mm_tokens")
_MSG_ENC = msgspec.msgpack.Encoder()  # the critic pool's messages (learner/critic_link.py)
_MAX_STATS = ("behav_w_max", "ratio_max", "neg_behav_w_min", "mm_abs_max")
_COUNT_STATS = ("behav_tokens_capped", "mm_abs_sum", "mm_k3_sum", "mm_outside", "mm_tokens")  # sums, not means


def reverse_kl_tokens(samples: list[Trajectory], teacher: str | None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """On-policy distillation: per sample, the per-token reverse KL of the sampled tokens to the teacher,
    log π_behav − log π_teacher, on loss tokens (0 elsewhere), and the loss mask (position 0 never a loss
    token). A sample without teacher logprobs is refused, naming the teacher (`teacher.model_path`)."""
    rkl_N, mask_N = [], []
    for s in samples:
        lp = s.teacher_logprobs_np()
        if lp is None:
            raise ValueError(f"trajectory {s.traj_id} carries no teacher logprobs, but this run distills from a "
                             f"teacher (teacher.model_path={teacher}): its group was written by a rollout worker "
                             f"without the teacher pool")
        m = s.mask_np().astype(np.float32)
        m[0] = 0.0
        mask_N.append(m)
        rkl_N.append((s.logprobs_np() - lp) * m)
    return rkl_N, mask_N


class Trainer:
    """One rank of the learner pool (or the whole learner, for d1p1t1). Construct it on every rank
    with the same arguments; call every method on every rank (they are collective).

    `layout` is a `ParallelLayout` (already built on the pool's process group), a `LayoutSpec`, a
    layout string like "d2p1t1"/allocation string, or None (single process, no torch.distributed).
    """

    def __init__(
        self,
        model_path: str,
        train_cfg: TrainConfig,
        layout: ParallelLayout | LayoutSpec | str | None = None,
        *,
        temperature: float,
        device: str = "cpu",
        dtype: str = "float32",
        algorithm: AlgorithmConfig | None = None,
        critic: CriticConfig | None = None,
        ref: RefConfig | None = None,
        reward: RewardShapingConfig | None = None,
        max_new_tokens: int | None = None,
        compute_entropy: bool | None = None,
        gradient_checkpointing: bool = False,
        fp32_lm_head: bool = False,
        lora: LoraSettings | None = None,
        teacher: TeacherConfig | None = None,
        role: str = "actor",
        critic_pool: bool = False,
    ) -> None:
        """`role`: "actor" (the policy, with its critic, reference and teacher signal), or "critic": a critic
        pool's trainer (the value model alone; `critic_values`, `critic_train`). `critic_pool` (the actor's):
        the critic trains on a pool of its own (`fsdp[critic]` in the allocation) — `train_step` fetches
        its values through rank 0's `remote_critic` (a `CriticLink`) instead of building one here."""
        if role not in ("actor", "critic"):
            raise ValueError(f"role must be actor or critic, got {role!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported: use one of {sorted(DTYPES)} (model.dtype)")
        md = train_cfg.master_dtype
        if md not in DTYPES or (md != "float32" and md != dtype):
            raise ValueError(f"train.master_dtype={md} with model.dtype={dtype}: use train.master_dtype=float32 "
                             f"(or train.master_dtype={dtype}, a pure {dtype} optimizer)")
        if train_cfg.micro_batch_tokens < 2:
            raise ValueError("train.micro_batch_tokens must be ≥ 2: set train.micro_batch_tokens=8192")
        if train_cfg.logits_chunk_tokens < 0:
            raise ValueError(f"train.logits_chunk_tokens={train_cfg.logits_chunk_tokens}: use ≥ 1 (e.g. 1024), "
                             f"or 0 (unchunked)")
        if not isinstance(layout, ParallelLayout):
            spec = layout if isinstance(layout, LayoutSpec) else (
                LayoutSpec() if layout is None else LayoutSpec.from_string(layout))
            layout = ParallelLayout(spec, timeout_s=train_cfg.collective_timeout_s,
                                    device_type=torch.device(device).type)
        self.layout = layout
        layout.on_command = self.serve_command  # rank 0's weight reads, joined from leader_ready waits
        self._packer = None  # a follower's side of per-GPU handoffs (weights.ipc.BucketPacker), once one ran
        self.cfg = train_cfg
        self.rejection = train_cfg.rejection_settings()  # train.rejection_sampling resolved; None = off
        self.alg = algorithm or AlgorithmConfig()
        self.critic_cfg = critic or CriticConfig()
        self.reward_cfg = reward or RewardShapingConfig()
        # On-policy distillation (teacher.*): every sample carries the teacher's logprobs; its per-token reverse
        # KL enters the advantage (`_advantages`). None without a teacher.
        self.teacher = teacher if teacher is not None and teacher.model_path else None
        self._teacher_kl: float | None = None  # the last step's mean, for TrainStats
        self.model_path = model_path
        self.temperature = float(temperature)
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.compute_entropy = train_cfg.compute_entropy if compute_entropy is None else compute_entropy
        self.max_new_tokens = max_new_tokens
        if self.reward_cfg.overlong_buffer_len > 0 and max_new_tokens is None:
            raise ValueError("reward.overlong_buffer_len needs the generation length: pass max_new_tokens")
        self.loss_norm_const = train_cfg.loss_norm_const or float(max_new_tokens or 0) or None

        torch.manual_seed(train_cfg.seed)  # same seed on every rank: identical RNG streams
        self.gradient_checkpointing = bool(gradient_checkpointing)
        self.dp_sharding = effective_dp_sharding(train_cfg.dp_sharding, layout)
        build = dict(train_cfg=train_cfg, compute_dtype=self.dtype, master_dtype=DTYPES[md], device=self.device,
                     dp_sharding=self.dp_sharding, checkpoint_layers=self.gradient_checkpointing)
        self.role = role
        self.critic_pool = bool(critic_pool) and role == "actor"
        self.remote_critic = None  # rank 0 of an actor pool with a critic pool: its `CriticLink` (main.py sets it)
        self.lora = lora if role == "actor" else None  # model.lora_rank > 0: the actor trains a LoRA adapter
        adapter = () if self.lora is None else (LoraConverter(self.lora, base_model=model_path, seed=train_cfg.seed),)
        self.actor: ShardedModel | None = None
        if role == "actor":
            self.actor = build_model(model_path, "actor", layout, converters=adapter,
                                     param_offload=train_cfg.param_offload,
                                     optimizer_offload=train_cfg.optimizer_offload, **build)
        self.fp32_lm_head = bool(fp32_lm_head)
        self.critic: ShardedModel | None = None
        c = self.critic_cfg
        if role == "critic" or (self.alg.adv_estimator == "gae" and not self.critic_pool):
            self.critic = build_model(c.path or model_path, "critic", layout, converters=(ValueHead(),),
                                      param_offload=c.param_offload, optimizer_offload=c.optimizer_offload, **build)
        self.config = (self.actor or self.critic).config
        self.pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        self.ref: ShardedModel | None = None
        r = ref or RefConfig()
        kl = role == "actor" and (self.alg.kl_loss_on or self.alg.kl_reward_on)
        # An actor with a frozen base (LoRA: its adapter disabled) is its own KL reference, unless ref.path
        # names another model: no second copy of the weights (verl's way)
        self.ref_is_base = bool(kl and self.actor and self.actor.conversion.has_frozen_base and r.path in (None, model_path))
        if kl and not self.ref_is_base:
            self.ref = build_model(r.path or model_path, "reference", layout, param_offload=r.param_offload, **build)
        if self.fp32_lm_head:  # model.fp32_lm_head: logits in fp32 (actor and reference; the critic has no LM head)
            for m in (self.actor, self.ref):
                if m is not None and m.head is not None:
                    use_fp32_lm_head(m.head)
        # MoE routing replay (train.routing_replay, learner/moe.py): the actor's routers patched to take given experts
        self.routing_replay = train_cfg.routing_replay if self.actor is not None else "off"
        self._replay = None
        self._routes: dict[int, np.ndarray] = {}  # this step's routes per sample (rollout: recorded by the servers)
        if self.routing_replay != "off":
            from areal_like.learner.moe import RouterReplay

            self._replay = RouterReplay(self.actor.stage_module, self.config)
            self.actor.stage_module.router_replay = self._replay
            if not self._replay.routers and layout.pp == 1:  # (a pipeline stage of dense layers has none)
                raise ValueError(f"train.routing_replay={self.routing_replay}: {model_path} is not a mixture-of-experts "
                                 "model (no router to replay); set train.routing_replay=off")
        if self.is_rank0:
            log.info("learner precision: %s", self.precision_policy)
            if md == dtype != "float32":
                log.warning("train.master_dtype=%s: pure %s optimizer — master weights, gradient reduction and "
                            "AdamW state in %s (updates below its precision round away); float32 is the default",
                            md, md, md)
        self.step = 0  # train_step calls completed (skipped ones included: their groups are consumed)
        self.skipped_steps = 0  # optimizer steps skipped by the finite check
        self.version = -1  # policy version of the weights last trained

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, layout: ParallelLayout | LayoutSpec | str | None, *,
                    device: str = "cpu", role: str = "actor") -> "Trainer":
        """`role` "actor": the actor pool's trainer (a critic pool in `cfg.allocation` — a `critic` component —
        takes the critic out of it); "critic": that critic pool's."""
        from allocation import parse_allocation

        critic_pool = any(c.role == "critic" for c in parse_allocation(cfg.allocation).training_components)
        return cls(cfg.model.path, cfg.train, layout, temperature=cfg.generation.temperature, device=device,
                   dtype=cfg.model.dtype, algorithm=cfg.algorithm, critic=cfg.critic, ref=cfg.ref,
                   reward=cfg.reward, max_new_tokens=cfg.generation.max_new_tokens,
                   gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
                   lora=LoraSettings.from_model_config(cfg.model),
                   fp32_lm_head=cfg.model.fp32_lm_head, teacher=cfg.teacher, role=role, critic_pool=critic_pool)

    @property
    def memory_policy(self) -> str:
        """One line: activation checkpointing and the logits chunk (logged at start)."""
        chunk = self.cfg.logits_chunk_tokens
        models = ", ".join(m.role for m in (self.actor, self.critic) if m is not None)
        return (f"gradient checkpointing {'on' if self.gradient_checkpointing else 'off'} ({models}); "
                + (f"logits in chunks of {chunk} tokens" if chunk else "logits unchunked"))

    @property
    def sharding_policy(self) -> str:
        """One line: how the dp ranks split the models (logged at start)."""
        return self._dp_policy + self._expert_policy

    @property
    def _expert_policy(self) -> str:
        L = self.layout
        if L.ep == 1:
            return ""
        from areal_like.learner.moe import expert_modules

        mods = expert_modules((self.actor or self.critic).stage_module)  # (a critic pool's trainer has no actor)
        E = mods[0][1].gate_up_proj.shape[0] if mods else 0
        edp = L.dp * L.tp // L.ep
        return (f"; experts split over ep={L.ep} (all-to-all dispatch): {E // L.ep} of {E} per MoE layer on each rank"
                + (f", replicated over {edp} ranks holding the same experts, their gradients all-reduced there"
                   if edp > 1 else "") + (f"; each of the {L.tp} tp ranks dispatches 1/{L.tp} of the tokens" if L.tp > 1 else ""))

    @property
    def _dp_policy(self) -> str:
        L, req = self.layout, self.cfg.dp_sharding
        if self.dp_sharding == "none":
            why = "" if req == "none" else f" (train.dp_sharding={req}: nothing to shard over at dp={L.dp})"
            return f"replicated over dp={L.dp}, gradients all-reduced{why}"
        zero = {"full": "ZeRO-3: parameters gathered per layer, freed after forward",
                "grad_op": "ZeRO-2: gathered parameters kept from forward to backward"}[self.dp_sharding]
        off = [f"{m.role} {what}" for m in (self.actor, self.critic, self.ref) if m is not None
               for what, on in (("parameters", m.param_offload), ("AdamW state", m.optimizer_offload)) if on]
        return (f"FSDP2 over dp={L.dp} (train.dp_sharding={self.dp_sharding}, {zero}); parameters, "
                f"gradients and AdamW state in 1/{L.dp} shards" + (f"; offloaded to host: {', '.join(off)}" if off else ""))

    @property
    def precision_policy(self) -> str:
        """One line: compute, master, grad-reduce and optimizer-state dtypes (logged at start)."""
        c = str(self.dtype).removeprefix("torch.")
        m = self.cfg.master_dtype
        return f"compute {c}, master {m}, grad reduce {m}, AdamW state {m}" + (", LM head fp32" if self.fp32_lm_head else "")

    @property
    def lora_policy(self) -> str:
        """What the actor's converters (`model.lora_*`) made of it (logged once by rank 0); "" without LoRA."""
        return self.actor.conversion.describe(self.actor, base_is_reference=self.ref_is_base)

    @property
    def has_ref(self) -> bool:
        """A KL term's reference logprobs are computed: a reference model, or the LoRA actor's base."""
        return self.ref is not None or self.ref_is_base

    @property
    def is_rank0(self) -> bool:
        return self.layout.rank == 0

    @property
    def optimizer_steps(self) -> int:
        return (self.actor or self.critic).optimizer_steps

    @property
    def trains_critic(self) -> bool:
        """GAE's critic is trained, here or on a critic pool."""
        return self.critic is not None or self.critic_pool

    def _total_optimizer_steps(self) -> int:
        return self.cfg.total_steps * self.cfg.ppo_epochs * self.cfg.ppo_minibatches

    # ---- forward-only passes (before any update) -------------------------------------------------
    def _micro_batches(self, shard: ShardedModel, samples: list[Trajectory], rows: list[int],
                       channels: dict[int, SampleArrays] | None = None) -> list[MicroBatch | None]:
        """This dp rank's micro-batches of `rows`. Under FSDP every dp rank must run as many
        forwards (and backwards) as the others — each one all-gathers and reduce-scatters over dp —
        so the shorter lists are filled up with `None` (a one-row padding batch that adds nothing)
        to the dp maximum (one small host all-reduce)."""
        replay = self._replay is not None and shard is self.actor
        mbs: list[MicroBatch | None] = list(pack(samples, rows, channels, micro_batch_tokens=self.cfg.micro_batch_tokens,
                                                 pad_id=self.pad_id, device=self.device,
                                                 routes=self._routes if replay else None,
                                                 routes_width=self._replay.layers * self._replay.top_k if replay else 0))
        if shard.lockstep:
            n = self._dp_max(len(mbs))
            mbs += [None] * (n - len(mbs))
        return mbs

    def _dp_max(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.layout.group_for(t, "dp"))
        return int(t.item())

    def _filler(self) -> MicroBatch:
        """A (1, 2) all-padding micro-batch with loss mask 0: keeps a dp rank in step under FSDP."""
        return MicroBatch(input_ids_BT=torch.full((1, 2), self.pad_id, dtype=torch.int64, device=self.device),
                          targets_BT1C=torch.zeros((1, 1, NUM_CHANNELS), device=self.device), rows=[], num_tokens=[])

    @torch.no_grad()
    def _forward_only(self, shard: ShardedModel, samples: list[Trajectory], rows: list[int], keep) -> SampleArrays:
        """Per-token results of `rows`, streamed: each micro-batch's last-stage output goes through
        `keep(mb, y) -> per-token tensor (B, T−1)` at once and is dropped (never every micro-batch's
        output at once). With p > 1 the stages pass activations with point-to-point sends inside the
        pp group (GPipe order, forward only); only the last stage returns results."""
        L = self.layout
        arrays: SampleArrays = {}
        for mb in self._micro_batches(shard, samples, rows):
            mb = mb or self._filler()
            B, T = mb.input_ids_BT.shape
            if L.pp == 1 or L.is_first_stage:
                x = mb.input_ids_BT
            else:
                x = torch.empty(B, T, shard.config.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(x, group=L.pp_group, group_src=L.pp_rank - 1)
            replay = self._replay is not None and shard is self.actor
            y = shard.stage_module(x, routes_BTW=mb.routes_BTW) if replay else shard.stage_module(x)
            if L.is_last_stage:
                out = keep(mb, y)  # a padding micro-batch too: a vocab-parallel head is collective over dp
                if mb.rows:
                    arrays.update(unpack_rows(mb, out))
            else:
                dist.send(y.contiguous(), group=L.pp_group, group_dst=L.pp_rank + 1)
            del y
            if replay:  # (after the send: with p > 1 it joins the stages' records over the pipeline)
                self._record_routes(mb)
        shard.reshard()  # FSDP keeps the root's gathered parameters after a forward: free them
        return arrays

    def _forward_logprobs(self, shard: ShardedModel, samples: list[Trajectory], rows: list[int]) -> SampleArrays:
        """π's logprobs on the loss positions (0 elsewhere), the head run in token chunks."""
        def keep(mb, h_BTH):
            lp, _ = chunked_token_logprobs(h_BTH[:, :-1], shard.head, mb.input_ids_BT[:, 1:], self.temperature,
                                           positions_BT=mb.loss_mask_BT1 > 0,
                                           chunk_tokens=self.cfg.logits_chunk_tokens)
            return lp

        return self._forward_only(shard, samples, rows, keep)

    def _measure_routing(self, samples: list[Trajectory]) -> tuple[float, float]:
        """train.routing_replay_measure: (mean |Δ log p| with the servers' routes, the same without) over the loss
        tokens of this step's samples that carry routes, the step's starting weights, summed over dp. Two
        forward-only passes over those samples."""
        rows = sorted(self._routes)
        replayed = self._forward_logprobs(self.actor, samples, rows)
        saved, self._routes = self._routes, {}  # the actor's own router
        own = self._forward_logprobs(self.actor, samples, rows)
        self._routes = saved
        t = torch.zeros(3, dtype=torch.float64)
        for i in rows:
            if i in replayed:  # the last stage's (p1: every rank's)
                m = samples[i].mask_np().astype(np.float64)
                m[0] = 0.0
                b = samples[i].logprobs_np().astype(np.float64)
                t[0] += float((np.abs(replayed[i] - b) * m).sum())
                t[1] += float((np.abs(own[i] - b) * m).sum())
                t[2] += float(m.sum())
        t = self._reduce(t.to(self.device))[0].cpu()  # over dp and the stages (p > 1: the last stage's logprobs)
        n = float(t[2])
        return (float(t[0]) / n, float(t[1]) / n) if n else (float("nan"), float("nan"))

    def _record_routes(self, mb: MicroBatch) -> None:
        """train.routing_replay=behaviour, in the pass that records: the experts the actor's routers chose
        for each position of this micro-batch's rows (positions [0, n − 1), as the servers record them)."""
        if self.routing_replay != "behaviour" or mb.routes_BTW is not None or not mb.rows:
            return
        B, T = mb.input_ids_BT.shape
        ids = self._replay.recorded(B * T, self.device)
        if self.layout.pp > 1:  # each stage recorded its own layers (zeros elsewhere): joined over the pipeline
            dist.all_reduce(ids, group=self.layout.pp_group)
        ids = ids.reshape(B, T, -1).cpu().numpy()
        for b, (i, n) in enumerate(zip(mb.rows, mb.num_tokens)):
            self._routes[i] = ids[b, :n - 1]

    def _forward_values(self, shard: ShardedModel, samples: list[Trajectory], rows: list[int]) -> SampleArrays:
        return self._forward_only(shard, samples, rows, lambda mb, v_BT1: v_BT1[:, :-1, 0])

    # ---- advantages (last pipeline stage) -------------------------------------------------------
    def _dp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the dp group: host-side stats (CPU tensors) on the gloo host group, never NCCL."""
        if self.layout.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.layout.group_for(t, "dp"))
        return t

    def _moments_fn(self, moments):
        stacked = self._dp_sum(torch.stack([m.double() for m in moments]))  # float64: exact zero variance
        return stacked[0], stacked[1], stacked[2]

    def _advantages(self, samples: list[Trajectory], mine: list[int], scores_N: np.ndarray,
                    group_index_N: np.ndarray, channels: dict[int, SampleArrays],
                    opd: tuple[list[np.ndarray], list[np.ndarray]] | None = None
                    ) -> tuple[SampleArrays, SampleArrays]:
        """`_reward_advantages`, and with a teacher (on-policy distillation, teacher.*) each loss token's
        advantage A_t ← reward_weight · A_t − kl_coef · (log π_behav(y_t) − log π_teacher(y_t)): the per-token
        reverse KL of the sampled token (slime's OPD), from the behaviour logprobs the servers returned; `opd`:
        `reverse_kl_tokens(samples)` when the step computed it already."""
        adv, returns = self._reward_advantages(samples, mine, scores_N, group_index_N, channels)
        t = self.teacher
        if t is None:
            return adv, returns
        rkl_N, mask_N = opd if opd is not None else reverse_kl_tokens(samples, t.model_path)
        sums = np.array([r.sum() for r in rkl_N], dtype=np.float64)
        counts = np.array([m.sum() for m in mask_N], dtype=np.float64)
        base = np.zeros(len(samples), dtype=np.float64)
        if t.baseline == "group":  # leave-one-out mean per-token reverse KL of the group's other samples
            g_sum = np.bincount(group_index_N, weights=sums)
            g_cnt = np.bincount(group_index_N, weights=counts)
            other_sum, other_cnt = g_sum[group_index_N] - sums, g_cnt[group_index_N] - counts
            base = np.where(other_cnt > 0, other_sum / np.maximum(other_cnt, 1), 0.0)
        for i in adv:
            a = -t.kl_coef * (rkl_N[i] - base[i] * mask_N[i])
            adv[i] = (t.reward_weight * adv[i] + a).astype(np.float32)
        return adv, returns

    def _reward_advantages(self, samples: list[Trajectory], mine: list[int], scores_N: np.ndarray,
                           group_index_N: np.ndarray, channels: dict[int, SampleArrays]
                           ) -> tuple[SampleArrays, SampleArrays]:
        """Per-token advantages (and critic returns for gae) of this rank's samples.

        Token rewards: the sequence score on the last loss token, minus kl_reward_coef·KL(π ‖ π_ref)
        on every loss token when the KL is in the reward (π = π_prox if recomputed, else π_behav).
        Sequence estimators see the sum of a sample's token rewards as its score (as verl). Whitening
        uses moments summed over the dp group, so the result does not depend on the layout."""
        alg = self.alg
        n_tok = [samples[i].num_tokens for i in mine]
        T = max(n_tok, default=1)
        B = len(mine)
        mask_BT = np.zeros((B, T), dtype=np.float32)
        for b, i in enumerate(mine):
            m = samples[i].mask_np().astype(np.float32)
            m[0] = 0.0  # position 0 is never a loss token
            mask_BT[b, :n_tok[b]] = m
        scores = scores_N.astype(np.float64).copy()
        kl_BT = np.zeros((B, T), dtype=np.float32)
        if alg.kl_reward_on:
            pi = channels.get(CH_PROX)
            for b, i in enumerate(mine):
                logp = pi[i] if pi is not None and i in pi else samples[i].logprobs_np()
                k = A.kl_estimate(torch.from_numpy(np.array(logp, np.float32)),
                                  torch.from_numpy(channels[CH_REF][i]), alg.kl_estimator).numpy()
                kl_BT[b, :n_tok[b]] = k * mask_BT[b, :n_tok[b]]
            kl_sum_N = np.zeros(len(samples), dtype=np.float64)
            kl_sum_N[mine] = kl_BT.sum(1)
            kl_sum_N = self._dp_sum(torch.from_numpy(kl_sum_N)).numpy()  # every rank: every sample's KL sum
            scores = scores - alg.kl_reward_coef * kl_sum_N
        adv: SampleArrays = {}
        returns: SampleArrays = {}
        est = alg.adv_estimator
        g_idx = torch.from_numpy(group_index_N)
        if est in ("grpo", "dr_grpo", "rloo"):
            s = torch.from_numpy(scores)
            seq = (A.rloo_advantages(s, g_idx) if est == "rloo"
                   else A.grpo_advantages(s, g_idx, norm_std=est == "grpo")).numpy()
            for b, i in enumerate(mine):
                adv[i] = (seq[i] * mask_BT[b, :n_tok[b]]).astype(np.float32)
            return adv, returns
        # Token-level estimators: rewards per token, whitened over the (dp-global) batch.
        last = [int(np.flatnonzero(mask_BT[b])[-1]) if mask_BT[b].any() else -1 for b in range(B)]
        r_BT = -alg.kl_reward_coef * kl_BT if alg.kl_reward_on else np.zeros((B, T), np.float32)
        raw = scores_N.astype(np.float64)
        for b, i in enumerate(mine):
            if last[b] >= 0:
                r_BT[b, last[b]] += raw[i]
        r_t, m_t = torch.from_numpy(r_BT), torch.from_numpy(mask_BT)
        if est == "reinforce_plus_plus":
            a_BT, _ = A.reinforce_pp_token_advantages(r_t, m_t, gamma=alg.gamma, moments_fn=self._moments_fn)
        elif est == "reinforce_plus_plus_baseline":
            a_BT = A.reinforce_pp_baseline_token_advantages(torch.from_numpy(scores), g_idx, m_t,
                                                           rows_B=torch.tensor(mine, dtype=torch.long),
                                                           moments_fn=self._moments_fn)
        elif est == "gae":
            v_BT = np.zeros((B, T), dtype=np.float32)
            for b, i in enumerate(mine):
                v_BT[b, :n_tok[b]] = channels[CH_OLD_VALUE][i]
            a_raw, ret_BT = A.gae_advantages(r_t, torch.from_numpy(v_BT), m_t, gamma=alg.gamma, lam=alg.lam)
            a_BT = A.masked_whiten(a_raw, m_t, moments=self._moments_fn(A.masked_moments(a_raw, m_t)))
            for b, i in enumerate(mine):
                returns[i] = ret_BT[b, :n_tok[b]].numpy().astype(np.float32)
        else:
            raise ValueError(f"unknown algorithm.adv_estimator {est!r}")
        for b, i in enumerate(mine):
            adv[i] = a_BT[b, :n_tok[b]].numpy().astype(np.float32)
        return adv, returns

    # ---- losses -----------------------------------------------------------------------------------
    def _proximal(self, logp_BT1: torch.Tensor, tgt: torch.Tensor, version: int, recomputed: bool) -> torch.Tensor:
        mode = self.cfg.proximal
        if mode == "behaviour":
            return tgt[..., CH_BEHAV]
        if mode == "loglinear":
            alpha = A.loglinear_alpha(tgt[..., CH_VERSION], v_prox=version, v_theta=version + 1)
            return A.loglinear_proximal(tgt[..., CH_BEHAV], logp_BT1, alpha)
        return tgt[..., CH_PROX] if recomputed else logp_BT1.detach()  # see the module docstring

    def _actor_loss_fn(self, acc: dict[str, torch.Tensor], loss_tokens: int, num_seqs: int, version: int,
                       recomputed: bool, measure: bool):
        """loss(hidden (B, T, H), targets (B, T−1, C)) of one micro-batch; accumulates its stats.

        The logprobs (and entropy) come from the last hidden states through `lm_head` in chunks of
        `train.logits_chunk_tokens` loss positions (0 elsewhere): no [B × T × V] logits.

        The learner's logprobs with the step's starting weights are the recomputed π_prox where that
        pass ran, else this call's own logp on the step's first optimizer step: against π_behav they
        give the mismatch statistics (`measure`: count this call's tokens, once per step) and, with
        standard PPO (π_prox = π_behav), what `train.rejection_sampling` judges."""
        cfg, alg = self.cfg, self.alg
        agg = dict(loss_tokens_global=loss_tokens, num_seqs_global=num_seqs, loss_norm_const=self.loss_norm_const)
        head = self.actor.head
        want_entropy = self.compute_entropy or alg.entropy_coef > 0

        def loss_fn(h_BTH: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            mask = tgt[..., CH_MASK]
            logp, ent_BT1 = chunked_token_logprobs(h_BTH[:, :-1], head, tgt[..., CH_IDS].long(), self.temperature,
                                                   positions_BT=mask > 0, chunk_tokens=cfg.logits_chunk_tokens,
                                                   with_entropy=want_entropy, entropy_grad=alg.entropy_coef > 0)
            prox = self._proximal(logp, tgt, version, recomputed)
            start = tgt[..., CH_PROX] if recomputed else logp.detach()  # the learner at the step's start
            if measure:
                mm = A.mismatch_sums(start, tgt[..., CH_BEHAV], mask)
                for k in ("abs_sum", "k3_sum", "outside", "tokens"):
                    acc[f"mm_{k}"] += mm[k]
                acc["mm_abs_max"] = torch.maximum(acc["mm_abs_max"], mm["abs_max"])
            rs = self.rejection
            loss, st = A.decoupled_ppo_loss(
                logp, prox, tgt[..., CH_BEHAV], tgt[..., CH_ADV], mask,
                eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high,
                behav_imp_weight_cap=None if rs else cfg.behav_imp_weight_cap, behav_mode=cfg.behav_imp_weight_mode,
                dual_clip_c=cfg.dual_clip_c, agg=cfg.loss_agg_mode, rejection=rs,
                logp_correct=start if rs and cfg.proximal == "behaviour" else None, **agg)
            frac = st["loss_tokens"] / max(loss_tokens, 1)
            for name in ("clipfrac", "approx_kl", "ratio_mean", "behav_w_mean", "dual_clipfrac"):
                acc[name] += st[name] * frac
            acc["behav_tokens_capped"] += st["behav_frac_capped"] * st["loss_tokens"]
            for name in ("behav_w_max", "ratio_max"):
                acc[name] = torch.maximum(acc[name], st[name])
            on = mask > 0
            with torch.no_grad():
                w = torch.exp(torch.where(on, prox.detach().float() - tgt[..., CH_BEHAV], torch.zeros_like(mask)))
                w_min = torch.where(on, w, torch.full_like(w, float("inf"))).min()
                acc["neg_behav_w_min"] = torch.maximum(acc["neg_behav_w_min"],
                                                       torch.where(on.any(), -w_min, acc["neg_behav_w_min"]))
                acc["adv_abs_mean"] += (tgt[..., CH_ADV].abs() * mask).sum() / max(loss_tokens, 1)
            if self.has_ref:
                kl = A.kl_estimate(logp, tgt[..., CH_REF], alg.kl_estimator)
                kl = torch.where(on, kl, torch.zeros_like(kl))
                acc["kl_ref"] += (kl.detach() * mask).sum() / max(loss_tokens, 1)
                if alg.kl_loss_on and alg.kl_loss_coef > 0:
                    loss = loss + alg.kl_loss_coef * A.aggregate_loss(kl, mask, cfg.loss_agg_mode, **agg)
            if ent_BT1 is not None:
                ent = ent_BT1 if alg.entropy_coef > 0 else ent_BT1.detach()
                acc["entropy"] += (ent.detach() * mask).sum() / max(loss_tokens, 1)
                if alg.entropy_coef > 0:
                    loss = loss - alg.entropy_coef * A.aggregate_loss(ent, mask, cfg.loss_agg_mode, **agg)
            acc["loss"] += loss.detach()
            return loss

        return loss_fn

    def _critic_loss_fn(self, acc: dict[str, torch.Tensor], loss_tokens: int):
        c = self.critic_cfg

        def loss_fn(values_BT1: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
            v = values_BT1[:, :-1, 0].float()
            vf = A.ppo_value_loss(v, tgt[..., CH_OLD_VALUE], tgt[..., CH_RETURN], tgt[..., CH_MASK],
                                  value_clip=c.value_clip, loss_tokens_global=loss_tokens)
            acc["value_loss"] += vf.detach()
            return vf * c.loss_coef

        return loss_fn

    # ---- forward/backward -------------------------------------------------------------------------
    def _forward_backward(self, shard: ShardedModel, samples: list[Trajectory], rows: list[int],
                          channels: dict[int, SampleArrays], loss_fn) -> None:
        """Accumulate this rank's share of ∇L into `.grad` (before the dp all-reduce; FSDP
        reduce-scatters each micro-batch's as its backward runs)."""
        with shard.conversion.training(shard.stage_module):  # LoRA: its dropout
            self._forward_backward_inner(shard, samples, rows, channels, loss_fn)

    def _forward_backward_inner(self, shard: ShardedModel, samples: list[Trajectory], rows: list[int],
                                channels: dict[int, SampleArrays], loss_fn) -> None:
        if self.layout.pp == 1:
            replay = self._replay is not None and shard is self.actor
            for mb in self._micro_batches(shard, samples, rows, channels):
                mb = mb or self._filler()
                # with routes, each layer's router replays them (in a checkpointed layer's recomputation too)
                y = (shard.stage_module(mb.input_ids_BT, routes_BTW=mb.routes_BTW) if replay
                     else shard.stage_module(mb.input_ids_BT))
                loss = loss_fn(y, mb.targets_BT1C)
                if not loss.requires_grad:  # no loss position in this micro-batch: a zero gradient, so
                    loss = loss + 0.0 * y.float().sum()  # the backward (and FSDP's reduce-scatter) still runs
                loss.backward()
            return
        self._pipeline_forward_backward(shard, samples, rows, channels, loss_fn)

    def _pipeline_forward_backward(self, shard: ShardedModel, samples: list[Trajectory], rows: list[int],
                                   channels: dict[int, SampleArrays], loss_fn) -> None:
        """One pipeline schedule over this dp rank's share: one right-padded (B, T) batch split into
        n equal micro-batches (B padded with all-padding rows of loss mask 0, which add nothing)."""
        L = self.layout
        replay = self._replay is not None and shard is self.actor
        routes = None
        if rows:
            (mb,) = pack(samples, rows, channels, micro_batch_tokens=1 << 62, pad_id=self.pad_id,
                         device=self.device, single=True, routes=self._routes if replay else None,
                         routes_width=self._replay.layers * self._replay.top_k if replay else 0)
            ids_BT, tgt, routes = mb.input_ids_BT, mb.targets_BT1C, mb.routes_BTW
        else:  # no samples on this dp rank: the pipeline still runs (stages must pair their sends)
            ids_BT = torch.full((1, 2), self.pad_id, dtype=torch.int64, device=self.device)
            tgt = torch.zeros((1, 1, NUM_CHANNELS), device=self.device)
        B, T = ids_BT.shape
        n = self.cfg.pp_microbatches or max(L.pp, math.ceil(B * T / self.cfg.micro_batch_tokens))
        n = max(n, L.pp) if self.cfg.pp_schedule == "1f1b" else n
        if shard.lockstep:  # every dp rank of a stage runs as many micro-batches (FSDP's collectives pair up)
            n = self._dp_max(n)
        pad_rows = (-B) % n
        if pad_rows:
            ids_BT = torch.cat([ids_BT, torch.full((pad_rows, T), self.pad_id, dtype=ids_BT.dtype, device=self.device)])
            tgt = torch.cat([tgt, torch.zeros((pad_rows, T - 1, NUM_CHANNELS), device=self.device)])
            if routes is not None:  # padding rows route themselves (−1)
                routes = torch.cat([routes, routes.new_full((pad_rows, *routes.shape[1:]), -1)])
        # routing replay: every stage gets the batch's routes, split into micro-batches as the inputs are; the
        # same kind of call on every stage (a stage without routes of its own passes −1 everywhere)
        kw = {}
        if replay:
            kw["routes_BTW"] = routes if routes is not None else torch.full(
                (ids_BT.shape[0], T, self._replay.layers * self._replay.top_k), -1, dtype=torch.int64, device=self.device)
        schedule = build_pipeline_schedule(shard.stage_module, L, n_microbatches=n, loss_fn=loss_fn,
                                           schedule=self.cfg.pp_schedule, device=self.device,
                                           microbatch_shape=(ids_BT.shape[0] // n, T), out_dim=shard.out_dim)
        # return_outputs=False: the loss ran per micro-batch; the last stage keeps no merged outputs
        if L.is_first_stage:
            schedule.step(ids_BT, return_outputs=False, **kw)
        elif L.is_last_stage:
            schedule.step(target=tgt, return_outputs=False, **kw)
        else:
            schedule.step(return_outputs=False, **kw)

    def _reduce(self, sums: torch.Tensor, maxes: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stats of the global (mini)batch: sums over dp and pp (only the last stage computed a loss)."""
        L = self.layout
        for group, size in ((L.pp_group, L.pp), (L.dp_group, L.dp)):
            if size > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
                if maxes is not None:
                    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        return sums, maxes

    def _optimizer_step(self, shard: ShardedModel, loss_tokens: int, loss: torch.Tensor, base_lr: float,
                        extra: torch.Tensor) -> tuple[float, str, float, list[float]]:
        """dp all-reduce → norm + clip → finite check → step. Returns (grad norm, skip reason, lr, extra).

        Host sync: the ONLY one of an optimizer step — grad norm, loss and `extra` stats in one copy.
        Every rank holds the same reduced values, so every rank takes the same decision."""
        shard.reduce_grads()  # to the master dtype, then the dp all-reduce
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip and self.cfg.grad_clip > 0 else float("inf")
        norm = shard.grad_norm_and_clip(max_norm)
        fetched = torch.cat([torch.stack([norm.float(), loss.float()]), extra.float()]).tolist()
        grad_norm, loss_f, rest = fetched[0], fetched[1], fetched[2:]
        skip = step_skip_reason(loss_tokens, grad_norm, loss_f)
        lr = lr_at(self.cfg, shard.optimizer_steps, base_lr=base_lr, total_steps=self._total_optimizer_steps())
        if skip:
            if self.layout.rank == 0:
                log.warning("learner step %d: optimizer step skipped: %s", self.step + 1, skip)
            self.skipped_steps += 1
        else:
            assert shard.optimizer is not None
            for g in shard.optimizer.param_groups:
                g["lr"] = lr
            shard.step()  # AdamW, then master → model
        return grad_norm, skip, lr, rest

    # ---- the step ---------------------------------------------------------------------------------
    def train_step(self, groups: list[TrajectoryGroup], version: int) -> TrainStats:
        """ppo_epochs × ppo_minibatches optimizer steps of the whole pool on `groups` (identical on
        every rank). Returns the same `TrainStats` on every rank (api/step_stats.py).

        `version` is the policy version of the weights this step starts from (π_prox); the updated
        weights become version + 1 once the caller has pushed them (DESIGN invariant 1). An
        optimizer step whose gradient is not finite (or that has no loss tokens) is skipped with a
        logged reason, leaving weights and optimizer state untouched; its groups still count as consumed.
        """
        if not groups:
            raise ValueError("train_step needs at least one group")
        t0 = time.perf_counter()
        L, cfg = self.layout, self.cfg
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        # 1. samples, rewards (+ overlong shaping), minibatches and this dp rank's share of each
        samples = [t for g in groups for t in g.trajectories]
        group_index_N = np.repeat(np.arange(len(groups)), [len(g.trajectories) for g in groups])
        rewards_N = np.asarray([t.reward for t in samples], dtype=np.float64)
        scores_N = rewards_N.copy()
        rs = self.reward_cfg
        if rs.overlong_buffer_len > 0:
            lengths = torch.tensor([t.num_tokens - t.prompt_len for t in samples], dtype=torch.float32)
            scores_N += A.overlong_penalty(lengths, max_len=int(self.max_new_tokens or 0),
                                           buffer_len=rs.overlong_buffer_len,
                                           penalty_factor=rs.overlong_penalty_factor).double().numpy()
        mbs = minibatches(len(samples), cfg.ppo_minibatches)
        shares = [dp_share(samples, mb, L.dp, L.dp_rank) for mb in mbs]
        mine = sorted(i for s in shares for i in s)
        # 2. forward-only passes with the step's starting weights (results on the last stage)
        channels: dict[int, SampleArrays] = {}
        # π at the step's start for every minibatch: π_prox of the decoupled loss, or what rejection
        # sampling judges under standard PPO (one optimizer step computes it in its own forward)
        recompute = len(mbs) * cfg.ppo_epochs > 1 and (
            cfg.proximal == "recompute" or (cfg.proximal == "behaviour" and self.rejection is not None))
        self._routes = {}
        if self.routing_replay == "rollout":  # the experts each server chose, as the trajectories carry them
            self._routes = {i: r for i in mine if (r := samples[i].routed_experts_np()) is not None}
        if recompute:  # (routing_replay=behaviour: its forward records the routes of the step's starting weights)
            channels[CH_PROX] = self._forward_logprobs(self.actor, samples, mine)
        elif self.routing_replay == "behaviour":  # one forward pass records them
            self._forward_only(self.actor, samples, mine, lambda mb, y: y[:, :-1, 0])
        routing_dlogp = self._measure_routing(samples) if (
            self.routing_replay == "rollout" and cfg.routing_replay_measure) else (None, None)
        if self.ref is not None:
            channels[CH_REF] = self._forward_logprobs(self.ref, samples, mine)
        elif self.ref_is_base:
            with self.actor.conversion.frozen_base(self.actor.stage_module):
                channels[CH_REF] = self._forward_logprobs(self.actor, samples, mine)
        if self.critic is not None:
            channels[CH_OLD_VALUE] = self._forward_values(self.critic, samples, mine)
        elif self.critic_pool:  # V_old from the critic pool: rank 0 asks it, every rank keeps its share
            channels[CH_OLD_VALUE] = self._remote_values(groups, mine)
        # 3. advantages (and critic returns) where the loss runs; the teacher's reverse KL (a stat) on every rank
        opd = None
        if self.teacher is not None:
            opd = rkl_N, mask_N = reverse_kl_tokens(samples, self.teacher.model_path)
            n_tok = sum(float(m.sum()) for m in mask_N)
            self._teacher_kl = sum(float(r.sum()) for r in rkl_N) / n_tok if n_tok else float("nan")
        if L.is_last_stage:
            channels[CH_ADV], ret = self._advantages(samples, mine, scores_N, group_index_N, channels, opd)
            if self.critic is not None:
                channels[CH_RETURN] = ret
        if self.critic_pool:  # the returns to the critic pool, which trains on them while the actor does
            self._remote_train(len(samples), ret if L.is_last_stage else {}, version)
        # 4. the PPO update: epochs × minibatches optimizer steps
        sums_total = torch.zeros(len(_SUM_STATS), dtype=torch.float64)
        maxes_total = torch.full((len(_MAX_STATS),), -math.inf, dtype=torch.float64)
        norms, skips, value_losses, critic_norms = [], [], [], []
        lr = critic_lr = float("nan")
        loss_tokens_total = 0
        n_opt = 0
        for epoch in range(cfg.ppo_epochs):
            for mb_i, (mb_rows, share) in enumerate(zip(mbs, shares)):
                lt = loss_tokens_of(samples, mb_rows)
                n_seqs = sum(1 for i in mb_rows if samples[i].mask_np()[1:].any())  # rows with loss tokens
                acc = {k: torch.zeros((), device=dev) for k in _SUM_STATS}
                acc.update({k: torch.full((), -math.inf, device=dev) for k in _MAX_STATS})
                self.actor.zero_grad()
                if lt > 0:
                    self._forward_backward(self.actor, samples, share, channels,
                                           self._actor_loss_fn(acc, lt, n_seqs, version, recompute,
                                                               epoch == 0 and (recompute or mb_i == 0)))
                sums, maxes = self._reduce(torch.stack([acc[k] for k in _SUM_STATS]),
                                           torch.stack([acc[k] for k in _MAX_STATS]))
                norm, skip, lr, rest = self._optimizer_step(self.actor, lt, sums[0], cfg.lr,
                                                            torch.cat([sums, maxes]))
                sums_total += torch.tensor(rest[:len(_SUM_STATS)], dtype=torch.float64)
                maxes_total = torch.maximum(maxes_total, torch.tensor(rest[len(_SUM_STATS):], dtype=torch.float64))
                norms.append(norm)
                skips.append(skip)
                loss_tokens_total += lt
                n_opt += 1
                if self.critic is not None:
                    vloss, cnorm, critic_lr = self._critic_update(samples, share, channels, lt)
                    value_losses.append(vloss)
                    critic_norms.append(cnorm)
        if self.critic_pool:  # the critic pool's stats of the same step (it trained beside the actor)
            value_losses, critic_norms, critic_lr = self._remote_trained()
        self.step += 1
        self.version = version
        route_agreement = None
        if self._replay is not None:  # over the step's replayed positions × layers, summed over dp and the stages
            t = self._reduce(torch.tensor(self._replay.take_stats(), dtype=torch.float64, device=self.device))[0].cpu()
            route_agreement = float(t[0] / t[1]) if float(t[1]) > 0 else float("nan")
            self._routes = {}
        # 5. stats: means over the step's optimizer steps (token-weighted within each), maxima overall
        st = dict(zip(_SUM_STATS, (sums_total / max(n_opt, 1)).tolist()))
        mx = dict(zip(_MAX_STATS, maxes_total.tolist()))
        for k in _COUNT_STATS:  # sums over the step, not means
            st[k] = st[k] * n_opt
        mm_n = st["mm_tokens"]
        applied = [n for n, s in zip(norms, skips) if not s]
        skip_reason = next((s for s in skips if s), "")
        return TrainStats(
            loss=st["loss"], reward_mean=float(rewards_N.mean()), reward_std=float(rewards_N.std()),
            score_mean=float(scores_N.mean()), adv_abs_mean=st["adv_abs_mean"],
            grad_norm=float(np.mean(applied)) if applied else float(norms[-1]) if norms else float("nan"),
            **{k: st[k] for k in ("clipfrac", "dual_clipfrac", "approx_kl", "ratio_mean", "behav_w_mean")},
            entropy=st["entropy"] if self.compute_entropy or self.alg.entropy_coef > 0 else float("nan"),
            ratio_max=mx["ratio_max"], behav_w_max=mx["behav_w_max"], behav_w_min=-mx["neg_behav_w_min"],
            behav_tokens_capped=int(round(st["behav_tokens_capped"])),
            # training–inference mismatch: the learner's logprobs at the step's start vs the servers'
            mismatch_logp_abs_mean=st["mm_abs_sum"] / mm_n if mm_n else float("nan"),
            mismatch_logp_abs_max=mx["mm_abs_max"] if mm_n else float("nan"),
            mismatch_kl=st["mm_k3_sum"] / mm_n if mm_n else float("nan"),
            mismatch_ratio_outside=st["mm_outside"] / mm_n if mm_n else float("nan"),
            mismatch_tokens=int(round(mm_n)),
            kl_ref=st["kl_ref"] if self.has_ref else None,
            teacher_kl=self._teacher_kl if self.teacher is not None else None,
            routing_agreement=route_agreement,
            routing_dlogp_replayed=routing_dlogp[0], routing_dlogp_own=routing_dlogp[1],
            value_loss=float(np.mean(value_losses)) if value_losses else None,
            critic_grad_norm=float(np.mean(critic_norms)) if critic_norms else None,
            lr=lr, critic_lr=critic_lr if self.trains_critic else None,
            num_tokens=int(sum(t.num_tokens for t in samples)),
            loss_tokens=loss_tokens_of(samples, list(range(len(samples)))),
            num_groups=len(groups), num_samples=len(samples), optimizer_steps=len(applied),
            num_minibatches=len(mbs), version_lag_max=max_trained_staleness(groups, version, default=-1),
            skipped=not applied, skip_reason=skip_reason, step=self.step,
            step_s=time.perf_counter() - t0, layout=str(L.spec),
            # this rank's peak of allocated CUDA memory during the step (None on CPU)
            device_mem_peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        )

    def _critic_update(self, samples: list[Trajectory], share: list[int], channels: dict[int, SampleArrays],
                       lt: int) -> tuple[float, float, float]:
        """One optimizer step of the critic on one minibatch (this rank's `share`; `lt` its global loss
        tokens): the clipped value loss against `channels`' returns. Returns (value loss, grad norm, lr)."""
        cacc = {"value_loss": torch.zeros((), device=self.device)}
        self.critic.zero_grad()
        if lt > 0:
            self._forward_backward(self.critic, samples, share, channels, self._critic_loss_fn(cacc, lt))
        vsum, _ = self._reduce(cacc["value_loss"].reshape(1))
        cnorm, _, lr, fetched = self._optimizer_step(self.critic, lt, vsum[0], self.critic_cfg.lr or self.cfg.lr, vsum)
        return fetched[0], cnorm, lr

    # ---- a critic on its own pool (`fsdp[critic]` in the allocation; learner/critic_pool.py) --------------
    def _remote_values(self, groups: list[TrajectoryGroup], mine: list[int]) -> SampleArrays:
        """V_old of this rank's samples, computed by the critic pool: rank 0 sends the step's groups and
        receives every sample's values; the pool gets them in one broadcast."""
        from areal_like.learner.critic_link import bytes_to_arrays
        from areal_like.learner.parallel.broadcast import broadcast_bytes

        payload = None
        if self.is_rank0:
            link = self.remote_critic
            link.send("values", step=self.step + 1, groups=_MSG_ENC.encode(groups))
            got = link.recv("values", timeout_s=self.critic_cfg.timeout_s, what=f"send step {self.step + 1}'s values")
            payload = _MSG_ENC.encode(got["values"])
        # the others wait for rank 0 outside any collective (a critic slower than train.collective_timeout_s is
        # bounded by critic.timeout_s alone)
        self.layout.leader_ready("receive the critic pool's values")
        values = bytes_to_arrays(msgspec.msgpack.decode(broadcast_bytes(payload, self.layout), type=list[bytes]))
        return {i: values[i] for i in mine}

    def _remote_train(self, n: int, returns: SampleArrays, version: int) -> None:
        """Every sample's returns (from the ranks that computed them) to rank 0, which sends them to the
        critic pool; it trains on them while this pool trains the actor (`_remote_trained` collects)."""
        from areal_like.learner.critic_link import gather_samples

        blobs = gather_samples(returns, n, self.layout, f"learner step {self.step + 1}: returns")
        if self.is_rank0:
            self.remote_critic.send("train", step=self.step + 1, version=version, returns=blobs)

    def _remote_trained(self) -> tuple[list[float], list[float], float]:
        """The critic pool's stats of this step (value losses and grad norms per optimizer step, its last
        lr), on every rank."""
        from areal_like.learner.parallel.broadcast import broadcast_bytes

        payload = None
        if self.is_rank0:
            got = self.remote_critic.recv("trained", timeout_s=self.critic_cfg.timeout_s,
                                          what=f"train the critic on step {self.step + 1}")
            payload = _MSG_ENC.encode([got["value_losses"], got["grad_norms"], got["lr"]])
        self.layout.leader_ready("receive the critic pool's step stats")
        vl, gn, lr = msgspec.msgpack.decode(broadcast_bytes(payload, self.layout))
        return [float(x) for x in vl], [float(x) for x in gn], float(lr)

    # ---- the critic pool's side (role "critic") -----------------------------------------------------------
    def critic_values(self, groups: list[TrajectoryGroup]) -> SampleArrays:
        """V_old of this rank's share of the step's samples (the actor's minibatch split, this pool's dp);
        results on the last pipeline stage."""
        samples = [t for g in groups for t in g.trajectories]
        mbs = minibatches(len(samples), self.cfg.ppo_minibatches)
        mine = sorted(i for mb in mbs for i in dp_share(samples, mb, self.layout.dp, self.layout.dp_rank))
        return self._forward_values(self.critic, samples, mine)

    def critic_train(self, groups: list[TrajectoryGroup], values: SampleArrays, returns: list[np.ndarray]
                     ) -> tuple[list[float], list[float], float]:
        """The critic's part of a step on a critic pool: ppo_epochs × ppo_minibatches optimizer steps, in
        the actor's order, against V_old (`critic_values`' results on this rank) and every sample's
        returns. Returns (value losses, grad norms, lr) of its optimizer steps."""
        samples = [t for g in groups for t in g.trajectories]
        cfg, L = self.cfg, self.layout
        mbs = minibatches(len(samples), cfg.ppo_minibatches)
        shares = [dp_share(samples, mb, L.dp, L.dp_rank) for mb in mbs]
        channels = {CH_OLD_VALUE: values, CH_RETURN: {i: returns[i] for i in values}}
        losses, norms, lr = [], [], float("nan")
        for _ in range(cfg.ppo_epochs):
            for mb_rows, share in zip(mbs, shares):
                v, n, lr = self._critic_update(samples, share, channels, loss_tokens_of(samples, mb_rows))
                losses.append(v)
                norms.append(n)
        self.step += 1
        return losses, norms, lr

    # ---- full tensors on rank 0 -------------------------------------------------------------------
    def weight_source(self):
        """The actor's full state as a `WeightSource` for rank 0's pusher (HF names, `save_pretrained`
        order; parameters from the optimizer's master, fp32 with a 16-bit `model.dtype`: the push casts
        them once, to `server.dtype`). Rank 0 reads it one bucket at a time, gathering each from the
        shards; the other ranks join those gathers from their `leader_ready` wait (`serve_command`).
        It reads the live weights: push it before the next `train_step`. A converter with its own format
        says what is pushed instead (LoRA: the adapter with its peft config; the servers keep their base)."""
        return self.actor.conversion.weight_source(self.actor, self.layout.leader_command)

    # ---- co-located mode -----------------------------------------------------------------------------
    def _models(self) -> list[ShardedModel]:
        return [m for m in (self.actor, self.critic, self.ref) if m is not None]

    def sleep(self, *, followers: bool = False, keep_params: bool = False) -> float:
        """Between training phases of a co-located run: every model of this rank sleeps
        (`ShardedModel.sleep`: gradients freed; on CUDA its state to host memory, then the cache emptied;
        `keep_params`: the parameters stay, for the weight handoff that reads them).
        `followers` (rank 0): the other ranks do the same from their wait for rank 0 (`leader_command`).
        Returns the seconds it took."""
        t0 = time.perf_counter()
        if followers:
            self.layout.leader_command("sleep all -")
        for m in self._models():
            m.sleep(keep_params=keep_params)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return time.perf_counter() - t0

    def wake(self) -> float:
        """Undo `sleep` on this rank (no-op when awake). Returns the seconds it took."""
        t0 = time.perf_counter()
        for m in self._models():
            m.wake()
        return time.perf_counter() - t0

    def serve_command(self, cmd: str) -> None:
        """A follower runs rank 0's `leader_command`: `gather <role> <dtype|-> <i,j,…>` = its part of rank 0's
        reading those tensors of that model in that dtype (`GatheredWeights.open`); `handoff <role> <dtype|->
        <i,j,…>` = its part of a per-GPU handoff (`GatheredWeights.hand_off`: it packs those tensors on its
        own GPU for the server there), `handoff <role> end` = drop the last bucket it packed;
        `sleep all -` = `sleep()`."""
        verb, role, rest = cmd.split(" ", 2)
        if verb == "sleep":
            self.sleep()
            return
        model = {"actor": self.actor, "critic": self.critic}.get(role) if verb in ("gather", "handoff") else None
        if model is None:
            raise RuntimeError(f"learner rank {self.layout.rank}: unknown command from rank 0: {cmd[:80]!r}")
        from areal_like.learner.parallel.sharded_model import gather_payloads, parse_dtype_word

        if verb == "handoff" and rest == "end":
            if self._packer is not None:
                self._packer.release()
            return
        word, idx = rest.split(" ", 1)
        src = model.weights()
        src.wire_dtype = parse_dtype_word(word)  # the same cast as rank 0's, before the same gathers
        indices = [int(i) for i in idx.split(",")]
        if verb == "handoff":
            from areal_like.weights.ipc import BucketPacker

            self._packer = self._packer or BucketPacker(src.device)
            gather_payloads(self.layout, self._packer.pack(src.open_everywhere(indices),
                                                           [src.meta[i] for i in indices], src.wire_dtype)[0])
            return
        for _ in src.open(indices):  # collective; None here
            pass

    def full_state(self) -> list[tuple[str, torch.Tensor]]:
        """The actor's HF-named full tensors on rank 0 ([] elsewhere), all at once; for tests and
        small models. Collective."""
        return self.actor.gather_full()

    def named_full_grads(self) -> list[tuple[str, torch.Tensor]]:
        """The actor's full gradients of the last optimizer step (after dp reduction and clipping)
        on rank 0, HF names; for tests. Collective."""
        return self.actor.gather_full(self.actor.grad_tensors(), params_only=True)

    def barrier(self) -> None:
        self.layout.barrier()  # the host (gloo) world group, under its timeout
