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
    logits = logits_BTV.float()
    if temperature > 1e-6 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, targets_BT.long().unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(model: torch.nn.Module, input_ids_BT: torch.Tensor, temperature: float = 1.0,
                      attention_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """logprob of every token given its prefix; position 0 gets 0. Shape (batch, tokens)."""
    out = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, use_cache=False)
    lp_BT1 = token_logprobs_from_logits(out.logits[:, :-1], input_ids_BT[:, 1:], temperature)
    return torch.nn.functional.pad(lp_BT1, (1, 0), value=0.0)
