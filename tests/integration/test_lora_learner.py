"""The LoRA learner (`model.lora_rank` > 0) on real HF model files with peft: only the adapter trains,
its checkpoint (adapter + AdamW state) resumes to the same next step, `train.export_hf` writes a peft
adapter directory peft loads (and `train.export_merged` the merged model), a KL term's reference is
the base itself (no second model), and `model.lora_path` starts from a peft adapter."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_like.api.config import AlgorithmConfig, TrainConfig
from areal_like.learner.checkpoint import export_hf, load_checkpoint, save_checkpoint
from areal_like.learner.logprobs import token_logprobs_from_logits
from areal_like.learner.lora import LoraSettings
from areal_like.learner.parallel.spawn import synthetic_groups
from areal_like.learner.trainer import Trainer

pytestmark = pytest.mark.integration

TEMP = 1.0
CFG = dict(lr=2e-2, warmup_steps=0, micro_batch_tokens=256, seed=3)
IDS = [[3, 17, 8, 25, 40, 11, 6, 9], [50, 2, 33, 12, 7, 7, 1, 60]]


def trainer(model_dir, lora=LoraSettings(8, 16.0, "all-linear"), **kw) -> Trainer:
    return Trainer(model_dir, TrainConfig(**CFG), None, temperature=TEMP, lora=lora, **kw)


def _bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))


def learner_logits(t: Trainer) -> torch.Tensor:
    with torch.no_grad():
        return t.actor.head(t.actor.stage_module(torch.tensor(IDS)))


def test_only_the_adapter_trains_and_its_checkpoint_resumes(tiny_model_dir, tmp_path):
    t = trainer(tiny_model_dir)
    base = {n: x.clone() for n, x in t.full_state() if ".lora_" not in n}
    adapter_params = sum(p.numel() for p in t.actor.opt_params)
    assert adapter_params == sum(x.numel() for n, x in t.full_state() if ".lora_" in n) > 0
    for step in (1, 2):
        assert not t.train_step(synthetic_groups(step, vocab=64), version=step).skipped
    state = dict(t.full_state())
    assert all(torch.equal(state[n], x) for n, x in base.items())  # the base never moves
    assert any(x.abs().max() > 0 for n, x in state.items() if ".lora_B." in n)  # B left 0
    # AdamW holds the adapter only: one (m, v) pair per adapter tensor
    assert sum(st["exp_avg"].numel() for st in t.actor.optimizer.state.values()) == adapter_params

    ck = str(tmp_path / "ck")
    save_checkpoint(t, ck)
    files = set(os.listdir(ck))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    full = Trainer(tiny_model_dir, TrainConfig(**CFG), None, temperature=TEMP)
    full.train_step(synthetic_groups(1, vocab=64), version=1)
    save_checkpoint(full, str(tmp_path / "full"))
    assert _bytes(ck) < _bytes(str(tmp_path / "full")) / 3  # adapter + its AdamW state vs model + AdamW
    nxt = synthetic_groups(9, vocab=64)
    expected = t.train_step(nxt, version=3)
    resumed = trainer(tiny_model_dir)
    load_checkpoint(resumed, ck)
    got = resumed.train_step(nxt, version=3)
    for k in ("loss", "grad_norm", "approx_kl"):
        assert getattr(got, k) == pytest.approx(getattr(expected, k), rel=1e-6, abs=1e-9), k
    # a full fine-tuning run does not take a LoRA checkpoint (and the message says what to set)
    with pytest.raises(ValueError, match="model.lora_rank=8"):
        load_checkpoint(Trainer(tiny_model_dir, TrainConfig(**CFG), None, temperature=TEMP), ck)


def test_export_is_a_peft_adapter_and_the_merged_model_matches(tiny_model_dir, tmp_path):
    from peft import PeftModel

    t = trainer(tiny_model_dir)
    for step in (1, 2):
        t.train_step(synthetic_groups(step, vocab=64), version=step)
    export_hf(t, str(tmp_path / "hf"))
    export_hf(t, str(tmp_path / "merged"), merged=True)
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "hf"))
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "hf")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        a, b = peft_model(input_ids=ids).logits, merged(input_ids=ids).logits
    mine = learner_logits(t)
    torch.testing.assert_close(a, mine, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, mine, atol=1e-5, rtol=1e-5)


def test_kl_reference_is_the_base_without_a_copy(tiny_model_dir):
    t = trainer(tiny_model_dir, algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5))
    assert t.ref is None and t.ref_is_base and t._models() == [t.actor]  # one model: no reference copy
    full = Trainer(tiny_model_dir, TrainConfig(**CFG), None, temperature=TEMP,
                   algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5))
    assert full.ref is not None  # full fine-tuning builds one
    held = sum(p.numel() for m in t._models() for p in m.stage_module.parameters())
    assert held < sum(p.numel() for m in full._models() for p in m.stage_module.parameters()) * 0.6
    first = t.train_step(synthetic_groups(1, vocab=64), version=1)
    assert first.kl_ref == pytest.approx(0.0, abs=1e-7)  # a fresh adapter (B = 0) is the base
    later = t.train_step(synthetic_groups(2, vocab=64), version=2)
    assert later.kl_ref > 1e-6  # the adapter moved; the reference did not


def test_lora_path_starts_from_a_peft_adapter(tiny_model_dir, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(str(tmp_path / "ad"))
    t = trainer(tiny_model_dir, LoraSettings(4, 8.0, ["q_proj", "v_proj", "lm_head"], path=str(tmp_path / "ad")))
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                    str(tmp_path / "ad")).eval()
    with torch.no_grad():
        expected = ref(input_ids=torch.tensor(IDS)).logits
    torch.testing.assert_close(learner_logits(t), expected, atol=1e-5, rtol=1e-5)
    lp = token_logprobs_from_logits(learner_logits(t)[:, :-1], torch.tensor(IDS)[:, 1:], TEMP)
    assert torch.isfinite(lp).all()
    with pytest.raises(ValueError, match="set model.lora_rank=4"):
        trainer(tiny_model_dir, LoraSettings(8, 8.0, ["q_proj", "v_proj", "lm_head"], path=str(tmp_path / "ad")))


def test_lora_dropout_acts_in_the_differentiated_forward_only(tiny_model_dir):
    """`model.lora_dropout`: peft's dropout on the adapter's input changes the gradients the learner
    trains on, never a forward-only pass (π_prox, the mismatch check, the servers' logprobs)."""
    from areal_like.learner.lora import dropout_active

    plain = trainer(tiny_model_dir)
    dropped = trainer(tiny_model_dir, lora=LoraSettings(8, 16.0, "all-linear", dropout=0.5))
    batch = synthetic_groups(1, vocab=64)
    a, b = plain.train_step(batch, version=1), dropped.train_step(batch, version=1)
    # step 1: B = 0, so the dropped input does not change the loss, only the gradient of B
    assert b.loss == pytest.approx(a.loss, rel=1e-6)
    assert b.grad_norm != pytest.approx(a.grad_norm, rel=1e-3)
    # forward-only passes are deterministic (no dropout); inside the differentiated forward they are not
    assert torch.equal(learner_logits(dropped), learner_logits(dropped))
    with dropout_active(dropped.actor.stage_module, 0.5):
        assert not torch.equal(learner_logits(dropped), learner_logits(dropped))
    assert torch.equal(learner_logits(dropped), learner_logits(dropped))  # back to eval after the context
