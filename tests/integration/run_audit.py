"""Audits of a finished run's files, shared by the crash and chaos tests (not a test module)."""

from __future__ import annotations


def effective_history(trained_log: str) -> list[tuple[int, str]]:
    """(step, group id) pairs the final model contains, from trained.jsonl (`trained_steps`: for each
    learner incarnation the steps up to the checkpoint the next incarnation resumed from)."""
    from areal_like.api.run_files import trained_steps

    return [(step, g) for step, groups in trained_steps(trained_log).items() for g in groups]


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
