"""Derived defaults of issue 23. `server.max_context_len` (item 7): null derives from the data and
generation lengths, so a response is never cut at "context minus prompt" behind the user's back; a
given value too small for them is refused at load with the numbers; validation's lengths count too.
`rollout.max_concurrent_groups` (item 10): null scales with the servers' capacity."""

from dataclasses import dataclass

import pytest

from areal_like.api.config import ConfigError, load_config
from areal_like.data.dataset import PromptRecord
from areal_like.data.tiny_model import build_char_tokenizer
from areal_like.reward import RewardFn
from areal_like.rollout.workflows import WorkflowRunner


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


class RecordingClient:
    """Records what each generation request asks for; answers `length` with as many tokens."""

    def __init__(self):
        self.asked: list[int] = []

    async def generate(self, input_ids, *, max_new_tokens, **kw):
        self.asked.append(max_new_tokens)
        return Result([7] * max_new_tokens, [-0.5] * max_new_tokens, [0] * max_new_tokens, "length")


async def test_long_responses_are_not_cut_by_a_default_context(tok):
    cfg = load_config(None, ["generation.max_new_tokens=2048", "generation.n=2"])
    client = RecordingClient()
    runner = WorkflowRunner(cfg, client, RewardFn(), tok, producer="p")
    record = PromptRecord(prompt_id="p:1", input_ids=list(range(3, 203)), ground_truth="2",
                          data_source="areal_like/demo", extra_info={}, raw_prompt="x" * 200)
    group = await runner.run_group(record, "g-1")
    # a 200-token prompt: each sample may still generate every one of the 2048 tokens asked for
    assert client.asked == [2048, 2048]
    assert all(len(t.mask_np()) - int(t.mask_np().sum()) == 200 for t in group.trajectories)
    assert all(int(t.mask_np().sum()) == 2048 for t in group.trajectories)
    assert cfg.resolved_max_context_len() == 256 + 2048  # what the servers get (--max-context-len / --context-length)


def test_a_given_context_too_small_is_refused_with_the_numbers():
    with pytest.raises(ConfigError, match=r"server\.max_context_len=512 is less than data\.max_prompt_length \(256\) "
                                          r"\+ generation\.max_new_tokens \(2048\) = 2304.*server\.max_context_len=2304"):
        load_config(None, ["generation.max_new_tokens=2048", "server.max_context_len=512"])
    # validation's budget counts as well (it used to bypass the cap)
    with pytest.raises(ConfigError, match=r"eval\.max_new_tokens \(1024\) = 1280"):
        load_config(None, ["eval.max_new_tokens=1024", "server.max_context_len=600"])
    with pytest.raises(ConfigError, match=r"rollout\.multi_turn\.max_total_tokens \(4096\) = 4096"):
        load_config(None, ["rollout.multi_turn.max_total_tokens=4096", "server.max_context_len=2048"])
    assert load_config(None, ["generation.max_new_tokens=2048", "server.max_context_len=4096"]) \
        .resolved_max_context_len() == 4096


def test_derived_context_covers_validation_and_multi_turn_episodes():
    assert load_config(None, ["eval.max_new_tokens=1024"]).resolved_max_context_len() == 256 + 1024
    assert load_config(None, ["data.max_prompt_length=100", "generation.max_new_tokens=50"]) \
        .resolved_max_context_len() == 150
    mt = load_config(None, ["rollout.workflow=multi_turn", "generation.max_new_tokens=100",
                            "rollout.multi_turn.max_assistant_turns=3", "rollout.multi_turn.max_tool_response_tokens=20"])
    assert mt.resolved_max_context_len() == 256 + 3 * 100 + 2 * 20  # the longest episode
    mt = load_config(None, ["rollout.workflow=multi_turn", "rollout.multi_turn.max_total_tokens=3000"])
    assert mt.resolved_max_context_len() == 3000


def test_concurrency_default_scales_with_the_servers_capacity():
    """rollout.max_concurrent_groups=null: 2 × servers × requests per server / (n × workers) groups per
    worker (issue 23, item 10: a fixed 16 groups × n=8 = 128 requests starved 8 SGLang servers)."""
    cfg = load_config(None, [])
    assert cfg.rollout.max_concurrent_groups is None
    # one embedded server (max_batch_size 64), n=8, one worker: its batch twice over
    assert cfg.resolved_max_concurrent_groups(num_servers=1, sglang=False) == 16
    # 8 SGLang replicas, 2 workers: 2 × 8 × 256 requests = 4096 in flight, 256 groups per worker
    assert cfg.resolved_max_concurrent_groups(num_servers=8, sglang=True) == 2 * 8 * 256 // 8
    two = load_config(None, ["rollout.workers=2", "server.max_batch_size=32", "generation.n=16"])
    assert two.resolved_max_concurrent_groups(num_servers=3, sglang=False) == 6  # 2·3·32 / (16·2)
    assert load_config(None, ["generation.n=512"]).resolved_max_concurrent_groups(num_servers=1, sglang=False) == 1
    assert load_config(None, ["rollout.max_concurrent_groups=5"]).resolved_max_concurrent_groups(
        num_servers=8, sglang=True) == 5
    with pytest.raises(ConfigError, match="rollout.max_concurrent_groups=0"):
        load_config(None, ["rollout.max_concurrent_groups=0"])
    with pytest.raises(ConfigError, match="rollout.request_retries=-1"):
        load_config(None, ["rollout.request_retries=-1"])
