"""The learner's ledger (rank 0): the policy version it publishes and the entries it trained, committed once.

Exactly once (DESIGN invariant 4): entries are committed (acked, recorded as trained) only after a
checkpoint that contains their update, so a crash replays exactly the updates the restored model lacks;
until then they are `uncommitted`, and a checkpoint stores them (`checkpoint_extra`) for the next start's
`recover`. `trained.jsonl` logs what each incarnation trained, for audits and tests. The published version
frees the staleness gate's next B slots.
"""

from __future__ import annotations

import json
import os

from areal_like import metrics as M
from areal_like.learner.feed import Batch
from areal_like.learner.log import log


def _append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


class Ledger:
    """Publishes versions, records trained entries and commits those a checkpoint covers."""

    def __init__(self, buffer, run_dir: str, incarnation: int, consumer: str):
        self.buffer = buffer  # buffer.replay_buffer.ReplayBuffer; its `run` holds the version
        self.incarnation = incarnation
        self.consumer = consumer
        self.uncommitted: list[tuple[str, str]] = []  # (entry id, group id) trained, not yet committed
        self.trained_log = os.path.join(run_dir, "trained.jsonl")

    def recover(self, uncommitted: list[tuple[str, str]], step: int, rollback: tuple[int, int] | None) -> list:
        """Finish a commit a crash cut off and return the entries read but not covered by the checkpoint
        of `step` (to train first). `rollback` (version, B): this start resumes an older checkpoint on
        purpose (explicit train.resume_mode, disable, or the fallback past an unusable newest one): a
        buffer that committed later steps is rewound."""
        redo = self.buffer.recover(self.consumer, uncommitted, step, rollback=rollback)
        if redo:
            log(f"recovered {len(redo)} entr(ies) read but not covered by a checkpoint: training them first")
        return redo

    def started(self, step: int) -> None:
        _append_jsonl(self.trained_log, {"event": "start", "incarnation": self.incarnation, "resumed_from_step": step})

    def set_version(self, version: int) -> None:
        self.buffer.run.set_version(version)
        M.POLICY_VERSION.set(version)

    def published(self, step: int, version: int, batch: Batch) -> None:
        """The step's weights are on every server as `version`: tell the gate, remember what to commit."""
        self.set_version(version)
        self.uncommitted += [(eid, g.group_id) for eid, g in zip(batch.ids, batch.groups)]
        _append_jsonl(self.trained_log, {"event": "trained", "incarnation": self.incarnation, "step": step,
                                         "groups": [g.group_id for g in batch.groups]})

    def commit(self, step: int) -> None:
        if self.uncommitted:
            self.buffer.commit(self.uncommitted, step, self.consumer)
        self.uncommitted = []

    def checkpoint_extra(self, step: int, version: int) -> dict:
        """What a checkpoint of `step` records besides the model: the entries trained since the last
        commit, which it covers (a start from it finishes their commit if this learner could not)."""
        return {"step": step, "version": version, "uncommitted": [list(p) for p in self.uncommitted]}
