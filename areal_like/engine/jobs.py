"""A request's samples as the embedded server handles them: `Job` (one sample: its sequence, its validated
sampling parameters, where it goes in the reply) and `GenOpts` (what the reply carries). Shared by the
native routes (server.py) and the OpenAI routes (openai_api.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from areal_like.engine.runner import Seq


@dataclass
class Job:
    """One sample of a request: its Seq, its validated sampling params, where it goes in the reply."""

    seq: Seq
    sp: dict[str, Any]
    prompt_index: int
    index: int
    cost: int = 0  # tokens this sample holds in the queue budget: prompt + max_new_tokens


@dataclass
class GenOpts:
    return_logprob: bool = False
    logprob_start_len: int | list[int] = -1  # one for all prompts, or one per prompt (SGLang's list form)
    top_logprobs_num: int = 0
    text_in_logprobs: bool = False
    stream: bool = False
    return_routed_experts: bool = False  # MoE: each position's routed experts in meta_info (SGLang's field)
    routed_experts_start_len: int = 0  # … from this position of the request's prompt (SGLang's field)
    input_logprobs: dict[int, tuple[list, list]] = field(default_factory=dict)  # prompt index → (token, top)
