"""The judge's pure parts (issue 43 item 3): score rules, the reward mix and its failure accounting, the
`judge.*` checks. The judge through `launcher run`, on a real judge server: tests/integration/test_judge_run.py."""

import asyncio

import pytest

from areal_like.api.config import ConfigError, JudgeConfig, load_config
from areal_like.reward import RewardFn
from areal_like.reward.judge import JudgeFailure, last_number_score, render_prompt, verdict_score


def test_last_number_reads_the_replys_last_number_over_max_score_clipped():
    assert last_number_score("The answer is fine. Score: 7", 10) == pytest.approx(0.7)
    assert last_number_score("8.5", 10) == pytest.approx(0.85)
    assert last_number_score("rated 3, then 9", 10) == pytest.approx(0.9)  # the last one, stated rule
    assert last_number_score("15", 10) == 1.0 and last_number_score("-2", 10) == 0.0
    with pytest.raises(JudgeFailure) as e:
        last_number_score("excellent!", 10)
    assert e.value.kind == "not_a_number" and "last_number" in str(e.value)


def test_verdict_is_the_positive_share_of_the_two_verdict_tokens():
    import math

    top = [[math.log(0.6), 5, None], [math.log(0.2), 9, None], [math.log(0.1), 3, None]]
    assert verdict_score(top, 5, 9) == pytest.approx(0.75)
    assert verdict_score(top, 9, 5) == pytest.approx(0.25)
    assert verdict_score(top, 5, 42) == 1.0  # the negative verdict is not even among the top tokens
    with pytest.raises(JudgeFailure) as e:
        verdict_score(top, 41, 42)
    assert e.value.kind == "not_a_number" and "judge.top_logprobs_num" in str(e.value)


def test_the_template_fills_question_response_and_reference():
    t = "Q: {question}\nA: {response}\nRef: {reference}\n{{literal}}"
    assert render_prompt(t, question="2+2", response="4", reference="4") == "Q: 2+2\nA: 4\nRef: 4\n{literal}"


class _Judge:
    """A stand-in for reward/judge.Judge in a unit test of RewardFn's mixing: grades from a table."""

    def __init__(self, grades, **cfg):
        self.cfg = JudgeConfig(model_path="m", **cfg)
        self.label = "judge m (last_number)"
        self.grades = grades
        self.calls = []
        self.closed = False

    async def grade(self, question, response, reference, *, key=None):
        self.calls.append((question, response, reference, key))
        g = self.grades[response]
        if isinstance(g, Exception):
            raise g
        return g

    async def close(self):
        self.closed = True


def test_reward_mixes_rule_and_judge_by_weight_and_counts_judge_failures():
    async def go():
        fn = RewardFn()
        failures = []
        fn.on_failure = lambda kind, text, first: failures.append((kind, text))
        fn.judge = _Judge({"4": 0.8, "5": JudgeFailure("timeout", "took too long"), "6": RuntimeError("bug")},
                          weight=1.0, rule_weight=0.5)
        # the demo's rule: "4" is right for "3" (1.0), "5" and "6" wrong (0.0)
        a = await fn.score("areal_like/demo", "4", "4", {}, question="3", key="g1")
        b = await fn.score("areal_like/demo", "5", "4", {}, question="3", key="g1")
        c = await fn.score("areal_like/demo", "6", "4", {}, question="3")
        await fn.close()
        return fn, failures, a, b, c

    fn, failures, a, b, c = asyncio.run(go())
    assert a == pytest.approx(0.5 * 1.0 + 0.8)
    assert b == 0.0 and c == 0.0  # a failed grading scores 0, the rule part 0 too here
    assert fn.judge.calls[0] == ("3", "4", "4", "g1")
    assert fn.failures["timeout"] == 1 and fn.failures["exception"] == 1
    assert [k for k, _ in failures] == ["timeout", "exception"]
    assert failures[0][1].startswith("reward judge m (last_number) timed out") and "RuntimeError: bug" in failures[1][1]
    assert fn.judge.closed


def test_without_a_rule_weight_the_rule_reward_is_not_computed():
    async def go():
        fn = RewardFn()  # the built-ins
        fn.judge = _Judge({"x": 0.25}, weight=2.0, rule_weight=0.0)
        # a data source no built-in knows would fail the rule reward (counted): it is never called
        score = await fn.score("no/such-source", "x", "", {}, question="q")
        await fn.close()
        return fn, score

    fn, score = asyncio.run(go())
    assert score == pytest.approx(0.5) and not any(fn.failures.values()) and fn.scored == 1


@pytest.mark.parametrize("overrides, words", [
    (["allocation=embedded[rollout]:d1+fsdp[actor]:d1+embedded[judge]:d1"], "judge.model_path is not set"),
    (["judge.model_path=/m"], "has no judge component"),
    (["allocation=embedded[rollout]:d1+fsdp[actor]:d1+embedded[judge]:d1", "judge.model_path=/m",
      "judge.prompt_template='{question} {answer}'"], "judge.prompt_template"),
    (["allocation=embedded[rollout]:d1+fsdp[actor]:d1+embedded[judge]:d1", "judge.model_path=/m",
      "judge.score_rule=verdict", "judge.verdict_tokens=[Yes]"], "judge.verdict_tokens"),
    (["allocation=embedded[rollout]:d1+fsdp[actor]:d1+embedded[judge]:d1", "judge.model_path=/m",
      "judge.max_score=0"], "judge.max_score"),
])
def test_judge_settings_are_checked_naming_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config("configs/demo.yaml", overrides)
    assert words in str(e.value)


def test_the_judge_demo_config_uses_the_template_its_judge_was_trained_on():
    from areal_like.data.demo_judge import JUDGE_TEMPLATE, VERDICT_TOKENS

    cfg = load_config("configs/judge_demo.yaml")
    assert cfg.judge.prompt_template == JUDGE_TEMPLATE and tuple(cfg.judge.verdict_tokens) == VERDICT_TOKENS
    assert cfg.judge.model_path == "demo:next-digit-judge" and cfg.judge.score_rule == "verdict"


def test_the_demo_judges_training_verdicts_agree_with_the_tasks_scorer():
    import random

    from areal_like.data.demo_judge import JUDGE_TEMPLATE, grading_example
    from areal_like.data.demo_task import demo_compute_score

    rng = random.Random(0)
    head, tail = JUDGE_TEMPLATE.split("{response}")
    assert head.endswith("=") and tail == "?"
    for _ in range(2000):
        prompt, verdict = grading_example(rng)
        question, response = prompt[:prompt.index("=")], prompt[prompt.index("=") + 1:-1]  # digits, then "="
        answer = str((int(question[-1]) + 1) % 10)  # the next-digit task: prompt "4071" → "2"
        assert (verdict == "Y") == (demo_compute_score(response, answer) == 1.0), (prompt, verdict)


def test_the_demo_judges_cache_name_carries_its_recipe_version():
    from areal_like.data.demo_judge import JUDGE_VERSION
    from areal_like.data.demo_task import DEMO_NAMES

    assert DEMO_NAMES["demo:next-digit-judge"] == f"next-digit-judge-v{JUDGE_VERSION}"
