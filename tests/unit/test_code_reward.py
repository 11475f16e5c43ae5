"""The code reward: the completion's last Python block against stdin/stdout cases or assert tests, each
run in the sandbox (real processes)."""

import json
import time

import pytest

from areal_like.reward.code import code_compute_score, extract_code, parse_ground_truth

ADD = "Read two numbers and print the sum.\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"


def test_extract_code_prefers_the_last_python_block():
    text = "```python\nfirst()\n```\nthen\n```\nplain()\n```\nand\n```python\nlast()\n```\n```bash\nls\n```"
    assert extract_code(text) == "last()\n"
    assert extract_code("```\nplain()\n```") == "plain()\n"
    assert extract_code("```py\nshort_tag()\n```") == "short_tag()\n"
    assert extract_code("```bash\nls\n```") is None
    assert extract_code("no code at all") is None
    assert extract_code("```python\nunclosed = 1\n") is None  # a completion cut off mid-block


def test_stdin_stdout_cases_score_the_fraction_passed():
    gt = json.dumps({"inputs": ["1 2\n", "3 4\n", "5 5\n", "0 0"], "outputs": ["3\n", "7", "11\n", "0  \n"]})
    assert code_compute_score(ADD, gt) == pytest.approx(3 / 4)  # 5 5 → 10, not 11; trailing spaces ignored
    assert code_compute_score(ADD, {"inputs": ["2 2"], "outputs": ["4"]}) == 1.0  # a decoded dict is fine


def test_assert_style_is_all_or_nothing():
    sol = "```python\ndef add(a, b):\n    return a + b\n```"
    assert code_compute_score(sol, json.dumps({"assert": "assert add(1, 2) == 3\nassert add(0, 0) == 0"})) == 1.0
    assert code_compute_score(sol, json.dumps({"tests": "assert add(1, 2) == 3\nassert add(2, 2) == 5"})) == 0.0
    assert code_compute_score(sol, json.dumps({"tests": ["assert add(1, 1) == 2", "assert add(2, 3) == 5"]})) == 1.0


def test_no_code_block_scores_zero():
    assert code_compute_score("The answer is 3.", json.dumps({"assert": "assert True"})) == 0.0


def test_crashing_and_hanging_solutions_score_zero_within_the_budget():
    crash = "```python\nraise SystemExit(1)\n```"
    assert code_compute_score(crash, json.dumps({"inputs": ["1"], "outputs": [""]})) == 0.0
    hang = "```python\nwhile True:\n    pass\n```"
    t0 = time.monotonic()
    assert code_compute_score(hang, json.dumps({"inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}),
                              timeout_s=1.5) == 0.0
    assert time.monotonic() - t0 < 4.0  # one budget for all cases, not 1.5 s each


@pytest.mark.parametrize("gt, fragment", [
    ("not json", "not JSON"),
    ("[1, 2]", "must be a JSON object"),
    (json.dumps({"inputs": ["1"], "outputs": []}), "same length"),
    (json.dumps({"inputs": [], "outputs": []}), "no test cases"),
    (json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [1]}), "fn_name"),
    (json.dumps({"expected": 1}), "expected"),
])
def test_malformed_ground_truth_raises(gt, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_ground_truth(gt)
    with pytest.raises(ValueError):
        code_compute_score(ADD, gt)
