"""Chat-template arithmetic for multi-turn episodes: the tokens to append after an assistant turn.

A multi-turn sample is one token sequence that only ever grows: the prompt, the assistant's generated
tokens (trained), then whatever the chat template puts between that turn and the next generation
(the end-of-turn glue the model did not generate, a tool or user message, the next assistant header)
as observation tokens (not trained). Re-rendering the whole conversation each turn would re-tokenize
the model's own output (possibly differently) and break the logprob ↔ token alignment; instead the
template is rendered for a fixed two-message conversation followed by the new messages, and what it
writes after the assistant's content is tokenized (verl measures the same difference).

    render([u, a] + new, gen prompt)  = P' + "y" + S + D      (S: the template's end of turn,
                                                               D: the new messages, the next header)
    append after the generated turn:  S + D, less the EOS text when the turn ended on EOS (generated)
"""

from __future__ import annotations

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


def observation_ids(tokenizer, new_messages: list[dict], *, ended_with_eos: bool) -> list[int]:
    """Tokens to append after a generated assistant turn so that the sequence continues with
    `new_messages` (tool results, a user turn) and the next assistant header: everything the template
    writes after the measured assistant content once `new_messages` follow it.

    Only what follows the content is read, never what precedes it: templates may render earlier turns
    differently once a new user turn arrives (Qwen3's drops their `<think>` blocks, and writes an
    empty one for the last assistant turn only), which is exactly why a multi-turn sample keeps the
    model's own tokens instead of re-rendering the conversation."""
    after = render(tokenizer, [dict(m) for m in _BASE] + list(new_messages), add_generation_prompt=True)
    at = after.rfind(_MARK)
    if at < 0:
        raise ValueError("the chat template drops an assistant message's content once new messages follow: "
                         "multi-turn episodes cannot continue from the model's own tokens with it")
    glue = after[at + len(_MARK):]
    eos = tokenizer.eos_token or ""
    if ended_with_eos and eos and glue.startswith(eos):
        glue = glue[len(eos):]
    return encode(tokenizer, glue)


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
