"""The learner's memory knobs (issue 25 items 4–5), CPU, fp32, a few seconds each:

- logprobs/entropy from the last hidden states in token chunks (`train.logits_chunk_tokens`) equal
  the unchunked [T × V] path — values and gradients — for chunk sizes that do and do not divide T;
- with chunking, autograd never keeps a [tokens × vocab] tensor for backward (what makes the logits
  memory bounded), and without it, it does — measured on what autograd saves, not on timing;
- activation checkpointing per decoder layer (`model.enable_gradient_checkpointing`) gives the same
  gradients, really recomputes each layer in backward, and keeps less for backward.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from areal_like.api.config import AlgorithmConfig, ExperimentConfig, TrainConfig, load_config
from areal_like.learner import algorithms as A
from areal_like.learner.logprobs import chunked_token_logprobs, token_logprobs_from_logits
from areal_like.learner.parallel.spawn import synthetic_groups
from areal_like.learner.trainer import Trainer

VOCAB = 512  # large enough that [tokens × vocab] dominates what autograd keeps
HIDDEN = 32


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 1000])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_logprobs_entropy_and_grads_equal_unchunked(chunk, temperature, masked):
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 11, 16, 37
    head = nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
    h = torch.randn(B, T, H, generator=g, requires_grad=True)
    tgt = torch.randint(0, V, (B, T), generator=g)
    pos = torch.rand(B, T, generator=g) > 0.4 if masked else None
    w_lp, w_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    def run(fn):
        h.grad = head.weight.grad = None
        lp, ent = fn()
        keep = pos if pos is not None else torch.ones(B, T, dtype=torch.bool)
        lp, ent = torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return lp.detach(), ent.detach(), h.grad.clone(), head.weight.grad.clone()

    # the reference: today's full-logits path (the servers' definition) and its entropy
    want = run(lambda: (token_logprobs_from_logits(head(h), tgt, temperature),
                        A.entropy_from_logits(head(h), temperature)))
    got = run(lambda: chunked_token_logprobs(h, head, tgt, temperature, positions_BT=pos, chunk_tokens=chunk,
                                             with_entropy=True))
    unchunked = run(lambda: chunked_token_logprobs(h, head, tgt, temperature, positions_BT=pos, chunk_tokens=0,
                                                   with_entropy=True))
    # fp32; the head's weight gradient sums over positions in another order (chunk by chunk): 1e-5
    for w, c, u in zip(want, got, unchunked):
        torch.testing.assert_close(c, w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(u, w, rtol=1e-5, atol=1e-5)
    if pos is not None:  # positions outside the selection are never computed
        assert (got[0][~pos] == 0).all()


def _model_dir(tmp_path, vocab=VOCAB, layers=2) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    d = str(tmp_path / f"m{vocab}-{layers}")
    if not os.path.exists(d):
        Qwen2ForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


def _trainer(model_dir, *, chunk=1024, ckpt=False, **train) -> Trainer:
    kw = dict(lr=1e-3, micro_batch_tokens=64, seed=5, logits_chunk_tokens=chunk)
    kw.update(train)
    return Trainer(model_dir, TrainConfig(**kw), None, temperature=0.9, gradient_checkpointing=ckpt,
                   algorithm=AlgorithmConfig(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1))


def _groups(seed=1):
    return synthetic_groups(seed, vocab=VOCAB, min_len=5, max_len=12)


@pytest.mark.parametrize("chunk", [3, 1024])
def test_train_step_with_chunks_equals_unchunked(tmp_path, chunk):
    """A whole step (π_prox recompute, reference, entropy bonus, KL loss, 2 minibatches) and its
    resulting weights: chunked == unchunked."""
    d = _model_dir(tmp_path)
    a, b = _trainer(d, chunk=0, ppo_minibatches=2), _trainer(d, chunk=chunk, ppo_minibatches=2)
    for step in range(2):
        sa, sb = a.train_step(_groups(step), version=step), b.train_step(_groups(step), version=step)
        for k in ("loss", "grad_norm", "entropy", "kl_ref", "approx_kl", "clipfrac"):
            assert getattr(sb, k) == pytest.approx(getattr(sa, k), rel=1e-5, abs=1e-6), (k, getattr(sa, k), getattr(sb, k))
    # Weights after 4 AdamW steps of lr 1e-3: Adam scales a near-zero gradient's last-bit difference
    # up to a fraction of a step (seen: 4.5e-6 on 2 of 16k embedding entries), so 1e-5 = 1 % of a step.
    for (n, p), (_, q) in zip(a.actor.stage_module.named_parameters(), b.actor.stage_module.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=lambda m: n + m)


class _SavedForBackward:
    """Every tensor autograd keeps for backward (outside checkpointed regions, which keep only
    their inputs): the activation memory of a forward pass."""

    def __init__(self):
        self.shapes: list[tuple[int, ...]] = []
        self.bytes = 0

    def __enter__(self):
        def pack(t):
            if not isinstance(t, nn.Parameter):  # weights are held anyway
                self.shapes.append(tuple(t.shape))
                self.bytes += t.numel() * t.element_size()
            return t

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _actor_loss_saved(learner: Trainer, groups) -> tuple[_SavedForBackward, int]:
    """What autograd saves for one micro-batch's actor loss (forward only; backward then runs)."""
    from areal_like.learner.batching import CH_ADV, pack

    samples = [t for g in groups for t in g.trajectories]
    rows = list(range(len(samples)))
    adv = {i: samples[i].mask_np().astype("float32") for i in rows}
    (mb,) = pack(samples, rows, {CH_ADV: adv}, micro_batch_tokens=1 << 30, pad_id=0,
                 device=torch.device("cpu"), single=True)
    acc = {k: torch.zeros(()) for k in ("loss", "clipfrac", "approx_kl", "ratio_mean", "behav_w_mean",
                                        "behav_tokens_capped", "dual_clipfrac", "entropy", "kl_ref", "adv_abs_mean",
                                        "mm_abs_sum", "mm_k3_sum", "mm_outside", "mm_tokens")}
    acc.update({k: torch.full((), -float("inf")) for k in ("behav_w_max", "ratio_max", "neg_behav_w_min", "mm_abs_max")})
    learner.ref = None
    loss_fn = learner._actor_loss_fn(acc, int(mb.loss_mask_BT1.sum()), len(rows), 0, False, True)
    with _SavedForBackward() as saved:
        loss = loss_fn(learner.actor.stage_module(mb.input_ids_BT), mb.targets_BT1C)
    loss.backward()
    return saved, int(mb.loss_mask_BT1.sum())


