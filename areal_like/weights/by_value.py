"""Tensors by value in an HTTP body, as SGLang reads a `serialized_named_tensors` entry: a plain pickle (each
storage by value, through `torch.storage._load_from_bytes`, which SGLang's SafeUnpickler allows), base64 text.
No CUDA-IPC handle, no file descriptor: it reaches a server on another node. Used by the LoRA adapter push
(adapter_tensors.py) and the SGLang delta push (sglang_delta.py). Torch only."""

from __future__ import annotations

import base64
import pickle

import torch


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it when it is a view into a larger storage: a pickled tensor carries its whole storage."""
    whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


def serialize_tensors(named: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]]) -> str:
    """The base64 text of one `serialized_named_tensors` entry: `{name: tensor}` or `[(name, tensor), …]`
    pickled by value."""
    own = ({n: own_storage(t) for n, t in named.items()} if isinstance(named, dict)
           else [(n, own_storage(t)) for n, t in named])
    return base64.b64encode(pickle.dumps(own, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
