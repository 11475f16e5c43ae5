"""Typed experiment configuration: YAML file + `a.b.c=value` overrides → `ExperimentConfig`.

Every section is a msgspec Struct that forbids unknown fields, so a typo fails before anything
starts, naming the key and the file. Names that AReaL/verl users already type are accepted as
aliases where they mean the same thing (see `ALIASES`). This module does not start anything.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Literal

import msgspec
import yaml


class ConfigError(ValueError):
    """A bad config: the message names the key, the file and the fix."""


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Section):
    path: str = "runs/_assets/tiny_model"
    """HF model directory (config.json + safetensors + tokenizer files)."""
    build_demo_if_missing: bool = True
    """If `path` does not exist, build the tiny demo model there (examples/build_demo.py)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DataConfig(_Section):
    train_files: list[str] = msgspec.field(default_factory=lambda: ["runs/_assets/demo_train.parquet"])
    """verl-format parquet files: `prompt` (text or chat list), `reward_model.ground_truth`, `data_source`."""
    prompt_key: str = "prompt"
    max_prompt_length: int = 256
    shuffle: bool = True
    apply_chat_template: bool = False
    """Apply the tokenizer's chat template when `prompt` is a chat list (always when it is a list)."""
    build_demo_if_missing: bool = True


class RewardFunctionConfig(_Section):
    path: str | None = None
    """Python file defining the reward function; None = the built-in reward for each `data_source`."""
    name: str = "compute_score"
    timeout_s: float = 10.0
    """A reward call that takes longer counts as reward 0 and is logged; it never stalls rollout."""


class GenerationConfig(_Section):
    n: int = 8
    """Samples per prompt (group size)."""
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = msgspec.field(default_factory=list)


class RolloutConfig(_Section):
    max_staleness: int = 1
    """η: no group is started more than η policy versions ahead of the learner; 0 = synchronous RL.
    Alias: `max_head_offpolicyness` (AReaL)."""
    workers: int = 1
    """Rollout worker processes."""
    max_concurrent_groups: int = 16
    """Groups in flight per worker (the staleness gate bounds the total across workers)."""
    request_timeout_s: float = 120.0
    workflow: str = "rlvr"


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    base_port: int = 0
    """0 = pick free ports."""
    max_batch_size: int = 64
    max_context_len: int = 512
    health_timeout_s: float = 120.0
    api_key: str | None = None
    admin_api_key: str | None = None
    device: str = "cpu"
    torch_threads: int = 1
    """Compute threads per server; on a shared CPU, torch's default (one per core) thrashes ~10×."""


class BufferConfig(_Section):
    redis_url: str | None = None
    """None = the launcher starts its own redis-server (AOF on, 127.0.0.1, password) in the run dir."""
    password_env: str = "AREAL_LIKE_REDIS_PASSWORD"
    stream: str = "areal_like"
    """Key prefix for the stream and the gate's keys."""
    max_groups: int = 1024
    """Back-pressure: producers wait while the stream holds more unconsumed groups than this."""
    block_ms: int = 1000
    socket_timeout_s: float = 10.0


class TrainConfig(_Section):
    batch_size: int = 4
    """B: groups per training step (each of `generation.n` samples)."""
    total_steps: int = 40
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_betas: list[float] = msgspec.field(default_factory=lambda: [0.9, 0.999])
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.28
    behav_imp_weight_cap: float | None = 5.0
    """Cap on π_prox/π_behav; None disables the behaviour correction."""
    behav_imp_weight_mode: Literal["cap", "mask"] = "cap"
    adv_norm: Literal["grpo", "drgrpo"] = "grpo"
    max_consume_staleness: int | None = None
    """Consume-time guard: groups older than this many versions (None = η from rollout) are …"""
    consume_stale_policy: Literal["drop", "keep"] = "drop"
    """… dropped (acked, counted dropped:stale) or kept and trained anyway (counted stale_kept)."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch (padded B×T); gradients accumulate over micro-batches."""
    warmup_steps: int = 0
    """Linear LR warm-up over this many applied optimizer steps (0 = none)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """LR after warm-up: constant, or linear/cosine decay to lr·min_lr_ratio at total_steps."""
    min_lr_ratio: float = 0.0
    pp_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule over micro-batches when the allocation's training side has p > 1."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per step; 0 = max(p, the token budget's count)."""
    save_freq: int = 0
    """Checkpoint every this many steps (0 = never)."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; None = `<run dir>/checkpoints`."""
    resume_mode: str = "auto"
    """`auto` (latest checkpoint in checkpoint_dir, if any), `disable`, or a checkpoint directory path."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk (older ones are deleted after a successful save)."""
    export_hf: bool = False
    """Also write an HF-format model dir (`hf/`) inside each checkpoint."""
    collective_timeout_s: float = 300.0
    """Timeout of every learner-pool collective (process sub-groups, pipeline send/recv)."""
    seed: int = 1


