"""A server restart while the learner waits for a validation (learner/main.py `Coordinator.collect_eval`).

The push reads the learner's live weights: after the next train step a re-sync pushes those (and says
so) rather than leaving the restarted server paused with the validation's requests. Pure logic with stand-ins for the eval channel and the buffer
(the real re-sync over HTTP and a real process group is tests/integration/test_weight_resync.py)."""

from __future__ import annotations

import asyncio

from areal_like.api.config import ExperimentConfig
from areal_like.api.step_stats import PushResult
from areal_like.learner.main import Coordinator


class _Evals:
    """Answers a validation only after one wait during which a server restart shows up."""

    def __init__(self) -> None:
        self.waits = 0

    def collect(self, version, timeout_s, stopping, on_wait):
        self.waits += 1
        if self.waits == 1:
            on_wait()  # the coordinator's restart check raises here
        return {"val/reward": 0.5}


class _RunState:
    def restarts(self, kind: str) -> int:
        return 1  # one server restart since the coordinator last synced


class _Buffer:
    run = _RunState()


def _coordinator() -> tuple[Coordinator, list]:
    c = Coordinator.__new__(Coordinator)  # no Redis, no servers: only the validation logic runs
    c.cfg, c.evals, c.buffer = ExperimentConfig(), _Evals(), _Buffer()
    c.eval_pending, c.held_row, c.held_extra, c.carry_val, c.seen_restarts = 3, None, {}, {}, 0
    c.pushed = ("live weights", 3)
    pushes: list = []

    async def push(weights, version, resync=None):
        pushes.append((weights, version, resync))
        c.seen_restarts = 1
        return PushResult()

    c._push = push
    return c, pushes


def test_restart_during_a_validation_of_the_weights_still_held_resyncs_and_keeps_waiting():
    c, pushes = _coordinator()
    asyncio.run(c.collect_eval(lambda: False, trained_since_push=False))
    assert pushes == [("live weights", 3, "server(s) restarted (1 restart(s))")]  # the served version again
    assert c.evals.waits == 2 and c.carry_val == {"val/reward": 0.5} and c.eval_pending is None


def test_restart_after_the_next_train_step_still_resyncs_and_says_the_server_holds_the_next_weights(capsys):
    c, pushes = _coordinator()
    asyncio.run(c.collect_eval(lambda: False, trained_since_push=True))
    assert pushes == [("live weights", 3, "server(s) restarted (1 restart(s))")]  # the validation keeps its server
    assert c.evals.waits == 2 and c.carry_val == {"val/reward": 0.5} and c.eval_pending is None
    assert "holds only the next step's weights" in capsys.readouterr().out
