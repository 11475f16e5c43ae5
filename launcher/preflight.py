"""Checks of the paths a run depends on, before anything starts; demo names resolved to the cache.

Every model and data path in the config is either a demo name (`demo:tiny-qwen2`, `demo:next-digit`,
`demo:next-digit-val`: built once in `$AREAL_LIKE_CACHE/demo`, default ~/.cache/areal_like/demo) or a
path the user gives — which is checked and never created or written. A failure names the key, the
path and the fix. Nothing here starts a process.
"""

from __future__ import annotations

import os
import re

from areal_like.api.config import ExperimentConfig

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PreflightError(ValueError):
    """A path of the config that cannot work: the message names the key, the path and the fix."""


def _resolve(value: str, key: str, log) -> str:
    from areal_like.data.demo_task import resolve_demo_name

    if not value.startswith("demo:"):
        return value
    try:
        path = resolve_demo_name(value, key)
    except ValueError as e:
        raise PreflightError(str(e)) from None
    log(f"{key}={value} → {path}")
    return path


def check_model_dir(path: str, key: str) -> None:
    if not path:
        raise PreflightError(f"{key} is not set: set {key}=/path/to/hf_model_dir (or {key}=demo:tiny-qwen2 "
                             "for the demo's tiny model)")
    if not os.path.isdir(path):
        if _HUB_ID.match(path) and not os.path.exists(path):
            name = path.rsplit("/", 1)[1]
            raise PreflightError(f"{key}={path} is not a local directory, and areal_like downloads nothing at run "
                                 f"time: download it first, e.g. `huggingface-cli download {path} --local-dir "
                                 f"models/{name}`, then pass {key}=models/{name}")
        raise PreflightError(f"{key}={path} does not exist: point {key} at an HF model directory "
                             "(config.json, safetensors, tokenizer files)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PreflightError(f"{key}={path} is not an HF model directory (no config.json): point {key} at the "
                             "directory `save_pretrained` wrote")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                                "tokenizer.model")):
        raise PreflightError(f"{key}={path} has no tokenizer files (tokenizer.json / tokenizer_config.json): "
                             "save the tokenizer into the model directory")


def resolve_and_check(cfg: ExperimentConfig, log=lambda msg: None) -> None:
    """Resolve demo names in `cfg` (in place, so every role reads real paths from config.json) and
    check every model and data path; raises PreflightError."""
    from areal_like.data.dataset import check_verl_parquet

    cfg.model.path = _resolve(cfg.model.path, "model.path", log)
    check_model_dir(cfg.model.path, "model.path")
    for key, sec in (("critic.path", cfg.critic), ("ref.path", cfg.ref)):
        if sec.path is not None:
            sec.path = _resolve(sec.path, key, log)
            check_model_dir(sec.path, key)
    if not cfg.data.train_files:
        raise PreflightError("data.train_files is empty: set data.train_files=[path/to/train.parquet] "
                             "(or [demo:next-digit] for the demo task)")
    for name, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for i, f in enumerate(files):
            key = f"{name}[{i}]"
            files[i] = path = _resolve(f, key, log)
            try:
                check_verl_parquet(path, prompt_key=cfg.data.prompt_key, where=f"{key}={path}")
            except (FileNotFoundError, ValueError) as e:
                raise PreflightError(str(e)) from None
    r = cfg.custom_reward_function
    if r.path is not None and not os.path.isfile(r.path):
        raise PreflightError(f"custom_reward_function.path={r.path} does not exist: point it at the .py file that "
                             f"defines {r.name}")
