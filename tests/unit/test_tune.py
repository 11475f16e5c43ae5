"""`launcher tune`'s pure parts on synthetic rows: the η list, the equal-sample reward, the
steady-state throughput and the recommendation rule (fastest η within noise of the reference)."""

from __future__ import annotations

import math
import os

import pytest

from launcher.tune import (
    RunResult,
    TuneError,
    analyze,
    mean_se,
    parse_etas,
    recommend,
    render_md,
    reward_at_samples,
    steady_samples_per_s,
    window,
)

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "demo.yaml")


def _rows(rewards, samples=8, dt=1.0, t0=1000.0):
    return [{"step": i + 1, "version": i + 1, "reward_mean": r, "samples": samples, "staleness_max": 0,
             "time": t0 + dt * (i + 1)} for i, r in enumerate(rewards)]


def _run(eta, rewards, dt=1.0, samples=8, rc=0, sps_run=None):
    rows = _rows(rewards, samples=samples, dt=dt)
    return RunResult(eta=eta, run_dir=f"/x/eta{eta}", rc=rc, rows=rows,
                     summary={"samples_per_s": sps_run if sps_run is not None else samples / dt / 2,
                              "generation": {"busy_fraction": 0.5, "gate_refusals": 3},
                              "buffer": {"dropped": {"stale": eta}}, "max_staleness_observed": eta})


def test_parse_etas():
    assert parse_etas("0,1,2,4,8") == [0, 1, 2, 4, 8]
    assert parse_etas(" 2, 0 ") == [2, 0]
    for bad in ("0,x", "0,-1", "", "0,,1", "1.5", "0,0"):
        with pytest.raises(TuneError, match="--eta"):
            parse_etas(bad)


def test_window_and_mean_se():
    assert window(8) == 2 and window(40) == 10 and window(1000) == 20 and window(1) == 2
    m, se = mean_se([1.0, 3.0])
    assert m == 2.0 and se == pytest.approx(math.sqrt(2) / math.sqrt(2))
    assert mean_se([]) == (None, None) and mean_se([0.5]) == (0.5, 0.0)


def test_reward_at_samples_averages_the_k_steps_ending_at_that_count():
    rows = _rows([0.0, 0.1, 0.2, 0.3, 0.4, 0.5], samples=10)
    assert reward_at_samples(rows, 30, k=2) == pytest.approx(0.15)  # steps 2–3 (cumulative 20, 30)
    assert reward_at_samples(rows, 25, k=1) == pytest.approx(0.2)  # first step reaching 25: step 3
    assert reward_at_samples(rows, 10_000, k=2) == pytest.approx(0.45)  # never reached: the last k
    # steps that trained nothing do not count
    rows[1]["samples"] = 0
    assert reward_at_samples(rows, 20, k=1) == pytest.approx(0.2)


def test_steady_samples_per_s_leaves_out_the_first_step():
    rows = _rows([0.1] * 5, samples=8, dt=0.5)
    assert steady_samples_per_s(rows) == pytest.approx(4 * 8 / 2.0)
    assert steady_samples_per_s([{k: v for k, v in r.items() if k != "time"} for r in rows]) is None


def test_equal_sample_count_is_the_smallest_total():
    a, b = _run(0, [0.1] * 8), _run(2, [0.2] * 6)
    k, equal = analyze([a, b], steps=8)
    assert k == 2 and equal == 6 * 8
    assert a.reward_equal == pytest.approx(0.1) and b.reward_equal == pytest.approx(0.2)


def test_recommends_the_fastest_eta_within_noise():
    noisy = [0.80, 0.84, 0.78, 0.82] * 5  # η=0: mean 0.81, spread ±0.02
    r0 = _run(0, noisy, dt=1.0)
    r2 = _run(2, [x - 0.005 for x in noisy], dt=0.6)  # a bit lower, well within noise, faster
    r4 = _run(4, [x - 0.2 for x in noisy], dt=0.4)  # fastest but reward clearly lower
    analyze([r0, r2, r4], steps=20)
    rec = recommend([r0, r2, r4])
    assert rec.reference == 0 and rec.reference_is_zero
    assert rec.within == {0: True, 2: True, 4: False}
    assert rec.eta == 2
    assert rec.text.startswith("recommended η: 2")
    md = render_md([r0, r2, r4], rec, 5, 160, config="c.yaml", steps=20, overrides=[], machine="m")
    assert "**recommended η: 2" in md and "| 4 |" in md and "Reference: η = 0." in md


def test_higher_reward_always_passes_and_eta0_wins_when_fastest():
    r0 = _run(0, [0.5, 0.5, 0.5, 0.5], dt=0.5)
    r1 = _run(1, [0.9, 0.9, 0.9, 0.9], dt=1.0)
    analyze([r0, r1], steps=4)
    rec = recommend([r0, r1])
    assert rec.within[1] and rec.eta == 0


def test_zero_spread_needs_equal_reward():
    r0 = _run(0, [1.0] * 8, dt=1.0)
    r2 = _run(2, [0.99] * 8, dt=0.5)
    analyze([r0, r2], steps=8)
    assert recommend([r0, r2]).eta == 0  # no noise on either side: any loss is beyond it


def test_without_eta0_the_smallest_eta_is_the_reference_and_says_so():
    r2, r4 = _run(2, [0.5, 0.52, 0.48, 0.5], dt=1.0), _run(4, [0.5, 0.52, 0.48, 0.5], dt=0.5)
    analyze([r4, r2], steps=4)
    rec = recommend([r4, r2])
    assert rec.reference == 2 and not rec.reference_is_zero and rec.eta == 4
    assert "η = 0 was not run" in rec.text
    md = render_md([r4, r2], rec, 2, 32, config="c.yaml", steps=4, overrides=[], machine="m")
    assert "η = 0 was not among the values" in md


def test_failed_runs_are_not_recommended():
    r0 = _run(0, [0.5] * 4, dt=1.0)
    r2 = _run(2, [0.5] * 4, dt=0.1, rc=1)
    analyze([r0, r2], steps=4)
    assert recommend([r0, r2]).eta == 0
    bad = RunResult(eta=0, run_dir="/x", rc=1)
    analyze([bad], steps=4)
    assert recommend([bad]).eta is None


def test_cli_rejects_bad_input_with_exit_2(capsys, tmp_path):
    from launcher.cli import main

    assert main(["tune", "--config", DEMO, "--eta", "0,a", "--steps", "3"]) == 2
    assert "--eta" in capsys.readouterr().err
    assert main(["tune", "--config", str(tmp_path / "none.yaml"), "--eta", "0", "--steps", "3"]) == 2
    assert "--config" in capsys.readouterr().err
    assert main(["tune", "--config", DEMO, "--eta", "0", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["tune", "--config", DEMO, "--eta", "0", "--steps", "3",
                 "rollout.max_staleness=3"]) == 2
    assert "rollout.max_staleness" in capsys.readouterr().err
    # the parser itself answers 2 for a non-integer --steps (SystemExit)
    with pytest.raises(SystemExit) as e:
        main(["tune", "--config", DEMO, "--eta", "0", "--steps", "x"])
    assert e.value.code == 2
