"""session_trajectories: the agent proxy's export of recorded completions (pure logic, no server)."""

import numpy as np
import pytest

from areal_like.agent.proxy import Completion, Session, completion_rewards, session_trajectories


def comp(k, prompt, out, *, reward=None, version=3, fr="stop"):
    return Completion(id=f"chatcmpl-{k}", seq=k, prompt_ids=list(prompt), output_ids=list(out),
                      output_logprobs=[-0.5 - 0.1 * i - k for i in range(len(out))],
                      output_versions=[version + (i % 2) for i in range(len(out))], finish_reason=fr, reward=reward)


def session(*comps):
    s = Session(group_id="g", index=2, api_key="k")
    for c in comps:
        s.add(c)
    return s


def export(s, reward, style="concat", discount=1.0):
    return session_trajectories(s, group_id="g", prompt_id="p", data_source="ds", index=2, reward=reward,
                                export_style=style, turn_discount=discount)


def chained():
    """Three chat turns: each prompt = previous prompt + previous output + glue (tool result)."""
    c0 = comp(0, [1, 2, 3], [10, 11])
    c1 = comp(1, [1, 2, 3, 10, 11, 50, 51], [12], version=4)
    c2 = comp(2, [1, 2, 3, 10, 11, 50, 51, 12, 60], [13, 14, 15], version=5, fr="length")
    return c0, c1, c2


def test_concat_one_trajectory_with_masks_logprobs_versions():
    c0, c1, c2 = chained()
    (t,) = export(session(c0, c1, c2), 1.0)
    t.validate()
    assert t.traj_id == "g-2" and t.group_id == "g" and t.prompt_id == "p" and t.data_source == "ds"
    assert t.prompt_len == 3 and t.finish_reason == "length" and t.reward == 1.0
    assert t.ids_np().tolist() == [1, 2, 3, 10, 11, 50, 51, 12, 60, 13, 14, 15]
    assert t.mask_np().tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert t.versions_np().tolist() == [-1, -1, -1, 3, 4, -1, -1, 4, -1, 5, 6, 5]
    want_lp = [0, 0, 0, *c0.output_logprobs, 0, 0, *c1.output_logprobs, 0, *c2.output_logprobs]
    assert t.logprobs_np().tolist() == pytest.approx(np.asarray(want_lp, np.float32).tolist(), abs=0)
    assert (t.min_version, t.max_version) == (3, 6)


def test_individual_style_and_broken_prefix_give_one_per_completion():
    c0, c1, c2 = chained()
    ts = export(session(c0, c1, c2), 1.0, style="individual")
    assert [t.traj_id for t in ts] == ["g-2-c0", "g-2-c1", "g-2-c2"]
    for t, c in zip(ts, (c0, c1, c2)):
        assert t.ids_np().tolist() == c.prompt_ids + c.output_ids and t.prompt_len == len(c.prompt_ids)
        assert t.mask_np().tolist() == [0] * len(c.prompt_ids) + [1] * len(c.output_ids)
        assert t.versions_np()[t.prompt_len:].tolist() == c.output_versions
        assert t.finish_reason == c.finish_reason
    # the template re-rendered turn 0 differently: no token prefix → individual even when concat is asked
    c1.prompt_ids = [1, 2, 3, 10, 99, 50, 51]
    assert [t.traj_id for t in export(session(c0, c1, c2), 1.0)] == ["g-2-c0", "g-2-c1", "g-2-c2"]


def test_float_reward_discounted_backwards():
    c0, c1, c2 = chained()
    ts = export(session(c0, c1, c2), 2.0, style="individual", discount=0.5)
    assert [t.reward for t in ts] == [0.5, 1.0, 2.0]
    assert export(session(*chained()), 2.0, discount=0.5)[0].reward == 2.0  # concat: the last completion's


def test_set_rewards_propagate_and_missing_count_zero():
    c0, c1, c2 = chained()
    c1.reward = 1.0  # /rl/set_reward on the middle turn only
    assert completion_rewards([c0, c1, c2], None, 0.5) == [0.5, 1.0, 0.0]
    c2.reward = 4.0
    assert completion_rewards([c0, c1, c2], None, 0.5) == [0.5 + 0.25 * 4, 1.0 + 2.0, 4.0]
    assert [t.reward for t in export(session(c0, c1, c2), None, "individual", 0.5)] == [1.5, 3.0, 4.0]
    # a returned float replaces the last completion's set reward; the others keep theirs
    assert completion_rewards([c0, c1, c2], 8.0, 1.0) == [9.0, 9.0, 8.0]
    # no reward anywhere: zeros
    assert completion_rewards([comp(0, [1], [2])], None) == [0.0]


def test_dict_rewards_by_id():
    c0, c1, c2 = chained()
    assert completion_rewards([c0, c1, c2], {"chatcmpl-0": 1.0, "chatcmpl-2": 2.0}, 0.0) == [1.0, 0.0, 2.0]
    with pytest.raises(ValueError, match="chatcmpl-9"):
        completion_rewards([c0, c1, c2], {"chatcmpl-9": 1.0})
    with pytest.raises(ValueError, match="finite"):
        completion_rewards([c0], float("nan"))


def test_ordering_by_seq_empty_session_and_bad_style():
    c0, c1, c2 = chained()
    s = session(c2, c0, c1)  # finished out of order: kept in arrival (seq) order
    assert [c.seq for c in s.completions] == [0, 1, 2] and s.find("chatcmpl-1") is c1 and s.find("x") is None
    assert export(session(), 1.0) == []
    with pytest.raises(ValueError, match="export_style"):
        export(s, 1.0, style="tree")
    with pytest.raises(ValueError, match="turn_discount"):
        export(s, 1.0, discount=-1.0)


def test_single_completion_concat_equals_individual_tokens():
    c = comp(0, [5, 6], [7, 8, 9])
    (a,) = export(session(c), 1.0)
    (b,) = export(session(c), 1.0, style="individual")
    assert a.traj_id == "g-2" and b.traj_id == "g-2-c0"
    for f in ("input_ids", "loss_mask", "logprobs", "versions"):
        assert getattr(a, f) == getattr(b, f)
