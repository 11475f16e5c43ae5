"""verl-format parquet prompts → tokenized `PromptRecord`s, and a resumable, sharded, shuffled iterator.

Schema read (verl's): `prompt` (a str, or a chat list of {"role", "content"}), `data_source` (str),
`reward_model` (struct with `ground_truth`, optional `style`), `extra_info` (struct/dict, may hold
`index`). Other columns are ignored. The column named by `data.prompt_key` replaces `prompt`.

Tokenization: a chat list always goes through `tokenizer.apply_chat_template(add_generation_prompt=True)`;
a plain string goes through the chat template only when `apply_chat_template=True` (as a single
user turn), else it is encoded as is (no special tokens added). Prompts longer than
`max_prompt_length` tokens are dropped, counted in `num_dropped` and logged once.

This module does not know about rewards, servers or the staleness gate: it hands out prompts.
"""

from __future__ import annotations

import logging
import os
import random
from typing import Any, Iterator

from areal_like.api.workflow import PromptRecord  # noqa: F401  (defined with the workflow API; imported from here too)

logger = logging.getLogger(__name__)


def _stem(path: str) -> str:
    base = os.path.basename(path)
    return base[: -len(".parquet")] if base.endswith(".parquet") else base


def _to_chat(raw: Any) -> list[dict[str, str]] | None:
    """A chat list (pyarrow gives list of dicts; numpy-ish arrays appear when read via pandas)."""
    if isinstance(raw, (list, tuple)):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in raw]
    return None


def prompt_cell_problem(raw: Any, prompt_key: str = "prompt") -> str | None:
    """What is wrong with one prompt cell (None when it is usable): a non-empty str, or a non-empty chat
    list of {role: str, content: str} messages. The same rule for `launcher run`'s preflight and the
    rollout worker, so a file the preflight passed never fails in the worker."""
    if raw is None:
        return f"column {prompt_key!r} is null"
    if isinstance(raw, str):
        return None if raw else f"column {prompt_key!r} is an empty string"
    if not isinstance(raw, (list, tuple)):
        return f"column {prompt_key!r} holds {type(raw).__name__}, want a str or a list of {{role, content}}"
    if not raw:
        return f"column {prompt_key!r} is an empty chat list"
    for j, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m.get("role"):
            return f"column {prompt_key!r} message {j} has no role (want {{role: str, content: str}}, got {m!r:.80})"
        if not isinstance(m.get("content"), str):
            return (f"column {prompt_key!r} message {j} ({m['role']}) has content "
                    f"{type(m.get('content')).__name__}, want a str")
    return None


def check_prompt_cells(path: str, *, prompt_key: str = "prompt",
                       where: str | None = None) -> tuple[int, dict[str, int]]:
    """Read only the prompt column (and the rows' `agent_name`, column or `extra_info.agent_name`) of a
    verl parquet file and check every prompt cell; ValueError naming `where` and the row otherwise.
    Returns (row count, {agent_name: first row using it})."""
    import pyarrow.parquet as pq

    where = where or path
    meta = pq.ParquetFile(path)
    names = set(meta.schema_arrow.names)
    cols = [prompt_key] + [c for c in ("agent_name", "extra_info") if c in names and c != prompt_key]
    if "extra_info" in cols:
        import pyarrow as pa

        t = meta.schema_arrow.field("extra_info").type
        if not (pa.types.is_struct(t) and t.get_field_index("agent_name") >= 0):
            cols.remove("extra_info")  # read extra_info only for its agent_name
    table = pq.read_table(path, columns=cols)
    for i, raw in enumerate(table.column(prompt_key).to_pylist()):
        problem = prompt_cell_problem(raw, prompt_key)
        if problem:
            raise ValueError(f"{where} row {i}: {problem}: fix the row (or drop it), or point data.prompt_key at "
                             "the column holding the prompt")
    agents: dict[str, int] = {}
    own = table.column("agent_name").to_pylist() if "agent_name" in cols else [None] * table.num_rows
    extra = ([(e or {}).get("agent_name") for e in table.column("extra_info").to_pylist()]
             if "extra_info" in cols else [None] * table.num_rows)
    for i, (a, b) in enumerate(zip(own, extra)):
        name = a or b  # PromptRecord.agent_name's rule
        if name and str(name) not in agents:
            agents[str(name)] = i
    return table.num_rows, agents


