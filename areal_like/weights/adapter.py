"""A LoRA adapter on disk and on the wire, in peft's format — what the learner pushes, checkpoints
and exports with `model.lora_rank` > 0, and what the servers load (ours and SGLang's
`/load_lora_adapter`).

    <dir>/adapter_config.json          peft's LoraConfig (r, lora_alpha, target_modules, peft_type
                                       LORA, base_model_name_or_path …): `adapter_config`
    <dir>/adapter_model.safetensors    the adapter tensors, peft's saved names:
                                       `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
                                       (A: [r, in], B: [out, r])

Inside areal_like an adapter tensor is named without peft's `base_model.model.` prefix
(`model.layers.0.self_attn.q_proj.lora_A.weight`, `learner.lora.canonical_name`): the names a push
carries. `file_key` / `tensor_name` convert.

`ADAPTER_NAME` is the one name the servers serve a run's adapter under (`lora_path` of every
generate request): each push replaces that adapter inside the push's pause, so a request never
runs on a half-replaced one and a resubmitted one continues on the new adapter.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from areal_like.api.config import LORA_ADAPTER_NAME as ADAPTER_NAME  # (lora_name, lora_path)
from areal_like.weights.source import WeightSource, as_source

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


# What marks a parameter of peft's LoRA layers (`…q_proj.lora_A.<adapter>.weight`), in the learner's
# model and the embedded server's alike; peft renames the wrapped base parameter `…q_proj.base_layer.weight`.
LORA_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def is_lora_name(name: str) -> bool:
    """A parameter of an adapter (not of the base)."""
    return any(m in name for m in LORA_MARKERS)


def base_layer_name(name: str) -> str:
    """The HF name of a base parameter inside a peft-wrapped module (`.base_layer` dropped)."""
    return name.replace(".base_layer.", ".")


def file_key(name: str) -> str:
    return name if name.startswith(PEFT_PREFIX) else PEFT_PREFIX + name


def tensor_name(key: str) -> str:
    return key.removeprefix(PEFT_PREFIX)


def adapter_config(settings, base_model: str | None) -> dict[str, Any]:
    """peft's adapter_config.json for `settings` (`learner.lora.LoraSettings`)."""
    cfg = settings.peft_config()
    cfg.base_model_name_or_path = base_model
    cfg.inference_mode = True
    d = cfg.to_dict()
    for k, v in list(d.items()):  # sets (target_modules) → sorted lists: JSON
        if isinstance(v, set):
            d[k] = sorted(v)
    return json.loads(json.dumps(d))  # plain JSON values (peft's enums are str subclasses: "LORA")


class AdapterWeights:
    """A `WeightSource` of an adapter that also carries its config: what a push of a LoRA learner
    reads (`Trainer.weight_source`). The pushers see `adapter_config` and load it as an adapter."""

    def __init__(self, source: WeightSource, config: dict[str, Any]) -> None:
        self.source = source
        self.adapter_config = config
        self.meta = source.meta
        self.device = source.device
        self.gathers = source.gathers

    def open(self, indices: Sequence[int]):
        return self.source.open(indices)

    @property
    def wire_dtype(self):
        """The dtype the wrapped source gathers in (`weights.source.gather_in`)."""
        return getattr(self.source, "wire_dtype", None)

    @wire_dtype.setter
    def wire_dtype(self, dtype) -> None:
        if hasattr(self.source, "wire_dtype"):
            self.source.wire_dtype = dtype


def is_adapter(weights: Any) -> bool:
    return getattr(weights, "adapter_config", None) is not None


def adapter_file_tensors(weights: WeightSource | Sequence[tuple[str, torch.Tensor]], *,
                         dtype: torch.dtype | None = None, keep: bool = True) -> dict[str, torch.Tensor]:
    """The adapter's tensors by peft's saved names (`file_key`), on the CPU, floating-point ones cast to
    `dtype` (None = as they are). With a gathering source every rank of the learner pool calls it (the
    opens are collectives); only the one with `keep` keeps the tensors."""
    from areal_like.weights.source import wire_dtype_of

    src = as_source(weights)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in src.open(range(len(src.meta))):
        if t is None or not keep:
            continue
        tensors[file_key(name)] = t.detach().to("cpu", dtype=wire_dtype_of(t.dtype, dtype)).contiguous()
    return tensors


def write_adapter_dir(weights: WeightSource | Sequence[tuple[str, torch.Tensor]], out_dir: str,
                      config: dict[str, Any], *, dtype: torch.dtype | None = None, write: bool = True) -> int:
    """`out_dir` as peft writes it: adapter_config.json + adapter_model.safetensors (one file; an
    adapter is small), floating-point tensors cast to `dtype` (None = as they are). With a gathering
    source every rank of the learner pool calls it; only the one with `write` writes. Returns bytes."""
    from safetensors.torch import save_file

    tensors = adapter_file_tensors(weights, dtype=dtype, keep=write)
    if not write:
        return 0
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_adapter_config(path: str, where: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{where}={path!r}: no {CONFIG_FILE} there — give a peft adapter directory "
                                f"(adapter_config.json + {WEIGHTS_FILE}, as PeftModel.save_pretrained writes)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{where}={path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise ValueError(f"{where}={path!r}: a DoRA adapter (use_dora) is not served: give a plain LoRA adapter")
    return cfg


def read_adapter_tensors(path: str, where: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors by areal_like name (peft's prefix dropped)."""
    from safetensors.torch import load_file

    f = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(f):
        raise FileNotFoundError(f"{where}={path!r}: no {WEIGHTS_FILE} there (a .bin adapter: re-save it with "
                                f"safe_serialization=True)")
    return {tensor_name(k): v for k, v in load_file(f).items()}


def read_adapter(path: str, settings, where: str = "model.lora_path") -> Mapping[str, torch.Tensor]:
    """An adapter to start training from, checked against `settings` (rank, target modules)."""
    cfg = read_adapter_config(path, where)
    if int(cfg.get("r", -1)) != settings.rank:
        raise ValueError(f"{where}={path!r} has rank r={cfg.get('r')}, but model.lora_rank={settings.rank}: "
                         f"set model.lora_rank={cfg.get('r')}")
    if float(cfg.get("lora_alpha", settings.alpha)) != settings.alpha:
        raise ValueError(f"{where}={path!r} has lora_alpha={cfg.get('lora_alpha')}, but model.lora_alpha="
                         f"{settings.alpha:g}: set model.lora_alpha={cfg.get('lora_alpha')}")
    targets = cfg.get("target_modules")
    targets = set(targets) if isinstance(targets, list) else {targets}
    if targets != set(settings.target_modules) and targets != {"all-linear"}:
        raise ValueError(f"{where}={path!r} targets {sorted(targets)}, but model.target_modules="
                         f"{list(settings.target_modules)}: set model.target_modules={sorted(targets)}")
    return read_adapter_tensors(path, where)
