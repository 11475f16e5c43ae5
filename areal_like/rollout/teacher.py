"""On-policy distillation's rollout half (`teacher.*`): the teacher scores every sample of a group.

After a workflow returned a group, and before the group enters the buffer, each trajectory's whole
sequence (prompt, response, and a multi-turn episode's tool tokens) goes to the allocation's teacher
servers as SGLang's scoring request — `/generate` with the sequence as `input_ids`, `max_new_tokens` 0,
`return_logprob`, `logprob_start_len` = the prompt's length (engine/client.py `GenerationClient.score`) —
and the teacher's logprob of every token after the prompt is stored on the trajectory
(`Trajectory.teacher_logprobs`, float32 aligned with the tokens; 4 bytes per token in the buffer). The
learner turns it into the per-token reverse KL of the advantage (learner/trainer.py `_advantages`).

A group's samples are scored in one batched request (SGLang's list forms of `input_ids` and
`logprob_start_len`), routed by the group id.
Scoring runs inside the episode's time limit; a teacher that cannot answer (past `teacher.timeout_s` and
`teacher.max_retries`, every server down) fails the group like a generation failure: it is counted and
its prompt retried, and nothing unscored reaches the learner.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from areal_like import metrics as M
from areal_like.api.config import TeacherConfig
from areal_like.api.trajectory import LOGPROBS_DTYPE, TrajectoryGroup


class Teacher:
    """`await teacher.score_group(group)`: sets every trajectory's `teacher_logprobs`."""

    def __init__(self, cfg: TeacherConfig, client: Any):
        self.cfg = cfg
        self.client = client
        self.label = f"teacher {cfg.model_path}"

    @classmethod
    def from_config(cls, cfg: TeacherConfig, urls: list[str], *, api_key: str | None) -> "Teacher":
        """The teacher over the servers `urls` (endpoints.json `teacher_servers`)."""
        from areal_like.engine.client import GenerationClient

        client = GenerationClient(urls, request_timeout_s=cfg.timeout_s, api_key=api_key,
                                  max_timeout_retries=cfg.max_retries)
        return cls(cfg, client)

    async def score_group(self, group: TrajectoryGroup) -> None:
        """Every trajectory's `teacher_logprobs`: one batched scoring request for the group's samples that have
        a response (zeros before each response's start; an empty response scores nothing)."""
        todo = []
        for traj in group.trajectories:
            ids = traj.ids_np()
            traj.teacher_logprobs = np.zeros(len(ids), dtype=LOGPROBS_DTYPE).tobytes()
            start = max(1, traj.prompt_len)
            if start < len(ids):
                todo.append((traj, ids, start))
        if not todo:
            return
        t0 = time.perf_counter()
        try:
            scored = await self.client.score([ids.tolist() for _, ids, _ in todo], [st for _, _, st in todo],
                                             key=group.group_id)
        except BaseException:
            M.TEACHER_SCORINGS.labels("failed").inc(len(todo))
            raise
        M.TEACHER_LATENCY.observe(time.perf_counter() - t0)
        M.TEACHER_SCORINGS.labels("ok").inc(len(todo))
        for (traj, ids, start), lps in zip(todo, scored):
            out = np.zeros(len(ids), dtype=LOGPROBS_DTYPE)
            out[start:] = lps
            traj.teacher_logprobs = out.tobytes()

    async def close(self) -> None:
        await self.client.close()
