"""Chat-template arithmetic for multi-turn episodes: the tokens to append after an assistant turn.

A multi-turn sample is one token sequence that only ever grows: the prompt, the assistant's generated
tokens (trained), then whatever the chat template puts between that turn and the next generation
(the end-of-turn glue the model did not generate, a tool or user message, the next assistant header)
as observation tokens (not trained). Re-rendering the whole conversation each turn would re-tokenize
the model's own output (possibly differently) and break the logprob ↔ token alignment; instead the
template is rendered for a fixed two-message conversation with and without the new messages, and
only the difference is tokenized (verl does the same).

    render([u, a])                       = P + "#A:" + "y" + S          (S: the template's end of turn)
    render([u, a] + new, gen prompt)     = P + "#A:" + "y" + S + D
    append after the generated turn:  the rest of S the model did not generate (all of S, or S minus
                                      the EOS text when the turn ended on EOS), then D.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

_MARK = "\x00y\x00"  # stands for an assistant turn's content while the template is measured


def render(tokenizer, messages: list[dict], *, tools: list[dict] | None = None, add_generation_prompt: bool) -> str:
    kw: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kw["tools"] = tools
    return tokenizer.apply_chat_template(messages, **kw)


def encode(tokenizer, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The first prompt of an episode: the conversation so far, the tools, the assistant header."""
    return encode(tokenizer, render(tokenizer, messages, tools=tools, add_generation_prompt=True))


_BASE = ({"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK})


@lru_cache(maxsize=64)
def _measured(tokenizer) -> tuple[str, str]:
    """(render of the fixed two-message conversation, S: what the template writes after an assistant
    message's content, e.g. "<eos>\\n", "<|im_end|>\\n") — once per tokenizer."""
    text = render(tokenizer, [dict(m) for m in _BASE], add_generation_prompt=False)
    return text, text[text.rindex(_MARK) + len(_MARK):]


def observation_ids(tokenizer, new_messages: list[dict], *, ended_with_eos: bool) -> list[int]:
    """Tokens to append after a generated assistant turn so that the sequence continues with
    `new_messages` (tool results, a user turn) and the next assistant header."""
    before, suffix = _measured(tokenizer)
    after = render(tokenizer, [dict(m) for m in _BASE] + list(new_messages), add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template renders earlier messages differently once new ones follow; "
                         "multi-turn episodes need a template whose output only grows")
    eos = tokenizer.eos_token or ""
    if ended_with_eos and eos and suffix.startswith(eos):
        suffix = suffix[len(eos):]
    return encode(tokenizer, suffix + after[len(before):])


def truncate_text(tokenizer, text: str, max_tokens: int) -> str:
    """`text` cut to `max_tokens` tokens, saying so (a tool's output must not flood the context)."""
    ids = encode(tokenizer, text)
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens], skip_special_tokens=False) + "...(truncated)"


def chat_messages(raw_prompt: Any) -> list[dict]:
    """A row's prompt as chat messages (verl rows hold a list of {role, content}, or a plain string)."""
    if isinstance(raw_prompt, str):
        return [{"role": "user", "content": raw_prompt}]
    if isinstance(raw_prompt, (list, tuple)):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in raw_prompt]
    raise ValueError(f"the row's prompt is {type(raw_prompt).__name__}: want a string or a list of {{role, content}}")
