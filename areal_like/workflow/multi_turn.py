"""Multi-turn without tools (`multi_turn`): answer, get feedback, answer again — verl's interaction loop.

    for each of n samples (concurrently):
        prompt (chat template) → assistant turn → score it
        correct (reward ≥ interaction_kwargs.target, default 1.0) or out of turns/context → done
        else: the user's feedback message (interaction_kwargs.feedback) appended as observation
              tokens (loss mask 0) → next assistant turn
    reward = the last turn's score × turn_penalty^(turns − 1)   (interaction_kwargs.turn_penalty, 1.0)

Finish reasons: the last turn's (`stop`, `length`), `max_turns`, or `context_limit`.
"""

from __future__ import annotations

from areal_like.api.trajectory import Trajectory
from areal_like.api.workflow import EpisodeContext
from areal_like.api.workflow import PromptRecord
from areal_like.workflow import chat
from areal_like.workflow.rlvr import gather_samples

DEFAULT_FEEDBACK = "That is not right. Try again."


async def multi_turn(ctx: EpisodeContext, row: PromptRecord) -> list[Trajectory]:
    kw = row.interaction_kwargs
    feedback = str(kw.get("feedback") or DEFAULT_FEEDBACK)
    target = float(kw.get("target", 1.0))
    penalty = float(kw.get("turn_penalty", 1.0))
    prompt = chat.prompt_ids(ctx.tokenizer, chat.chat_messages(row.raw_prompt))
    eos = ctx.tokenizer.eos_token_id

    async def one(i: int) -> Trajectory:
        seq = ctx.sequence(prompt, index=i)
        reward = 0.0
        for turn in range(ctx.multi_turn.max_assistant_turns):
            if not seq.has_room():
                break
            res = await seq.generate()
            reward = await ctx.score(row, ctx.tokenizer.decode(res.output_ids, skip_special_tokens=True))
            if reward >= target:
                break
            if turn + 1 == ctx.multi_turn.max_assistant_turns:
                seq.finish_reason = "max_turns"
                break
            obs = chat.observation_ids(ctx.tokenizer, [{"role": "user", "content": feedback}],
                                       ended_with_eos=bool(res.output_ids) and res.output_ids[-1] == eos)
            if not seq.observe(obs):
                break
        return seq.to_trajectory(reward=reward * penalty ** max(0, seq.turns - 1))

    return await gather_samples(one(i) for i in range(ctx.n))
