"""`weights.sync=delta` to SGLang servers: the update travels through SGLang's own
`/update_weights_from_tensor`, and SGLang applies it with this module's `load_delta`, which the
launcher registers with `--custom-weight-loader` (SGLang 0.5.23's `WeightUpdater.update_weights_from_tensor`
calls a `load_format` listed there as `loader(model, named_tensors)` on every TP rank).

    learner (rank 0)                                      each SGLang server (t TP ranks)
    diff → packed buckets (weights/delta.py's layout)
      → pickle by value → base64, one copy per TP rank ─ pause(abort) ─► /begin_weight_update
                                                                         /update_weights_from_tensor
                                                                           {serialized_named_tensors,
                                                                            load_format: LOADER,
                                                                            weight_version}
                                                                           → load_delta(model, named_tensors)
                                                       ◄─ flush, continue    /end_weight_update

With `weights.mode=disk` the learner writes the delta as a directory (weights/disk.py `write_delta_dir`, the
same buckets in `delta.safetensors` plus `delta.json`) and the payload is one header naming it, with an empty
tensor: each server reads the files from the filesystem it shares with the learner, inside the pause
(SGLang's own disk route loads whole checkpoints only).

The payload is a plain pickle of ``[(header, bucket), …]``: each bucket a uint8 CPU tensor in the wire
layout of weights/delta.py (the broadcast's and the disk file's), each header the JSON of
``{"areal_like_delta": 1, "base_version": …, "deltas": [[name, dtype, shape, encoding, count], …]}``.
SGLang reads it with its SafeUnpickler (storages by value through `torch.storage._load_from_bytes`):
no CUDA-IPC handle, no file, so it reaches a server on another node — megabytes where a full push is
gigabytes. SGLang has no route that stages an update while it generates, so the bytes travel inside the
pause (the embedded servers' broadcast stages them before it).

Why a loader of our own, not SGLang's `load_weights`: SGLang stores a model in its own layout (q, k and v
stacked into `qkv_proj`, gate and up into `gate_up_proj`, every linear split over the TP ranks, the
vocabulary padded), and its per-parameter weight loaders take whole Hugging Face tensors. `load_delta`
lets SGLang's own loaders place the changed elements, so every layout SGLang loads is handled as a full
load handles it: for each changed tensor it runs the model's `load_weights` twice — on the tensor with
the new values at the changed positions (zeros elsewhere), and on a mask of the changed positions —
with every parameter's `weight_loader` redirected into a scratch copy of that parameter; the positions
the mask reached in the scratch are this rank's changed elements, and the values scratch holds their new
values. Nothing is written until every tensor of the update was placed; then each parameter's changed
elements are overwritten (`index_copy_`, no arithmetic): a delta leaves a server bit-identical to a
full push of the same version, or — a payload that does not decode, a tensor SGLang's loader cannot
place — changes nothing and fails the request.

This module imports torch and weights/delta.py (and its torch-only safetensors reader) only: SGLang's process imports it from the package root
the launcher puts on its PYTHONPATH, and needs none of the learner's dependencies.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

import torch

from areal_like.weights import delta as deltas_
from areal_like.weights.by_value import serialize_tensors

log = logging.getLogger(__name__)

LOADER = "areal_like.weights.sglang_delta.load_delta"
"""The `load_format` of a delta update, and the `--custom-weight-loader` SGLang servers start with."""
HEADER = "areal_like_delta"
FORMAT = 1


# --------------------------------------------------------------------------------------- sender
def named_tensors(packed: Sequence[tuple[list[list], torch.Tensor]], base_version: str) -> list[tuple[str, torch.Tensor]]:
    """The update as SGLang's `named_tensors`: one (header, bucket) pair per packed bucket."""
    return [(json.dumps({HEADER: FORMAT, "base_version": base_version, "deltas": described}), buf.contiguous())
            for described, buf in packed]


def path_named_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """A delta written as a directory (`weights.mode=disk`: weights/disk.py `write_delta_dir`) as SGLang's
    `named_tensors`: one header naming the directory, with an empty tensor; the loader reads the files."""
    return [(json.dumps({HEADER: FORMAT, "path": path}), torch.zeros(0, dtype=torch.uint8))]


