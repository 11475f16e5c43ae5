"""A custom reward function that asks the run's judge itself (issue 43 item 3): its own grading prompt
and its own parser, on the judge servers of the allocation's judge component.

    launcher run --config configs/judge_demo.yaml \
        custom_reward_function.path=examples/judge_reward/compute_score.py \
        judge.weight=0 judge.rule_weight=1        # this function's score is the reward

A function whose parameters include `judge` gets a JudgeClient (areal_like/reward/judge_client.py):
`judge.question` is the sample's prompt as text, `judge.generate(prompt)` the judge's reply (greedy by
default: judge.temperature). Here the judge is the demo judge (demo:next-digit-judge), trained on
"<question>=<response>?" followed by Y or N; the function reads its one-token verdict.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info, judge):
    reply = judge.generate(f"{judge.question}={solution_str.strip()}?", max_new_tokens=1)
    return 1.0 if reply.strip() == "Y" else 0.0
