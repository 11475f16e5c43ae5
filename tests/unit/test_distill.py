"""On-policy distillation (issue 43 item 4, `teacher.*`): the learner's per-token reverse-KL advantage, the
trajectory's teacher logprobs, and the config's checks. The runs are in tests/integration/test_distill_run.py."""

from __future__ import annotations

import types

import msgspec
import numpy as np
import pytest

from areal_like.api.config import ConfigError, TeacherConfig, load_config
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.learner.trainer import Trainer, reverse_kl_tokens

ALLOC = "allocation=embedded[rollout]:d1+fsdp[actor]:d1+embedded[teacher]:d1"


def _traj(i: int, behav: list[float], teacher: list[float] | None, prompt=(5, 6)) -> Trajectory:
    t = Trajectory.build(traj_id=f"t{i}", group_id="g", prompt_id="p", prompt_ids=list(prompt),
                         output_ids=[7] * len(behav), output_logprobs=behav, output_versions=[0] * len(behav),
                         reward=float(i), finish_reason="stop")
    if teacher is not None:
        t.teacher_logprobs = np.array([0.0] * len(prompt) + teacher, dtype=np.float32).tobytes()
    return t


def _advantages(samples, group_index, teacher: TeacherConfig, reward_adv: float = 0.0):
    """`Trainer._advantages` on a stand-in whose reward advantage is `reward_adv` on every loss token."""
    def reward_advantages(samples, mine, scores, g, channels):
        return {i: (s.mask_np() * reward_adv).astype(np.float32) for i, s in enumerate(samples) if i in mine}, {}

    fake = types.SimpleNamespace(teacher=teacher, _reward_advantages=reward_advantages)
    adv, _ = Trainer._advantages(fake, samples, list(range(len(samples))), np.zeros(len(samples)),
                                 np.asarray(group_index), {})
    rkl, mask = reverse_kl_tokens(samples, teacher.model_path)  # the step's teacher_kl stat
    return adv, sum(r.sum() for r in rkl) / sum(m.sum() for m in mask)


def test_the_advantage_is_minus_the_per_token_reverse_kl_and_the_reward_enters_by_its_weight():
    samples = [_traj(0, [-1.0, -2.0], [-0.5, -4.0]), _traj(1, [-3.0], [-0.25])]
    adv, kl = _advantages(samples, [0, 0], TeacherConfig(model_path="/t", kl_coef=2.0, reward_weight=0.0),
                          reward_adv=5.0)
    # prompt positions 0; then −2 × (log π_behav − log π_teacher) per generated token; no reward at weight 0
    np.testing.assert_allclose(adv[0], [0, 0, -2 * (-1.0 + 0.5), -2 * (-2.0 + 4.0)])
    np.testing.assert_allclose(adv[1], [0, 0, -2 * (-3.0 + 0.25)])
    assert kl == pytest.approx(((-1.0 + 0.5) + (-2.0 + 4.0) + (-3.0 + 0.25)) / 3)
    adv1, _ = _advantages(samples, [0, 0], TeacherConfig(model_path="/t", kl_coef=2.0, reward_weight=0.5),
                          reward_adv=5.0)
    np.testing.assert_allclose(adv1[1], [0, 0, 0.5 * 5.0 - 2 * (-3.0 + 0.25)])


def test_the_group_baseline_subtracts_the_other_samples_mean_reverse_kl():
    # group 0: samples 0, 1, 2; group 1: sample 3 alone (no other sample: no baseline)
    samples = [_traj(0, [-1.0], [0.0]), _traj(1, [-2.0, -2.0], [0.0, -1.0]), _traj(2, [-4.0], [-1.0]),
               _traj(3, [-1.0], [-3.0])]
    adv, _ = _advantages(samples, [0, 0, 0, 1], TeacherConfig(model_path="/t", kl_coef=1.0, reward_weight=0.0,
                                                              baseline="group"))
    rkl = {0: [-1.0], 1: [-2.0, -1.0], 2: [-3.0], 3: [2.0]}
    base = {0: (-2.0 - 1.0 - 3.0) / 3, 1: (-1.0 - 3.0) / 2, 2: (-1.0 - 2.0 - 1.0) / 3, 3: 0.0}
    for i in range(4):
        np.testing.assert_allclose(adv[i][2:], [-(r - base[i]) for r in rkl[i]], rtol=1e-6)


def test_a_sample_without_teacher_logprobs_is_refused_naming_the_teacher():
    with pytest.raises(ValueError, match="carries no teacher logprobs.*teacher.model_path=/t"):
        _advantages([_traj(0, [-1.0], None)], [0], TeacherConfig(model_path="/t"))


def test_teacher_logprobs_travel_with_the_trajectory_and_are_checked():
    t = _traj(0, [-1.0, -2.0], [-0.5, -4.0])
    g = TrajectoryGroup(group_id="g", prompt_id="p", trajectories=[t], created_at=0.0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(g), type=TrajectoryGroup)
    np.testing.assert_array_equal(back.trajectories[0].teacher_logprobs_np(), [0, 0, -0.5, -4.0])
    assert _traj(1, [-1.0], None).teacher_logprobs_np() is None
    t.teacher_logprobs = t.teacher_logprobs[:-4]
    with pytest.raises(ValueError, match="teacher_logprobs has 3.0 entries for 4 tokens"):
        t.validate()


@pytest.mark.parametrize("overrides,words", [
    ([ALLOC], "teacher.model_path is not set"),
    (["teacher.model_path=/m"], "has no teacher component"),
    ([ALLOC, "teacher.model_path=/m", "teacher.kl_coef=0"], "teacher.kl_coef=0"),
    ([ALLOC, "teacher.model_path=/m", "teacher.reward_weight=-1"], "teacher.reward_weight=-1"),
    ([ALLOC, "teacher.model_path=/m", "teacher.baseline=mean"], "baseline"),
])
def test_teacher_settings_are_checked_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo.yaml", overrides)
    assert words in str(e.value)


def test_the_distillation_demo_config_loads_with_its_teacher():
    cfg = load_config("configs/distill_demo.yaml", [])
    assert cfg.teacher.model_path == "demo:next-digit-teacher" and cfg.teacher.reward_weight == 0.0
