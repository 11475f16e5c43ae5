"""Search-R1: multi-turn retrieval with a local BM25 index; retrieved text is masked out of the loss.

    rollout.workflow=examples/search_r1/workflow.py:search_r1
    rollout.tools_config=examples/search_r1/tools.yaml      (the `search` tool over a parquet corpus)

The Search-R1 protocol (Jin et al., 2025): the model reasons, writes <search>query</search> when it
needs knowledge, and the rollout appends <information>top-k passages</information>; it ends with
<answer>…</answer>, scored by exact match after SQuAD normalisation (data_source `searchR1_nq`).
The <information> tokens carry loss mask 0 — Search-R1's "retrieved token masking": the policy is
never trained to produce text it did not write.

An *episode workflow* (areal_like/api/workflow.py); copy it to change the tags or the retriever.
"""

from __future__ import annotations

import asyncio
import re

from areal_like.api.workflow import EpisodeContext
from areal_like.data.dataset import PromptRecord
from areal_like.workflow import chat

SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)


async def search_r1(ctx: EpisodeContext, row: PromptRecord):
    if ctx.tools is None or "search" not in ctx.tools.names:
        raise ValueError("search_r1 needs the `search` tool: set rollout.tools_config=examples/search_r1/tools.yaml")
    prompt = chat.prompt_ids(ctx.tokenizer, chat.chat_messages(row.raw_prompt))

    async def one(i: int):
        seq = ctx.sequence(prompt, index=i)
        response = ""
        for _turn in range(ctx.multi_turn.max_assistant_turns):
            if not seq.has_room():
                break
            res = await seq.generate()
            text = ctx.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            response += text
            queries = SEARCH.findall(text)
            if "<answer>" in text or not queries:
                break
            result = await ctx.tools.call("search", {"query": queries[-1].strip()}, row.tools_kwargs)
            passages = chat.truncate_text(ctx.tokenizer, result.text, ctx.multi_turn.max_tool_response_tokens)
            obs = ctx.tokenizer(f"\n<information>{passages}</information>\n", add_special_tokens=False)["input_ids"]
            if not seq.observe(obs):  # retrieved text: loss mask 0 (Search-R1's retrieved-token masking)
                break
        reward = await ctx.score(row, response)  # the last <answer>…</answer>, exact match
        return seq.to_trajectory(reward=reward)

    return list(await asyncio.gather(*(one(i) for i in range(ctx.n))))
