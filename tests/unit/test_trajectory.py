import msgspec
import numpy as np
import pytest

from areal_like.api.trajectory import Trajectory, TrajectoryGroup, decode_group, encode_group


def _traj(i=0, versions=(3, 3, 4)):
    return Trajectory.build(traj_id=f"t{i}", group_id="g", prompt_id="p", prompt_ids=[5, 6, 7],
                            output_ids=[8, 9, 2], output_logprobs=[-0.5, -1.0, -0.25],
                            output_versions=list(versions), reward=1.0, finish_reason="stop")


def test_build_lays_out_prompt_and_output():
    t = _traj()
    assert t.ids_np().tolist() == [5, 6, 7, 8, 9, 2]
    assert t.mask_np().tolist() == [0, 0, 0, 1, 1, 1]
    assert t.versions_np().tolist() == [-1, -1, -1, 3, 3, 4]
    assert t.logprobs_np().tolist() == [0, 0, 0, -0.5, -1.0, -0.25]
    assert (t.min_version, t.max_version) == (3, 4)
    assert t.ids_np().dtype == np.dtype("<i4")


def test_group_round_trip_is_msgpack_not_pickle():
    g = TrajectoryGroup(group_id="g", prompt_id="p", trajectories=[_traj(0), _traj(1, (2, 5, 5))], created_at=1.0)
    data = encode_group(g)
    assert not data.startswith(b"\x80")  # a pickle stream starts with PROTO 0x80
    back = decode_group(data)
    assert back == g
    assert (back.min_version, back.max_version) == (2, 5)


def test_malformed_payloads_are_rejected():
    with pytest.raises(msgspec.DecodeError):
        decode_group(b"\x93not a group")
    g = TrajectoryGroup(group_id="g", prompt_id="p", trajectories=[_traj()], created_at=1.0)
    bad = msgspec.structs.replace(g.trajectories[0], loss_mask=b"\x01")
    with pytest.raises(ValueError, match="disagree"):
        decode_group(encode_group(msgspec.structs.replace(g, trajectories=[bad])))
    with pytest.raises(ValueError, match="schema_version"):
        decode_group(encode_group(msgspec.structs.replace(g, schema_version=99)))


def test_mismatched_output_lengths_fail_loudly():
    with pytest.raises(ValueError, match="same length"):
        Trajectory.build(traj_id="t", group_id="g", prompt_id="p", prompt_ids=[1], output_ids=[2, 3],
                         output_logprobs=[-1.0], output_versions=[0, 0], reward=0.0, finish_reason="stop")


def test_routed_experts_travel_compactly_and_are_checked():
    """Issue 44: a trajectory's routed experts (positions [0, m), m ≤ num_tokens − 1, layers × top-k ids each) in the
    smallest unsigned dtype — 1 byte per id up to 256 experts — survive the wire, and a record claiming more
    positions than the sequence ran is refused."""
    t = Trajectory.build(traj_id="a", group_id="g", prompt_id="p", prompt_ids=[1, 2, 3], output_ids=[4, 5],
                         output_logprobs=[-1.0, -1.0], output_versions=[0, 0], reward=1.0, finish_reason="stop")
    assert t.routed_experts_np() is None
    rows = np.array([[0, 7, 3, 255], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    r = t.with_routes(rows)
    assert r.routed_experts_itemsize == 1 and len(r.routed_experts) == 16  # 4 positions × 4 ids × 1 byte
    back = decode_group(encode_group(TrajectoryGroup(group_id="g", prompt_id="p", trajectories=[r], created_at=0.0)))
    assert back.trajectories[0].routed_experts_np().tolist() == rows.tolist()
    assert t.with_routes(rows + 300).routed_experts_itemsize == 2  # more than 256 experts: 2 bytes an id
    t.with_routes(rows[:2]).validate()  # a prefix: a trailing observation no server ran
    with pytest.raises(ValueError, match="at most 4 positions"):
        t.with_routes(np.zeros((5, 4), dtype=int)).validate()
    with pytest.raises(ValueError, match="≥ 0"):
        t.with_routes(rows - 1)
