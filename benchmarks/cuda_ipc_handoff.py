"""Issue 40 item 3 on one CUDA GPU: a CUDA-IPC handoff buffer is never overwritten before the receiver's copy
of it has completed.

A receiver process stands in for an SGLang TP worker: it rebuilds each payload the learner's
`weights.ipc.BucketPacker` serialized (CUDA devices by UUID, mapped back as SGLang's patched
`rebuild_cuda_tensor` does), enqueues the copy into its own tensor behind a busy stream (`torch.cuda._sleep`:
the copy runs late, as it may behind SGLang's other work), and answers *before* the copy ran — SGLang
answers once `load_weights` has enqueued its copies — then drops the received tensor when the next bucket
arrives. Two senders, side by side:

  fresh   BucketPacker (what the push runs): a new buffer per bucket, dropped when the next starts; torch's
          CUDA-IPC reference counting keeps the block from the allocator until the receiver released it
  reused  one buffer, refilled as soon as the answer came (what a push that reuses its buffers would do)

Each bucket is filled with its index; the receiver reports the values its copies ended with. The last line
is `intact: yes` when every bucket of the fresh sender arrived whole. The reused sender shows what the
guarantee prevents (its count of corrupted buckets depends on the GPU's timing).

    python benchmarks/cuda_ipc_handoff.py [--buckets 8] [--mib 64]
"""

from __future__ import annotations

import argparse
import base64
import pickle
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_like.weights.ipc import BucketPacker, serialize_named_tensors  # noqa: E402

SLEEP_CYCLES = 200_000_000  # ~0.1 s of a busy stream on a current GPU


def _patch_rebuild_by_uuid() -> None:
    """What SGLang's `monkey_patch_torch_reductions` does: the device arrives as its UUID, mapped back to an index."""
    from torch.multiprocessing import reductions

    by_uuid = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    orig = reductions.rebuild_cuda_tensor

    def rebuild(*args):
        args = list(args)
        if isinstance(args[6], str):
            args[6] = by_uuid[args[6]]
        return orig(*args)

    reductions.rebuild_cuda_tensor = rebuild


def receiver(requests, answers) -> None:
    _patch_rebuild_by_uuid()
    torch.cuda.set_device(0)
    held, out = None, []
    while True:
        msg = requests.get()
        held = None  # the previous bucket's tensor, released now (its deleter syncs, then counts down)
        if msg is None:
            break
        (name, t), = pickle.loads(base64.b64decode(msg))
        dst = torch.empty_like(t)
        torch.cuda._sleep(SLEEP_CYCLES)  # a busy stream: the copy below runs late
        dst.copy_(t)
        out.append(dst)
        held = t
        answers.put("loaded")  # before the copy ran, as SGLang answers
    torch.cuda.synchronize()
    answers.put([float(d.float().mean()) for d in out])


def send(kind: str, buckets: int, numel: int) -> list[float]:
    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=receiver, args=(requests, answers))
    p.start()
    dev = torch.device("cuda:0")
    packer, buf = BucketPacker(dev), torch.empty(numel, dtype=torch.float32, device=dev)
    meta = [("w", (numel,), torch.float32)]
    for k in range(buckets):
        value = torch.full((numel,), float(k), device=dev)
        if kind == "fresh":
            (payload,) = packer.pack(iter([("w", value)]), meta, None)
        else:
            buf.copy_(value)
            torch.cuda.synchronize()
            payload = serialize_named_tensors([("w", buf)])
        requests.put(payload)
        assert answers.get(timeout=120) == "loaded"
    packer.release()
    requests.put(None)
    got = answers.get(timeout=300)
    p.join(timeout=60)
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--mib", type=int, default=64)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check needs one")
        return 2
    numel = (a.mib << 20) // 4
    bad = {}
    for kind in ("fresh", "reused"):
        got = send(kind, a.buckets, numel)
        bad[kind] = [k for k, v in enumerate(got) if v != float(k)]
        print(f"{kind:6s}: {len(bad[kind])}/{a.buckets} buckets corrupted {bad[kind] or ''} (received means {got})")
    print(f"intact: {'yes' if not bad['fresh'] else 'no'}")
    return 0 if not bad["fresh"] else 1


if __name__ == "__main__":
    sys.exit(main())
