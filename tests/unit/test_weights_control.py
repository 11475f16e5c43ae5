"""Both transports are the learner's GenerationControl handle (weights/control.py): every verb the
co-located runtime composes exists on each, with the Protocol's names."""

import inspect

import pytest

from areal_like.weights import MEMORY_TAGS, DiskWeightPusher, GenerationControl, WeightPusher


@pytest.mark.parametrize("make", [
    lambda tmp: WeightPusher(["http://127.0.0.1:9"], master_port=1),
    lambda tmp: DiskWeightPusher(["http://127.0.0.1:9"], out_dir=str(tmp), model_path=str(tmp)),
])
def test_each_transport_is_a_generation_control(tmp_path, make):
    handle = make(tmp_path)
    assert isinstance(handle, GenerationControl)
    for verb in ("init", "close", "wait_servers", "pause", "resume", "update", "release_memory",
                 "resume_memory", "reform"):
        assert inspect.iscoroutinefunction(getattr(handle, verb)), verb


def test_memory_tags_are_sglangs():
    assert MEMORY_TAGS == ("kv_cache", "weights")  # sglang.srt.constants.GPU_MEMORY_TYPE_{KV_CACHE,WEIGHTS}
