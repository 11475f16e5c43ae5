"""rollout/failures.py: workflow failures counted by kind, logged once per kind, backed off, and measured
against rollout.max_failure_fraction (pure logic; the runs are in tests/integration/test_workflow_failures_run.py)."""

import pytest

from areal_like.api.config import ConfigError, ExperimentConfig, RolloutConfig
from areal_like.rollout.failures import BACKOFF_MAX_S, WorkflowFailures


def _raise(msg):
    try:
        raise RuntimeError(msg)
    except RuntimeError as e:
        return e


def test_first_failure_of_each_kind_is_logged_then_only_counted():
    logs = []
    f = WorkflowFailures("wf.py:Mine", max_failure_fraction=1.0, failure_window=4, timeout_s=2.0, log=logs.append,
                         clock=lambda: 0.0)
    for i in range(1000):
        assert f.failed("exception", f"w0-{i}", f"p{i}", _raise(f"boom {i}")) is False
    f.failed("timeout", "w0-x", "px", None)
    assert f.counts == {"exception": 1000, "timeout": 1, "bad_result": 0, "generation": 0}
    assert len(logs) == 2, logs
    assert "first workflow failure of kind exception" in logs[0] and "RuntimeError: boom 0" in logs[0]
    assert "Traceback" in logs[0] and "wf.py:Mine" in logs[0] and "(prompt p0)" in logs[0]
    assert "cancelled after 2 s (rollout.episode_timeout_s)" in logs[1] and "(prompt px)" in logs[1]
    assert f.take_unflushed() == {"exception": 1000, "timeout": 1} and f.take_unflushed() == {}


def test_budget_names_the_workflow_the_key_and_the_first_traceback():
    f = WorkflowFailures("wf.py:Mine", max_failure_fraction=0.5, failure_window=8, log=lambda m: None)
    crossed = [f.failed("bad_result", f"g{i}", f"p{i}", _raise(f"reward '1.0' #{i}")) for i in range(5)]
    assert crossed == [False] * 4 + [True]  # > 0.5 × 8
    msg = f.limit_message
    assert "workflow wf.py:Mine failed on 5 of the last 5 groups" in msg
    assert "rollout.max_failure_fraction=0.5" in msg and "rollout.failure_window=8" in msg
    assert "First failure of kind bad_result" in msg and "RuntimeError: reward '1.0' #0" in msg


def test_successes_keep_the_run_under_budget_and_generation_failures_do_not_count():
    f = WorkflowFailures("w", max_failure_fraction=0.5, failure_window=8, log=lambda m: None)
    for i in range(100):  # 1 in 4 times out
        if i % 4 == 0:
            assert not f.failed("timeout", f"g{i}", "p", None)
        else:
            f.ok()
    for i in range(50):
        assert not f.failed("generation", f"h{i}", "p", _raise("server down"))
    assert f.limit_message is None


def test_backoff_doubles_per_failure_in_a_row_and_resets():
    f = WorkflowFailures("w", max_failure_fraction=1.0, log=lambda m: None)
    assert f.backoff_s() == 0
    f.failed("exception", "g", "p", _raise("x"))
    first = f.backoff_s()
    f.failed("exception", "g", "p", _raise("x"))
    assert f.backoff_s() == 2 * first > 0
    for _ in range(50):
        f.failed("exception", "g", "p", _raise("x"))
    assert f.backoff_s() == BACKOFF_MAX_S
    f.ok()
    assert f.backoff_s() == 0


@pytest.mark.parametrize("kw,key", [({"episode_timeout_s": 0}, "rollout.episode_timeout_s"),
                                    ({"max_failure_fraction": 1.5}, "rollout.max_failure_fraction"),
                                    ({"failure_window": 0}, "rollout.failure_window")])
def test_bad_values_are_refused_naming_the_key(kw, key):
    cfg = ExperimentConfig(rollout=RolloutConfig(**kw))
    with pytest.raises(ConfigError, match=key):
        cfg.validate()