def serialize(named: list[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` entry: the (header, bucket) pairs by value (by_value.py)."""
    return serialize_tensors(named)


# --------------------------------------------------------------------------------------- receiver
def decode(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[str | None, list[deltas_.TensorDelta]]:
    """The base version and every tensor's delta of an update; ValueError naming what does not decode."""
    out: list[deltas_.TensorDelta] = []
    bases = set()
    for i, (header, buf) in enumerate(named):
        try:
            meta = json.loads(header)
        except (TypeError, ValueError):
            raise ValueError(f"entry {i} of the update is not a delta bucket (its name is not the JSON header "
                             f"{LOADER} writes): {str(header)[:80]!r}") from None
        if not isinstance(meta, dict) or meta.get(HEADER) != FORMAT:
            raise ValueError(f"entry {i}: not a format-{FORMAT} delta header ({str(header)[:80]!r})")
        if "path" in meta:  # a delta directory on a filesystem this server reads (weights.mode=disk)
            manifest, got = deltas_.read_delta_dir(str(meta["path"]))
            bases.add(manifest.get("base_version"))
            out += got
            continue
        bases.add(meta.get("base_version"))
        if buf.dtype != torch.uint8 or buf.dim() != 1:
            raise ValueError(f"entry {i}: the bucket is {buf.dtype} {tuple(buf.shape)}, not flat uint8")
        out += [d.prepare() for d in deltas_.unpack(buf.cpu(), meta.get("deltas") or [])]
    if len(bases) > 1:
        raise ValueError(f"the update's buckets name different base versions: {sorted(map(str, bases))}")
    names = [d.name for d in out]
    if len(set(names)) != len(names):
        raise ValueError("the update names a tensor twice")
    return (bases.pop() if bases else None), out


def _dense(d: deltas_.TensorDelta) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensor's new values at its changed positions (zeros elsewhere) and the mask of those positions
    (1 there, 0 elsewhere), both in the tensor's dtype and shape."""
    if d.encoding == "dense":
        return d.values.view(d.shape), torch.ones(d.shape, dtype=d.dtype)
    values = torch.zeros(d.shape, dtype=d.dtype)
    mask = torch.zeros(d.shape, dtype=d.dtype)
    values.view(-1)[d.where] = d.values
    mask.view(-1)[d.where] = 1
    return values, mask


def _through_loaders(model, name: str, tensor: torch.Tensor) -> tuple[dict[int, tuple], int]:
    """Run `model.load_weights([(name, tensor)])` with every parameter's weight loader writing into a
    zeroed scratch copy of the parameter instead of the parameter: {id(param): (param, scratch)} of the
    parameters a loader wrote from `tensor` (or a view of it), and how many loader calls came with
    another tensor (skipped: e.g. a tied LM head copied from the embedding's current weights)."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    scratch: dict[int, tuple] = {}
    foreign = [0]
    storage = tensor.untyped_storage().data_ptr()
    params = {id(p): p for p in model.parameters()}
    saved = {k: p.__dict__.get("weight_loader") for k, p in params.items()}

    def redirect(orig):
        def loader(param, loaded, *args, **kwargs):
            if not isinstance(loaded, torch.Tensor) or loaded.untyped_storage().data_ptr() != storage:
                foreign[0] += 1
                return None
            entry = scratch.get(id(param))
            if entry is None:
                entry = scratch[id(param)] = (param, torch.zeros_like(param.data))
            real = param.data
            param.data = entry[1]
            try:
                return orig(param, loaded, *args, **kwargs)
            finally:
                param.data = real
        return loader

    try:
        for k, p in params.items():
            p.weight_loader = redirect(saved[k] if saved[k] is not None else default_weight_loader)
        model.load_weights([(name, tensor)])
    finally:
        for k, p in params.items():
            if saved[k] is None:
                p.__dict__.pop("weight_loader", None)
            else:
                p.weight_loader = saved[k]
    return scratch, foreign[0]


def place(model, d: deltas_.TensorDelta) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Where tensor `d.name`'s changed elements go on this rank, as SGLang's own loaders place the tensor:
    (parameter, flat positions in it, their new values) per parameter it reaches. [] when SGLang's
    `load_weights` skips the name (as a full load does, e.g. a tied LM head); ValueError when a loader
    was handed a copy of the tensor instead of it (its positions cannot be followed)."""
    values, mask = _dense(d)
    by_value, foreign_v = _through_loaders(model, d.name, values)
    by_mask, _ = _through_loaders(model, d.name, mask)
    if not by_value:
        if foreign_v:
            raise ValueError(f"SGLang's loader for tensor {d.name!r} placed a copy of it, not the tensor: a delta "
                             "cannot follow its positions (set weights.sync=full)")
        log.debug("tensor %r: SGLang's load_weights skips it (as a full load does)", d.name)
        return []
    out = []
    for key, (param, got) in by_value.items():
        if not param.data.is_contiguous():
            raise ValueError(f"tensor {d.name!r} lands in a non-contiguous SGLang parameter: set weights.sync=full")
        hit = by_mask[key][1].reshape(-1) != 0
        where = hit.nonzero().view(-1)
        if where.numel():
            out.append((param, where, got.reshape(-1)[where].clone()))
    return out


def load_delta(model, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader for a delta update (see the module doc): decode every bucket, place
    every changed tensor with SGLang's own loaders, then overwrite the changed elements. Raises (SGLang
    answers the request with the error, and nothing was written) when a bucket does not decode or a
    tensor cannot be placed."""
    base, deltas = decode(named)
    writes = []
    for d in deltas:
        writes += place(model, d)
    with torch.no_grad():
        for param, where, values in writes:
            param.data.view(-1).index_copy_(0, where.to(param.device), values.to(param.device, param.dtype))
    log.info("applied a delta on version %s: %d tensors, %d elements written", base, len(deltas),
             sum(w.numel() for _, w, _ in writes))
