"""Delta weight sync's encoding (areal_like/weights/delta.py): what the servers rebuild from a delta is the
new tensor bit for bit, whichever encoding a tensor took, through the wire layout — NaN payloads and ±0
included — and each tensor takes the encoding that costs the fewest bytes."""

import pytest
import torch

from areal_like.weights import delta


def _changed(old: torch.Tensor, frac: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    flat = new.view(-1)
    pick = torch.rand(flat.numel(), generator=g) < frac
    flat[pick] = (flat[pick].float() + 0.5).to(flat.dtype)
    return new


@pytest.mark.parametrize("frac,encoding", [(0.001, "sparse"), (0.2, "mask"), (1.0, "dense")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_each_encoding_rebuilds_the_new_tensor_bit_for_bit_through_the_wire(frac, encoding, dtype):
    g = torch.Generator().manual_seed(0)
    old = torch.randn(64, 300, generator=g).to(dtype)
    new = _changed(old, frac, seed=1)
    d = delta.encode("w", new, old)
    assert d.encoding == encoding
    assert d.count == int((new.view(-1) != old.view(-1)).sum()) if encoding != "dense" else d.count == new.numel()
    buf = torch.empty(d.nbytes, dtype=torch.uint8)
    packed = delta.pack([d], buf)
    assert packed.numel() == d.nbytes
    (back,) = delta.unpack(packed, [d.describe()])
    target = old.clone()
    delta.apply(target, back)
    bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
    assert torch.equal(target.view(-1).view(bits), new.view(-1).view(bits))
    assert d.nbytes < new.numel() * new.element_size() or encoding == "dense"


def test_bytes_not_values_decide_what_changed():
    old = torch.tensor([0.0, float("nan"), 1.0, -0.0], dtype=torch.bfloat16)
    new = torch.tensor([-0.0, float("nan"), 1.0, -0.0], dtype=torch.bfloat16)  # +0 → -0: equal values, new bytes
    new.view(torch.int16)[1] = old.view(torch.int16)[1]  # the same NaN payload: unchanged
    d = delta.encode("w", new, old)
    assert d is not None and d.count == 1
    target = old.clone()
    delta.apply(target, d)
    assert torch.equal(target.view(torch.int16), new.view(torch.int16))
    assert delta.encode("w", new, new.clone()) is None


def test_several_tensors_share_a_bucket_aligned_and_mixed_dtypes():
    g = torch.Generator().manual_seed(3)
    olds = [torch.randn(37, generator=g).to(torch.bfloat16), torch.randn(5, 7, generator=g),
            torch.randint(0, 100, (11,), generator=g), torch.randn(1000, generator=g).to(torch.bfloat16)]
    news = [_changed(o, f, seed=i) for i, (o, f) in enumerate(zip(olds, (0.5, 0.1, 1.0, 0.002)))]
    ds = [delta.encode(f"t{i}", n, o) for i, (n, o) in enumerate(zip(news, olds))]
    ds = [d for d in ds if d is not None]
    buf = torch.full((sum(d.nbytes for d in ds),), 255, dtype=torch.uint8)
    back = delta.unpack(delta.pack(ds, buf), [d.describe() for d in ds])
    for d, b in zip(ds, back):
        i = int(d.name[1:])
        target = olds[i].clone()
        delta.apply(target, b)
        assert torch.equal(target, news[i]), d.name


def test_choice_is_the_cheapest_and_the_mask_round_trips():
    # bf16, 10,000 elements (one block): sparse 4 + 4 × count, mask 1,250 + 2 × count, dense 20,000 bytes
    assert delta.choose_encoding(10_000, 100, 2) == "sparse"  # 404 vs 1,450
    assert delta.choose_encoding(10_000, 1_000, 2) == "mask"  # 4,004 vs 3,250
    assert delta.choose_encoding(10_000, 9_000, 2) == "mask"  # 19,250 vs 20,000
    assert delta.choose_encoding(10_000, 9_900, 2) == "dense"  # 21,050 vs 20,000
    bits = torch.rand(1001, generator=torch.Generator().manual_seed(0)) < 0.3
    assert torch.equal(delta.unpack_mask(delta.pack_mask(bits), 1001), bits)


def test_a_bucket_that_does_not_fit_its_description_is_refused_naming_the_entry():
    d = delta.encode("w", torch.ones(64), torch.zeros(64))
    buf = delta.pack([d], torch.empty(d.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="'w'.*past the bucket"):
        delta.unpack(buf[:-8], [d.describe()])
    with pytest.raises(ValueError, match="unknown encoding 'zip'"):
        delta.unpack(buf, [["w", "float32", [64], "zip", 64]])
    with pytest.raises(ValueError, match="count 65 does not fit"):
        delta.unpack(buf, [["w", "float32", [64], "sparse", 65]])
    s = delta.encode("w", torch.arange(1000.0), torch.arange(1000.0) * (torch.arange(1000) % 97 != 0))
    assert s.encoding == "sparse" and s.count == 10  # 97, 194, …, 970
    sbuf = delta.pack([s], torch.empty(s.nbytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="blocks list 10 positions, its count is 9"):
        delta.unpack(sbuf, [["w", "float32", [1000], "sparse", 9]])


def test_sparse_positions_span_blocks_and_offsets_past_the_int16_range():
    numel = 3 * delta.BLOCK + 5
    pos = torch.tensor([0, 1, 32767, 32768, 65535, 65536, 65537 + 40000, 3 * delta.BLOCK + 4])
    assert torch.equal(delta.sparse_positions(delta.sparse_index(pos, numel), numel, len(pos)), pos)


@pytest.mark.parametrize("frac", [0.01, 0.3, 1.0])
def test_the_sent_copy_follows_each_encoding_and_a_failed_push_invalidates_it(frac):
    sent = delta.SentCopy()
    old = torch.randn(10_000).to(torch.bfloat16)
    sent.record("w", old)
    sent.version = 1
    new = _changed(old, frac, seed=9)
    d = delta.encode("w", new, sent.tensors["w"])
    sent.follow(new, d)
    assert torch.equal(sent.tensors["w"], new) and sent.nbytes == 20_000 and d.where is None
    target = old.clone()
    delta.apply(target, d)  # what a server does with the same delta
    assert torch.equal(target, new)
    sent.invalidate()
    assert sent.version is None


def test_checksums_are_sglangs():
    """SGLang's tensor_hash on CPU: the first 8 bytes of SHA-256 of the tensor's bytes, big-endian → 16 hex."""
    import hashlib

    t = torch.arange(10, dtype=torch.bfloat16)
    assert delta.checksum(t) == hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).digest()[:8].hex()
    assert delta.overall_checksum({"b": "2", "a": "1"}) == hashlib.sha256(b"a1b2").hexdigest()


@pytest.mark.parametrize("allocation,overrides,error", [
    ("embedded:d1|fsdp:d1", {}, "this run pushes with weights.mode=memory"),
    ("embedded.d1p1t1+d1p1t1", {"model.lora_rank": 8}, "pushes the adapter alone"),
])
def test_delta_sync_refuses_what_it_does_not_reach_naming_the_key(allocation, overrides, error):
    from areal_like.api.config import ConfigError, load_config

    argv = [f"allocation={allocation}", "weights.sync=delta", *(f"{k}={v}" for k, v in overrides.items())]
    with pytest.raises(ConfigError, match=error):
        load_config(None, argv).validate()
    with pytest.raises(ConfigError, match="weights.check_every=-1"):
        load_config(None, ["weights.check_every=-1"]).validate()
    for mode in ("distributed", "disk"):  # both transports carry deltas
        load_config(None, ["weights.sync=delta", "weights.check_every=5", f"weights.mode={mode}"]).validate()
    for mode in ("distributed", "disk"):  # SGLang: both, through /update_weights_from_tensor (weights/sglang_delta.py)
        load_config(None, ["allocation=sglang.d1p1t1+d1p1t1", "weights.sync=delta", f"weights.mode={mode}"]).validate()


def test_the_memory_plan_counts_the_sent_copy_in_host_memory():
    """`launcher plan`: weights.sync=delta keeps the servers' weights as last sent on learner rank 0's host."""
    from allocation import parse_allocation, place
    from allocation.memory import ModelShape, TrainSettings, format_memory, plan_memory
    from areal_like.data.real_shape import QWEN3_0_6B

    shape = ModelShape.from_config(QWEN3_0_6B)
    placement = place(parse_allocation("sglang.d1p1t1+d1p1t1"), None, 2)
    full = plan_memory(placement, shape, TrainSettings(server_dtype="bfloat16"), 80 << 30)
    delta_ = plan_memory(placement, shape, TrainSettings(server_dtype="bfloat16", delta_sync=True), 80 << 30)
    assert full.host == {} and delta_.host["delta_sent_copy_bytes"] == shape.count_params() * 2
    assert 1.1e9 < delta_.host["delta_sent_copy_bytes"] < 1.3e9  # Qwen3-0.6B in bf16: 1.19 GB
    assert [d.total_bytes for d in full.devices] == [d.total_bytes for d in delta_.devices]  # not on a device
    assert "host memory of learner rank 0's node: 1.1 GiB for weights.sync=delta" in format_memory(delta_)


def test_the_threaded_apply_in_chunks_equals_the_plain_one(monkeypatch):
    """A server applies its update on all its CPUs, in chunks of positions: the same bytes as one call."""
    monkeypatch.setattr(delta, "CHUNK", 7)
    g = torch.Generator().manual_seed(5)
    olds = {f"t{i}": torch.randn(n, generator=g).to(torch.bfloat16) for i, n in enumerate((1000, 300, 64))}
    news = {k: _changed(v, f, seed=i) for i, ((k, v), f) in enumerate(zip(olds.items(), (0.02, 0.3, 1.0)))}
    ds = [delta.encode(k, news[k], olds[k]) for k in olds]
    assert [d.encoding for d in ds] == ["sparse", "mask", "dense"]
    plain = {k: v.clone() for k, v in olds.items()}
    for d in ds:
        delta.apply(plain[d.name], d)
    threaded = {k: v.clone() for k, v in olds.items()}
    delta.apply_all(threaded, [d.prepare() for d in ds], threads=3)
    for k in olds:
        assert torch.equal(plain[k], news[k]) and torch.equal(threaded[k], news[k]), k
