"""Host side of a training step: which samples a rank trains, in which minibatch, packed how.

    groups ─► samples (flattened, group order) ─► minibatches (ppo_minibatches contiguous slices)
           ─► this dp rank's share of each minibatch (token-balanced, deterministic)
           ─► micro-batches: right-padded (B, T) ids + one (B, T−1, C) float32 `targets` tensor

Alignment (the trap of every RL trainer): the logits at position t predict token t+1, while a
`Trajectory` stores the behaviour logprob and loss mask of a token *at that token's own position*.
So every per-token quantity lives on token positions 1..T−1 (suffix `_BT1`), and logits 0..T−2
are scored against ids 1..T−1. Position 0 has no prediction and is never a loss token.

Padding: batches are right-padded and run *without* an attention mask — with causal attention a
real token never attends to the padding after it, so a sequence's logits are the same padded or
not, and splitting a batch into micro-batches changes no gradient.

Per-token channels: the `targets` tensor carries every per-token input of the loss in one tensor,
because a pipeline schedule splits exactly one `target` into micro-batches. Channels the step did
not compute stay 0. Per-sample arrays (`SampleArrays`) are indexed by token position (length
num_tokens; index 0 unused), so they pack like the trajectory's own arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from areal_like.api.trajectory import Trajectory

# Channels of `targets` (last axis).
CH_IDS, CH_MASK, CH_BEHAV, CH_ADV, CH_PROX, CH_REF, CH_OLD_VALUE, CH_RETURN, CH_VERSION = range(9)
NUM_CHANNELS = 9

SampleArrays = dict[int, np.ndarray]  # global sample index → float32 per-token array (num_tokens,)


@dataclass
class MicroBatch:
    """One right-padded forward/backward unit. Tensors are on the learner's device."""

    input_ids_BT: torch.Tensor  # (B, T) int64, padded with pad_id on the right
    targets_BT1C: torch.Tensor  # (B, T−1, NUM_CHANNELS) float32: per-token inputs of tokens 1..T−1
    rows: list[int]  # global sample indices, in row order
    num_tokens: list[int]  # real tokens per row
    # routing replay (train.routing_replay): each position's expert ids as the server routed them,
    # (B, T, layers × top-k) int64, −1 where none was recorded (the last token, padding); None: no replay
    routes_BTW: torch.Tensor | None = None

    @property
    def loss_mask_BT1(self) -> torch.Tensor:
        return self.targets_BT1C[..., CH_MASK]


