"""`weights.mode` → the learner's `weights.control.GenerationControl`: `WeightPusher`, `DiskWeightPusher` or
`SharedMemoryWeightPusher` (`await init()`, `await update(named_tensors, version) -> PushResult`
(api/step_stats.py), …, `await close()`)."""

from __future__ import annotations

import hashlib
import os

from areal_like.weights.adapter_tensors import AdapterTensorPusher
from areal_like.weights.disk import DiskWeightPusher
from areal_like.weights.ipc import CudaIpcWeightPusher
from areal_like.weights.push import WeightPusher
from areal_like.weights.shm import SharedMemoryWeightPusher

DISK_DIR = "weights_disk"  # under the run dir: the versioned checkpoint dirs of `weights.mode=disk`


def make_weight_pusher(cfg, endpoints, *, model_path: str, run_dir: str, weight_port: int,
                       incarnation: int) -> (WeightPusher | DiskWeightPusher | SharedMemoryWeightPusher | CudaIpcWeightPusher
                                           | AdapterTensorPusher):
    """The pusher `cfg.weights.mode` asks for, to the servers of `endpoints` (`api.run_files.Endpoints`).

    distributed: bucketed broadcast in a group rank 0 forms on `weight_port`; a fresh group name per
    incarnation (a learner that died mid-push leaves its group behind on the servers). With
    `weights.sync=delta`, SGLang servers get each delta by value through /update_weights_from_tensor
    (weights/sglang_delta.py), embedded ones over the group. A LoRA run
    (`model.lora_rank` > 0) with SGLang servers: the adapter by value over HTTP instead
    (/load_lora_adapter_from_tensors, weights/adapter_tensors.py) — SGLang has no NCCL route for adapters.
    disk: HF checkpoint dirs under `<run_dir>/weights_disk/` (the newest two kept; safetensors files of
    at most `weights.bucket_mb`), configs and tokenizer files copied from `model_path`; `weight_port`
    and `incarnation` are unused.
    memory (co-located): to our servers, buckets of `weights.bucket_mb` through two shared-memory segments
    named after the run dir (weights/shm.py); to SGLang (the nccl backend), CUDA-IPC handles of buckets on
    the learner ranks' GPUs, each TP rank of each server given the buffer of the learner rank on its GPU
    (weights/ipc.py). Co-located LoRA: the adapter
    by value to SGLang (as distributed), as a peft dir under `<run_dir>/weights_disk/` to our servers.
    All cast floating-point tensors to the servers' dtype (`server.dtype`)."""
    mode = cfg.weights.mode
    if mode == "auto":
        mode = cfg.resolved_weights_mode()
    if mode not in ("distributed", "disk", "memory"):
        raise ValueError(f"weights.mode={mode!r}: use 'auto', 'distributed', 'disk' or 'memory'")
    # The servers' dtype (`launcher run` resolved `auto` into config.json; a config that did not pass
    # through it resolves here the same way, SGLang being the NCCL group's peer). Every push casts to it.
    dtype = cfg.resolved_server_dtype(sglang=endpoints.weight_backend == "nccl")
    devices = endpoints.server_devices
    if devices is not None:  # per server: a device count, or its device list (count = its length)
        devices = [len(d) if isinstance(d, (list, tuple)) else int(d) for d in devices]
    if mode == "disk":
        return DiskWeightPusher(endpoints.servers, out_dir=os.path.join(run_dir, DISK_DIR), model_path=model_path,
                                timeout_s=cfg.weights.timeout_s, admin_api_key=cfg.server.admin_api_key,
                                api_key=cfg.server.api_key,
                                dtype=dtype, shard_bytes=int(cfg.weights.bucket_mb * 2**20),
                                sync=cfg.weights.sync, check_every=cfg.weights.check_every,
                                # SGLang: each delta dir's path to its delta loader (weights/sglang_delta.py)
                                delta_route="tensor" if endpoints.weight_backend == "nccl" else "disk",
                                tp_per_server=devices)
    lora = cfg.model.lora_rank > 0
    if mode == "memory" and lora and endpoints.weight_backend != "nccl":
        # co-located LoRA, embedded servers: the adapter (MBs) as a peft dir under the run dir
        return DiskWeightPusher(endpoints.servers, out_dir=os.path.join(run_dir, DISK_DIR), model_path=model_path,
                                timeout_s=cfg.weights.timeout_s, admin_api_key=cfg.server.admin_api_key,
                                dtype=dtype)
    if mode in ("memory", "distributed") and lora and endpoints.weight_backend == "nccl":
        # SGLang has no NCCL route for adapters: the adapter by value (co-located or not)
        return AdapterTensorPusher(endpoints.servers, tp_per_server=devices, timeout_s=cfg.weights.timeout_s,
                                   admin_api_key=cfg.server.admin_api_key, dtype=dtype)
    if mode == "memory" and endpoints.weight_backend == "nccl":  # co-located SGLang: CUDA-IPC handles
        return CudaIpcWeightPusher(endpoints.servers, tp_per_server=devices, bucket_bytes=int(cfg.weights.bucket_mb * 2**20),
                                   timeout_s=cfg.weights.timeout_s, admin_api_key=cfg.server.admin_api_key, dtype=dtype,
                                   server_gpus=endpoints.server_gpus, learner_gpus=endpoints.learner_gpus)
    if mode == "memory":
        # one run's segments share a prefix: a restarted learner removes what a killed one left
        owner = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
        return SharedMemoryWeightPusher(endpoints.servers, owner=owner, bucket_bytes=int(cfg.weights.bucket_mb * 2**20),
                                        timeout_s=cfg.weights.timeout_s, admin_api_key=cfg.server.admin_api_key,
                                        dtype=dtype)
    if mode == "distributed":
        return WeightPusher(
            endpoints.servers, master_addr=endpoints.learner_host, master_port=weight_port,
            backend=endpoints.weight_backend, bucket_bytes=int(cfg.weights.bucket_mb * 2**20),
            timeout_s=cfg.weights.timeout_s, admin_api_key=cfg.server.admin_api_key, api_key=cfg.server.api_key,
            devices_per_server=devices, group_name=f"weight_update_group_{incarnation}", dtype=dtype,
            # our embedded servers receive bucket k+1 while they load bucket k; SGLang (NCCL) does not
            overlap_loads=endpoints.weight_backend != "nccl",
            sync=cfg.weights.sync, check_every=cfg.weights.check_every,
            # a delta to SGLang goes by value through its /update_weights_from_tensor (weights/sglang_delta.py)
            delta_route="tensor" if endpoints.weight_backend == "nccl" else "broadcast",
        )
    raise ValueError(f"weights.mode={mode!r}: use 'auto', 'distributed', 'disk' or 'memory'")
