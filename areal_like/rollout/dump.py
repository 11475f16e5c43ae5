"""Trajectory dumps (`rollout.dump_dir`): every group a rollout worker got accepted, as one JSON line.

What users open first when an agent misbehaves: the text of each sample with the trained parts
marked, and everything the learner needs to train on it again (`launcher replay --dump-dir D`).

    <dump_dir>/rollout<k>.jsonl, one line per accepted group:
    {"group_id", "prompt_id", "producer", "created_at", "episode": {…workflow counters, e.g. tool calls…},
     "trajectories": [{"traj_id", "data_source", "reward", "finish_reason", "prompt_len",
                       "min_version", "max_version", "prompt_text", "segments": [{"text", "trained"}…],
                       "input_ids", "loss_mask", "logprobs", "versions"}]}

`segments` splits the sequence after the prompt into runs of trained (loss mask 1, generated) and
untrained (tool output, template glue, feedback) tokens, decoded — the assistant turns and what came
back between them. The token arrays are exact: `read_dump` rebuilds the very `TrajectoryGroup`s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

from areal_like.api.trajectory import (IDS_DTYPE, LOGPROBS_DTYPE, MASK_DTYPE, VERSIONS_DTYPE, Trajectory,
                                       TrajectoryGroup)


def group_record(group: TrajectoryGroup, tokenizer=None, episode: dict | None = None) -> dict:
    trajs = []
    for t in group.trajectories:
        ids, mask = t.ids_np(), t.mask_np()
        d = {"traj_id": t.traj_id, "data_source": t.data_source, "reward": t.reward, "finish_reason": t.finish_reason,
             "prompt_len": t.prompt_len, "min_version": t.min_version, "max_version": t.max_version}
        if tokenizer is not None:
            d["prompt_text"] = tokenizer.decode(ids[:t.prompt_len].tolist(), skip_special_tokens=False)
            segs, start = [], t.prompt_len
            for i in range(t.prompt_len + 1, len(ids) + 1):
                if i == len(ids) or mask[i] != mask[start]:
                    segs.append({"text": tokenizer.decode(ids[start:i].tolist(), skip_special_tokens=False),
                                 "trained": bool(mask[start])})
                    start = i
            d["segments"] = segs
        d.update(input_ids=ids.tolist(), loss_mask=mask.tolist(),
                 logprobs=[float(x) for x in t.logprobs_np()], versions=t.versions_np().tolist())
        trajs.append(d)
    return {"group_id": group.group_id, "prompt_id": group.prompt_id, "producer": group.producer,
            "created_at": group.created_at, "episode": _jsonable(episode or {}), "trajectories": trajs}


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


def record_group(d: dict) -> TrajectoryGroup:
    """A dump line back into the exact group (token arrays, logprobs, versions, mask)."""
    trajs = []
    for t in d["trajectories"]:
        tr = Trajectory(
            traj_id=t["traj_id"], group_id=d["group_id"], prompt_id=d["prompt_id"],
            input_ids=np.asarray(t["input_ids"], IDS_DTYPE).tobytes(),
            loss_mask=np.asarray(t["loss_mask"], MASK_DTYPE).tobytes(),
            logprobs=np.asarray(t["logprobs"], LOGPROBS_DTYPE).tobytes(),
            versions=np.asarray(t["versions"], VERSIONS_DTYPE).tobytes(),
            prompt_len=int(t["prompt_len"]), reward=float(t["reward"]), finish_reason=t["finish_reason"],
            min_version=int(t["min_version"]), max_version=int(t["max_version"]), data_source=t.get("data_source", ""))
        tr.validate()
        trajs.append(tr)
    return TrajectoryGroup(group_id=d["group_id"], prompt_id=d["prompt_id"], trajectories=trajs,
                           created_at=float(d.get("created_at", 0.0)), producer=d.get("producer", ""))


class DumpWriter:
    """Appends accepted groups to `<dump_dir>/rollout<k>.jsonl` (one line each, flushed: a crash loses none)."""

    def __init__(self, dump_dir: str, index: int, tokenizer=None):
        os.makedirs(dump_dir, exist_ok=True)
        self.path = os.path.join(dump_dir, f"rollout{index}.jsonl")
        self.tokenizer = tokenizer
        self._f = open(self.path, "a", buffering=1)

    def write(self, group: TrajectoryGroup, episode: dict | None = None) -> None:
        self._f.write(json.dumps(group_record(group, self.tokenizer, episode)) + "\n")

    def close(self) -> None:
        self._f.close()


def read_dump(dump_dir: str) -> Iterator[TrajectoryGroup]:
    """Every group of every `rollout*.jsonl` in `dump_dir` (file by file, in line order); a clear error
    naming the file and line for anything that is not a dump line."""
    if not os.path.isdir(dump_dir):
        raise FileNotFoundError(f"--dump-dir {dump_dir} is not a directory (a run's rollout.dump_dir)")
    files = sorted(f for f in os.listdir(dump_dir) if f.startswith("rollout") and f.endswith(".jsonl"))
    if not files:
        raise FileNotFoundError(f"--dump-dir {dump_dir} holds no rollout*.jsonl: was rollout.dump_dir set for the run?")
    for name in files:
        path = os.path.join(dump_dir, name)
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield record_group(json.loads(line))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{path} line {lineno} is not a trajectory dump line: {type(e).__name__}: {e}") from e
