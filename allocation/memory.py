"""Memory planner: bytes per device of an allocation for a given model (`launcher plan --model`).

Pure standard library (no torch): the model is its HF ``config.json`` read with ``json``, and every
number below is a formula of its shapes. What it models is *today's* learner (areal_like/learner):

Parameters (Qwen2 / Qwen3 / Llama-style decoders; `count_params`)
    embeddings   V·h                                   (first pipeline stage; replicated over tp)
    per layer    q: h·a·d (+a·d bias)  k, v: h·g·d (+g·d bias each)   o: a·d·h
                 (bias: `attention_bias`, or Qwen2's always-on q/k/v bias)
                 MLP gate, up: h·I each, down: I·h
                 norms: 2·h; Qwen3 q_norm/k_norm: 2·d
    final norm   h                                     (last stage)
    lm_head      V·h unless tied to the embeddings     (last stage; the critic's value head: h·1)
    with h = hidden_size, a = num_attention_heads, g = num_key_value_heads, d = head_dim
    (default h/a), I = intermediate_size, V = vocab_size, L = num_hidden_layers.

Split over the learner's layout (areal_like/learner/parallel/parallelize.py): pipeline stage s keeps
the contiguous balanced layer range `stage_layer_ids`, the embeddings on stage 0, the final norm and
lm_head on the last stage; tensor parallel shards q/k/v/o and gate/up/down (biases included) by t
and keeps norms, embeddings and lm_head replicated over tp. Data parallel (`train.dp_sharding`):
    none           every dp rank holds full parameters, gradients and AdamW state of its stage/tp shard
    full | grad_op (FSDP2, dp > 1) each rank stores 1/dp of them, in the master dtype m: params
                   m·n/dp, grads m·n/dp, AdamW 2·m·n/dp — plus what is all-gathered at a time in the
                   compute dtype b: the root unit (final norm; a critic's value head) through
                   forward and backward, and two decoder layers (the running one and the prefetched
                   next) with `full`, every layer of the stage with `grad_op` (kept from forward to
                   backward); one unit's unsharded gradient (b + m bytes) while it is reduce-scattered.
                   The embedding and lm_head are split by vocabulary rows over dp and never gathered
                   (learner/parallel/vocab_parallel.py): their 1/dp share is in m·n/dp, plus its
                   b-dtype cast while it runs (b ≠ m) and one backward's gradient of it beside the
                   accumulated one; the logits chunk holds every dp rank's tokens against V/dp rows.
                   The frozen reference: b·n/dp plus the same gathered units.

Bytes per trainable parameter (`train.master_dtype`, areal_like/learner/trainer.py):
    model.dtype = master dtype (fp32, or a pure 16-bit optimizer): params p, grads p, AdamW 2·p
    16-bit model.dtype with an fp32 master: params 2 + grads 4 + optimizer 12 (fp32 master 4 + AdamW
    m, v 8) = 18. Backward leaves 16-bit grads that `reduce_grads` moves onto the masters' fp32 .grad
    one tensor at a time, so the peak is max(14 + 2 + activations, 14 + 4) bytes/param: counting
    the fp32 grads beside the activations is an upper bound, high by at most 2 bytes/param.
The frozen reference (`ref`, any KL on) holds params in model.dtype only; the critic (gae) is a
second trainable model (value head instead of lm_head) with its own gradients and optimizer.
LoRA (`model.lora_rank` = r > 0, learner/lora.py): the base is frozen in model.dtype (FSDP: its
1/dp shard plus the gathered units, like the reference); only the adapter — r·(in + out) per
targeted projection (`ModelShape.lora_layer_params`) — has gradients, AdamW state and a master; the
KL reference is the base itself (no reference bytes).

Activations per token of one micro-batch (`activation_bytes_per_token`), HF decoder layer under SDPA
with no mask (the learner's case: causal, no padding mask, GQA native, no repeat_kv), compute dtype
b bytes, fp32 RMSNorm internals — what autograd keeps for backward:
    2 RMSNorms           2·(4 + b)·h      (fp32 copy of the input + the normalised b-dtype output)
    attention            b·(3·a·d + 2·g·d) + 4·a   (q, k after RoPE, v, the output, its contiguous
                                                 copy for o_proj; fp32 log-sum-exp per head)
    Qwen3 q/k norm       (4 + b)·(a + g)·d
    MLP                  4·b·I             (gate out, SiLU out, up out, their product)
  A stage with n layers keeps n·A_layer per token, plus one layer's worth (A_layer) of transient
  work while it runs; with `model.enable_gradient_checkpointing` it keeps only each layer's input
  (b·h per token per layer) plus one layer recomputed in backward (A_layer). The last stage adds
  the final norm ((4 + b)·h). Pipeline stage s under 1F1B holds min(pp − s, n_micro) micro-batches
  in flight (GPipe: all n_micro). This is the Korthikanti et al. (2022) count (34·h + 5·a·s per
  token per layer for GPT-3 in 16-bit) redone for SwiGLU/GQA/RMSNorm and a flash-style attention that
  stores no s×s scores (CUDA's flash kernels, GQA included). Where SDPA falls back to its math
  kernel (CPU with GQA: measured) one layer at a time also holds ~5·b·a·T·s bytes of s×s scores,
  softmax and their gradients (`TrainSettings.math_attention`; not the GPU default).
Measured (CPU, fp32, h 256, 8 layers, 4/2 heads, I 1024, V 32000, T 1024–2048, chunks of 256, with
  and without checkpointing, logit chunks of 256/1024 and unchunked, 3 AdamW steps;
  benchmarks/planner_memory_check.py): peak RSS above the post-import baseline / this model with
  `math_attention` = 1.05–1.09 with logit chunks of 256, 0.92–0.98 with 1024, 0.80–0.96 unchunked
  (varies between runs; the unchunked model is conservative), when glibc's malloc is kept from hoarding freed chunks
  (MALLOC_MMAP_THRESHOLD_=65536); with its default dynamic threshold the chunked logits path
  retains up to ~1.4 GiB more RSS than the live tensors (ratio 2.4: allocator retention, not tensors).
Logits (`logits_bytes`, last stage; areal_like/learner/logprobs.py `chunked_token_logprobs`): with
  `train.logits_chunk_tokens` = c > 0 the head runs c positions at a time, each chunk recomputed in
  backward: c·V·(12 + b') — the fp32 log-softmax kept for backward (4), its gradient and the
  gradient of the fp32 logits (8), b' = b for the 16-bit logits before their fp32 cast (0 in fp32)
  — + 4·c·V with the entropy (exp(log p); the learner's default); c = 0 (unchunked): the whole
  micro-batch's T tokens in place of c. Measured in fp32 unchunked: 10–13 bytes per logit (the
  model's 16 is high on this part).

Servers: weights in `server.dtype`, split evenly over a server's t·p devices; the KV-cache room is
`mem_fraction_static` × device memory − weights; one token of KV cache costs
2 · (L / p) · max(g / t, 1) · d · server-dtype bytes on each device.
A device of the learner also carries a fixed `runtime_bytes` (CUDA context, NCCL and allocator
slack; 1 GiB), counted in its total.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RUNTIME_BYTES = 2**30  # per learner device: CUDA context, NCCL buffers, allocator slack
GIB = 2**30


def sglang_default_mem_fraction(tp: int) -> float:
    """SGLang's default `--mem-fraction-static` by tensor-parallel size (its ServerArgs table; newer
    releases derive it from the GPU's memory, close to these)."""
    if tp >= 16:
        return 0.79
    if tp >= 8:
        return 0.81
    if tp >= 4:
        return 0.85
    if tp >= 2:
        return 0.87
    return 0.88