class WeightSyncConfig(_Section):
    mode: Literal["distributed", "disk"] = "distributed"
    bucket_mb: float = 512.0
    timeout_s: float = 120.0


class LauncherConfig(_Section):
    max_learner_restarts: int = 0
    """A learner rank that dies restarts the whole pool from its latest checkpoint (train.save_freq > 0)
    up to this many times; servers, rollouts and Redis keep running. 0 = a dead learner ends the run."""
    stop_timeout_s: float = 60.0
    """On Ctrl-C/stop, how long the learner may take to finish its step, checkpoint and commit."""


class MetricsConfig(_Section):
    prometheus: bool = True
    """Each role serves /metrics on its own port (recorded in the run dir's ports.json)."""


class ExperimentConfig(_Section):
    experiment_name: str = "demo"
    seed: int = 1
    allocation: str = "embedded.d1p1t1+d1p1t1"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    custom_reward_function: RewardFunctionConfig = msgspec.field(default_factory=RewardFunctionConfig)
    generation: GenerationConfig = msgspec.field(default_factory=GenerationConfig)
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    weights: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    launcher: LauncherConfig = msgspec.field(default_factory=LauncherConfig)

    def validate(self) -> None:
        """Cross-field checks; each error says which setting to change."""
        if self.rollout.max_staleness < 0:
            raise ConfigError("rollout.max_staleness must be ≥ 0 (0 = synchronous RL): set rollout.max_staleness=0")
        if self.generation.n < 1:
            raise ConfigError("generation.n (group size) must be ≥ 1: set generation.n=8")
        if self.train.batch_size < 1:
            raise ConfigError("train.batch_size (groups per step) must be ≥ 1: set train.batch_size=4")
        if self.rollout.workers < 1:
            raise ConfigError("rollout.workers must be ≥ 1")
        if self.train.eps_clip_low < 0 or self.train.eps_clip_high < 0:
            raise ConfigError("train.eps_clip_low/high must be ≥ 0")
        if self.launcher.max_learner_restarts > 0 and self.train.save_freq <= 0:
            raise ConfigError("launcher.max_learner_restarts needs checkpoints to restart from: set train.save_freq=1 "
                              "(or larger)")
        if self.generation.max_new_tokens < 1:
            raise ConfigError("generation.max_new_tokens must be ≥ 1")


# Names users already know → our key. Applied to file keys and to overrides alike.
ALIASES: dict[str, str] = {
    "max_head_offpolicyness": "rollout.max_staleness",
    "rollout.max_head_offpolicyness": "rollout.max_staleness",
    "max_staleness": "rollout.max_staleness",
    "gconfig.n_samples": "generation.n",
    "rollout.n": "generation.n",
    "actor_rollout_ref.rollout.n": "generation.n",
    "group_size": "generation.n",
    "batch_size": "train.batch_size",
    "data.train_batch_size": "train.batch_size",
    "lr": "train.lr",
    "actor.optimizer.lr": "train.lr",
    "optim.lr": "train.lr",
    "total_training_steps": "train.total_steps",
    "trainer.total_training_steps": "train.total_steps",
    "total_steps": "train.total_steps",
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


def load_config(path: str | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load a YAML file (or defaults when `path` is None) with overrides; validate everything."""
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
    try:
        cfg = msgspec.convert(tree, ExperimentConfig, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        # msgspec says e.g. "Object contains unknown field `lrr` - at `$.train`"
        raise ConfigError(f"{where}: {msg.replace('$.', '').replace('`$`', 'top level')}") from None
    cfg.validate()
    return cfg


def config_to_dict(cfg: ExperimentConfig) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def encode_config(cfg: ExperimentConfig) -> bytes:
    """JSON for handing the resolved config to child processes (never pickle)."""
    return msgspec.json.encode(cfg)


def decode_config(data: bytes | str) -> ExperimentConfig:
    return msgspec.json.decode(data, type=ExperimentConfig)
