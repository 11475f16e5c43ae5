"""LoRA's settings (`model.lora_*`, verl's names as aliases), the refusals before start, and the memory
planner's LoRA learner (frozen base, adapter-only gradients and AdamW state, no reference copy)."""

import json

import pytest

from allocation.memory import LORA_LINEARS, ModelShape, TrainSettings, learner_parts
from areal_like.api.config import ConfigError, load_config, lora_target_modules
from areal_like.api.config import LORA_ADAPTER_NAME
from areal_like.learner.lora import LoraSettings, canonical_name, init_adapter_tensor


def test_verl_names_are_aliases(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("actor_rollout_ref:\n  model:\n    lora_rank: 16\n    lora_alpha: 32\n"
                 "    target_modules: [q_proj, v_proj]\n")
    cfg = load_config(str(y), ["actor_rollout_ref.model.lora_dropout=0.05"])
    m = cfg.model
    assert (m.lora_rank, m.lora_alpha, m.target_modules, m.lora_dropout) == (16, 32.0, ["q_proj", "v_proj"], 0.05)
    s = LoraSettings.from_model_config(m)
    assert s.scaling == 2.0 and s.target_modules == ("q_proj", "v_proj")
    assert LoraSettings.from_model_config(load_config(None).model) is None  # lora_rank 0: full fine-tuning
    assert lora_target_modules("all-linear") == LORA_LINEARS and "lm_head" not in LORA_LINEARS


@pytest.mark.parametrize("overrides, names", [
    (["model.lora_rank=-1"], "model.lora_rank"),
    (["model.lora_rank=8", "model.lora_alpha=0"], "model.lora_alpha"),
    (["model.lora_rank=8", "model.lora_dropout=1.0"], "model.lora_dropout"),
    (["model.lora_rank=8", "model.target_modules=[qkv]"], "model.target_modules"),
    (["model.lora_rank=8", "model.target_modules=everything"], "model.target_modules"),
    (["model.lora_path=/nonexistent"], "model.lora_rank"),
    (["model.lora_rank=8", "model.lora_path=/nonexistent"], "model.lora_path"),
    (["train.export_merged=true"], "train.export_merged"),
    (["model.lora_rank=8", "model.target_modules=[q_proj,lm_head]", "model.fp32_lm_head=true"], "model.fp32_lm_head"),
    (["model.lora_rank=8", "model.target_modules=[q_proj,lm_head]", "allocation=embedded:d1+fsdp:d2"],
     "train.dp_sharding=none"),
])
def test_refusals_name_the_setting(overrides, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        load_config(None, overrides)


def test_lora_path_must_be_a_peft_dir(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    cfg = load_config(None, ["model.lora_rank=8", f"model.lora_path={tmp_path}"])
    assert cfg.model.lora_path == str(tmp_path)


def test_names_and_fresh_init_do_not_depend_on_the_layout():
    assert canonical_name("model.layers.3.mlp.up_proj.base_layer.weight") == "model.layers.3.mlp.up_proj.weight"
    assert canonical_name("model.layers.3.mlp.up_proj.lora_B.default.weight") == "model.layers.3.mlp.up_proj.lora_B.weight"
    a = init_adapter_tensor("model.layers.0.self_attn.q_proj.lora_A.weight", (8, 64), seed=1)
    assert a.abs().max() <= 1 / 8 and a.std() > 0  # U(−1/√in, 1/√in)
    assert init_adapter_tensor("model.layers.0.self_attn.q_proj.lora_A.weight", (8, 64), seed=1).equal(a)
    assert not init_adapter_tensor("model.layers.1.self_attn.q_proj.lora_A.weight", (8, 64), seed=1).equal(a)
    assert init_adapter_tensor("x.lora_B.weight", (64, 8), seed=1).abs().max() == 0  # B = 0: the base's outputs
    assert LORA_ADAPTER_NAME == "policy"


def test_planner_lora_learner_is_the_frozen_base_plus_the_adapter():
    # Qwen2.5-0.5B's published shape
    m = ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936,
                   tied=True, qkv_bias=True, qk_norm=False)
    assert m.layers * m.lora_layer_params(8, LORA_LINEARS) == 4_399_104  # peft's count for r = 8, all-linear
    kw = dict(dtype="bfloat16", reference=True, seq_len=1024)
    full = learner_parts(m, TrainSettings(**kw), pp=1, tp=1, stage=0)
    lora = learner_parts(m, TrainSettings(**kw, lora_rank=8, lora_targets=LORA_LINEARS), pp=1, tp=1, stage=0)
    adapter = 4_399_104
    assert lora["reference_bytes"] == 0 and full["reference_bytes"] == full["params_bytes"]
    assert lora["grads_bytes"] == 4 * adapter and lora["optimizer_bytes"] == 12 * adapter  # fp32 grads, master, m, v
    assert lora["params_bytes"] == full["params_bytes"] + 2 * adapter
    assert lora["activations_bytes"] == full["activations_bytes"]
    # tp splits one side of each adapter matrix
    assert m.lora_layer_params(8, LORA_LINEARS, tp=2) < m.lora_layer_params(8, LORA_LINEARS)


def test_sglang_servers_take_lora_and_each_weights_mode_picks_an_adapter_transport(tmp_path):
    """SGLang + LoRA: `disk` → peft dirs through /load_lora_adapter; `distributed` (and `auto`) → the adapter
    by value through /load_lora_adapter_from_tensors (SGLang has no NCCL route for adapters), one payload
    per TP rank; embedded servers keep the broadcast. Co-located LoRA: by value to SGLang, a peft dir to
    embedded servers."""
    from areal_like.api.run_files import Endpoints
    from areal_like.weights import DiskWeightPusher, WeightPusher, make_weight_pusher
    from areal_like.weights.adapter_tensors import AdapterTensorPusher

    sg = Endpoints(servers=["http://a:1", "http://b:2"], learner_host="127.0.0.1", weight_backend="nccl",
                   server_devices=[[0, 1], [2, 3]])
    kw = dict(model_path="m", run_dir=str(tmp_path), weight_port=1, incarnation=0)
    for mode in ("auto", "distributed"):
        cfg = load_config(None, ["model.lora_rank=8", "allocation=sglang:d2t2+fsdp:d4", f"weights.mode={mode}"])
        p = make_weight_pusher(cfg, sg, **kw)
        assert isinstance(p, AdapterTensorPusher) and p.tp_per_server == [2, 2]
    cfg = load_config(None, ["model.lora_rank=8", "allocation=sglang:d2t2+fsdp:d4", "weights.mode=disk"])
    assert isinstance(make_weight_pusher(cfg, sg, **kw), DiskWeightPusher)
    emb = Endpoints(servers=["http://a:1"], learner_host="127.0.0.1")
    cfg = load_config(None, ["model.lora_rank=8", "allocation=embedded:d1+d1"])
    assert isinstance(make_weight_pusher(cfg, emb, **kw), WeightPusher)
    # co-located (weights.mode auto → memory): by value to SGLang, a peft dir under the run dir to ours
    cfg = load_config(None, ["model.lora_rank=8", "allocation=sglang:d2t2|fsdp:d4"])
    assert isinstance(make_weight_pusher(cfg, sg, **kw), AdapterTensorPusher)
    cfg = load_config(None, ["model.lora_rank=8", "allocation=embedded:d1|fsdp:d1"])
    p = make_weight_pusher(cfg, emb, **kw)
    assert isinstance(p, DiskWeightPusher) and p.out_dir == str(tmp_path / "weights_disk")


def test_the_adapter_transport_refuses_full_weights():
    import asyncio

    import torch

    from areal_like.weights.adapter_tensors import AdapterTensorPusher
    from areal_like.weights.admin import WeightPushError

    async def go():
        p = AdapterTensorPusher(["http://127.0.0.1:9"], timeout_s=1)
        await p.init()
        try:
            await p.update([("model.norm.weight", torch.ones(2))], 1)
        finally:
            await p.close()

    with pytest.raises(WeightPushError, match="model.lora_rank"):
        asyncio.run(go())


def test_the_by_value_payload_carries_each_tensor_not_the_buffer_it_views():
    """A pickled tensor carries its whole storage: an adapter tensor viewing a large gathered buffer is
    copied out first, so the payload is the adapter's size (and unpickles to the same values)."""
    import base64
    import pickle

    import torch

    from areal_like.weights.adapter_tensors import serialize_adapter

    buf = torch.randn(1000, 100)
    tensors = {"a.lora_A.weight": buf[10:12], "b.lora_B.weight": torch.randn(3, 2)}
    payload = serialize_adapter(tensors)
    assert len(payload) < 4096  # not the 400 KB buffer
    back = pickle.loads(base64.b64decode(payload))
    assert back.keys() == tensors.keys() and all(back[k].equal(tensors[k]) for k in tensors)
