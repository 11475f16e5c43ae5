"""A judge (generative reward model) on servers of its own: `judge.*`, the allocation's judge component.

One grading, per sample, in the rollout worker's event loop:
```
 question (PromptRecord.question) ─┐
 response (the sample's text)     ├─► judge.prompt_template ─► [chat template] ─► judge tokenizer ─► ids
 reference (ground truth)         ─┘
 ids ──► GenerationClient over the judge servers (POST /generate, greedy by default; a group's samples
         go to one judge server together, which batches them like any requests) ──► reply
 reply ──► judge.score_rule: last_number (text) | verdict (first token's top logprobs) ──► score in [0, 1]
```
The judge servers are started by `launcher run` with `judge.model_path` and never receive weights:
they answer at version 0 for the whole run. A grading that raises (HTTP error, server down past the
client's retries), times out (`judge.timeout_s`, sent again up to `judge.max_retries` times) or yields no
score raises `JudgeFailure` with the reward failure kind (exception, timeout, not_a_number): `RewardFn`
scores it 0 and counts it like any reward failure. Every grading's time (failed ones too) goes to
`areal_like_judge_latency_seconds`, its outcome to `areal_like_judge_gradings{outcome}`.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from areal_like.api.config import JudgeConfig
from areal_like.metrics import JUDGE_GRADINGS, JUDGE_LATENCY


class JudgeFailure(Exception):
    """A grading that gave no score; `kind` is the reward failure kind it counts as."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")


def render_prompt(template: str, *, question: str, response: str, reference: str) -> str:
    return template.format(question=question, response=response, reference=reference)


def last_number_score(text: str, max_score: float) -> float:
    """`last_number`: the reply's last number / max_score, clipped to [0, 1]."""
    found = _NUMBER.findall(text)
    if not found:
        raise JudgeFailure("not_a_number", f"the judge's reply holds no number (judge.score_rule=last_number): "
                                           f"{text[-200:]!r}")
    return min(1.0, max(0.0, float(found[-1]) / max_score))


def verdict_score(top: list[Any], positive: int, negative: int) -> float:
    """`verdict`: p(positive) / (p(positive) + p(negative)) among the first reply token's top logprobs
    (`[[logprob, token_id, text], …]`); one of the two missing counts as probability 0."""
    lp = {int(t[1]): float(t[0]) for t in top if t is not None and t[0] is not None}
    if positive not in lp and negative not in lp:
        raise JudgeFailure("not_a_number", f"neither verdict token ({positive}, {negative}) is among the judge's "
                                           f"{len(lp)} most likely first tokens (raise judge.top_logprobs_num, or "
                                           f"check judge.verdict_tokens against the judge's tokenizer)")
    p = math.exp(lp[positive]) if positive in lp else 0.0
    n = math.exp(lp[negative]) if negative in lp else 0.0
    return p / (p + n)


class Judge:
    """`await judge.grade(question, response, reference, key=group_id) -> float` in [0, 1], or JudgeFailure."""

    def __init__(self, cfg: JudgeConfig, client: Any, tokenizer: Any, *, api_key: str | None = None):
        self.cfg = cfg
        self.client = client
        self.api_key = api_key
        self.tokenizer = tokenizer
        self.label = f"judge {cfg.model_path} ({cfg.score_rule})"
        if cfg.apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"judge.apply_chat_template=true but the tokenizer of judge.model_path={cfg.model_path} "
                             f"has no chat template: set judge.apply_chat_template=false")
        self.verdict_ids: tuple[int, int] | None = None
        if cfg.score_rule == "verdict":
            ids = []
            for word in cfg.verdict_tokens:
                toks = tokenizer.encode(word, add_special_tokens=False)
                if not toks:
                    raise ValueError(f"judge.verdict_tokens entry {word!r} is no token under the judge's tokenizer")
                ids.append(int(toks[0]))
            if ids[0] == ids[1]:
                raise ValueError(f"judge.verdict_tokens={cfg.verdict_tokens} begin with the same token ({ids[0]}) "
                                 f"under the judge's tokenizer: pick words that differ in their first token")
            self.verdict_ids = (ids[0], ids[1])
        eos = getattr(tokenizer, "eos_token_id", None)
        self._stop = [int(eos)] if eos is not None else []

    @classmethod
    def from_config(cls, cfg: JudgeConfig, urls: list[str], *, api_key: str | None) -> "Judge":
        """The judge over the servers `urls` (endpoints.json `judge_servers`)."""
        from transformers import AutoTokenizer

        from areal_like.engine.client import GenerationClient

        tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        client = GenerationClient(urls, request_timeout_s=cfg.timeout_s, api_key=api_key,
                                  max_timeout_retries=cfg.max_retries)
        return cls(cfg, client, tokenizer, api_key=api_key)

    def client_spec(self) -> dict[str, Any]:
        """What a custom reward function's `JudgeClient` is built from (judge_client.py), in its worker."""
        c = self.cfg
        return {"urls": list(self.client.server_urls), "api_key": self.api_key, "timeout_s": c.timeout_s,
                "max_retries": c.max_retries, "max_new_tokens": c.max_new_tokens, "temperature": c.temperature,
                "prompt_template": c.prompt_template}

    def prompt_ids(self, question: str, response: str, reference: str) -> list[int]:
        text = render_prompt(self.cfg.prompt_template, question=question, response=response, reference=reference)
        if self.cfg.apply_chat_template:
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                           add_generation_prompt=True))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def grade(self, question: str, response: str, reference: str, *, key: str | None = None) -> float:
        from areal_like.engine.client import GenerationError, GenerationTimeout

        t0 = time.perf_counter()
        outcome = "exception"
        try:
            ids = self.prompt_ids(question, response, reference)
            verdict = self.verdict_ids is not None
            try:
                res = await self.client.generate(
                    ids, max_new_tokens=1 if verdict else self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                    stop_token_ids=self._stop, key=key, top_logprobs_num=self.cfg.top_logprobs_num if verdict else 0)
            except GenerationTimeout as e:
                outcome = "timeout"
                raise JudgeFailure("timeout", f"{e} (judge.timeout_s={self.cfg.timeout_s:g}, judge.max_retries="
                                              f"{self.cfg.max_retries})") from None
            except (GenerationError, OSError, ValueError) as e:
                raise JudgeFailure("exception", f"{type(e).__name__}: {e}") from None
            if verdict:
                tops = res.extra.get("output_top_logprobs") or []
                if not tops:
                    raise JudgeFailure("exception", f"judge server {res.server} returned no output_top_logprobs")
                assert self.verdict_ids is not None
                score = verdict_score(tops[0], *self.verdict_ids)
            else:
                score = last_number_score(self.tokenizer.decode(res.output_ids, skip_special_tokens=True),
                                          self.cfg.max_score)
            outcome = "ok"
            return score
        except JudgeFailure as e:
            outcome = e.kind
            raise
        finally:
            JUDGE_LATENCY.observe(time.perf_counter() - t0)
            JUDGE_GRADINGS.labels(outcome=outcome).inc()

    async def close(self) -> None:
        await self.client.close()
