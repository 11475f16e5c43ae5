"""The push's bucket code casts floating-point tensors to the servers' dtype in the buffer itself;
integer buffers keep theirs; the bytes equal each tensor's cast, in order, aligned or not."""

import torch

from areal_like.weights.push import align_bucket, flatten_bucket, make_buckets, wire_dtype
from areal_like.weights.receive import unflatten_bucket

BF16 = torch.bfloat16


def _bucket():
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 5, generator=g)),                # fp32 → bf16
            ("odd", torch.tensor([1, 2, 3], dtype=torch.int8)),  # 3 bytes: in model order, what follows is misaligned
            ("b", torch.randn(7, generator=g, dtype=torch.float64)),
            ("pos", torch.arange(4, dtype=torch.int64))]


def _want_bytes(bucket):
    return torch.cat([(t.to(BF16) if t.is_floating_point() else t).reshape(-1).view(torch.uint8) for _, t in bucket])


def test_flatten_casts_floats_keeps_ints_and_round_trips():
    bucket = align_bucket(_bucket(), BF16)  # as the pusher sends it
    flat = flatten_bucket(bucket, dtype=BF16)
    assert flat.dtype == torch.uint8 and flat.numel() == 15 * 2 + 3 + 7 * 2 + 4 * 8
    assert torch.equal(flat, _want_bytes(bucket))
    dts = [wire_dtype(t, BF16) for _, t in bucket]
    back = unflatten_bucket(flat, [n for n, _ in bucket], dts, [list(t.shape) for _, t in bucket])
    for name, t in _bucket():
        want = t.to(BF16) if t.is_floating_point() else t
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
    # into a reused (bigger, dirty) buffer: the prefix, same bytes
    out = torch.full((200,), 7, dtype=torch.uint8)
    assert torch.equal(flatten_bucket(bucket, out=out, dtype=BF16), flat)
    # no dtype: the tensors' own bytes, unchanged behaviour
    assert flatten_bucket(bucket).numel() == sum(t.numel() * t.element_size() for _, t in bucket)


def test_flatten_casts_at_unaligned_offsets_too():
    bucket = _bucket()  # model order: bf16 `b` lands at byte 33
    assert torch.equal(flatten_bucket(bucket, dtype=BF16), _want_bytes(bucket))


def test_buckets_are_sized_by_the_bytes_sent():
    named = [(f"w{i}", torch.zeros(256)) for i in range(8)]  # 1 KiB each in fp32, 512 B in bf16
    assert len(make_buckets(named, 2048)) == 4
    assert len(make_buckets(named, 2048, BF16)) == 2