def parse_bytes(text: str) -> int:
    """`80GB`, `80GiB`, `81559MiB`, `85e9` → bytes. GB and GiB both mean 2³⁰ (device memory is sold in
    binary units: an "80GB" H100 reports 81559 MiB = 79.6 GiB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B?|B)?\s*", text or "")
    if not m:
        raise ValueError(f"memory size {text!r} not understood: write e.g. 80GB, 80GiB or 81559MiB")
    num, unit = float(m.group(1)), (m.group(2) or "B").upper().rstrip("B").rstrip("I") or "B"
    scale = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[unit]
    return int(num * scale)


def fmt_bytes(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if abs(n) >= GIB else f"{n / 2**20:.0f} MiB"


@dataclass(frozen=True)
class ModelShape:
    """The shapes the planner needs from an HF config.json."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    model_type: str = ""
    # mixture of experts (0 experts: dense): per sparse layer a router (E × h), E experts of moe_intermediate
    # (gate, up, down), Qwen2-MoE's shared expert of shared_intermediate (+ its h → 1 gate); top_k active per token
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    sparse_layers: int = 0  # how many of `layers` are sparse (decoder_sparse_step, mlp_only_layers)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "ModelShape":
        try:
            h, a = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            mt = str(cfg.get("model_type", ""))
            L = int(cfg["num_hidden_layers"])
            experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
            sparse = 0
            if experts:
                step = int(cfg.get("decoder_sparse_step") or 1)
                dense = set(cfg.get("mlp_only_layers") or [])
                first_dense = int(cfg.get("first_k_dense_replace") or 0)  # DeepSeek's leading dense layers
                sparse = sum(1 for i in range(L) if (i + 1) % step == 0 and i not in dense and i >= first_dense)
            return cls(hidden=h, layers=L, heads=a,
                       kv_heads=int(cfg.get("num_key_value_heads") or a),
                       head_dim=int(cfg.get("head_dim") or h // a), intermediate=int(cfg["intermediate_size"]),
                       vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
                       # Qwen2 (and Qwen2-MoE) always have q/k/v biases; Llama/Qwen3 follow `attention_bias`
                       qkv_bias=mt in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
                       qk_norm=mt.startswith("qwen3"), model_type=mt, experts=experts,
                       top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
                       moe_intermediate=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else 0,
                       shared_intermediate=int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0,
                       sparse_layers=sparse)
        except KeyError as e:
            raise ValueError(f"model config has no {e.args[0]!r}: the planner needs an HF decoder config.json "
                             "(hidden_size, num_hidden_layers, num_attention_heads, intermediate_size, vocab_size)") from None

    @classmethod
    def load(cls, path: str) -> "ModelShape":
        """A model directory (its config.json) or a config.json file."""
        p = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(p):
            raise ValueError(f"--model {path!r}: no config.json there: pass an HF model directory or its config.json")
        with open(p, encoding="utf-8") as f:
            cfg = json.load(f)
        if isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg, **cfg["text_config"]}
        return cls.from_config(cfg)

    # ---- parameter counts -----------------------------------------------------------------------
    def layer_params(self, tp: int = 1) -> int:
        """One decoder layer's parameters on one tp rank (sharded projections / tp + replicated norms); a MoE
        model's layers averaged over its sparse and dense ones (`moe_layer_params`)."""
        h, a, g, d, i = self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate
        if self.experts:
            return -(-(self.sparse_layers * self.moe_layer_params(tp)
                       + (self.layers - self.sparse_layers) * self.moe_layer_params(tp, dense=True)) // self.layers)
        sharded = h * a * d + 2 * h * g * d + a * d * h + 3 * h * i
        if self.qkv_bias:
            sharded += a * d + 2 * g * d
        replicated = 2 * h + (2 * d if self.qk_norm else 0)
        return sharded // tp + replicated

    def moe_layer_params(self, tp: int = 1, *, dense: bool = False) -> int:
        """One decoder layer of a MoE model on one tp rank: attention, then a dense MLP (`dense`) or the router,
        every expert and the shared expert."""
        h, a, g, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        sharded = h * a * d + 2 * h * g * d + a * d * h
        if dense:
            sharded += 3 * h * self.intermediate
        else:
            sharded += self.experts * 3 * h * self.moe_intermediate + 3 * h * self.shared_intermediate
        if self.qkv_bias:
            sharded += a * d + 2 * g * d
        replicated = 2 * h + (2 * d if self.qk_norm else 0)
        if not dense:
            replicated += self.experts * h + (h if self.shared_intermediate else 0)  # router (+ shared-expert gate)
        return sharded // tp + replicated

    def routed_params(self) -> int:
        """The routed experts' parameters of one decoder layer, averaged over the layers (a sparse layer holds
        E experts of 3·h·moe_intermediate); 0 for a dense model."""
        if not self.experts:
            return 0
        return self.sparse_layers * self.experts * 3 * self.hidden * self.moe_intermediate // self.layers

    def learner_layer_params(self, tp: int = 1, ep: int = 1) -> int:
        """One decoder layer on one *learner* rank: `layer_params(tp)`, but the routed experts whole on every tp
        rank (the learner splits no expert over t) and split over the ep ranks (`e`: 1/ep of them each)."""
        r = self.routed_params()
        return self.layer_params(tp) - r // tp + r // ep

    def active_params(self) -> int:
        """Parameters one token passes through (the A in Qwen3-30B-A3B): the routed experts count top_k of
        `experts`."""
        if not self.experts:
            return self.count_params()
        idle = self.sparse_layers * (self.experts - self.top_k) * 3 * self.hidden * self.moe_intermediate
        return self.count_params() - idle

    def lora_layer_params(self, rank: int, targets: tuple[str, ...], tp: int = 1) -> int:
        """One decoder layer's LoRA adapter parameters on one tp rank: r·(in + out) per targeted
        projection, the tp-split side of each divided by tp (learner/lora.py's plan: a column-parallel
        projection splits its B, a row-parallel one its A)."""
        h, a, g, d, i = self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate
        dims = {"q_proj": (h, a * d, "col"), "k_proj": (h, g * d, "col"), "v_proj": (h, g * d, "col"),
                "o_proj": (a * d, h, "row"), "gate_proj": (h, i, "col"), "up_proj": (h, i, "col"),
                "down_proj": (i, h, "row")}
        n = 0
        for t in targets:
            if t not in dims:  # lm_head: not a decoder layer's (learner_parts adds it on the last stage)
                continue
            fan_in, fan_out, split = dims[t]
            n += rank * (fan_in + fan_out // tp) if split == "col" else rank * (fan_in // tp + fan_out)
        return n

    def count_params(self) -> int:
        """Total parameters of the *ForCausalLM model (tied lm_head counted once)."""
        emb = self.vocab * self.hidden
        layers = (self.sparse_layers * self.moe_layer_params() + (self.layers - self.sparse_layers)
                  * self.moe_layer_params(dense=True)) if self.experts else self.layers * self.layer_params()
        return emb + layers + self.hidden + (0 if self.tied else emb)

    def stage_params(self, pp: int, stage: int, tp: int, *, head_dim_out: int | None = None,
                     learner_ep: int | None = None) -> int:
        """Parameters of pipeline stage `stage` on one tp rank; `head_dim_out` = 1 for a critic; `learner_ep`:
        on a learner rank of that expert-parallel size (`learner_layer_params`), else as a server splits it."""
        n = len(stage_layer_ids(self.layers, pp, stage))
        total = n * (self.layer_params(tp) if learner_ep is None else self.learner_layer_params(tp, learner_ep))
        first, last = stage == 0, stage == pp - 1
        if first:
            total += self.vocab * self.hidden
        if last:
            total += self.hidden
            if head_dim_out is not None:
                total += self.hidden * head_dim_out
            elif not (self.tied and first):
                total += self.vocab * self.hidden
        return total

    # ---- activations ----------------------------------------------------------------------------
    def layer_activation_bytes(self, b: int, tp: int = 1) -> float:
        """A_layer: bytes autograd keeps per token for one decoder layer (module docstring)."""
        # a MoE layer's MLP activations: the top_k routed experts (and the shared one) each token passes through
        inter = (self.top_k * self.moe_intermediate + self.shared_intermediate) if self.experts else self.intermediate
        h, a, g, d, i = self.hidden, self.heads / tp, max(self.kv_heads / tp, 1), self.head_dim, inter / tp
        total = 2 * (4 + b) * h + b * (3 * a * d + 2 * g * d) + 4 * a + 4 * b * i
        if self.qk_norm:
            total += (4 + b) * (a + g) * d
        return total

    def kv_bytes_per_token(self, b: int, tp: int = 1, pp: int = 1) -> float:
        """KV-cache bytes of one token on one device of a t×p server."""
        layers = -(-self.layers // pp)
        return 2 * layers * max(self.kv_heads / tp, 1) * self.head_dim * b


def stage_layer_ids(num_layers: int, pp: int, stage: int) -> list[int]:
    """The learner's split (parallelize.stage_layer_ids, copied: this module must not import torch)."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


@dataclass(frozen=True)
class TrainSettings:
    """What the learner's memory depends on (from the experiment config; `from_config`)."""

    dtype: str = "float32"  # model.dtype (compute)
    master_dtype: str = "float32"  # train.master_dtype
    dp_sharding: str = "full"  # train.dp_sharding (takes effect at dp > 1)
    checkpointing: bool = False  # model.enable_gradient_checkpointing
    micro_batch_tokens: int = 8192  # train.micro_batch_tokens
    seq_len: int = 0  # longest sequence (a micro-batch holds at least one)
    logits_chunk_tokens: int = 1024  # train.logits_chunk_tokens (0 = unchunked)
    entropy: bool = True  # the learner computes the entropy beside the logprobs (its default)
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 0
    critic: bool = False  # algorithm.adv_estimator == gae
    reference: bool = False  # any KL term on
    server_dtype: str = "bfloat16"  # resolved server.dtype
    mem_fraction_static: float | None = None
    math_attention: bool = False  # SDPA's math kernel (CPU with GQA): s×s scores while a layer runs
    release_memory: bool = True  # colocate.release_memory: co-located servers free KV cache + weights in training
    offload_learner: bool = True  # colocate.offload_learner: the co-located learner's state off the device meanwhile
    lora_rank: int = 0  # model.lora_rank (0 = full fine-tuning)
    lora_targets: tuple[str, ...] = ()  # model.target_modules as module names
    delta_sync: bool = False  # weights.sync=delta: the pushing rank keeps the last-sent copy in host memory

    @classmethod
    def from_config(cls, cfg: Any, *, sglang: bool, seq_len: int | None = None,
                    micro_batch_tokens: int | None = None) -> "TrainSettings":
        alg = cfg.algorithm
        return cls(dtype=cfg.model.dtype, master_dtype=cfg.train.master_dtype, dp_sharding=cfg.train.dp_sharding,
                   checkpointing=cfg.model.enable_gradient_checkpointing,
                   micro_batch_tokens=micro_batch_tokens or cfg.train.micro_batch_tokens,
                   seq_len=seq_len if seq_len is not None else cfg.resolved_max_context_len(),
                   logits_chunk_tokens=cfg.train.logits_chunk_tokens,
                   entropy=bool(getattr(cfg.train, "compute_entropy", True)) or alg.entropy_coef > 0,
                   pp_schedule=cfg.train.pp_schedule, pp_microbatches=cfg.train.pp_microbatches,
                   critic=alg.adv_estimator == "gae", reference=alg.kl_loss_on or alg.kl_reward_on,
                   server_dtype=cfg.resolved_server_dtype(sglang=sglang),
                   mem_fraction_static=cfg.server.mem_fraction_static,
                   release_memory=cfg.colocate.release_memory, offload_learner=cfg.colocate.offload_learner,
                   lora_rank=cfg.model.lora_rank, lora_targets=(
                       LORA_LINEARS if cfg.model.target_modules == "all-linear" else tuple(cfg.model.target_modules)),
                   delta_sync=cfg.weights.sync == "delta")

    @property
    def tokens_per_micro_batch(self) -> int:
        return max(self.micro_batch_tokens, self.seq_len)


# model.target_modules=all-linear: every linear layer of a decoder layer (areal_like.api.config's list)
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class DeviceMemory:
    """One device: its parts in bytes (JSON keys as named) and whether their sum fits."""

    node: int
    device: int
    roles: list[str] = field(default_factory=list)
    parts: dict[str, int] = field(default_factory=dict)
    kv_cache_tokens: int | None = None
    capacity: int = 0
    info: dict[str, int] = field(default_factory=dict)  # shown, not summed (the other checkpointing setting)
    phases: dict[str, int] | None = None  # co-located: bytes in each phase of a step (`colocated_phases`)

    @property
    def total_bytes(self) -> int:
        """The parts' sum; on a co-located device the fullest phase (its roles take turns)."""
        return max(self.phases.values()) if self.phases else sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity and self.parts.get("kv_cache_bytes", 0) >= 0

    def add(self, key: str, value: float) -> None:
        self.parts[key] = self.parts.get(key, 0) + int(value)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"node": self.node, "device": self.device, "roles": self.roles, **self.parts,
                             "total_bytes": self.total_bytes, "capacity_bytes": self.capacity, "fits": self.fits}
        if self.kv_cache_tokens is not None:
            d["kv_cache_tokens"] = self.kv_cache_tokens
        if self.phases:
            d["colocated_phases"] = dict(self.phases)
            d["colocated_without_release_bytes"] = sum(self.parts.values())
        d.update(self.info)
        return d


def colocated_phases(parts: dict[str, int], s: TrainSettings) -> dict[str, int]:
    """A device whose server and learner take turns (co-located allocation): its bytes in each phase.

    generation  the server's weights and KV cache + what the sleeping learner keeps there (its runtime;
                its parameters, master and AdamW state unless colocate.offload_learner)
    training    the learner's every part + what the paused server keeps (nothing once released; its
                weights and KV cache with colocate.release_memory=false; with LoRA its weights, the frozen base)
    handoff     the learner's parameters (+ reference, critic) and runtime — gradients freed, AdamW state
                offloaded already with colocate.offload_learner, else all but activations and logits — +
                the server's weights, resumed to receive the new ones (the KV cache comes back after the
                learner sleeps)"""
    learner = {k: v for k, v in parts.items() if k in LEARNER_KEYS}
    weights, kv = parts.get("weights_bytes", 0), parts.get("kv_cache_bytes", 0)
    state = sum(v for k, v in learner.items() if k in ("params_bytes", "optimizer_bytes", "reference_bytes",
                                                          "critic_bytes"))
    runtime = learner.get("runtime_bytes", 0)
    # LoRA: a push carries the adapter alone, so the servers release only their KV cache (they keep the base)
    kept = (0 if s.release_memory else kv) + (weights if (s.lora_rank > 0 or not s.release_memory) else 0)
    return {"generation_bytes": weights + kv + runtime + (0 if s.offload_learner else state),
            "training_bytes": sum(learner.values()) + kept,
            "handoff_bytes": (sum(v for k, v in learner.items() if k in ("params_bytes", "reference_bytes",
                                                                            "critic_bytes", "runtime_bytes"))
                              if s.offload_learner else
                              sum(v for k, v in learner.items() if k not in ("activations_bytes", "logits_bytes")))
            + weights + (0 if s.release_memory else kv)}


def learner_parts(shape: ModelShape, s: TrainSettings, *, pp: int, tp: int, stage: int, dp: int = 1,
                  ep: int = 1) -> dict[str, int]:
    """Bytes of one learner rank (pipeline stage `stage`, one tp shard, one of `dp`; a MoE model's experts split
    over `ep` of the dp ranks) — module docstring."""
    b = DTYPE_BYTES[s.dtype]
    m = DTYPE_BYTES[s.master_dtype]
    separate_master = s.master_dtype != s.dtype
    fsdp = dp > 1 and s.dp_sharding != "none"
    n_layers = len(stage_layer_ids(shape.layers, pp, stage))
    n_layer = shape.learner_layer_params(tp, ep)
    # expert parallel (ep > 1): each layer's 1/ep of the routed experts is this rank's own — never FSDP-sharded
    # or gathered; under FSDP they are stored in the master dtype (cast to b, one layer's, while it computes)
    e_layer = shape.routed_params() // ep if ep > 1 else 0
    n_exp = n_layers * e_layer

    first, last = stage == 0, stage == pp - 1
    # [V × h] matrices on this stage: the embedding (first), an untied lm_head (last); a critic has a value head
    n_vocab = shape.vocab * shape.hidden * (int(first) + int(last and not (shape.tied and first)))
    n_vocab_critic = shape.vocab * shape.hidden * int(first)

    def trainable(n: int, n_vocab: int) -> tuple[float, float, float]:  # params, grads, optimizer
        if fsdp:  # the master-dtype dp shard, its gradient and AdamW m, v — plus what is gathered at a time
            n, unit = n - n_exp, n_layer - e_layer  # what FSDP shards; the experts (ep > 1) whole, below
            root = n - n_layers * unit - n_vocab  # final norm (value head): gathered through forward and backward
            gathered = root + (n_layers * unit if s.dp_sharding == "grad_op" else 2 * unit)
            # the vocabulary rows: a 1/dp shard never gathered, cast to b while it runs; each backward's
            # gradient of them beside the accumulated one
            vocab_cast = (b if b != m else 0) * n_vocab / dp
            exp_cast = (b if b != m else 0) * e_layer
            return (n * m / dp + b * gathered + vocab_cast + n_exp * m + exp_cast,
                    n * m / dp + max((b + m) * max(unit, root), m * n_vocab / dp) + n_exp * m,
                    2 * m * n / dp + 2 * m * n_exp)
        if separate_master:  # 16-bit model + fp32 master: the fp32 grads (the 16-bit ones freed as they move)
            return n * b, n * m, n * (m + 2 * m)
        return n * b, n * b, n * 2 * b

    n_actor = shape.stage_params(pp, stage, tp, learner_ep=ep)
    if s.lora_rank > 0:  # the base frozen in model.dtype (FSDP: its dp shard + the gathered units); the adapter trains
        n_ad = n_layers * shape.lora_layer_params(s.lora_rank, s.lora_targets, tp)
        if last and "lm_head" in s.lora_targets:  # an adapter on the (replicated) LM head: r·(h + V)
            n_ad += s.lora_rank * (shape.hidden + shape.vocab)
        base = (n_actor * b / dp + b * (n_actor - n_layers * n_layer - n_vocab + 2 * n_layer)) if fsdp else n_actor * b
        ap, grads, opt = trainable(n_ad, 0)
        params = base + (n_ad * m / dp if fsdp else ap)
    else:
        params, grads, opt = trainable(n_actor, n_vocab)
    T = s.tokens_per_micro_batch
    a_layer = shape.layer_activation_bytes(b, tp)
    keep = (b * shape.hidden) if s.checkpointing else a_layer
    per_token = n_layers * keep + a_layer + ((4 + b) * shape.hidden if last else 0)
    in_flight = 1
    if pp > 1:
        n_micro = max(pp, s.pp_microbatches)
        in_flight = n_micro if s.pp_schedule == "gpipe" else min(pp - stage, n_micro)
    activations = per_token * T * in_flight
    if s.math_attention:  # one layer's transient s×s work: scores, softmax and their gradients (~5 copies)
        activations += 5 * b * (shape.heads / tp) * T * max(min(s.seq_len, T), 1)
    logits = 0.0
    if last:
        c = s.logits_chunk_tokens if s.logits_chunk_tokens > 0 else T
        if fsdp:  # vocab-parallel: chunks of every dp rank's tokens against V/dp rows, hidden states gathered
            logits = (min(c, dp * T) * shape.vocab / dp * (12 + (4 if s.entropy else 0) + (b if b != 4 else 0))
                      + dp * T * shape.hidden * (b + 4))
        else:
            logits = min(c, T) * shape.vocab * (12 + (4 if s.entropy else 0) + (b if b != 4 else 0))
    parts = {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": opt,
             "activations_bytes": activations, "logits_bytes": logits, "reference_bytes": 0.0,
             "critic_bytes": 0.0, "runtime_bytes": RUNTIME_BYTES}
    if s.reference and s.lora_rank == 0:  # frozen, model.dtype; sharded like the actor (LoRA: the base itself)
        n_f, unit = n_actor - n_exp, n_layer - e_layer  # (its experts split over ep as the actor's)
        parts["reference_bytes"] = (n_f * b / dp + b * (n_f - n_layers * unit - n_vocab + 2 * unit) + n_exp * b
                                    if fsdp else n_actor * b)
    if s.critic:
        cp, cg, co = trainable(shape.stage_params(pp, stage, tp, head_dim_out=1, learner_ep=ep), n_vocab_critic)
        parts["critic_bytes"] = cp + cg + co  # its activations come at another time than the actor's
    return {k: int(v) for k, v in parts.items()}


def server_parts(shape: ModelShape, s: TrainSettings, *, tp: int, pp: int, backend: str,
                 capacity: int) -> tuple[dict[str, int], int | None]:
    """Bytes on one device of a generation server, and its KV-cache capacity in tokens (SGLang)."""
    b = DTYPE_BYTES[s.server_dtype]
    weights = shape.count_params() * b / (tp * pp)
    if backend != "sglang":  # embedded: weights and a small dynamic KV cache, no reservation
        return {"weights_bytes": int(weights), "kv_cache_bytes": 0}, None
    frac = s.mem_fraction_static if s.mem_fraction_static is not None else sglang_default_mem_fraction(tp)
    kv = frac * capacity - weights
    return ({"weights_bytes": int(weights), "kv_cache_bytes": int(kv)},
            max(int(kv // shape.kv_bytes_per_token(b, tp, pp)), 0))


@dataclass
class MemoryPlan:
    devices: list[DeviceMemory]
    shape: ModelShape
    settings: TrainSettings
    capacity: int
    fixes: list[str] = field(default_factory=list)
    # host memory beside the devices', by part: learner rank 0's node (`delta_sent_copy_bytes`: what
    # `weights.sync=delta` keeps of the servers' weights, as last sent, in their dtype)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def over(self) -> list[DeviceMemory]:
        return [d for d in self.devices if not d.fits]

    def to_dict(self) -> dict[str, Any]:
        return {"model_params": self.shape.count_params(), "device_memory_bytes": self.capacity,
                "fits": self.fits, "devices": [d.to_dict() for d in self.devices], "fixes": self.fixes,
                "host": dict(self.host)}


def plan_memory(placement: Any, shape: ModelShape, settings: TrainSettings, capacity: int,
                *, suggest: bool = True, aux_shapes: dict[str, ModelShape | str] | None = None) -> MemoryPlan:
    """Every device of `placement` (allocation.placement.Placement) with its parts. A judge or teacher pool's
    servers (role `judge` / `teacher`) serve `aux_shapes[role]` (`judge.model_path`'s / `teacher.model_path`'s
    shape) at the servers' dtype; a str instead says why its shape is unknown, and their devices are listed
    with that reason and nothing counted."""
    devs: dict[tuple[int, int], DeviceMemory] = {}

    def dev(node: int, device: int) -> DeviceMemory:
        return devs.setdefault((node, device), DeviceMemory(node, device, capacity=capacity))

    gen = placement.allocation.generation
    if gen is not None:
        for srv in placement.servers:
            parts, kv_tokens = server_parts(shape, settings, tp=gen.tp, pp=gen.pp, backend=gen.backend,
                                            capacity=capacity)
            for node, device in zip(srv.nodes, srv.devices):
                d = dev(node, device)
                d.roles.append(f"server {srv.index}")
                for k, v in parts.items():
                    d.add(k, v)
                d.kv_cache_tokens = kv_tokens
    for g in placement.generation:
        role = g.spec.role
        if role not in ("judge", "teacher"):
            continue
        aux = (aux_shapes or {}).get(role)
        for srv in g.servers:
            known = isinstance(aux, ModelShape)
            parts, kv_tokens = (server_parts(aux, settings, tp=g.spec.tp, pp=g.spec.pp, backend=g.spec.backend,
                                             capacity=capacity) if known else ({}, None))
            for node, device in zip(srv.nodes, srv.devices):
                d = dev(node, device)
                d.roles.append(f"{role} server {srv.index}" + ("" if known else f" (not counted: {aux or f'no {role}.model_path'})"))
                for k, v in parts.items():
                    d.add(k, v)
                d.kv_cache_tokens = kv_tokens
    critic_pool = any(c.spec.role == "critic" for c in placement.training)
    for comp in placement.training:
        t = comp.spec
        pool = t.role == "critic"  # a critic on a pool of its own: its ranks hold the value model alone
        # the actor's ranks hold the critic only when no critic component trains it
        s_comp = replace(settings, critic=True, reference=False) if pool else replace(
            settings, critic=settings.critic and not critic_pool)
        for r in comp.ranks:
            d = dev(r.node, r.device)
            experts = (f", {shape.experts // t.ep} of {shape.experts} experts per MoE layer"
                       + (f" (ep {(r.dp_rank * t.tp + r.tp_rank) % t.ep})" if t.ep > 1 else "")) if shape.experts else ""
            d.roles.append(f"{'critic' if pool else 'learner'} rank {r.rank} (dp {r.dp_rank} pp {r.pp_rank} tp {r.tp_rank}"
                           f"{experts})")
            parts = learner_parts(shape, s_comp, pp=t.pp, tp=t.tp, stage=r.pp_rank, dp=t.dp, ep=t.ep)
            if pool:  # the value model's body activations, no actor state and no logits
                parts = {k: (v if k in ("activations_bytes", "critic_bytes", "runtime_bytes") else 0)
                         for k, v in parts.items()}
            for k, v in parts.items():
                d.add(k, v)
            for on in (False, True):
                other = learner_parts(shape, replace(s_comp, checkpointing=on), pp=t.pp, tp=t.tp, stage=r.pp_rank,
                                      dp=t.dp, ep=t.ep)
                key = f"activations_{'with' if on else 'without'}_checkpointing_bytes"
                d.info[key] = d.info.get(key, 0) + other["activations_bytes"]
    if placement.allocation.colocated:  # servers and learner ranks take turns on each shared device
        for d in devs.values():
            if any(r.startswith("server") for r in d.roles) and any(r.startswith("learner") for r in d.roles):
                d.phases = colocated_phases(d.parts, settings)
    plan = MemoryPlan(sorted(devs.values(), key=lambda d: (d.node, d.device)), shape, settings, capacity)
    if settings.delta_sync and placement.training:  # kept in host memory, not on a device: never in `fits`
        plan.host["delta_sent_copy_bytes"] = shape.count_params() * DTYPE_BYTES[settings.server_dtype]
    if suggest and not plan.fits:
        plan.fixes = suggest_fixes(placement, shape, settings, capacity)
    return plan


def _learner_fits(shape: ModelShape, s: TrainSettings, capacity: int, *, pp: int, tp: int, dp: int = 1) -> bool:
    return all(sum(learner_parts(shape, s, pp=pp, tp=tp, stage=st, dp=dp).values()) <= capacity for st in range(pp))


def _valid_tp(shape: ModelShape, tp: int) -> bool:
    return shape.heads % tp == 0 and shape.kv_heads % tp == 0 and shape.intermediate % tp == 0


def suggest_fixes(placement: Any, shape: ModelShape, s: TrainSettings, capacity: int) -> list[str]:
    """Knobs that exist today and make the over-full devices fit, each as the user would type it.

    Learner: dp sharding (FSDP) when replicated, checkpointing, a smaller micro-batch, bf16 compute with
    its fp32 master, logit chunks, then more pipeline stages / tensor parallel in the allocation's
    training side (more devices per dp group). Servers: a larger t."""
    fixes: list[str] = []
    alloc = placement.allocation
    tr = alloc.training
    if tr is not None and not _learner_fits(shape, s, capacity, pp=tr.pp, tp=tr.tp, dp=tr.dp):
        pp, tp, dp = tr.pp, tr.tp, tr.dp
        knobs: list[tuple[str, TrainSettings]] = []
        if s.dp_sharding == "none" and dp > 1:
            knobs.append(("train.dp_sharding=full", replace(s, dp_sharding="full")))
        if not s.checkpointing:
            knobs.append(("model.enable_gradient_checkpointing=true", replace(s, checkpointing=True)))
        if s.logits_chunk_tokens == 0:
            knobs.append(("train.logits_chunk_tokens=1024", replace(s, logits_chunk_tokens=1024)))
        if s.dtype == "float32":
            knobs.append(("model.dtype=bfloat16", replace(s, dtype="bfloat16")))
        found = [k for k, s2 in knobs if _learner_fits(shape, s2, capacity, pp=pp, tp=tp, dp=dp)]
        mb = s.micro_batch_tokens // 2
        while mb >= max(256, s.seq_len) and not found:
            s2 = replace(s, micro_batch_tokens=mb)
            if _learner_fits(shape, s2, capacity, pp=pp, tp=tp, dp=dp):
                found.append(f"train.micro_batch_tokens={mb}")
            mb //= 2
        fixes += found
        # More model parallelism in the training side: the fewest devices per dp replica that fit with the
        # settings as given, and (when fewer) with every knob above on.
        best_all = s
        for _, s2 in knobs:
            best_all = replace(best_all, **{f: getattr(s2, f) for f in ("checkpointing", "logits_chunk_tokens", "dtype",
                                                                        "dp_sharding")
                                            if getattr(s2, f) != getattr(s, f)})
        prev = None
        for settings, extra in ((s, ""), (best_all, " with " + " ".join(k for k, _ in knobs))):
            if settings is best_all and not knobs:
                break
            cand = []
            for p2 in (1, 2, 4, 8, 16):
                for t2 in (1, 2, 4, 8):
                    if p2 * t2 <= pp * tp or p2 > shape.layers or not _valid_tp(shape, t2):
                        continue
                    if p2 > 1 and shape.tied:
                        continue  # the learner refuses pp with tied embeddings
                    if _learner_fits(shape, settings, capacity, pp=p2, tp=t2, dp=dp):
                        cand.append((p2 * t2, t2, p2))
            if cand and (prev is None or min(cand)[0] < prev):
                size, t2, p2 = min(cand)
                prev = size
                fixes.append(f"--allocation {_with_training(alloc, tr, p2, t2)} ({tr.dp} × {size} learner devices){extra}")
        if not fixes:
            fixes.append("none of the knobs available today fits this model's learner state on these devices"
                         + (" (dp ranks hold full replicas: train.dp_sharding=none)" if s.dp_sharding == "none"
                            else f" (its state is already sharded over d{dp}: more learner devices)"))
    gen = alloc.generation
    if gen is not None and gen.backend == "sglang":
        parts, _ = server_parts(shape, s, tp=gen.tp, pp=gen.pp, backend=gen.backend, capacity=capacity)
        if parts["kv_cache_bytes"] <= 0:
            for t2 in (2, 4, 8):
                if t2 > gen.tp and _valid_tp(shape, t2):
                    p2, _ = server_parts(shape, s, tp=t2, pp=gen.pp, backend=gen.backend, capacity=capacity)
                    if p2["kv_cache_bytes"] > 0:
                        fixes.append(f"generation side t{t2} (servers of {t2 * gen.pp} devices)")
                        break
    return fixes


def _with_training(alloc: Any, tr: Any, pp: int, tp: int) -> str:
    """The allocation string with its training side's p and t replaced (the dims alone when the string is
    not a simple `generation+training`)."""
    dims = f"d{tr.dp}p{pp}t{tp}"
    src = str(getattr(alloc, "source", "") or "")
    if src.count("+") == 1 and "|" not in src and "(" not in src:
        head, tail = src.split("+")
        prefix = tail[: tail.index(":") + 1] if ":" in tail else ""
        if "m" in tail.split(":")[-1]:  # legacy spelling: m is the tensor-parallel size
            dims = dims.replace("t", "m")
        text = f"{head.strip()}+{prefix.strip()}{dims}"
        try:
            from allocation.parser import parse_allocation

            parse_allocation(text)
            return text
        except Exception:  # noqa: BLE001 — the dims alone still say it
            pass
    return f"(training side {dims})"


LEARNER_KEYS = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "logits_bytes",
                "reference_bytes", "critic_bytes", "runtime_bytes")
SERVER_KEYS = ("weights_bytes", "kv_cache_bytes")


def format_memory(plan: MemoryPlan) -> str:
    """Per-device table in GiB; over-full devices marked, then the fixes."""
    sh, s = plan.shape, plan.settings
    lines = [
        "",
        f"memory: {sh.model_type or 'decoder'} {sh.count_params() / 1e9:.2f}B params (h {sh.hidden}, L {sh.layers}, "
        f"heads {sh.heads}/{sh.kv_heads}, vocab {sh.vocab}"
        + (f"; {sh.experts} experts, top-{sh.top_k} in {sh.sparse_layers} layers, {sh.active_params() / 1e9:.2f}B "
           f"active per token" if sh.experts else "") + f"); device {fmt_bytes(plan.capacity)}",
        f"        learner: model.dtype={s.dtype} train.master_dtype={s.master_dtype} "
        f"train.dp_sharding={s.dp_sharding} checkpointing={'on' if s.checkpointing else 'off'} micro-batch {s.tokens_per_micro_batch} tokens, "
        f"logits chunk {s.logits_chunk_tokens or 'off'}; servers: {s.server_dtype}",
    ]
    cols = [("params", "params_bytes"), ("grads", "grads_bytes"), ("optim", "optimizer_bytes"),
            ("activ", "activations_bytes"), ("logits", "logits_bytes"), ("ref", "reference_bytes"),
            ("critic", "critic_bytes"), ("weights", "weights_bytes"), ("kv", "kv_cache_bytes")]
    header = ["node:dev"] + [c for c, _ in cols] + ["total", "fits", "roles"]
    rows = []
    for d in plan.devices:
        row = [f"{d.node}:{d.device}"] + [f"{d.parts[k] / GIB:.1f}" if k in d.parts else "-" for _, k in cols]
        row += [f"{d.total_bytes / GIB:.1f}", "yes" if d.fits else "OVER", "; ".join(d.roles)]
        if d.kv_cache_tokens is not None:
            row[-1] += f" (KV {d.kv_cache_tokens} tokens)"
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines.extend("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
    learners = [d for d in plan.devices if "activations_without_checkpointing_bytes" in d.info]
    if learners:
        worst = max(learners, key=lambda d: d.info["activations_without_checkpointing_bytes"])
        lines.append(f"activations of the fullest learner device ({worst.node}:{worst.device}): "
                     f"{fmt_bytes(worst.info['activations_without_checkpointing_bytes'])} without checkpointing, "
                     f"{fmt_bytes(worst.info['activations_with_checkpointing_bytes'])} with "
                     "(model.enable_gradient_checkpointing)")
    for d in plan.devices:
        if d.phases:
            p = d.phases
            lines.append(f"co-located {d.node}:{d.device} (total = its fullest phase): generation {fmt_bytes(p['generation_bytes'])}, "
                         f"training {fmt_bytes(p['training_bytes'])}, handoff {fmt_bytes(p['handoff_bytes'])}"
                         + (f"; without colocate.release_memory {fmt_bytes(sum(d.parts.values()))}"
                            if s.release_memory else " (colocate.release_memory=false: the server keeps its memory)"))
    if "delta_sent_copy_bytes" in plan.host:
        lines.append(f"host memory of learner rank 0's node: {fmt_bytes(plan.host['delta_sent_copy_bytes'])} for "
                     f"weights.sync=delta (the servers' weights as last sent, {s.server_dtype})")
    over = plan.over()
    if over:
        lines.append(f"does not fit: {len(over)} of {len(plan.devices)} devices over {fmt_bytes(plan.capacity)}")
        for f in plan.fixes:
            lines.append(f"  fix: {f}")
    else:
        lines.append(f"fits: every device within {fmt_bytes(plan.capacity)}")
    return "\n".join(lines)


def refusal_message(plan: MemoryPlan) -> str:
    """One paragraph for `launcher run` when the plan does not fit its devices."""
    worst = max(plan.over(), key=lambda d: d.total_bytes)
    parts = ", ".join(f"{k.removesuffix('_bytes')} {fmt_bytes(v)}" for k, v in worst.parts.items() if v)
    fixes = "; ".join(plan.fixes) or "a larger allocation"
    return (f"the plan does not fit its devices: {len(plan.over())} of {len(plan.devices)} devices need more than "
            f"{fmt_bytes(plan.capacity)} (device {worst.node}:{worst.device}, {'; '.join(worst.roles)}: "
            f"{fmt_bytes(worst.total_bytes)} = {parts}). Fix: {fixes}. See `launcher plan --model` "
            f"(launcher.check_memory=false starts anyway, if you measured that it fits).")
