"""Issue 40 item 8: a pool verifies a checkpoint by reading each file once, spread over its ranks — the
shared model files too (16 ranks used to hash every model shard 16 times, under the collective timeout,
while the servers loaded the same files). Checked on real files with `verify_checkpoint`, as each rank of
a 2-rank pool calls it (`_verified` then makes the ranks agree)."""

import json
import os

import msgspec

from areal_like.learner.checkpoint import publish_checkpoint_dir, verify_checkpoint


def _checkpoint(tmp_path) -> str:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    for name, size in (("model-00001-of-00002.safetensors", 3000), ("model-00002-of-00002.safetensors", 2000),
                       ("model.safetensors.index.json", 100), ("rank00000.pt", 50), ("rank00001.pt", 60),
                       ("__0_0.distcp", 70), ("__1_0.distcp", 80)):
        (tmp / name).write_bytes(os.urandom(size))
    path = str(tmp_path / "step_00000001")
    publish_checkpoint_dir(str(tmp), path, msgspec.json.encode({"format": 5}), manifest=True)
    return path


def _corrupt(path: str, name: str) -> None:
    p = os.path.join(path, name)
    data = bytearray(open(p, "rb").read())
    data[0] ^= 0xFF  # same size: only the hash can tell
    open(p, "wb").write(bytes(data))


def test_each_file_is_hashed_by_exactly_one_rank(tmp_path):
    path = _checkpoint(tmp_path)
    files = sorted(json.load(open(os.path.join(path, "meta.json")))["files"])
    for name in files:
        _corrupt(path, name)
        found = [r for r in range(2) if verify_checkpoint(path, r, 2) is not None]
        assert len(found) == 1, (name, found)  # one rank read it, not both
        assert name in verify_checkpoint(path, found[0], 2)
        assert verify_checkpoint(path, 0, 1) is not None  # a one-rank pool reads everything
        _corrupt(path, name)  # flipped back
    assert all(verify_checkpoint(path, r, 2) is None for r in range(2))


def test_the_model_shards_are_split_between_the_ranks(tmp_path):
    path = _checkpoint(tmp_path)
    _corrupt(path, "model-00001-of-00002.safetensors")
    _corrupt(path, "model-00002-of-00002.safetensors")
    errs = [verify_checkpoint(path, r, 2) for r in range(2)]
    assert all(e is not None for e in errs), errs  # each rank found the shard it read
    assert "model-00001" in errs[0] + errs[1] and "model-00002" in errs[0] + errs[1]