MODEL_STYLE = "model"  # verl's reward_model.style of a row a reward model grades (no rule reference needed)


def first_model_graded_row(path: str) -> int | None:
    """The first row of a verl parquet file whose `reward_model.style` is "model" (verl's mark of a row graded
    by a reward model, whose `ground_truth` may be empty), or None. Reads only that column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.ParquetFile(path).schema_arrow.field("reward_model").type
    if not (pa.types.is_struct(t) and t.get_field_index("style") >= 0):
        return None
    for i, rm in enumerate(pq.read_table(path, columns=["reward_model"]).column("reward_model").to_pylist()):
        if isinstance(rm, dict) and str(rm.get("style") or "").lower() == MODEL_STYLE:
            return i
    return None


def check_verl_parquet(path: str, *, prompt_key: str = "prompt", where: str | None = None) -> int:
    """Check a verl parquet file from its footer alone (no rows read): it exists, is parquet, and has
    the prompt column and `reward_model` with a `ground_truth` field. Returns the row count.

    `where` names the config key in error messages (e.g. "data.train_files[0]=x.parquet")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = where or path
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where} does not exist: point it at a verl-format parquet file "
                                "(or use demo:next-digit for the demo task)")
    try:
        meta = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 — pyarrow raises several types for a non-parquet file
        raise ValueError(f"{where} is not a parquet file ({type(e).__name__}: {e})") from None
    schema = meta.schema_arrow
    cols = set(schema.names)
    if prompt_key not in cols:
        raise ValueError(f"{where} has no column {prompt_key!r} (columns: {sorted(cols)}): "
                         f"set data.prompt_key=<the column holding the prompt>")
    if "reward_model" not in cols:
        raise ValueError(f"{where} has no column 'reward_model' (columns: {sorted(cols)}): verl format needs "
                         f"reward_model: {{ground_truth: ...}} per row; add it to the file")
    rm = schema.field("reward_model").type
    if not pa.types.is_struct(rm) or rm.get_field_index("ground_truth") < 0:
        raise ValueError(f"{where}: column reward_model is {rm}, not a struct with a ground_truth field: "
                         "write reward_model as {ground_truth: str, style: str}")
    return meta.metadata.num_rows


def read_verl_parquet(path: str, *, prompt_key: str = "prompt", where: str | None = None) -> list[dict[str, Any]]:
    """Rows of one verl parquet file as dicts with keys prompt, data_source, ground_truth, extra_info.

    `where` names the file in error messages (e.g. "data.train_files[0]=x.parquet").
    """
    import pyarrow.parquet as pq

    where = where or path
    check_verl_parquet(path, prompt_key=prompt_key, where=where)  # existence, columns: one set of messages
    table = pq.read_table(path)
    cols = set(table.column_names)
    n = table.num_rows
    prompts = table.column(prompt_key).to_pylist()
    rms = table.column("reward_model").to_pylist()
    sources = table.column("data_source").to_pylist() if "data_source" in cols else [""] * n
    extras = table.column("extra_info").to_pylist() if "extra_info" in cols else [None] * n
    whole = table.to_pylist()
    rows = []
    for i in range(n):
        rm = rms[i]
        if not isinstance(rm, dict) or "ground_truth" not in rm:
            raise ValueError(f"{where} row {i}: reward_model has no 'ground_truth' field ({rm!r}): "
                             f"write reward_model as a struct {{ground_truth: str, style: str}}")
        gt = rm["ground_truth"]
        rows.append({
            "prompt": prompts[i],
            "data_source": sources[i] or "",
            "ground_truth": "" if gt is None else str(gt),
            "extra_info": dict(extras[i]) if isinstance(extras[i], dict) else {},
            "row": whole[i],
        })
    return rows


