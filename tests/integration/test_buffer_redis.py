"""ReplayBuffer and RedisServer against a real redis-server (one per module, see tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import redis

from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.buffer.redis_client import RedisCallError, RedisEndpoint
from areal_like.buffer.redis_server import RedisServer, RedisServerError
from areal_like.buffer.replay_buffer import BufferFullTimeout, ReplayBuffer
from areal_like.rollout.gate import StalenessGate

pytestmark = pytest.mark.integration


def group(gid: str, version: int = 0, n: int = 2) -> TrajectoryGroup:
    trajs = [
        Trajectory.build(traj_id=f"{gid}-{i}", group_id=gid, prompt_id="p", prompt_ids=[1, 2, 3],
                         output_ids=[4, 5], output_logprobs=[-0.1, -0.2], output_versions=[version, version],
                         reward=float(i), finish_reason="stop")
        for i in range(n)
    ]
    return TrajectoryGroup(group_id=gid, prompt_id="p", trajectories=trajs, created_at=time.time())


@pytest.fixture
def buf(redis_server, redis_stream):
    b = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100, max_groups=100)
    yield b
    b.close()


# ---- RedisServer ---------------------------------------------------------------------------------
def test_server_is_locked_down(redis_server):
    assert redis_server.is_running() and redis_server.url.startswith("redis://:")
    from areal_like.buffer.redis_client import make_client

    with pytest.raises(redis.exceptions.AuthenticationError):
        make_client(f"redis://127.0.0.1:{redis_server.port}/0", password_env=None).ping()
    c = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    cfg = c.config_get("*")
    assert cfg["appendonly"] == "yes" and cfg["appendfsync"] == "everysec"
    assert cfg["maxmemory-policy"] == "noeviction" and cfg["protected-mode"] == "yes"
    assert cfg["save"] == "" and cfg["bind"] == "127.0.0.1"
    assert redis_server.password not in redis_server.safe_url
    assert oct(os.stat(redis_server.conf_path).st_mode & 0o777) == "0o600"
    c.close()


def test_server_start_failure_names_port_and_shows_log(redis_server, tmp_path):
    clash = RedisServer(tmp_path, port=redis_server.port, start_timeout_s=5)
    with pytest.raises(RedisServerError) as ei:
        clash.start()
    msg = str(ei.value)
    assert f"127.0.0.1:{redis_server.port}" in msg and str(clash.log_path) in msg
    assert "Address already in use" in msg
    assert not clash.is_running()


# ---- add / read / ack ---------------------------------------------------------------------------
def test_add_is_idempotent_by_group_id(buf):
    g = group("g-1")
    assert buf.add_group(g) is True
    assert buf.add_group(g) is False  # a retried add (lost reply) never duplicates
    st = buf.stats()
    assert st["added"] == 1 and st["duplicates"] == 1 and st["depth"] == 1
    got = buf.read(10, consumer="L0")
    assert [e[1].group_id for e in got] == ["g-1"]
    assert got[0][1] == g  # the record round-trips unchanged
    assert buf.read(10, block_ms=0, consumer="L0") == []


def test_invalid_group_fails_in_the_producer(buf):
    g = group("g-bad")
    g.trajectories[0].prompt_len = 99
    with pytest.raises(ValueError, match="prompt_len"):
        buf.add_group(g)
    assert buf.stats()["added"] == 0


def test_read_ack_reclaim_nothing_lost_nothing_twice(buf):
    for i in range(5):
        buf.add_group(group(f"g{i}"))
    a = buf.read(3, consumer="A")
    assert [e[1].group_id for e in a] == ["g0", "g1", "g2"]
    assert buf.ack([a[0][0]]) == 1  # A commits one step's worth, then "dies" holding g1, g2
    assert buf.ack([a[0][0]]) == 0  # acks are idempotent
    st = buf.stats()
    assert st["pending"] == 2 and st["depth"] == 2 and st["acked"] == 1 and st["consumed"] == 3

    assert buf.reclaim(min_idle_ms=300, consumer="B") == []  # A is not idle long enough yet
    time.sleep(0.35)
    r = buf.reclaim(min_idle_ms=300, consumer="B")
    assert sorted(e[1].group_id for e in r) == ["g1", "g2"]
    rest = buf.read(10, consumer="B")
    assert [e[1].group_id for e in rest] == ["g3", "g4"]
    assert buf.ack([e[0] for e in r + rest]) == 4

    # acked entries are gone: no reclaim, no read, nothing left in the stream
    assert buf.reclaim(min_idle_ms=0, consumer="C") == []
    assert buf.read(10, block_ms=0, consumer="C") == []
    st = buf.stats()
    assert st == st | {"pending": 0, "depth": 0, "acked": 5, "reclaimed": 2, "consumed": 5}
    assert buf.endpoint.client.xlen(buf.keys.stream) == 0


def test_ack_of_an_undelivered_id_deletes_nothing(buf):
    buf.add_group(group("g0"))
    (eid,) = buf.endpoint.client.xrange(buf.keys.stream)[0][:1]
    assert buf.ack([eid.decode()]) == 0  # never delivered: a wrong id must not lose the group
    assert [e[1].group_id for e in buf.read(5, consumer="L")] == ["g0"]


def test_malformed_and_foreign_entries_are_counted_and_skipped(buf):
    buf.add_group(group("ok-1"))
    c = buf.endpoint.client
    c.xadd(buf.keys.stream, {"g": b"\x93not-a-group"})  # undecodable
    c.xadd(buf.keys.stream, {"other": b"field"})  # foreign: no payload field
    from areal_like.api.trajectory import encode_group

    wrong = group("ok-2")
    wrong.schema_version = 99
    c.xadd(buf.keys.stream, {"g": encode_group(wrong)})  # wrong schema
    buf.add_group(group("ok-3"))
    got = []
    for _ in range(3):
        got += buf.read(10, consumer="L")
    assert [e[1].group_id for e in got] == ["ok-1", "ok-3"]
    st = buf.stats()
    assert st["dropped"] == {"malformed": 3} and st["pending"] == 2 and st["depth"] == 0


def test_filter_stale_acks_and_counts(buf):
    for v in range(4):
        buf.add_group(group(f"v{v}", version=v))
    entries = buf.read(4, consumer="L")
    keep, dropped = buf.filter_stale(entries, current_version=3, max_staleness=1)
    assert [e[1].group_id for e in keep] == ["v2", "v3"]
    assert [e[1].group_id for e in dropped] == ["v0", "v1"]
    st = buf.stats()
    assert st["dropped"] == {"stale": 2} and st["pending"] == 2
    buf.ack([e[0] for e in keep])
    assert buf.stats()["consumed"] == 4


def test_version_key(buf):
    assert buf.run.get_version() == 0
    buf.run.set_version(7)
    assert buf.run.get_version() == 7


def test_oldest_age_counts_only_undelivered(buf):
    buf.add_group(group("old"))
    time.sleep(0.3)
    assert buf.stats()["oldest_age_s"] >= 0.25
    buf.read(1, consumer="L")
    assert buf.stats()["oldest_age_s"] == 0.0


# ---- back-pressure ------------------------------------------------------------------------------
async def test_back_pressure_waits_then_proceeds(redis_server, redis_stream):
    buf = ReplayBuffer(redis_server.url, stream=redis_stream, max_groups=3, block_ms=100, add_poll_s=0.02)
    for i in range(3):
        assert await buf.add_group_async(group(f"g{i}"))
    blocked = asyncio.create_task(buf.add_group_async(group("g3"), timeout_s=10))
    await asyncio.sleep(0.3)
    assert not blocked.done()  # depth 3 ≥ max_groups
    assert await buf.depth_async() == 3
    got = buf.read(1, consumer="L")  # learner takes one: depth 2, room for one
    assert await asyncio.wait_for(blocked, 5) is True
    assert await buf.depth_async() == 3
    with pytest.raises(BufferFullTimeout, match=rf"{redis_server.port}/0 key .*{redis_stream}.*max_groups 3"):
        await buf.add_group_async(group("g4"), timeout_s=0.2)
    assert await buf.add_group_async(group("g0")) is False  # duplicates answer at once even when full
    buf.ack([got[0][0]])
    await buf.aclose()
    buf.close()


# ---- errors name the peer ----------------------------------------------------------------------
def test_wrong_password_fails_fast_and_names_the_peer(redis_server, redis_stream):
    bad = ReplayBuffer(f"redis://:Zq9badpw@127.0.0.1:{redis_server.port}/0", stream=redis_stream,
                       endpoint=RedisEndpoint(f"redis://:Zq9badpw@127.0.0.1:{redis_server.port}/0", retries=5))
    t0 = time.monotonic()
    with pytest.raises(RedisCallError) as ei:
        bad.run.get_version()
    assert time.monotonic() - t0 < 2  # auth errors are not retried
    assert f"127.0.0.1:{redis_server.port}/0" in str(ei.value) and "Zq9badpw" not in str(ei.value)


def test_password_from_env_when_url_has_none(redis_server, redis_stream, monkeypatch):
    monkeypatch.setenv("MY_REDIS_PW", redis_server.password)
    b = ReplayBuffer(f"redis://127.0.0.1:{redis_server.port}/0", stream=redis_stream, password_env="MY_REDIS_PW")
    assert b.run.get_version() == 0
    b.close()


# ---- crash and restart -----------------------------------------------------------------------------
def test_kill9_and_restart_keeps_entries_counters_and_version(tmp_path):
    with RedisServer(tmp_path / "r") as srv:
        b = ReplayBuffer(srv.url, stream="run", block_ms=100)
        gate = StalenessGate(srv.url, stream="run", max_staleness=1, batch_size=4)
        for i in range(6):
            assert gate.try_acquire(f"g{i}")
            b.add_group(group(f"g{i}"))
        assert gate.try_acquire("still-running")
        b.run.set_version(1)
        read = b.read(3, consumer="L")
        b.ack([read[0][0]])  # g0 committed; g1, g2 pending; g3..g5 undelivered
        before = b.stats()
        time.sleep(1.3)  # appendfsync everysec: let one fsync pass
        srv.kill()
        with pytest.raises(RedisCallError):
            b.endpoint.retries, b.endpoint.reconnect_timeout_s = 0, 0
            b.run.get_version()
        srv.restart()
        b.endpoint.retries, b.endpoint.reconnect_timeout_s = 6, 60
        after = b.stats()  # the same client object reconnects
        for k in ("added", "acked", "depth", "pending", "version", "running"):
            assert after[k] == before[k], k
        assert gate.state() == {"version": 1, "accepted": 6, "running": 1, "capacity": 12}
        assert b.add_group(group("g4")) is False  # idempotency markers survived too
        reclaimed = b.reclaim(0, consumer="L2")
        assert sorted(e[1].group_id for e in reclaimed) == ["g1", "g2"]
        rest = b.read(10, consumer="L2")
        assert [e[1].group_id for e in rest] == ["g3", "g4", "g5"]
        b.close()
        gate.close()
    assert not srv.is_running()


def test_drop_ack_lost_in_a_redis_restart_is_reconciled_by_the_next_read(tmp_path):
    """Deterministic replay of the kill+lose leak (test_redis_crash.py): a producer's journal re-adds a
    copy (r=1) of a group the learner trained, before the learner's re-commit restored the trained set;
    the learner reads the copy and drops it (already_trained: XACK + XDEL); a second crash loses the
    last second — the delivery survives, the ack does not. The learner notices the restart in a
    commit, not a read, so its next read must still reconcile its pending list: the copy is dropped
    again, never left pending (nor trained twice)."""
    from areal_like.api.trajectory import encode_group

    with RedisServer(tmp_path / "r") as srv:
        ep = RedisEndpoint(srv.url, backoff_base_s=0.02, backoff_cap_s=0.2, reconnect_timeout_s=30)
        b = ReplayBuffer(stream="run", block_ms=100, endpoint=ep)
        k = b.keys
        admin = redis.Redis.from_url(srv.url, socket_timeout=5)  # plays the crash; not the learner's connections
        b.add_group(group("g0"))
        (e0, _), = b.read(1, consumer="L")
        b.commit([(e0, "g0")], step=1, consumer="L")
        admin.xadd(k.stream, {"g": encode_group(group("g0")), "i": "g0", "r": "1"})  # the re-added copy
        stream0, counters0 = admin.dump(k.stream), admin.dump(k.counters)
        assert b.read(8, block_ms=0, consumer="L") == []  # delivered, dropped as already_trained, acked
        assert b.stats()["dropped"] == {"already_trained": 1} and b.stats()["pending"] == 0
        # the lost second: back to before the read, then the delivery (not the ack) replayed from the AOF
        admin.restore(k.stream, 0, stream0, replace=True)
        admin.restore(k.counters, 0, counters0, replace=True)
        (_, [(copy_id, _)]), = admin.xreadgroup(b.consumer_group, "L", {k.stream: ">"}, count=1)
        # This state (the delivery, not the ack) is what the crash keeps: rewrite the AOF from memory so
        # it survives the kill whatever the everysec fsync timing (a loaded machine may postpone a write).
        admin.bgrewriteaof()
        while (info := admin.info("persistence"))["aof_rewrite_in_progress"] or info["aof_rewrite_scheduled"]:
            time.sleep(0.01)
        assert info["aof_last_bgrewrite_status"] == "ok", info
        admin.close()
        srv.kill()
        srv.restart()
        b.commit([], step=1, consumer="L")  # a commit, not a read, notices the restart and runs the hook
        assert ep.restarts == 1 and b.stats()["pending"] == 1 and b.held("L") == {}
        b.add_group(group("g1"))
        assert [g.group_id for _, g in b.read(8, block_ms=0, consumer="L")] == ["g1"]  # g0's copy: not again
        st = b.stats()
        assert st["pending"] == 1 and st["dropped"] == {"already_trained": 1}, st  # g1 pending; the copy acked
        assert copy_id.decode() not in {x[0].decode() for x in b.endpoint.client.xrange(k.stream)}
        b.read(8, block_ms=0, consumer="L")  # the scan is done once per restart
        assert b.stats()["dropped"] == {"already_trained": 1}
        b.close()


# ---- consume-time policy, commit, recover ---------------------------------------------------------
def test_stale_policy_keep_trains_and_counts(buf):
    for v in range(3):
        buf.add_group(group(f"v{v}", version=v))
    entries = buf.read(3, consumer="L")
    keep, dropped = buf.filter_stale(entries, current_version=2, max_staleness=0, policy="keep")
    assert [e[1].group_id for e in keep] == ["v0", "v1", "v2"] and dropped == []
    st = buf.stats()
    assert st["stale_kept"] == 2 and st["dropped"] == {} and st["pending"] == 3
    with pytest.raises(ValueError, match="'drop' or 'keep'"):
        buf.filter_stale(entries, 2, 0, policy="maybe")


def test_commit_records_trained_ids_and_blocks_their_return(buf):
    for i in range(3):
        buf.add_group(group(f"g{i}"))
    got = buf.read(3, consumer="L")
    pairs = [(e, g.group_id) for e, g in got]
    assert buf.held("L") == dict(pairs)
    assert buf.commit(pairs, step=1, consumer="L") == 3
    assert buf.commit(pairs, step=1, consumer="L") == 0  # idempotent
    assert buf.held("L") == {}
    c = buf.endpoint.client
    assert c.zcard(buf.keys.trained) == 3 and c.get(buf.keys.committed("L")) == b"1"
    assert buf.add_group(group("g1")) is False  # trained (and its marker exists): never re-enters
    c.delete(buf.keys.group_id("g2"))  # marker gone (e.g. expired): the trained set still refuses it
    assert buf.add_group(group("g2")) is False
    st = buf.stats()
    assert st["acked"] == 3 and st["pending"] == 0 and c.xlen(buf.keys.stream) == 0


def test_recover_commits_the_checkpoint_and_returns_only_untrained_pending(buf, redis_server):
    from areal_like.buffer.replay_buffer import CheckpointBehindBuffer

    for i in range(6):
        buf.add_group(group(f"g{i}"))
    step1 = buf.read(2, consumer="L")
    buf.commit([(e, g.group_id) for e, g in step1], step=1, consumer="L")
    step2 = buf.read(2, consumer="L")  # checkpoint 2 saved with these, then the learner died
    buf.read(2, consumer="L")  # step 3 read and trained, never checkpointed
    ckpt2 = [(e, g.group_id) for e, g in step2]

    fresh = ReplayBuffer(redis_server.url, stream=buf.stream, block_ms=100)  # the restarted learner
    redo = fresh.recover("L", ckpt2, step=2)
    assert [g.group_id for _, g in redo] == ["g4", "g5"]  # re-trained into the restored model
    assert set(fresh.held("L").values()) == {"g4", "g5"}
    assert fresh.read(5, block_ms=0, consumer="L") == []  # nothing is handed out twice
    assert buf.endpoint.client.get(buf.keys.committed("L")) == b"2"
    with pytest.raises(CheckpointBehindBuffer, match="step 2 but the checkpoint being resumed is step 1"):
        ReplayBuffer(redis_server.url, stream=buf.stream).recover("L", [], step=1)
    fresh.close()


def test_recover_with_rollback_rewinds_the_buffer_once(buf, redis_server):
    """Issue 24: a deliberate rollback (explicit older train.resume_mode, or the fallback past an
    unusable checkpoint) rewinds the committed step and the version, and gives the gate back the
    undone versions' capacity — once; the undone steps' groups stay trained (never handed out again)."""
    for i in range(4):
        buf.add_group(group(f"g{i}"))
    for step in (1, 2):
        entries = buf.read(2, consumer="L")
        buf.commit([(e, g.group_id) for e, g in entries], step=step, consumer="L")
    buf.run.set_version(2)
    c = buf.endpoint.client
    credit0 = int(c.hget(buf.keys.counters, "gate_credit") or 0)
    back = ReplayBuffer(redis_server.url, stream=buf.stream, block_ms=100)
    assert back.recover("L", [], step=1, rollback=(1, 2)) == []
    assert c.get(buf.keys.committed("L")) == b"1" and c.get(buf.keys.version) == b"1"
    assert int(c.hget(buf.keys.counters, "gate_credit")) == credit0 + 2  # (2 − 1) versions · B=2
    assert int(c.hget(buf.keys.counters, "rolled_back_steps")) == 1
    back.recover("L", [], step=1, rollback=(1, 2))  # a retry (or a restarted learner): nothing more
    assert int(c.hget(buf.keys.counters, "gate_credit")) == credit0 + 2
    buf.add_group(group("g2"))  # step 2's group again (e.g. re-added): already trained, not handed out
    assert back.read(5, block_ms=0, consumer="L") == []
    back.close()


def test_redelivered_held_entry_and_readded_duplicate_are_skipped(buf):
    buf.add_group(group("g0"))
    (eid, _), = buf.read(1, consumer="L")
    c = buf.endpoint.client
    # a Redis restart that lost the delivery: the entry is undelivered again, the learner still holds it
    c.xgroup_setid(buf.keys.stream, buf.consumer_group, "0")
    c.xack(buf.keys.stream, buf.consumer_group, eid)
    # … and a producer re-added the same group (new entry id, flag r=1)
    from areal_like.api.trajectory import encode_group

    c.xadd(buf.keys.stream, {"g": encode_group(group("g0")), "i": "g0", "r": "1"})
    assert buf.read(10, block_ms=0, consumer="L") == []
    st = buf.stats()
    assert st["dropped"] == {"duplicate": 1} and st["pending"] == 1  # the original, pending again
    assert buf.commit([(eid, "g0")], step=1, consumer="L") == 1
    assert c.xlen(buf.keys.stream) == 0


def test_commit_deletes_an_entry_whose_delivery_was_lost_only_if_it_is_the_same_group(buf):
    buf.add_group(group("g0"))
    buf.add_group(group("g1"))
    got = buf.read(2, consumer="L")
    c = buf.endpoint.client
    c.xgroup_setid(buf.keys.stream, buf.consumer_group, "0")
    c.xack(buf.keys.stream, buf.consumer_group, *[e for e, _ in got])  # deliveries "lost"
    (e0, _), (e1, _) = got
    assert buf.commit([(e0, "g0"), (e1, "not-g1")], step=1, consumer="L") == 1
    assert [x[0].decode() for x in c.xrange(buf.keys.stream)] == [e1]  # a wrong pair deletes nothing


def test_metrics_follow_buffer_operations(buf):
    from areal_like import metrics as M

    def val(m, **labels):
        return (m.labels(**labels) if labels else m)._value.get()

    added0, consumed0 = val(M.BUFFER_ADDED), val(M.BUFFER_CONSUMED)
    kept0, stale0 = val(M.BUFFER_STALE_KEPT), val(M.BUFFER_DROPPED, reason="stale")
    for v in range(3):
        buf.add_group(group(f"v{v}", version=v))
    got = buf.read(2, consumer="L")
    buf.filter_stale(got[:1], 2, 0, policy="keep")
    buf.filter_stale(got[1:], 2, 0, policy="drop")
    time.sleep(0.05)
    st = buf.refresh_metrics()
    assert val(M.BUFFER_ADDED) - added0 == 3 and val(M.BUFFER_CONSUMED) - consumed0 == 2
    assert val(M.BUFFER_STALE_KEPT) - kept0 == 1 and val(M.BUFFER_DROPPED, reason="stale") - stale0 == 1
    assert val(M.BUFFER_DEPTH) == st["depth"] == 1 and val(M.BUFFER_PENDING) == st["pending"] == 1
    assert val(M.BUFFER_OLDEST_AGE) == st["oldest_age_s"] >= 0.04


# ---- security ------------------------------------------------------------------------------------
def test_valid_msgpack_of_the_wrong_shape_is_counted_and_skipped(buf):
    import msgspec

    from areal_like.api.trajectory import encode_group

    c = buf.endpoint.client
    c.xadd(buf.keys.stream, {"g": msgspec.msgpack.encode({"group_id": "x", "rm -rf": 1})})  # foreign shape
    bad = group("bad-lengths")
    bad.trajectories[0].logprobs = b"\x00" * 3  # decodes, fails validate(): arrays disagree
    c.xadd(buf.keys.stream, {"g": encode_group(bad), "i": "bad-lengths"})
    c.xadd(buf.keys.stream, {"g": b"\xc1" * 10_000})  # msgpack "never used" bytes
    buf.add_group(group("ok"))
    assert [g.group_id for _, g in buf.read(10, consumer="L")] == ["ok"]
    assert buf.stats()["dropped"] == {"malformed": 3}


def test_remote_plain_url_warns_and_server_binds_loopback_by_default(tmp_path, caplog, monkeypatch):
    from areal_like.buffer.redis_client import check_url_security

    monkeypatch.delenv("AREAL_LIKE_REDIS_PASSWORD", raising=False)
    assert check_url_security("redis://:pw@127.0.0.1:6379/0") == []
    assert check_url_security("rediss://:pw@redis.example:6380/0") == []
    w = check_url_security("redis://redis.example:6379/0", "AREAL_LIKE_REDIS_PASSWORD")
    assert len(w) == 2 and "use rediss://" in w[0] and "no password" in w[1]
    with caplog.at_level("WARNING"):
        RedisEndpoint("redis://:pw@10.1.2.3:6379/0")
    assert "clear text" in caplog.text and "pw@" not in caplog.text
    srv = RedisServer(tmp_path)
    assert srv.host == "127.0.0.1" and len(srv.password) >= 24 and srv.password not in srv.safe_url


def test_oom_under_noeviction_is_back_pressure_not_a_crash(tmp_path):
    n_tok = 60_000  # ~0.8 MB per group
    big = group("big")
    t = big.trajectories[0]
    t.input_ids, t.loss_mask, t.logprobs, t.versions = (b"\x00" * (4 * n_tok), b"\x00" * n_tok,
                                                        b"\x00" * (4 * n_tok), b"\x00" * (4 * n_tok))
    with RedisServer(tmp_path / "r", maxmemory="12mb") as srv:
        b = ReplayBuffer(srv.url, stream="oom", block_ms=100, max_groups=0, add_poll_s=0.02)
        import msgspec

        n = 0
        with pytest.raises(BufferFullTimeout, match="Redis refused the write: OOM"):
            for n in range(20):
                b.add_group(msgspec.structs.replace(big, group_id=f"big{n}"), timeout_s=0.3)
        assert 1 <= n < 20
        assert b.stats()["added"] == n  # every accepted group is there; the refused one is not
        b.close()
