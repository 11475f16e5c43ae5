"""examples/staleness_study.py's pure part: per-run figures from metrics.jsonl rows, the summary over
seeds, the table and the figure (the runs themselves: tests/integration/test_staleness_study.py)."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("staleness_study", os.path.join(ROOT, "examples", "staleness_study.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(rewards, staleness=0, capped=0, clip=0.0):
    return [{"step": i + 1, "reward_mean": r, "staleness_max": staleness, "staleness_mean": float(staleness),
             "loss_tokens": 100, "behav_tokens_capped": capped, "clipfrac": clip} for i, r in enumerate(rewards)]


def test_first_reaching_uses_the_running_mean(study):
    assert study.first_reaching([0.0] * 5 + [1.0] * 20, 0.8, window=10) == 13  # 8 of the last 10 at step 13
    assert study.first_reaching([1.0] * 9, 0.8, window=10) is None  # fewer steps than the window
    assert study.first_reaching([0.5] * 30, 0.8) is None


def test_run_stats_and_summary_over_seeds(study):
    a = study.run_stats(_rows([0.0] * 20 + [1.0] * 30, staleness=4, capped=5, clip=0.1), last_k=10, target=0.8)
    # a duplicated step (a learner restart re-writes its row) counts once, the last one wins
    b = study.run_stats(_rows([0.0] * 50, staleness=2) + [{"step": 50, "reward_mean": 0.5, "staleness_max": 4,
                                              "staleness_mean": float("nan"), "loss_tokens": 100}],
                        last_k=10, target=0.8)
    assert a["steps"] == 50 and a["last"] == 1.0 and a["reach"] == 28 and a["auc"] == pytest.approx(0.6)
    assert a["staleness_mean"] == 4 and a["staleness_max"] == 4 and a["capped"] == pytest.approx(0.05)
    assert a["clipfrac"] == pytest.approx(0.1)
    assert b["steps"] == 50 and b["last"] == pytest.approx(0.05) and b["reach"] is None
    assert b["staleness_mean"] == 2.0 and b["staleness_max"] == 4  # the NaN row is left out of the mean
    s = study.summarize({("recompute", 4): [a, b]})[("recompute", 4)]
    assert s["seeds"] == 2 and s["last"] == pytest.approx(0.525) and s["auc"] == pytest.approx((0.6 + 0.01) / 2)
    assert s["last_se"] == pytest.approx(math.sqrt(((1 - 0.525) ** 2 + (0.05 - 0.525) ** 2) / 1 / 2))
    assert s["reach_median"] is None and s["reached"] == 1  # one seed never got there: no median claimed


def test_table_and_figure(study, tmp_path):
    stats = {(m, e): [study.run_stats(_rows([min(1.0, 0.01 * i * (1 + e)) for i in range(60)], staleness=e),
                                      last_k=20, target=0.8)]
             for m in study.MODES for e in (0, 8)}
    summary = study.summarize(stats)
    md = study.render_md(summary, etas=[0, 8], seeds=[1], steps=60, last_k=20, target=0.8, command="cmd")
    lines = [line for line in md.splitlines() if line.startswith("| ") and "PPO" in line]
    assert len(lines) == 4
    assert lines[0].startswith("| decoupled PPO (proximal=recompute) | 0 | ")
    assert lines[3].startswith("| standard PPO (proximal=behaviour) | 8 | ") and "| 8.00 / 8 |" in lines[3]
    assert "| 0.295 ± 0.000 | 0.495 ± 0.000 |" in lines[0]  # mean over the run, then the last 20 steps
    assert "not reached (0/1 seeds did)" in lines[0]  # η = 0 here climbs 0.01 per step: 0.59 at step 60
    path = tmp_path / "fig" / "study.png"
    study.plot(stats, summary, [0, 8], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_name_the_flag(study, capsys):
    for argv, flag in ((["--modes", "ppo"], "--modes"), (["--eta", "a,b"], "--eta"), (["seed=3"], "seed=3"),
                       (["train.proximal=behaviour"], "train.proximal")):
        with pytest.raises(SystemExit) as e:
            study.main(argv + ["--no-run", "--out", "/nonexistent/never-made"])
        assert e.value.code == 2
        assert flag in capsys.readouterr().err