def test_chunked_loss_keeps_no_token_by_vocab_tensor_for_backward(tmp_path):
    d = _model_dir(tmp_path)
    groups = _groups(3)
    chunk = 4
    chunked, n_loss = _actor_loss_saved(_trainer(d, chunk=chunk), groups)
    full, _ = _actor_loss_saved(_trainer(d, chunk=0), groups)
    vocab_wide = lambda s: [sh for sh in s.shapes if sh and sh[-1] == VOCAB]  # noqa: E731
    # without chunking autograd keeps the loss positions' full-vocab logits (several copies) ...
    assert max(torch.Size(sh).numel() for sh in vocab_wide(full)) >= n_loss * VOCAB
    # ... with chunking it keeps none: each chunk's logits are recomputed in backward
    assert vocab_wide(chunked) == []
    # and keeps at least one fp32 [loss tokens × vocab] tensor less in all (the rest: the decoder's)
    assert full.bytes - chunked.bytes >= n_loss * VOCAB * 4, (chunked.bytes, full.bytes, n_loss)


def _layer_calls(learner: Trainer) -> list[int]:
    calls = [0]
    for layer in learner.actor.stage_module.hf.model.layers:
        layer.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))  # recompute stops early
    return calls


def test_gradient_checkpointing_same_gradients_recomputes_and_keeps_less(tmp_path):
    d = _model_dir(tmp_path, layers=3)
    groups = _groups(4)
    runs = {}
    for ckpt in (False, True):
        ln = _trainer(d, ckpt=ckpt, proximal="behaviour", grad_clip=0.0)  # no forward-only pass
        calls = _layer_calls(ln)
        st = ln.train_step(groups, version=0)
        grads = dict(ln.named_full_grads())
        runs[ckpt] = (st, grads, calls[0], ln)
    (st0, g0, c0, _), (st1, g1, c1, ln1) = runs[False], runs[True]
    assert c1 == 2 * c0 > 0  # each decoder layer ran again in backward
    assert st1.loss == pytest.approx(st0.loss, rel=1e-6, abs=1e-7)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)
    saved_on, _ = _actor_loss_saved(ln1, groups)
    saved_off, _ = _actor_loss_saved(runs[False][3], groups)
    assert saved_on.bytes < saved_off.bytes / 2, (saved_on.bytes, saved_off.bytes)


