"""A long-tail episode workflow (`rollout.workflow=benchmarks/longtail_workflow.py:longtail`), used by
benchmarks/async_vs_sync.py and usable in any run.

Each of a group's n samples gets its own output length, drawn from a lognormal (median
`LONGTAIL_MEDIAN` tokens, shape `LONGTAIL_SIGMA`; environment variables, defaults 24 and 1.0) and
clipped to [1, generation.max_new_tokens], and is generated with `ignore_eos`, so it produces exactly
that many tokens: most samples are short, a few run to the limit — the long tail that leaves a
synchronous step waiting on its slowest sample. The draw is seeded by (seed, group, sample), so every
run with the same seed asks for the same lengths. The reward is the row's own verifiable reward of the
text (for the demo task: is the first character the next digit).
"""

from __future__ import annotations

import asyncio
import math
import os
import random

from areal_like.api.workflow import sample_seed

MEDIAN = float(os.environ.get("LONGTAIL_MEDIAN", "24"))
SIGMA = float(os.environ.get("LONGTAIL_SIGMA", "1.0"))


def output_length(seed: int | None, group_id: str, index: int, max_new_tokens: int) -> int:
    """The sample's output length: lognormal(ln MEDIAN, SIGMA), rounded, clipped to [1, max_new_tokens]."""
    rng = random.Random(sample_seed(seed or 0, f"len/{group_id}", index))
    return max(1, min(max_new_tokens, round(rng.lognormvariate(math.log(MEDIAN), SIGMA))))


async def longtail(ctx, row):
    g = ctx.gen

    async def one(i: int):
        seq = ctx.sequence(index=i)
        n = min(output_length(ctx.seed, ctx.group_id, i, g.max_new_tokens), seq.room)
        res = await ctx.client.generate(
            seq.all_ids, max_new_tokens=n, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
            ignore_eos=True, sampling_seed=ctx.sampling_seed(i), rid=f"{ctx.group_id}-{i}", key=ctx.group_id)
        seq.append_generated(res.output_ids, res.output_logprobs, res.output_versions)
        text = ctx.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        return seq.to_trajectory(reward=await ctx.score(row, text), finish_reason=res.finish_reason)

    tasks = [asyncio.ensure_future(one(i)) for i in range(ctx.n)]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:  # a partial group is useless to GRPO: cancel the rest
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
