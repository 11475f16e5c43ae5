"""The vocabulary split over the data-parallel ranks: embedding and LM head of a sharded learner.

Under FSDP (`train.dp_sharding=full|grad_op`) every decoder layer is gathered only while it runs,
but the embedding and the LM head would sit in the root unit, which FSDP never reshards between
forward and backward: the whole [V × H] matrix (and, in backward, its whole gradient) on every
rank from the first token to the last — for a 152k vocabulary, 28 % of Qwen2.5-0.5B, and 1.1 B
parameters of an untied 7B model. So parallelize.py (step 4) takes them out of FSDP and splits their
*rows* over the dp ranks instead (Megatron's vocab-parallel embedding and cross-entropy, run over the
dp group rather than the tp group): each rank holds a dim-0 shard — a `DTensor` `Shard(0)` over the dp
mesh, the same placement FSDP gives its shards, so pushes, checkpoints, clipping and the optimizer
treat it like any other shard — and nobody ever gathers it during a step.

dp ranks hold different tokens, so each operation first shares its tokens (a few bytes per token):

    embedding   all-gather every rank's token ids → each rank looks up the rows it owns (zeros for
                the others) → reduce-scatter: each rank gets its own tokens' embeddings. Backward:
                all-gather the embeddings' gradients → each rank adds its rows' gradient
    logprobs    all-gather every rank's hidden states at the loss positions → per chunk of
                `train.logits_chunk_tokens` tokens: logits against the local rows ([chunk × V/dp]),
                then the log-softmax over the whole vocabulary from two all-reduces of a few floats
                per token (the max; Σexp, the target's logit and Σp·z). Backward recomputes each
                chunk's logits (nothing [chunk × V] is kept) and reduce-scatters ∂L/∂hidden

Each rank's gradient of its rows is complete after its own backward (it saw every rank's tokens):
no reduction over dp. Every rank must call these in the same order, as FSDP's collectives already
require (the trainer runs as many micro-batches on every dp rank, padding ones included).
The numerics are the unsplit ones: `logprobs.token_logprobs_from_logits`'s definition (fp32,
temperature-scaled), equal to the one-process learner within float rounding (the layout tests).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from areal_like.learner.logprobs import effective_temperature


def vocab_rows(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of the rows `rank` holds: `torch.chunk`'s split, as a `Shard(0)` DTensor's."""
    chunk = math.ceil(vocab / world)
    start = min(rank * chunk, vocab)
    return start, min(start + chunk, vocab)


def _sizes(n: int, group, device) -> list[int]:
    out = torch.empty(dist.get_world_size(group), dtype=torch.int64, device=device)
    dist.all_gather_single(out, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    return out.tolist()


def _all_gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's `x` (its own number of rows, `sizes`), concatenated in rank order."""
    m = max(sizes)
    pad = x.new_zeros((m - x.shape[0], *x.shape[1:]))
    out = x.new_empty((len(sizes) * m, *x.shape[1:]))
    dist.all_gather_single(out, torch.cat([x, pad]).contiguous(), group=group)
    keep = torch.cat([torch.arange(r * m, r * m + s, device=x.device) for r, s in enumerate(sizes)])
    return out.index_select(0, keep)


def _reduce_scatter_rows(x_all: torch.Tensor, sizes: list[int], rank: int, group) -> torch.Tensor:
    """The SUM over ranks of `x_all` (rows of every rank, in rank order), this rank's rows only."""
    m = max(sizes)
    padded = x_all.new_zeros((len(sizes) * m, *x_all.shape[1:]))
    off = 0
    for r, s in enumerate(sizes):
        padded[r * m:r * m + s] = x_all[off:off + s]
        off += s
    out = x_all.new_empty((m, *x_all.shape[1:]))
    dist.reduce_scatter_single(out, padded, op=dist.ReduceOp.SUM, group=group)
    return out[:sizes[rank]]


class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids_N, w_local, start, end, dtype, padding_idx, group):  # noqa: D102
        rank = dist.get_rank(group)
        sizes = _sizes(ids_N.numel(), group, ids_N.device)
        all_ids = _all_gather_rows(ids_N, sizes, group)
        ours = (all_ids >= start) & (all_ids < end)
        rows = torch.where(ours, all_ids - start, 0)
        out = torch.where(ours.unsqueeze(1), w_local.index_select(0, rows).to(dtype), 0)
        ctx.save_for_backward(all_ids)
        ctx.meta = (sizes, rank, start, end, padding_idx, group, w_local.shape, w_local.dtype)
        return _reduce_scatter_rows(out, sizes, rank, group)

    @staticmethod
    def backward(ctx, g_NH):  # noqa: D102
        (all_ids,) = ctx.saved_tensors
        sizes, rank, start, end, padding_idx, group, shape, dtype = ctx.meta
        g_all = _all_gather_rows(g_NH.contiguous(), sizes, group)
        ours = (all_ids >= start) & (all_ids < end)
        if padding_idx is not None:
            ours &= all_ids != padding_idx  # nn.Embedding's padding row gets no gradient
        idx = ours.nonzero().squeeze(1)
        grad = torch.zeros(shape, dtype=torch.float32, device=g_NH.device)
        grad.index_add_(0, all_ids.index_select(0, idx) - start, g_all.index_select(0, idx).float())
        return None, grad.to(dtype), None, None, None, None, None


