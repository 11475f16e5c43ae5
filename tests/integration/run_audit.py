"""Audits of a finished run's files, shared by the crash and chaos tests (not a test module)."""

from __future__ import annotations

import json


def effective_history(trained_log: str) -> list[tuple[int, str]]:
    """(step, group id) pairs the final model contains, from trained.jsonl: for each learner incarnation
    the steps up to the checkpoint the next incarnation resumed from, plus everything of the last one."""
    incarnations: list[dict] = []
    for line in open(trained_log):
        ev = json.loads(line)
        if ev["event"] == "start":
            incarnations.append({"resumed_from": ev["resumed_from_step"], "steps": {}})
        else:
            incarnations[-1]["steps"][ev["step"]] = ev["groups"]
    history = []
    for i, inc in enumerate(incarnations):
        upto = incarnations[i + 1]["resumed_from"] if i + 1 < len(incarnations) else float("inf")
        for step, groups in sorted(inc["steps"].items()):
            if step <= upto:
                history += [(step, g) for g in groups]
    return history


def buffer_accounting(url: str, stream: str = "areal_like") -> tuple[set[str], set[str], dict]:
    """(every group id ever accepted, the ids still waiting in the buffer, the buffer's stats)."""
    from areal_like.buffer.replay_buffer import ReplayBuffer

    buf = ReplayBuffer(url, stream=stream)
    try:
        stats = buf.stats()
        keys = buf.endpoint.client.keys(f"{{{stream}}}:gid:*")
        produced = {(k.decode() if isinstance(k, bytes) else k).split(":gid:", 1)[1] for k in keys}
        waiting = {g.group_id for _, g in buf.read(10_000, block_ms=0, consumer="audit")}
    finally:
        buf.close()
    return produced, waiting, stats
