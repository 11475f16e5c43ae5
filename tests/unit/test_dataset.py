"""verl parquet → PromptRecords; errors; seeded epochs; resumable cursor; sharding."""

import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_like.data.dataset import PromptDataset
from areal_like.data.demo_task import DEMO_DATA_SOURCE, build_demo_task, demo_compute_score
from areal_like.data.tiny_model import build_char_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _write(path, n=6, chat=False, drop=None, extra_index=True):
    cols = {
        "prompt": [[{"role": "user", "content": f"q{i}"}] if chat else f"q{i}" for i in range(n)],
        "data_source": ["exact"] * n,
        "reward_model": [{"ground_truth": str(i), "style": "rule"} for i in range(n)],
        "extra_info": [{"index": 100 + i} if extra_index else {"split": "train"} for i in range(n)],
        "ignored": list(range(n)),
    }
    if drop:
        cols.pop(drop)
    pq.write_table(pa.table(cols), path)
    return str(path)


def test_text_prompts(tok, tmp_path):
    ds = PromptDataset([_write(tmp_path / "t.parquet")], tok, max_prompt_length=64)
    r = ds[2]
    assert r.input_ids == tok.encode("q2", add_special_tokens=False)
    assert (r.prompt_id, r.ground_truth, r.data_source, r.raw_prompt) == ("t:102", "2", "exact", "q2")
    assert r.extra_info == {"index": 102}


def test_chat_prompts_and_row_ids(tok, tmp_path):
    ds = PromptDataset([_write(tmp_path / "c.parquet", chat=True, extra_index=False)], tok, max_prompt_length=64)
    r = ds[1]
    assert tok.decode(r.input_ids) == "#U:q1\n#A:"  # the template with the generation prompt
    assert r.prompt_id == "c:row1"
    assert r.raw_prompt == [{"role": "user", "content": "q1"}]


def test_text_with_chat_template_flag(tok, tmp_path):
    ds = PromptDataset([_write(tmp_path / "t.parquet")], tok, max_prompt_length=64, apply_chat_template=True)
    assert tok.decode(ds[0].input_ids) == "#U:q0\n#A:"


def test_drops_long_prompts(tok, tmp_path):
    p = tmp_path / "l.parquet"
    pq.write_table(pa.table({"prompt": ["ab", "abcdefgh"], "reward_model": [{"ground_truth": "x"}] * 2}), p)
    ds = PromptDataset([str(p)], tok, max_prompt_length=4)
    assert len(ds) == 1 and ds.num_dropped == 1 and ds[0].data_source == ""


def test_missing_column_errors(tok, tmp_path):
    f = _write(tmp_path / "x.parquet", drop="prompt")
    with pytest.raises(ValueError, match=r"data.train_files\[0\]=.*x.parquet has no column 'prompt'.*data.prompt_key"):
        PromptDataset([f], tok, max_prompt_length=64)
    g = _write(tmp_path / "y.parquet", drop="reward_model")
    with pytest.raises(ValueError, match=r"train_files\[1\]=.*y.parquet has no column 'reward_model'"):
        PromptDataset([_write(tmp_path / "ok.parquet"), g], tok, max_prompt_length=64)
    with pytest.raises(FileNotFoundError, match="nope.parquet"):
        PromptDataset([str(tmp_path / "nope.parquet")], tok, max_prompt_length=64)
    with pytest.raises(ValueError, match="column 'ignored' holds int"):
        PromptDataset([_write(tmp_path / "k.parquet")], tok, prompt_key="ignored", max_prompt_length=64)


def test_shuffle_epochs_and_resume(tok, tmp_path):
    ds = PromptDataset([_write(tmp_path / "t.parquet", n=10)], tok, max_prompt_length=64)
    it = ds.iterator(seed=3)
    ep0 = [next(it).prompt_id for _ in range(10)]
    ep1 = [next(it).prompt_id for _ in range(10)]
    assert sorted(ep0) == sorted(ep1) == sorted(r.prompt_id for r in ds.records)
    assert ep0 != ep1  # a new permutation each epoch
    assert [next(ds.iterator(seed=3)).prompt_id] == ep0[:1]  # same seed, same order
    # resume mid-epoch from a saved cursor
    it2 = ds.iterator(seed=3)
    for _ in range(13):
        next(it2)
    state = it2.state_dict()
    assert (state["epoch"], state["position"]) == (1, 3)
    it3 = ds.iterator(seed=3)
    it3.load_state_dict(state)
    assert [next(it3).prompt_id for _ in range(7)] == ep1[3:]
    no_shuffle = ds.iterator(shuffle=False)
    assert [next(no_shuffle).prompt_id for _ in range(3)] == [r.prompt_id for r in ds.records[:3]]


def test_sharding_is_disjoint_and_covers(tok, tmp_path):
    ds = PromptDataset([_write(tmp_path / "t.parquet", n=9)], tok, max_prompt_length=64)
    shards = [[next(ds.iterator(seed=1, rank=k, world_size=3)) for _ in range(1)] for k in range(3)]
    full = []
    for k in range(3):
        it = ds.iterator(seed=1, rank=k, world_size=3)
        full.append([next(it).prompt_id for _ in range(3)])
    flat = [p for s in full for p in s]
    assert len(set(flat)) == 9 and shards[0][0].prompt_id == full[0][0]
    it = ds.iterate(seed=1, shard=2, num_shards=3)
    assert [next(it).prompt_id for _ in range(3)] == full[2]
    with pytest.raises(ValueError, match="rollout.workers"):
        ds.iterator(rank=0, world_size=10)


def test_demo_task_parquet(tok, tmp_path):
    path = build_demo_task(str(tmp_path / "demo.parquet"), n_train=32, seed=0)
    ds = PromptDataset([path], tok, max_prompt_length=16)
    assert len(ds) == 32 and os.path.exists(path)
    for r in ds.records:
        assert r.data_source == DEMO_DATA_SOURCE
        last = tok.decode(r.input_ids[-1:])
        assert r.ground_truth == str((int(last) + 1) % 10)
        assert demo_compute_score(r.ground_truth, r.ground_truth) == 1.0


def test_first_digit_task_keys_on_the_first_digit(tok, tmp_path, monkeypatch):
    """`demo:first-digit` (configs/staleness_study.yaml): ≥ 2 digits, answer = successor of the FIRST one;
    built by `resolve_demo_name` in the cache dir like the other demo names, and its -val file too."""
    from areal_like.data.demo_task import make_example, resolve_demo_name

    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path))
    path = resolve_demo_name("demo:first-digit", "data.train_files")
    assert path.startswith(str(tmp_path)) and path.endswith("first-digit-train.parquet")
    ds = PromptDataset([path], tok, max_prompt_length=16)
    assert len(ds) == 2048
    lens = set()
    for r in ds.records:
        digits = tok.decode(r.input_ids)
        lens.add(len(digits))
        assert r.ground_truth == str((int(digits[0]) + 1) % 10), digits
    assert lens == {2, 3, 4, 5, 6}
    # the key is not the last digit: next-digit's answer differs on most prompts
    assert sum(r.ground_truth != str((int(tok.decode(r.input_ids[-1:])) + 1) % 10) for r in ds.records) > 1500
    val = resolve_demo_name("demo:first-digit-val", "data.val_files")
    vds = PromptDataset([val], tok, max_prompt_length=16)
    assert len(vds) == 32 and not {r.raw_prompt for r in vds.records} <= {r.raw_prompt for r in ds.records}
    with pytest.raises(ValueError, match="first-digit"):
        make_example(random.Random(0), task="middle-digit")
