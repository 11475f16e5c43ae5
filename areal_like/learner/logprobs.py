"""Token logprobs with exactly the generation servers' definition (PROTOCOL.md).

Output-token logprobs are `log_softmax(logits / temperature)` over the whole vocabulary —
temperature-scaled, not renormalised by top-p/top-k. Prompt-token logprobs are not
temperature-scaled. If the learner used any other definition the importance weights π_prox/π_behav
would be biased, so the server and the learner both call `token_logprobs_from_logits`.
"""

from __future__ import annotations

import torch


def token_logprobs_from_logits(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logprob of `targets[b, t]` under `logits[b, t]` (already aligned: logits at t predict targets at t).

    Computed in fp32 whatever the model dtype; temperature below 1e-6 (greedy) counts as 1.
    """
    logp = _log_softmax_fp32(logits_BTV, temperature)
    return logp.gather(-1, targets_BT.long().unsqueeze(-1)).squeeze(-1)


def fp32_lm_head(head: torch.nn.Module, *, cache_weight: bool = False) -> None:
    """Make `head` (an `nn.Linear` LM head) compute its logits in fp32 — input and weight upcast for
    the matmul, the stored weight unchanged (`model.fp32_lm_head`; SGLang's --enable-fp32-lm-head,
    PipelineRL's default): the learner and the embedded engine both call it, so a 16-bit model's
    logits stop carrying 16-bit rounding into the logprobs on either side. A vocab-parallel head
    (parallel/vocab_parallel.py) takes `dtype = float32` instead.

    `cache_weight` (the embedded engine: its weights change only through in-place `copy_` of a weight
    update): keep the fp32 copy between calls, made again when the weight's version counter moves,
    instead of casting the whole [V × H] matrix at every decode step. Calls that need the weight's
    gradient always cast afresh."""
    if getattr(head, "vocab_parallel", False):
        head.dtype = torch.float32
        return
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"model.fp32_lm_head: the LM head is a {type(head).__name__}, not an nn.Linear")

    cache: list = [None, -1]  # the weight's fp32 copy, and the weight's version counter it was made at

    def weight_fp32() -> torch.Tensor:
        w = head.weight
        if not cache_weight or (torch.is_grad_enabled() and w.requires_grad):
            return w.float()  # in the graph: the gradient flows back to the stored weight
        # an in-place copy (a weight update) bumps `_version`: a stale copy is never used
        if cache[0] is None or cache[1] != w._version or cache[0].shape != w.shape:
            cache[0], cache[1] = w.detach().float(), w._version
        return cache[0]

    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(x.float(), weight_fp32(), bias)

    head.forward = forward  # type: ignore[method-assign]
    head.fp32_weight_cache = cache  # the engine empties it when it releases its weights' memory


def effective_temperature(temperature: float) -> float:
    """What logits are divided by: the temperature, except that below 1e-6 (greedy) it counts as 1."""
    return temperature if temperature > 1e-6 else 1.0


def _log_softmax_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The one definition: fp32 log_softmax of logits / temperature (temperature < 1e-6 counts as 1)."""
    z = logits.float()
    t = effective_temperature(temperature)
    if t != 1.0:
        z = z / t
    return torch.log_softmax(z, dim=-1)


def _chunk_logprobs(head: torch.nn.Module, temperature: float, with_entropy: bool, entropy_grad: bool):
    def fn(h_NH: torch.Tensor, tgt_N: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logp_NV = _log_softmax_fp32(head(h_NH), temperature)  # the only [chunk × V] tensors
        lp_N = logp_NV.gather(-1, tgt_N.unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return (lp_N,)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):  # a stat only: no graph
            ent_N = -(logp_NV.exp() * logp_NV).sum(-1)
        return lp_N, ent_N

    return fn


def chunked_token_logprobs(hidden_BTH: torch.Tensor, head: torch.nn.Module, targets_BT: torch.Tensor,
                           temperature: float = 1.0, *, positions_BT: torch.Tensor | None = None,
                           chunk_tokens: int | None = 1024, with_entropy: bool = False,
                           entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs_from_logits(head(hidden), targets, temperature)` (and the entropy of the same
    distribution) without the [B × T × V] logits: `head` (the lm_head) runs on `chunk_tokens`
    positions at a time; each chunk's logits are freed before the next, and under autograd each
    chunk is checkpointed, so backward recomputes its logits instead of keeping them.

    Only `positions_BT` (bool, e.g. the loss mask) are computed — elsewhere the results are 0;
    None = every position. `chunk_tokens` 0/None = all selected positions in one chunk, not
    checkpointed (the unchunked path). `entropy_grad=False`: the entropy is a statistic (no
    gradient, and its [chunk × V] intermediates are not kept). Returns fp32 (logp_BT, entropy_BT or None).

    Transient memory: about 3 fp32 [chunk × V] tensors while a chunk runs backward (5 when the
    entropy has a gradient). Measured on CPU, V = 151,936, 2048 loss tokens, entropy as a statistic:
    peak RSS above the model 1.8 GiB at chunk 1024 vs 3.5 GiB unchunked (with an entropy gradient:
    3.0 GiB at 1024, 0.8 GiB at 256, 5.9 GiB unchunked).
    """
    B, T = targets_BT.shape
    flat_idx = (torch.arange(B * T, device=hidden_BTH.device) if positions_BT is None
                else positions_BT.reshape(-1).nonzero().squeeze(1))
    h_NH = hidden_BTH.reshape(B * T, -1).index_select(0, flat_idx)
    tgt_N = targets_BT.reshape(-1).long().index_select(0, flat_idx)
    if getattr(head, "vocab_parallel", False):  # rows split over dp: parallel/vocab_parallel.py
        vals = head.token_logprobs(h_NH, tgt_N, temperature, chunk_tokens, with_entropy, entropy_grad)
        outs = [tuple(v for v in vals if v is not None)]
        return _scatter_back(outs, flat_idx, B, T, 0), (_scatter_back(outs, flat_idx, B, T, 1) if with_entropy else None)
    fn = _chunk_logprobs(head, temperature, with_entropy, entropy_grad)
    n = int(flat_idx.numel())
    step = n if not chunk_tokens or chunk_tokens >= n else int(chunk_tokens)
    grad = torch.is_grad_enabled() and (h_NH.requires_grad or any(p.requires_grad for p in head.parameters()))
    outs: list[tuple[torch.Tensor, ...]] = []
    for s in range(0, n, max(step, 1)):
        args = (h_NH[s:s + step], tgt_N[s:s + step])
        if grad and chunk_tokens:
            from torch.utils.checkpoint import checkpoint

            outs.append(checkpoint(fn, *args, use_reentrant=False))
        else:
            outs.append(fn(*args))

    return _scatter_back(outs, flat_idx, B, T, 0), (_scatter_back(outs, flat_idx, B, T, 1) if with_entropy else None)


def _scatter_back(outs: list[tuple[torch.Tensor, ...]], flat_idx: torch.Tensor, B: int, T: int, k: int) -> torch.Tensor:
    """Output `k` of every chunk, back at its (B, T) positions; 0 elsewhere."""
    vals = torch.cat([o[k] for o in outs]) if outs else torch.zeros(0, device=flat_idx.device)
    full = torch.zeros(B * T, dtype=torch.float32, device=flat_idx.device)
    return full.index_copy(0, flat_idx, vals.float()).reshape(B, T)


def sequence_logprobs(model: torch.nn.Module, input_ids_BT: torch.Tensor, temperature: float = 1.0,
                      attention_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """logprob of every token given its prefix; position 0 gets 0. Shape (batch, tokens)."""
    out = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False)
    lp_BT1 = token_logprobs_from_logits(out.logits[:, :-1], input_ids_BT[:, 1:], temperature)
    return torch.nn.functional.pad(lp_BT1, (1, 0), value=0.0)
