"""A server restart while the learner waits for a validation (learner/evaluation.py `Evaluation.collect`,
through `Coordinator.collect_eval`).

The push reads the learner's live weights: after the next train step a re-sync pushes those (and says
so) rather than leaving the restarted server paused with the validation's requests. Pure logic with stand-ins for the eval channel and the run state
(the real re-sync over HTTP and a real process group is tests/integration/test_weight_resync.py)."""

from __future__ import annotations

import asyncio

from areal_like.api.config import ExperimentConfig
from areal_like.api.step_stats import PushResult
from areal_like.learner.evaluation import Evaluation
from areal_like.learner.main import Coordinator
from areal_like.learner.reporter import Reporter
from areal_like.learner.serving import Disaggregated
from areal_like.learner.weight_sync import WeightSync


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


def _coordinator() -> tuple[Coordinator, list]:
    c = Coordinator.__new__(Coordinator)  # no Redis, no servers: only the validation logic runs
    cfg = ExperimentConfig()
    c.sync = WeightSync(cfg, pusher=None, run=_RunState(), phase=Disaggregated())
    c.sync.pushed = ("live weights", 3)  # seen_restarts 0
    c.evaluation = Evaluation(cfg, _Evals(), c.sync)
    c.evaluation.pending = 3
    c.reporter = Reporter(cfg, buffer=None, run_dir="", incarnation=0, loggers=None)  # no row held
    pushes: list = []

    async def push(weights, version, resync=None):
        pushes.append((weights, version, resync))
        c.sync.seen_restarts = 1
        return PushResult()

    c.sync._push = push
    return c, pushes


def test_restart_during_a_validation_of_the_weights_still_held_resyncs_and_keeps_waiting():
    c, pushes = _coordinator()
    asyncio.run(c.collect_eval(lambda: False, trained_since_push=False))
    assert pushes == [("live weights", 3, "server(s) restarted (1 restart(s))")]  # the served version again
    assert c.evaluation.channel.waits == 2 and c.reporter.carry_val == {"val/reward": 0.5}
    assert c.evaluation.pending is None


def test_restart_after_the_next_train_step_still_resyncs_and_says_the_server_holds_the_next_weights(capsys):
    c, pushes = _coordinator()
    asyncio.run(c.collect_eval(lambda: False, trained_since_push=True))
    assert pushes == [("live weights", 3, "server(s) restarted (1 restart(s))")]  # the validation keeps its server
    assert c.evaluation.channel.waits == 2 and c.reporter.carry_val == {"val/reward": 0.5}
    assert c.evaluation.pending is None
    assert "holds only the next step's weights" in capsys.readouterr().out