def test_critic_checkpointing_same_values_loss(tmp_path):
    d = _model_dir(tmp_path)
    from areal_like.api.config import CriticConfig

    out = {}
    for ckpt in (False, True):
        ln = Trainer(d, TrainConfig(lr=1e-3, micro_batch_tokens=64, seed=5), None, temperature=0.9,
                     gradient_checkpointing=ckpt, algorithm=AlgorithmConfig(adv_estimator="gae"),
                     critic=CriticConfig())
        assert ln.critic.stage_module.checkpoint_layers is ckpt
        sts = [ln.train_step(_groups(s), version=s) for s in range(2)]
        out[ckpt] = [x for s in sts for x in (s.loss, s.value_loss, s.critic_grad_norm)]
    assert out[True] == pytest.approx(out[False], rel=1e-5, abs=1e-7)


def test_config_keys_and_verl_alias():
    cfg = load_config(None, ["model.enable_gradient_checkpointing=true", "train.logits_chunk_tokens=256"])
    assert cfg.model.enable_gradient_checkpointing is True and cfg.train.logits_chunk_tokens == 256
    cfg = load_config(None, ["actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    assert cfg.model.enable_gradient_checkpointing is True
    assert ExperimentConfig().train.logits_chunk_tokens == 1024
    assert ExperimentConfig().model.enable_gradient_checkpointing is False


def test_negative_chunk_is_refused_at_load():
    from areal_like.api.config import ConfigError

    with pytest.raises(ConfigError, match="train.logits_chunk_tokens=-1"):
        load_config(None, ["train.logits_chunk_tokens=-1"])


def test_memory_policy_line(tmp_path):
    d = _model_dir(tmp_path)
    assert _trainer(d, chunk=0, ckpt=True).memory_policy == \
        "gradient checkpointing on (actor); logits unchunked"
    assert _trainer(d).memory_policy == "gradient checkpointing off (actor); logits in chunks of 1024 tokens"


def test_entropy_statistic_can_be_switched_off(tmp_path):
    d = _model_dir(tmp_path)
    on = Trainer(d, TrainConfig(lr=1e-3, micro_batch_tokens=64, seed=5), None, temperature=0.9)
    off = Trainer(d, TrainConfig(lr=1e-3, micro_batch_tokens=64, seed=5, compute_entropy=False), None,
                  temperature=0.9)
    s_on, s_off = on.train_step(_groups(), version=0), off.train_step(_groups(), version=0)
    assert s_on.entropy > 0 and s_off.entropy != s_off.entropy  # NaN: not measured
    assert s_off.loss == s_on.loss and s_off.grad_norm == s_on.grad_norm
    bonus = Trainer(d, TrainConfig(lr=1e-3, micro_batch_tokens=64, seed=5, compute_entropy=False), None,
                    temperature=0.9, algorithm=AlgorithmConfig(entropy_coef=0.01))
    assert bonus.train_step(_groups(), version=0).entropy == pytest.approx(s_on.entropy, rel=1e-6)


class _WidestVocabTensor:
    """The most rows of any tensor with a last dimension of VOCAB that any op produces (forward,
    forward-only passes, backward and its recomputation)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        rows = [0]

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB \
                            and tuple(t.shape) != (HIDDEN, VOCAB):  # lm_head.weight.t(), a view
                        rows[0] = max(rows[0], t.numel() // VOCAB)
                return out

        self.rows = rows
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def test_no_step_ever_allocates_more_than_a_chunk_of_logits(tmp_path):
    """A whole train step — π_prox recompute and reference passes (forward-only), the actor loss
    with an entropy bonus, backward — allocates vocab-wide tensors of at most `chunk` rows; the
    unchunked path allocates the loss positions' whole [tokens × vocab] logits."""
    d = _model_dir(tmp_path)
    widest = {}
    for chunk in (4, 0):
        ln = _trainer(d, chunk=chunk, ppo_minibatches=2, micro_batch_tokens=4096)  # one micro-batch
        with _WidestVocabTensor() as w:
            ln.train_step(_groups(6), version=0)
        widest[chunk] = w.rows[0]
    assert widest[4] == 4
    assert widest[0] >= 8 * 5 * 2, widest  # a minibatch: 8 samples × 5–12 loss tokens