def pack(samples: list[Trajectory], rows: list[int], channels: dict[int, SampleArrays] | None = None, *,
         micro_batch_tokens: int, pad_id: int, device: torch.device, single: bool = False,
         routes: "dict[int, np.ndarray] | None" = None, routes_width: int = 0) -> list[MicroBatch]:
    """Right-padded micro-batches of `rows` whose padded size B×T stays within `micro_batch_tokens`.

    Rows are sorted by length (longest first, stable) and packed greedily, which keeps padding low
    and the split deterministic; a sample longer than the budget gets a micro-batch of its own.
    `single=True` packs all rows into one batch (a pipeline schedule splits it itself).
    `channels`: extra per-token channels (CH_ADV, CH_PROX, …) as per-sample arrays. `routes_width` > 0:
    each micro-batch carries `routes` ({sample: (positions, routes_width) expert ids}, positions from 0; a
    sample without an entry: none) as `MicroBatch.routes_BTW`.
    """
    channels = channels or {}
    order = sorted(rows, key=lambda i: -samples[i].num_tokens)
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        n = samples[i].num_tokens
        new_max = max(cur_max, n)
        if cur and not single and new_max * (len(cur) + 1) > micro_batch_tokens:
            batches.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)

    out = []
    for mb_rows in batches:
        T = max(2, max(samples[i].num_tokens for i in mb_rows))
        B = len(mb_rows)
        ids = np.full((B, T), pad_id, dtype=np.int64)
        tgt = np.zeros((B, T, NUM_CHANNELS), dtype=np.float32)
        for b, i in enumerate(mb_rows):
            t = samples[i]
            n = t.num_tokens
            ids[b, :n] = t.ids_np()
            tgt[b, :n, CH_IDS] = ids[b, :n]
            tgt[b, :n, CH_MASK] = t.mask_np()
            tgt[b, :n, CH_BEHAV] = t.logprobs_np()
            tgt[b, :n, CH_VERSION] = t.versions_np()
            for ch, arrays in channels.items():
                a = arrays.get(i)
                if a is not None:
                    tgt[b, :n, ch] = a
        tgt[..., CH_ADV] *= tgt[..., CH_MASK]
        routes_BTW = None
        if routes_width and any(i in (routes or {}) for i in mb_rows):
            r_BTW = np.full((B, T, routes_width), -1, dtype=np.int64)
            for b, i in enumerate(mb_rows):
                r = routes.get(i)
                if r is not None:
                    if r.shape[1] != routes_width:
                        raise ValueError(f"trajectory {samples[i].traj_id}: routes of width {r.shape[1]}, this model "
                                         f"routes layers × top-k = {routes_width} experts per position")
                    r_BTW[b, :len(r)] = r
            routes_BTW = torch.from_numpy(r_BTW).to(device)
        out.append(MicroBatch(
            input_ids_BT=torch.from_numpy(ids).to(device),
            # Drop position 0: it has no logit predicting it (see module docstring).
            targets_BT1C=torch.from_numpy(tgt[:, 1:].copy()).to(device),
            rows=mb_rows,
            num_tokens=[samples[i].num_tokens for i in mb_rows],
            routes_BTW=routes_BTW,
        ))
    return out


def unpack_rows(mb: MicroBatch, values_BT1: torch.Tensor) -> SampleArrays:
    """Per-token values of a micro-batch (B, T−1) back into per-sample arrays indexed by token position.

    Host sync: one copy of the micro-batch's values (used outside the gradient step)."""
    v = values_BT1.detach().float().cpu().numpy()
    out: SampleArrays = {}
    for b, (i, n) in enumerate(zip(mb.rows, mb.num_tokens)):
        a = np.zeros(n, dtype=np.float32)
        a[1:n] = v[b, :n - 1]
        out[i] = a
    return out


def dp_share(samples: list[Trajectory], rows: list[int], dp: int, dp_rank: int) -> list[int]:
    """The rows of `rows` this dp rank trains on: longest first to the least-loaded rank (by
    tokens), ties to the lowest rank — deterministic, so every rank computes every share alike."""
    if dp == 1:
        return list(rows)
    load = [0] * dp
    mine = []
    for i in sorted(rows, key=lambda i: -samples[i].num_tokens):
        r = min(range(dp), key=lambda k: (load[k], k))
        load[r] += samples[i].num_tokens
        if r == dp_rank:
            mine.append(i)
    return sorted(mine)


def minibatches(num_samples: int, n: int) -> list[list[int]]:
    """`n` contiguous, near-equal slices of the step's samples (group order: a minibatch holds whole
    groups when the sizes allow). Deterministic, the same on every rank."""
    n = max(1, min(n, num_samples))
    return [list(map(int, a)) for a in np.array_split(np.arange(num_samples), n)]


def loss_tokens_of(samples: list[Trajectory], rows: list[int]) -> int:
    """Loss tokens of `rows`: the same [1:] slice the loss sees, counted on the host."""
    return int(sum(int(samples[i].mask_np()[1:].sum()) for i in rows))


def step_skip_reason(loss_tokens: int, grad_norm: float, loss: float) -> str:
    """The finite check of an optimizer step: why it must be skipped ("" = it may run)."""
    if loss_tokens == 0:
        return "no loss tokens in the batch"
    if not np.isfinite(grad_norm):
        return f"non-finite grad norm ({grad_norm})"
    if not np.isfinite(loss):
        return f"non-finite loss ({loss})"
    return ""
