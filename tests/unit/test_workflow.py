"""RLVRWorkflow against a fake client: group shape, versions, loss mask, rewards, seeds, failures."""

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

from areal_like.api.config import GenerationConfig
from areal_like.api.trajectory import decode_group, encode_group
from areal_like.data.dataset import PromptRecord
from areal_like.data.tiny_model import build_char_tokenizer
from areal_like.reward import RewardFn
from areal_like.workflow import RLVRWorkflow, RolloutWorkflow, sample_seed


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(str(tmp_path_factory.mktemp("tok")))


@dataclass
class Result:
    output_ids: list
    output_logprobs: list
    output_versions: list
    finish_reason: str
    server: str = "fake:0"
    num_interruptions: int = 0


class FakeClient:
    """Answers sample i (rid suffix) with a scripted completion; versions 3,3,4 (an interrupted update)."""

    def __init__(self, tok, answers, fail_on=None):
        self.tok, self.answers, self.fail_on = tok, answers, fail_on
        self.calls = []

    async def generate(self, input_ids, *, max_new_tokens, temperature, top_p, top_k, stop_token_ids,
                       sampling_seed, rid, key):
        self.calls.append(dict(input_ids=list(input_ids), max_new_tokens=max_new_tokens, stop=stop_token_ids,
                               seed=sampling_seed, rid=rid, key=key, temperature=temperature))
        i = int(rid.rsplit("-", 1)[1])
        await asyncio.sleep(0.001 * (self.tokens_len(i) % 3))
        if self.fail_on == i:
            raise TimeoutError("server fake:0 timed out generating rid " + rid)
        ids = self.tok.encode(self.answers[i], add_special_tokens=False)
        reason = "length" if len(ids) >= max_new_tokens else "stop"
        ids = ids[:max_new_tokens]
        if reason == "stop":
            ids = ids + [self.tok.eos_token_id]
        versions = [3 + (j >= 2) for j in range(len(ids))]
        return Result(ids, [-0.5] * len(ids), versions, reason)

    def tokens_len(self, i):
        return len(self.answers[i])


def _record(tok):
    return PromptRecord(prompt_id="demo:7", input_ids=tok.encode("4071", add_special_tokens=False),
                        ground_truth="2", data_source="areal_like/demo", extra_info={"index": 7}, raw_prompt="4071")


async def test_group_is_built_correctly(tok):
    answers = ["2", "3", "2222", "", "x"]
    gen = GenerationConfig(n=5, max_new_tokens=3, stop_token_ids=[5])
    client = FakeClient(tok, answers)
    wf = RLVRWorkflow(client, RewardFn(), gen, tok, producer="rollout-0", seed=11)
    assert isinstance(wf, RolloutWorkflow)
    g = await wf.run_group(_record(tok), "g-1")
    g = decode_group(encode_group(g))  # survives the wire
    assert (g.group_id, g.prompt_id, g.producer) == ("g-1", "demo:7", "rollout-0")
    assert [t.traj_id for t in g.trajectories] == [f"g-1-{i}" for i in range(5)]
    assert g.rewards == [1.0, 0.0, 0.5, 0.0, 0.0]
    t0, t2 = g.trajectories[0], g.trajectories[2]
    P = 4
    assert t0.prompt_len == P and t0.finish_reason == "stop" and t2.finish_reason == "length"
    assert list(t0.ids_np()) == _record(tok).input_ids + [tok.encode("2", add_special_tokens=False)[0], tok.eos_token_id]
    assert list(t0.versions_np()) == [-1] * P + [3, 3]
    assert list(t0.mask_np()) == [0] * P + [1, 1]
    assert np.allclose(t0.logprobs_np(), [0] * P + [-0.5, -0.5])
    assert (t2.min_version, t2.max_version) == (3, 4)
    assert (g.min_version, g.max_version) == (3, 4)
    assert all(t.data_source == "areal_like/demo" for t in g.trajectories)
    # request parameters: EOS added to the stop ids, per-sample seeds, one routing key per group
    assert all(c["stop"] == [5, tok.eos_token_id] and c["max_new_tokens"] == 3 for c in client.calls)
    assert sorted(c["seed"] for c in client.calls) == sorted(sample_seed(11, "g-1", i) for i in range(5))
    assert len({c["seed"] for c in client.calls}) == 5 and {c["key"] for c in client.calls} == {"g-1"}
    assert sample_seed(11, "g-1", 0) == sample_seed(11, "g-1", 0) != sample_seed(12, "g-1", 0)


async def test_no_seed_means_server_randomness(tok):
    client = FakeClient(tok, ["2", "2"])
    wf = RLVRWorkflow(client, RewardFn(), GenerationConfig(n=2, max_new_tokens=2), tok, producer="p")
    await wf.run_group(_record(tok), "g")
    assert [c["seed"] for c in client.calls] == [None, None]


async def test_failed_sample_fails_the_group(tok):
    client = FakeClient(tok, ["2", "3", "4"], fail_on=1)
    wf = RLVRWorkflow(client, RewardFn(), GenerationConfig(n=3, max_new_tokens=2), tok, producer="p")
    with pytest.raises(TimeoutError, match="fake:0"):
        await wf.run_group(_record(tok), "g")
