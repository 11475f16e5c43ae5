"""Pure logic of the buffer and the gate: staleness arithmetic, gate capacity, URL redaction.

No Redis here; tests/integration/test_buffer_redis.py and test_gate.py run the real thing.
"""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.buffer.redis_client import Call, Cmd, RedisCallError, RedisCallTimeout, RedisEndpoint, endpoint_name
from areal_like.buffer.replay_buffer import ReplayBuffer, split_stale, staleness
from areal_like.buffer.scripts import Keys
from areal_like.rollout.gate import StalenessGate, allowed, capacity


def _group(gid: str, versions: list[list[int]]) -> TrajectoryGroup:
    trajs = [
        Trajectory.build(traj_id=f"{gid}-{i}", group_id=gid, prompt_id="p", prompt_ids=[1, 2],
                         output_ids=[3] * len(v), output_logprobs=[-0.5] * len(v), output_versions=v,
                         reward=0.0, finish_reason="stop")
        for i, v in enumerate(versions)
    ]
    return TrajectoryGroup(group_id=gid, prompt_id="p", trajectories=trajs, created_at=time.time())


def test_staleness_uses_oldest_generated_token_across_the_group():
    g = _group("g", [[3, 4], [2, 5]])
    assert g.min_version == 2
    assert staleness(g, 5) == 3
    assert staleness(g, 2) == 0


def test_group_without_generated_tokens_is_never_stale():
    g = _group("g", [[]])
    assert g.min_version == -1
    assert staleness(g, 100) == 0


def test_split_stale_keeps_exactly_the_bound():
    entries = [(f"{v}-0", _group(f"g{v}", [[v]])) for v in range(5)]
    keep, drop = split_stale(entries, current_version=4, max_staleness=2)
    assert [e[1].group_id for e in keep] == ["g2", "g3", "g4"]
    assert [e[1].group_id for e in drop] == ["g0", "g1"]


@given(eta=st.integers(0, 5), v=st.integers(0, 50), b=st.integers(1, 16), accepted=st.integers(0, 2000),
       running=st.integers(0, 100))
def test_gate_check_matches_invariant_2(eta, v, b, accepted, running):
    assert capacity(eta, v, b) == (eta + v + 1) * b
    assert allowed(accepted, running, eta, v, b) == (accepted + running + 1 <= (eta + v + 1) * b)


@given(b=st.integers(1, 8),
       actions=st.lists(st.tuples(st.sampled_from(["start", "finish", "fail", "learn"]), st.integers(0, 63)),
                        max_size=400))
def test_sync_rl_eta0_model_every_group_consumed_at_its_start_version(b, actions):
    """Model of η=0: interleave starts/finishes/failures/learner steps arbitrarily; staleness is always 0."""
    v, accepted = 0, 0
    running: list[int] = []  # start versions of groups in flight
    stream: list[int] = []  # start versions of accepted, unconsumed groups
    for action, pick in actions:
        if action == "start" and allowed(accepted, len(running), 0, v, b):
            running.append(v)
        elif action in ("finish", "fail") and running:
            sv = running.pop(pick % len(running))
            if action == "finish":
                accepted += 1
                stream.append(sv)
        elif action == "learn" and len(stream) >= b:
            batch, stream = stream[:b], stream[b:]
            assert all(v - sv == 0 for sv in batch)
            v += 1
        assert accepted + len(running) <= capacity(0, v, b)


def test_keys_share_one_hash_tag():
    k = Keys.for_stream("run7")
    for key in (k.stream, k.version, k.counters, k.running, k.group_id("g-1")):
        assert key.startswith("{run7}:")


def test_endpoint_name_never_contains_the_password():
    assert endpoint_name("redis://:s3cret@10.0.0.5:6380/2") == "10.0.0.5:6380/2"
    assert endpoint_name("rediss://user:s3cret@h:7000") == "h:7000/0 (tls)"
    with pytest.raises(ValueError, match="redis:// or rediss://"):
        RedisEndpoint("http://h:1")


