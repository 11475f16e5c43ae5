"""Single-turn RLVR: n samples of one prompt, each scored by a verifiable reward, as one group.

    record ──► n × client.generate (concurrent) ──► decode ──► reward_fn.score (concurrent) ──► TrajectoryGroup

Per-token versions and logprobs are copied from the server's reply (prompt tokens get −1 / 0 in
`Trajectory.build`); this workflow never invents a version. It does not touch the staleness gate,
the buffer or metrics — the rollout worker that calls `run_group` does.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any, Protocol

from areal_like.api.config import GenerationConfig
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.data.dataset import PromptRecord

logger = logging.getLogger(__name__)


class _Client(Protocol):
    async def generate(self, input_ids: list[int], *, max_new_tokens: int, temperature: float, top_p: float,
                       top_k: int, stop_token_ids: list[int], sampling_seed: int | None, rid: str,
                       key: str) -> Any: ...


class _Reward(Protocol):
    async def score(self, data_source: str, solution_str: str, ground_truth: str,
                    extra_info: dict[str, Any] | None = None) -> float: ...


def sample_seed(base_seed: int, group_id: str, index: int) -> int:
    """Per-sample sampling seed, stable across processes (Python's hash() is salted per process).

    Each sample of a group needs its own seed: with one seed per request, deterministic servers
    return n identical samples and GRPO's advantages are all zero.
    """
    h = hashlib.blake2b(f"{base_seed}:{group_id}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


class RLVRWorkflow:
    def __init__(self, client: _Client, reward_fn: _Reward, gen_cfg: GenerationConfig, tokenizer, *,
                 producer: str, seed: int | None = None):
        self.client = client
        self.reward_fn = reward_fn
        self.gen_cfg = gen_cfg
        self.tokenizer = tokenizer
        self.producer = producer
        self.seed = seed
        """Base seed for per-sample sampling seeds; None = the server's own randomness."""
        stop = list(gen_cfg.stop_token_ids)
        eos = tokenizer.eos_token_id
        if eos is not None and eos not in stop:
            stop.append(int(eos))
        self.stop_token_ids = stop

    async def _sample(self, record: PromptRecord, group_id: str, i: int) -> Trajectory:
        g = self.gen_cfg
        res = await self.client.generate(
            record.input_ids,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            stop_token_ids=self.stop_token_ids,
            sampling_seed=None if self.seed is None else sample_seed(self.seed, group_id, i),
            rid=f"{group_id}-{i}",
            key=group_id,  # the n samples of a group go to one server: the prompt's prefix is cached once
        )
        text = self.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        reward = await self.reward_fn.score(record.data_source, text, record.ground_truth, record.extra_info)
        return Trajectory.build(
            traj_id=f"{group_id}-{i}",
            group_id=group_id,
            prompt_id=record.prompt_id,
            prompt_ids=record.input_ids,
            output_ids=res.output_ids,
            output_logprobs=res.output_logprobs,
            output_versions=res.output_versions,
            reward=reward,
            finish_reason=res.finish_reason,
            data_source=record.data_source,
        )

    async def run_group(self, record: PromptRecord, group_id: str) -> TrajectoryGroup | None:
        """The group of `gen_cfg.n` samples; raises if any sample's generation fails (the others are
        cancelled — a partial group is useless to GRPO); None if no sample produced a token."""
        tasks = [asyncio.create_task(self._sample(record, group_id, i)) for i in range(self.gen_cfg.n)]
        try:
            trajs = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if all(t.num_tokens == t.prompt_len for t in trajs):
            logger.warning("group %s (prompt %s): no sample produced a token; dropping it", group_id, record.prompt_id)
            return None
        return TrajectoryGroup(group_id=group_id, prompt_id=record.prompt_id, trajectories=list(trajs),
                               created_at=time.time(), producer=self.producer)
