"""Batched next-token sampling with per-row parameters and a counter-based random stream.

Every row of a decode batch has its own temperature, top-p, top-k, min-p and seed; one call samples
all rows with tensor ops (no Python loop over rows). Randomness comes from a splitmix64 hash of
(row seed, absolute token position) instead of a stateful `torch.Generator`, so that

- a seeded request draws the same numbers whatever else shares its batch, and
- a request that was aborted by a weight-update pause and resubmitted with `prompt + tokens so far`
  continues the same random stream (the position keeps counting), as if it had never stopped.

This module does not compute logprobs (that is `areal_like.learner.logprobs`, the one definition)
and knows nothing of requests or HTTP.
"""

from __future__ import annotations

import torch

GREEDY_EPS = 1e-6  # temperature below this means greedy (PROTOCOL.md)

_MASK64 = (1 << 64) - 1


def _to_signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


_GOLDEN = _to_signed64(0x9E3779B97F4A7C15)
_MIX1 = _to_signed64(0xBF58476D1CE4E5B9)
_MIX2 = _to_signed64(0x94D049BB133111EB)


def _lshr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on signed ints)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors; multiplication wraps modulo 2**64 as in C."""
    z = x + _GOLDEN
    z = (z ^ _lshr(z, 30)) * _MIX1
    z = (z ^ _lshr(z, 27)) * _MIX2
    return z ^ _lshr(z, 31)


def splitmix64_int(x: int) -> int:
    """Pure-Python reference of `splitmix64` (also used to derive per-sample seeds)."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return _to_signed64(z ^ (z >> 31))


def derive_seed(seed: int, stream: int) -> int:
    """Seed of sample `stream` of a request seeded with `seed` (n>1 samples must differ)."""
    return splitmix64_int(splitmix64_int(seed) ^ (stream * 0x632BE59BD9B4E019))


def uniform_from_counter(seed_B: torch.Tensor, position_B: torch.Tensor) -> torch.Tensor:
    """One U[0,1) float64 per row from (seed, position); both int64 tensors of shape (B,)."""
    h = splitmix64(splitmix64(seed_B) + position_B)
    return _lshr(h, 11).to(torch.float64) * (1.0 / (1 << 53))  # top 53 bits → exact double


def sample_next(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor,
    min_p_B: torch.Tensor,
    seed_B: torch.Tensor,
    position_B: torch.Tensor,
    *,
    needs_filter: bool = True,
    all_greedy: bool | None = None,
) -> torch.Tensor:
    """Sample one token per row; returns int64 (B,).

    temperature_B (float32) < GREEDY_EPS → argmax. top_k_B ≤ 0 disables top-k; top_p_B = 1 and
    min_p_B = 0 disable those. `needs_filter=False` (no row uses top-p/top-k/min-p) skips the sort.
    seed_B/position_B: int64 on the logits' device. `all_greedy` (known on the host by the caller)
    skips the device→host check of whether every row is greedy.
    """
    logits_BV = logits_BV.float()
    B, V = logits_BV.shape
    greedy_B = temperature_B < GREEDY_EPS
    argmax_B = logits_BV.argmax(dim=-1)
    if all_greedy is None:
        all_greedy = bool(greedy_B.all())  # host sync, but saves the softmax for all-greedy batches
    if all_greedy:
        return argmax_B
    temp_B = torch.where(greedy_B, torch.ones_like(temperature_B), temperature_B)
    scaled_BV = logits_BV / temp_B[:, None]
    u_B = uniform_from_counter(seed_B, position_B).to(torch.float32)
    probs_BV = torch.softmax(scaled_BV, dim=-1)
    if needs_filter:
        # Filters are decided in sorted order, then mapped back: the draw itself always walks the
        # vocabulary order, so a row's token does not depend on whether other rows use filters.
        sorted_BV, idx_BV = probs_BV.sort(dim=-1, descending=True)
        rank_V = torch.arange(V, device=logits_BV.device)
        k_B = torch.where(top_k_B > 0, top_k_B, torch.full_like(top_k_B, V))
        drop_sorted_BV = rank_V[None, :] >= k_B[:, None]
        # top-p keeps the smallest prefix whose mass reaches p: drop a token if the mass before it already does
        drop_sorted_BV |= (sorted_BV.cumsum(dim=-1) - sorted_BV) > top_p_B[:, None]
        drop_sorted_BV |= sorted_BV < (min_p_B[:, None] * sorted_BV[:, :1])
        drop_sorted_BV[:, 0] = False  # the most likely token always survives
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter_(1, idx_BV, drop_sorted_BV)
        probs_BV = probs_BV.masked_fill(drop_BV, 0.0)
    cdf_BV = probs_BV.cumsum(dim=-1)
    target_B1 = (u_B * cdf_BV[:, -1]).unsqueeze(-1)
    pick_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1).clamp_(max=V - 1)
    if needs_filter:
        # Rounding can land on a dropped token (zero mass): fall back to the row's most likely token.
        landed_on_dropped = probs_BV.gather(-1, pick_B.unsqueeze(-1)).squeeze(-1) <= 0
        pick_B = torch.where(landed_on_dropped, argmax_B, pick_B)
    return torch.where(greedy_B, argmax_B, pick_B)


def apply_penalties(logits_BV: torch.Tensor, counts_BV: torch.Tensor, frequency_B: torch.Tensor,
                    presence_B: torch.Tensor, repetition_B: torch.Tensor) -> torch.Tensor:
    """SGLang/OpenAI penalties from the counts of tokens this request generated so far (fp32, (B, V)).

    frequency: −f·count; presence: −p·[count>0]; repetition (CTRL/HF): a seen token's logit is
    divided by r when positive, multiplied by r when negative. Rows with 0/0/1 are unchanged.
    """
    seen_BV = counts_BV > 0
    logits_BV = logits_BV - frequency_B[:, None] * counts_BV - presence_B[:, None] * seen_BV
    rep_BV = repetition_B[:, None].expand_as(logits_BV)
    penalised = torch.where(logits_BV > 0, logits_BV / rep_BV, logits_BV * rep_BV)
    return torch.where(seen_BV, penalised, logits_BV)