def test_block_time_must_fit_inside_the_socket_timeout():
    with pytest.raises(ValueError, match="socket_timeout_s"):
        ReplayBuffer("redis://127.0.0.1:1/0", block_ms=5000, socket_timeout_s=5.0)


def test_gate_rejects_nonsense_parameters():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate("redis://127.0.0.1:1/0", max_staleness=-1, batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        StalenessGate("redis://127.0.0.1:1/0", max_staleness=0, batch_size=0)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_redis_error_names_peer_key_and_operation_not_password():
    port = _closed_port()
    ep = RedisEndpoint(f"redis://:hunter2@127.0.0.1:{port}/0", retries=2, backoff_base_s=0.001,
                       connect_timeout_s=0.5, socket_timeout_s=1.0, reconnect_timeout_s=0)

    def op():
        return (yield Call.one("get policy version", "{x}:version", Cmd("get", ("{x}:version",)), idempotent=True))

    with pytest.raises(RedisCallError) as ei:
        ep.run(op())
    msg = str(ei.value)
    assert f"127.0.0.1:{port}/0" in msg and "{x}:version" in msg and "get policy version" in msg
    assert "after 3 attempts" in msg  # idempotent: retried twice
    assert "hunter2" not in msg


def test_non_idempotent_calls_are_not_retried():
    port = _closed_port()
    ep = RedisEndpoint(f"redis://127.0.0.1:{port}/0", retries=5, connect_timeout_s=0.5, socket_timeout_s=1.0)

    def op():
        return (yield Call.one("read", "{x}:stream", Cmd("get", ("k",)), idempotent=False))

    with pytest.raises(RedisCallError) as ei:
        ep.run(op())
    assert "attempts" not in str(ei.value)
    assert not isinstance(ei.value, RedisCallTimeout) or isinstance(ei.value, TimeoutError)


async def test_async_driver_reports_the_same_way():
    port = _closed_port()
    ep = RedisEndpoint(f"redis://:pw@127.0.0.1:{port}/0", retries=1, backoff_base_s=0.001,
                       connect_timeout_s=0.5, socket_timeout_s=1.0, reconnect_timeout_s=0)

    def op():
        return (yield Call.one("gate state", "{x}:running", Cmd("get", ("k",)), idempotent=True))

    with pytest.raises(RedisCallError, match=rf"127\.0\.0\.1:{port}/0 key \{{x\}}:running: gate state failed"):
        await ep.arun(op())
    await ep.aclose()


def test_rediss_url_builds_a_tls_client_with_explicit_timeouts_and_no_implicit_retries(monkeypatch):
    import redis

    from areal_like.buffer.redis_client import make_client

    monkeypatch.setenv("AREAL_LIKE_REDIS_PASSWORD", "from-env")
    c = make_client("rediss://h.example:6380/1?ssl_cert_reqs=none", socket_timeout_s=7.0)
    kw = c.connection_pool.connection_kwargs
    assert c.connection_pool.connection_class is redis.connection.SSLConnection
    assert kw["socket_timeout"] == 7.0 and kw["socket_connect_timeout"] == 5.0 and kw["health_check_interval"] == 30
    assert kw["password"] == "from-env"  # URL has none → environment
    assert kw["retry"].get_retries() == 0  # redis-py must not silently re-run commands
    c2 = make_client("redis://:in-url@h:1/0")
    assert c2.connection_pool.connection_kwargs["password"] == "in-url"


def test_a_peer_that_never_answers_times_out_naming_it():
    """A socket that accepts but never replies (hung Redis): the call ends after socket_timeout."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        buf = ReplayBuffer(f"redis://127.0.0.1:{port}/0", stream="s", block_ms=0,
                           endpoint=RedisEndpoint(f"redis://127.0.0.1:{port}/0", socket_timeout_s=1.2,
                                                  retries=0, reconnect_timeout_s=0))
        t0 = time.monotonic()
        with pytest.raises(RedisCallTimeout, match=rf"127\.0\.0\.1:{port}/0 key \{{s\}}:version: get policy version"):
            buf.run.get_version()
        assert time.monotonic() - t0 < 5
    finally:
        srv.close()
