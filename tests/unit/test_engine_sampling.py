"""Pure logic of the engine: sampling, counter RNG, weight buckets, client routing and reply parsing."""

import pytest
import torch

from areal_like.engine.client import GenerationClient, parse_reply
from areal_like.engine.sampling import derive_seed, sample_next, splitmix64, splitmix64_int, uniform_from_counter
from areal_like.weights.push import align_bucket, flatten_bucket, make_buckets
from areal_like.weights.receive import bucket_nbytes, unflatten_bucket


def _params(B, temp=1.0, top_p=1.0, top_k=-1, min_p=0.0):
    return (torch.full((B,), temp), torch.full((B,), top_p), torch.full((B,), top_k, dtype=torch.long),
            torch.full((B,), min_p))


def test_splitmix64_matches_python_reference():
    xs = [0, 1, 2, 12345, -1, -(2 ** 63), 2 ** 63 - 1, 987654321987654321]
    got = splitmix64(torch.tensor(xs, dtype=torch.long)).tolist()
    assert got == [splitmix64_int(x) for x in xs]


def test_uniform_is_a_function_of_seed_and_position_only():
    seeds = torch.tensor([1, 2, 3, 1], dtype=torch.long)
    pos = torch.tensor([10, 10, 10, 10], dtype=torch.long)
    u = uniform_from_counter(seeds, pos)
    assert u[0] == u[3] and len(set(u[:3].tolist())) == 3
    assert bool(((u >= 0) & (u < 1)).all())
    big = uniform_from_counter(torch.full((20000,), 7, dtype=torch.long), torch.arange(20000))
    assert abs(big.mean().item() - 0.5) < 0.01
    assert derive_seed(5, 0) != derive_seed(5, 1)


def test_greedy_and_degenerate_filters_pick_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    seeds, pos = torch.arange(6), torch.zeros(6, dtype=torch.long)
    argmax = logits.argmax(-1)
    assert torch.equal(sample_next(logits, *_params(6, temp=0.0), seeds, pos), argmax)
    assert torch.equal(sample_next(logits, *_params(6, top_k=1), seeds, pos), argmax)
    assert torch.equal(sample_next(logits, *_params(6, top_p=1e-6), seeds, pos), argmax)
    assert torch.equal(sample_next(logits, *_params(6, min_p=1.0), seeds, pos), argmax)


def test_mixed_rows_in_one_batch():
    torch.manual_seed(1)
    logits = torch.randn(3, 40)
    temp = torch.tensor([0.0, 1.0, 1.0])
    top_k = torch.tensor([-1, 3, -1])
    out = sample_next(logits, temp, torch.ones(3), top_k, torch.zeros(3), torch.arange(3),
                      torch.zeros(3, dtype=torch.long))
    assert out[0] == logits[0].argmax()
    assert out[1] in logits[1].topk(3).indices


def test_sampling_follows_the_softmax():
    torch.manual_seed(2)
    V, N = 8, 40000
    logits = torch.randn(1, V).expand(N, V)
    seeds = torch.arange(N, dtype=torch.long)
    tok = sample_next(logits, *_params(N, temp=0.7), seeds, torch.zeros(N, dtype=torch.long), needs_filter=False)
    freq = torch.bincount(tok, minlength=V).float() / N
    expect = torch.softmax(logits[0] / 0.7, -1)
    assert (freq - expect).abs().max() < 0.015
    # the filtered path draws the same tokens when no filter is active
    tok2 = sample_next(logits, *_params(N, temp=0.7), seeds, torch.zeros(N, dtype=torch.long), needs_filter=True)
    assert torch.equal(tok2, tok)


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(2000, 4)
    tok = sample_next(logits, *_params(2000, top_p=0.7), torch.arange(2000), torch.zeros(2000, dtype=torch.long))
    assert set(tok.tolist()) == {0, 1}


def test_buckets_roundtrip_mixed_dtypes():
    named = [("a", torch.randn(3, 5)), ("b", torch.randn(7).to(torch.bfloat16)), ("c", torch.randn(2, 2)),
             ("d", torch.arange(5, dtype=torch.int64))]
    buckets = make_buckets(named, bucket_bytes=64)
    assert [n for b in buckets for n, _ in b] == ["a", "b", "c", "d"]
    assert all(len(b) >= 1 for b in buckets)
    for b in map(align_bucket, buckets):
        buf = flatten_bucket(b)
        dts = [t.dtype for _, t in b]
        shapes = [list(t.shape) for _, t in b]
        assert buf.numel() == bucket_nbytes(dts, shapes)
        back = unflatten_bucket(buf, [n for n, _ in b], dts, shapes)
        for n, t in b:
            assert torch.equal(back[n], t)
    # an fp32 after a 14-byte bf16 sits at an unaligned offset: refused, as SGLang's receiver does
    # (FlattenedTensorBucket.empty); the pusher's align_bucket orders the bucket so that it never is
    buf = flatten_bucket(named[1:3])
    with pytest.raises(ValueError, match="Unaligned received tensor c"):
        unflatten_bucket(buf, ["b", "c"], [torch.bfloat16, torch.float32], [[7], [2, 2]])
    aligned = align_bucket(named[1:3])
    assert [n for n, _ in aligned] == ["c", "b"]
    back = unflatten_bucket(flatten_bucket(aligned), ["c", "b"], [torch.float32, torch.bfloat16], [[2, 2], [7]])
    assert torch.equal(back["c"], named[2][1]) and torch.equal(back["b"], named[1][1])


def test_client_routing_least_loaded_and_sticky():
    c = GenerationClient(["http://a", "http://b/"])
    c.inflight["http://a"] = 3
    assert c.pick_server() == "http://b"
    assert c.pick_server(key="g1") == "http://b"
    c.inflight["http://b"] = 10
    assert c.pick_server(key="g1") == "http://b"  # sticky beats load
    assert c.pick_server(key="g2") == "http://a"


def test_parse_reply_old_and_new_sglang():
    new = {"output_ids": [5, 6], "meta_info": {"output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
                                               "weight_version": "3"}}
    ids, lps, meta = parse_reply(new)
    assert ids == [5, 6] and lps == [-0.1, -0.2] and meta["weight_version"] == "3"
    old = {"text": "x", "meta_info": {"output_token_logprobs": [[-0.3, 9, None]]}}
    assert parse_reply(old)[0] == [9]


async def test_client_connection_errors_are_retried_then_name_the_server():
    import socket

    from areal_like.engine.client import GenerationError

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    async with GenerationClient([url], max_connection_retries=2, retry_backoff_s=0.01, down_wait_s=0) as c:
        try:
            await c.generate([1, 2], max_new_tokens=2)
        except GenerationError as e:
            assert url in str(e) and "3 times" in str(e)
        else:
            raise AssertionError("expected GenerationError")
        assert c.inflight[url] == 0
        assert await c.health(url) is False
