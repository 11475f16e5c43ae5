"""Safetensors files as HF writes them, read lazily by name with plain file reads (`SafetensorsDir`), and HF's
shard file names. Torch only: the learner's checkpoints and disk pushes use it, and so does a delta update's
reader inside an SGLang server (weights/sglang_delta.py)."""

from __future__ import annotations

import json
import os

import torch


def shard_files(n: int, prefix: str = "model") -> list[str]:
    """HF's file names of n shards: `model.safetensors` alone, else `model-00001-of-00003.safetensors` …
    (with `model.safetensors.index.json` beside them)."""
    return [f"{prefix}.safetensors"] if n == 1 else [f"{prefix}-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def index_file(prefix: str = "model") -> str:
    return f"{prefix}.safetensors.index.json"


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _safetensors_header(path: str) -> tuple[dict, int]:
    """(header, offset of the data) of a safetensors file: 8 bytes little-endian header size, the JSON header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsDir:
    """The tensors `write_safetensors_shards` (or `save_pretrained`) wrote under `prefix` in `path`,
    read lazily by name (`name in d`, `d[name]`, on the host): one tensor in memory at a time,
    whatever the model's size. Each tensor is read with plain file reads into its own storage — no
    memory map, so a reader's resident memory is the tensors it holds, not the files it read."""

    def __init__(self, path: str, prefix: str = "model") -> None:
        index = os.path.join(path, index_file(prefix))
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, f"{prefix}.safetensors")):
            files = [f"{prefix}.safetensors"]
        else:
            raise FileNotFoundError(f"{path} has neither {prefix}.safetensors nor {index_file(prefix)}")
        self._where: dict[str, tuple[str, dict, int]] = {}  # name → (file, its header entry, data offset)
        for fname in files:
            full = os.path.join(path, fname)
            header, data = _safetensors_header(full)
            for name, entry in header.items():
                self._where[name] = (full, entry, data)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __getitem__(self, name: str) -> torch.Tensor:
        full, entry, data = self._where[name]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{full}: tensor {name!r} has dtype {entry['dtype']}, which this reader does not know")
        begin, end = entry["data_offsets"]
        t = torch.empty(entry["shape"], dtype=dtype)
        if end > begin:
            with open(full, "rb") as f:
                f.seek(data + begin)
                buf = t.view(-1).view(torch.uint8).numpy()
                if f.readinto(memoryview(buf)) != end - begin:
                    raise ValueError(f"{full}: tensor {name!r} is cut short (the file is truncated)")
        return t

    def shape(self, name: str) -> list[int]:
        return list(self._where[name][1]["shape"])

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of tensor `name` along its first dimension: one contiguous read of those
        bytes alone (a sharded learner rank reads the part it holds, not the whole tensor)."""
        full, entry, data = self._where[name]
        dtype = _ST_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"{full}: tensor {name!r} has dtype {entry['dtype']}, which this reader does not know")
        shape = list(entry["shape"])
        if not shape:
            return self[name]
        row = dtype.itemsize
        for d in shape[1:]:
            row *= d
        begin = entry["data_offsets"][0] + start * row
        t = torch.empty([stop - start, *shape[1:]], dtype=dtype)
        n = (stop - start) * row
        if n > 0:
            with open(full, "rb") as f:
                f.seek(data + begin)
                if f.readinto(memoryview(t.view(-1).view(torch.uint8).numpy())) != n:
                    raise ValueError(f"{full}: tensor {name!r} is cut short (the file is truncated)")
        return t

    def keys(self) -> list[str]:
        return list(self._where)