class _Logprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NH, tgt_N, w_local, start, end, temperature, chunk, with_entropy, entropy_grad, group):  # noqa: D102
        rank = dist.get_rank(group)
        dev, cdt = h_NH.device, h_NH.dtype
        sizes = _sizes(h_NH.shape[0], group, dev)
        h_all = _all_gather_rows(h_NH.contiguous(), sizes, group)
        tgt_all = _all_gather_rows(tgt_N.contiguous(), sizes, group)
        n = h_all.shape[0]
        temp = effective_temperature(temperature)
        w = w_local.to(cdt)
        lp_all = torch.zeros(n, dtype=torch.float32, device=dev)
        logz_all = torch.zeros(n, dtype=torch.float32, device=dev)
        ent_all = torch.zeros(n, dtype=torch.float32, device=dev) if with_entropy else None
        step = n if not chunk or chunk >= n else int(chunk)
        for s in range(0, n, max(step, 1)):
            z = _logits(h_all[s:s + step], w, temp)
            tgt = tgt_all[s:s + step]
            m = (z.max(-1).values if z.shape[1] else torch.full((z.shape[0],), -math.inf, device=dev))
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            e = torch.exp(z - m.unsqueeze(1))
            ours = (tgt >= start) & (tgt < end)
            picked = (z.gather(1, torch.where(ours, tgt - start, 0).unsqueeze(1)).squeeze(1) if z.shape[1]
                      else torch.zeros_like(m))
            parts = [e.sum(-1), torch.where(ours, picked, 0.0)]
            if with_entropy:
                parts.append((e * z).sum(-1))
            sums = torch.stack(parts)
            dist.all_reduce(sums, group=group)
            logz = m + sums[0].log()
            lp_all[s:s + step] = sums[1] - logz
            logz_all[s:s + step] = logz
            if with_entropy:
                ent_all[s:s + step] = logz - sums[2] / sums[0]  # −Σ p log p = log Z − Σ p z
            del z, e
        ctx.save_for_backward(h_all, tgt_all, logz_all, ent_all if ent_all is not None else logz_all, w_local)
        ctx.meta = (sizes, rank, start, end, temp, step, with_entropy and entropy_grad, group, cdt)
        off = sum(sizes[:rank])
        lp = lp_all[off:off + sizes[rank]]
        ent = ent_all[off:off + sizes[rank]] if with_entropy else lp.new_zeros(0)
        if not (with_entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):  # noqa: D102
        h_all, tgt_all, logz_all, ent_all, w_local = ctx.saved_tensors
        sizes, rank, start, end, temp, step, ent_grad, group, cdt = ctx.meta
        dev = h_all.device
        n = h_all.shape[0]
        g_lp = g_lp if g_lp is not None else torch.zeros(sizes[rank], device=dev)
        g_lp_all = _all_gather_rows(g_lp.float().contiguous(), sizes, group)
        g_ent_all = None
        if ent_grad:
            g_ent = g_ent if g_ent is not None else torch.zeros(sizes[rank], device=dev)
            g_ent_all = _all_gather_rows(g_ent.float().contiguous(), sizes, group)
        w = w_local.to(cdt)
        grad_w = torch.zeros(w_local.shape, dtype=torch.float32, device=dev)
        grad_h_all = torch.zeros(h_all.shape, dtype=torch.float32, device=dev)
        for s in range(0, n, max(step, 1)):
            h = h_all[s:s + step]
            z = _logits(h, w, temp)
            p = torch.exp(z - logz_all[s:s + step].unsqueeze(1))
            g = g_lp_all[s:s + step]
            dz = p * (-g).unsqueeze(1)  # ∂ log p_t / ∂z = onehot(t) − p
            tgt = tgt_all[s:s + step]
            ours = ((tgt >= start) & (tgt < end)).nonzero().squeeze(1)
            dz.index_put_((ours, tgt.index_select(0, ours) - start), g.index_select(0, ours), accumulate=True)
            if g_ent_all is not None:  # ∂H/∂z = −p (log p + H)
                logp = z - logz_all[s:s + step].unsqueeze(1)
                dz -= g_ent_all[s:s + step].unsqueeze(1) * p * (logp + ent_all[s:s + step].unsqueeze(1))
                del logp
            dz = (dz / temp if temp != 1.0 else dz).to(cdt)  # z = h Wᵀ / T
            grad_w += (dz.t() @ h).float()
            grad_h_all[s:s + step] = (dz @ w).float()
            del z, p, dz
        grad_h = _reduce_scatter_rows(grad_h_all, sizes, rank, group)
        return grad_h.to(cdt), None, grad_w.to(w_local.dtype), None, None, None, None, None, None, None


