"""Reasoning parsers of the agent proxy: a chat reply's think block → `message.reasoning_content`.

The names and the one-shot parse follow SGLang's `--reasoning-parser` (its `BaseReasoningFormatDetector.
detect_and_parse`), so an agent written against SGLang's OpenAI server sees the same messages here:

- `qwen3`: reasoning only when the text holds `<think>`; the block ends at `</think>`, or — when the
  model opens a `<tool_call>` without closing the block — right before that call (the call stays in the
  content); a block never closed is all reasoning, with empty content.
- `deepseek-r1`: reasoning from the first character up to `</think>` (DeepSeek-R1 starts thinking
  without an opening tag); no `</think>` = all reasoning.

Leading opening tags are removed; `reasoning_content` is the block as generated, `content` the text
after `</think>` without its leading newlines (what chat templates write back between the block and the
answer, Qwen3's `'</think>\n\n' + content.lstrip('\n')`; SGLang's releases strip both ends or neither).
Tool calls are parsed from the content alone (a call written inside a think block is thinking, not a
call). The trained tokens are the generated ones whatever the parser shows the agent.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    force: bool  # reasoning from the first character, without an opening tag
    tool_start: str | None = None  # a tool call that opens inside the block closes it


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("<think>", "</think>", force=False, tool_start="<tool_call>"),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", force=True),
}


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning_content or None when the text has none, content)."""
    fmt = REASONING_PARSERS.get(parser)
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {parser!r}: use one of {sorted(REASONING_PARSERS)}")
    if not (fmt.force or fmt.start in text):
        return None, text
    body = text
    while body.startswith(fmt.start):
        body = body[len(fmt.start):]
    if fmt.end in body:
        reasoning, content = body.split(fmt.end, 1)
        return reasoning, content.lstrip("\n")
    if fmt.tool_start is not None and fmt.tool_start in body:
        i = body.index(fmt.tool_start)
        return body[:i], body[i:]
    return body, ""  # cut off before the block closed