class PromptDataset:
    """All prompts of the given parquet files, tokenized once at load time (small datasets by design)."""

    def __init__(self, files: list[str], tokenizer, *, prompt_key: str = "prompt", max_prompt_length: int = 256,
                 apply_chat_template: bool = False, key: str = "data.train_files"):
        """`key` names the config key of `files` in error messages (data.train_files / data.val_files)."""
        if not files:
            raise ValueError(f"{key} is empty: set {key}=[path/to/file.parquet]")
        self.records: list[PromptRecord] = []
        self.num_dropped = 0
        num_rows = 0
        for fi, path in enumerate(files):
            where = f"{key}[{fi}]={path}"
            stem = _stem(path)
            for row_idx, row in enumerate(read_verl_parquet(path, prompt_key=prompt_key, where=where)):
                num_rows += 1
                raw = row["prompt"]
                problem = prompt_cell_problem(raw, prompt_key)
                if problem:
                    raise ValueError(f"{where} row {row_idx}: {problem}: fix the row (or drop it), or point "
                                     "data.prompt_key at the column holding the prompt")
                chat = _to_chat(raw)
                if chat is not None:
                    ids = _chat_ids(tokenizer, chat)
                else:
                    ids = (_chat_ids(tokenizer, [{"role": "user", "content": raw}]) if apply_chat_template
                           else list(tokenizer.encode(raw, add_special_tokens=False)))
                if len(ids) > max_prompt_length:
                    self.num_dropped += 1
                    continue
                idx = row["extra_info"].get("index")
                pid = f"{stem}:{idx}" if idx is not None else f"{stem}:row{row_idx}"
                self.records.append(PromptRecord(prompt_id=pid, input_ids=ids, ground_truth=row["ground_truth"],
                                                 data_source=row["data_source"], extra_info=row["extra_info"],
                                                 raw_prompt=raw, row=row["row"]))
        if self.num_dropped:
            logger.warning("dropped %d prompts longer than data.max_prompt_length=%d tokens (kept %d)",
                           self.num_dropped, max_prompt_length, len(self.records))
        if not num_rows:
            raise ValueError(f"{key}={list(files)} have no rows: add prompts to the file(s) or point {key} at "
                             "other files")
        if not self.records:
            raise ValueError(f"no prompts left from {key}={list(files)}: all {self.num_dropped} are longer than "
                             f"data.max_prompt_length={max_prompt_length} tokens: raise data.max_prompt_length")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]

    def iterator(self, *, seed: int = 1, shuffle: bool = True, rank: int = 0, world_size: int = 1) -> "PromptIterator":
        return PromptIterator(self, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size)

    def iterate(self, *, seed: int = 1, shuffle: bool = True, shard: int = 0, num_shards: int = 1) -> "PromptIterator":
        """`iterator()` with shard/num_shards naming (as the rollout worker calls it)."""
        return self.iterator(seed=seed, shuffle=shuffle, rank=shard, world_size=num_shards)


def _chat_ids(tokenizer, chat: list[dict[str, str]]) -> list[int]:
    out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    # transformers 5 may return a BatchEncoding / dict instead of a list of ids.
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]


class PromptIterator:
    """Endless epochs over one worker's shard; epoch e is a seeded permutation (same on every worker).

    Sharding: worker `rank` of `world_size` takes positions rank, rank+N, rank+2N, … of each epoch's
    permutation, so the workers' shards are disjoint and together cover the epoch. The cursor
    (epoch, position within this shard) is all the state: `state_dict()` / `load_state_dict()`
    resume exactly where the iterator stopped, for checkpointing.
    """

    def __init__(self, dataset: PromptDataset, *, seed: int = 1, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rollout worker rank {rank} outside [0, {world_size}): check rollout.workers")
        if len(dataset) < world_size:
            raise ValueError(f"{len(dataset)} prompts cannot be sharded across {world_size} rollout workers: "
                             f"set rollout.workers ≤ {len(dataset)}")
        self.dataset = dataset
        self.seed, self.shuffle, self.rank, self.world_size = seed, shuffle, rank, world_size
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None

    def _shard_order(self) -> list[int]:
        if self._order is None:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            # Every shard gets the same length (the tail that does not divide evenly is skipped this epoch,
            # and lands elsewhere in the next permutation) so workers stay in step epoch by epoch.
            per = len(order) // self.world_size
            self._order = order[self.rank::self.world_size][:per]
        return self._order

    def __iter__(self) -> Iterator[PromptRecord]:
        return self

    def __next__(self) -> PromptRecord:
        order = self._shard_order()
        if self.position >= len(order):
            self.epoch += 1
            self.position = 0
            self._order = None
            order = self._shard_order()
        rec = self.dataset[order[self.position]]
        self.position += 1
        return rec

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("world_size", self.world_size) != self.world_size or state.get("seed", self.seed) != self.seed:
            logger.warning("prompt iterator state was saved with world_size=%s seed=%s, now %s/%s: "
                           "resuming at the same epoch, positions may repeat or skip",
                           state.get("world_size"), state.get("seed"), self.world_size, self.seed)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None