def _logits(h: torch.Tensor, w: torch.Tensor, temp: float) -> torch.Tensor:
    """fp32 logits of `h` against the local rows `w`, divided by the temperature (as `_log_softmax_fp32`)."""
    z = (h @ w.t()).float()
    return z / temp if temp != 1.0 else z


def _row_shard(rows: int, cols: int, mesh, *, dtype: torch.dtype, device) -> tuple[nn.Parameter, int, int]:
    """An uninitialised [rows × cols] Parameter split by rows over `mesh` (a `Shard(0)` DTensor: this
    rank's block only), and the [start, end) rows this rank holds."""
    from torch.distributed.tensor import DTensor, Shard

    start, end = vocab_rows(rows, mesh.size(), mesh.get_local_rank())
    local = torch.empty(end - start, cols, dtype=dtype, device=device)
    param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=(rows, cols),
                                            stride=(cols, 1)))
    return param, start, end


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` whose rows are split over the dp group (see the module docstring). `weight` is a
    `Shard(0)` DTensor over the dp mesh, stored in the master dtype; lookups return `dtype`."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh, *, padding_idx: int | None,
                 dtype: torch.dtype, param_dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.group = mesh.get_group()
        self.weight, self.start, self.end = _row_shard(num_embeddings, embedding_dim, mesh, dtype=param_dtype,
                                                       device=device)
        self.dtype = dtype  # what forward returns (model.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = _Embed.apply(ids.reshape(-1), self.weight.to_local(), self.start, self.end, self.dtype,
                           self.padding_idx, self.group)
        return out.reshape(*ids.shape, self.embedding_dim)


class VocabParallelHead(nn.Module):
    """The LM head over the same row split: only token log-probabilities (and the entropy), never
    logits — `logprobs.chunked_token_logprobs` calls `token_logprobs`. `weight` is the embedding's
    Parameter when the model ties them."""

    vocab_parallel = True

    def __init__(self, weight: nn.Parameter, start: int, end: int, group, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.start, self.end, self.group, self.dtype = start, end, group, dtype

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a vocab-parallel LM head has no full logits: use logprobs.chunked_token_logprobs")

    def token_logprobs(self, h_NH: torch.Tensor, tgt_N: torch.Tensor, temperature: float, chunk: int | None,
                       with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        lp, ent = _Logprobs.apply(h_NH.to(self.dtype), tgt_N, self.weight.to_local(), self.start, self.end,
                                  temperature, chunk, with_entropy, entropy_grad, self.group)
        return lp, (ent if with_entropy else None)


def apply_vocab_parallel(stage, mesh, *, dtype: torch.dtype) -> set[nn.Parameter]:
    """Replace this stage's embedding and LM head (a tied pair stays one Parameter) by their
    vocab-parallel versions over `mesh` (the dp mesh); returns the new parameters, which FSDP must
    ignore. A head that is not a [vocab × hidden] projection (the critic's value head) stays."""
    hf, inner = stage.hf, stage.hf.model
    cfg = hf.config
    new: set[nn.Parameter] = set()
    emb = getattr(inner, "embed_tokens", None)
    head = getattr(hf, "lm_head", None)
    tied = emb is not None and head is not None and head.weight is emb.weight
    if emb is not None:
        vp = VocabParallelEmbedding(emb.num_embeddings, emb.embedding_dim, mesh, padding_idx=emb.padding_idx,
                                    dtype=dtype, param_dtype=emb.weight.dtype, device=emb.weight.device)
        vp.weight.requires_grad_(emb.weight.requires_grad)  # frozen under LoRA
        inner.embed_tokens = vp
        new.add(vp.weight)
    if head is not None and isinstance(head, nn.Linear) and head.out_features == cfg.vocab_size and head.bias is None:
        if tied:
            weight, start, end = vp.weight, vp.start, vp.end
        else:
            weight, start, end = _row_shard(head.out_features, head.in_features, mesh, dtype=head.weight.dtype,
                                            device=head.weight.device)
            weight.requires_grad_(head.weight.requires_grad)
            new.add(weight)
        hf.lm_head = VocabParallelHead(weight, start, end, mesh.get_group(), dtype)
    return new
