"""Single-turn RLVR (`rlvr`): n samples of one prompt, each scored by a verifiable reward, as one group.

    row ──► n × ctx.generate (concurrent) ──► decode ──► reward (concurrent) ──► trajectories

Written against the same API as a user's episode workflow (areal_like/api/workflow.py). Per-token
versions and logprobs are the server's; prompt tokens get −1 / 0. A failed sample fails the group
(the others are cancelled — a partial group is useless to GRPO).
"""

from __future__ import annotations

import asyncio

from areal_like.api.trajectory import Trajectory
from areal_like.api.workflow import EpisodeContext, PromptRecord, sample_seed  # noqa: F401 (sample_seed re-exported)
from areal_like.workflow.base import EpisodeWorkflow


async def gather_samples(coros) -> list:
    """Run a group's samples concurrently; if one fails, cancel the others and raise its error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def rlvr(ctx: EpisodeContext, row: PromptRecord) -> list[Trajectory]:
    async def one(i: int) -> Trajectory:
        seq = ctx.sequence(index=i)
        res = await seq.generate(max_new_tokens=ctx.gen.max_new_tokens)
        text = ctx.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        return seq.to_trajectory(reward=await ctx.score(row, text), finish_reason=res.finish_reason)

    return await gather_samples(one(i) for i in range(ctx.n))


class RLVRWorkflow(EpisodeWorkflow):
    """The `rlvr` episode behind the worker's `run_group` protocol."""

    def __init__(self, client, reward_fn, gen_cfg, tokenizer, *, producer: str, seed: int | None = None, **kw):
        super().__init__(rlvr, client, reward_fn, gen_cfg, tokenizer, producer=producer, seed=seed, name="rlvr", **kw)
