"""Config keys of the sharded learner (issue 25 items 2 and 6): `train.dp_sharding` and the allocation's
training backend, and the offload keys (verl's names too) refused where they cannot act — never ignored."""

from __future__ import annotations

import pytest

from areal_like.api.config import ConfigError, load_config


def test_dp_sharding_default_and_values():
    assert load_config(None, []).train.dp_sharding == "full"  # ZeRO-3 by default, as FSDP users expect
    for v in ("full", "grad_op", "none"):
        assert load_config(None, [f"train.dp_sharding={v}"]).train.dp_sharding == v
    with pytest.raises(ConfigError, match="dp_sharding"):
        load_config(None, ["train.dp_sharding=zero3"])


def test_fsdp_backend_refuses_replication():
    load_config(None, ["allocation=embedded:d1+fsdp:d2"])  # sharded: fine
    load_config(None, ["allocation=embedded.d1p1t1+d2p1t1", "train.dp_sharding=none"])  # megatron/legacy: either
    with pytest.raises(ConfigError, match=r"fsdp training backend but train.dp_sharding=none .*'\+d2p1t1'"):
        load_config(None, ["allocation=embedded:d1+fsdp:d2", "train.dp_sharding=none"])


@pytest.mark.parametrize("key", ["train.param_offload", "train.optimizer_offload", "critic.param_offload",
                                 "critic.optimizer_offload", "ref.param_offload",
                                 "actor_rollout_ref.actor.fsdp_config.param_offload",
                                 "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                                 "actor_rollout_ref.ref.fsdp_config.param_offload",
                                 "critic.model.fsdp_config.param_offload",
                                 "critic.model.fsdp_config.optimizer_offload"])
def test_offload_is_refused_on_a_cpu_learner(key):
    """On a run without CUDA there is nothing to offload to: refused at load, naming the key to remove."""
    with pytest.raises(ConfigError, match=r"learner is on CPU .*nothing to offload to: remove .*offload"):
        load_config(None, ["allocation=embedded:d1+fsdp:d2", f"{key}=true"])


def test_offload_on_cuda_learner_is_accepted_and_param_offload_needs_fsdp():
    cuda = ["server.device=cuda"]
    cfg = load_config(None, [*cuda, "allocation=embedded:d1+fsdp:d2",
                             "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                             "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                             "actor_rollout_ref.ref.fsdp_config.param_offload=true"])
    assert cfg.train.param_offload and cfg.train.optimizer_offload and cfg.ref.param_offload
    assert load_config(None, [*cuda, "allocation=sglang:d1+fsdp:d1", "train.optimizer_offload=true"]).train.optimizer_offload
    with pytest.raises(ConfigError, match=r"parameter offload goes through FSDP .*d1"):
        load_config(None, [*cuda, "allocation=sglang:d1+fsdp:d1", "train.param_offload=true"])
    with pytest.raises(ConfigError, match=r"train.dp_sharding=none"):
        load_config(None, [*cuda, "allocation=sglang:d1+d2p1t1", "train.dp_sharding=none", "train.param_offload=true"])
