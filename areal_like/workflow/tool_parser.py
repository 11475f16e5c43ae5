"""Tool calls in the Hermes/Qwen format, as Qwen2.5 and most open tool-use models write them:

    some reasoning<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>

`parse_tool_calls(text)` → (the text outside the calls, the calls). Used by the `tool_agent`
workflow (areal_like/workflow/tool_agent.py) and by the OpenAI-compatible agent proxy, which returns
the calls as `tool_calls` in a chat completion. A call whose body is not a JSON object with a string
`name` is kept as a *malformed* call (`error` set) rather than dropped: the agent loop answers it
with an error observation, so the policy is told what was wrong instead of silently ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    id: str = ""
    error: str | None = None
    """Why the call could not be read (bad JSON, no name, arguments not an object); None = well-formed."""
    raw: str = ""

    def to_openai(self) -> dict:
        """The call as an OpenAI chat `tool_calls` entry (arguments as a JSON string, as the API sends)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str, *, id_prefix: str = "call") -> tuple[str, list[ToolCall]]:
    """(content without the calls, stripped; the calls in order). An unclosed `<tool_call>` at the end
    (generation cut by a token limit) is a malformed call."""
    calls: list[ToolCall] = []
    for i, m in enumerate(_CALL.finditer(text)):
        calls.append(_one(m.group(1), f"{id_prefix}_{i}"))
    content = _CALL.sub("", text)
    cut = content.find(TOOL_CALL_OPEN)
    if cut >= 0:  # opened, never closed
        calls.append(ToolCall(name="", id=f"{id_prefix}_{len(calls)}", raw=content[cut:],
                              error=f"{TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE} (the turn ended mid-call)"))
        content = content[:cut]
    return content.strip(), calls


def _one(body: str, call_id: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(name="", id=call_id, raw=body, error=f"the tool call is not valid JSON ({e.msg} at {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(name="", id=call_id, raw=body, error='the tool call needs {"name": <tool>, "arguments": {…}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as the OpenAI API does
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(name=obj["name"], id=call_id, raw=body, error="the tool call's arguments are not JSON")
    if not isinstance(args, dict):
        return ToolCall(name=obj["name"], id=call_id, raw=body, error="the tool call's arguments must be a JSON object")
    return ToolCall(name=obj["name"], arguments=args, id=call_id, raw=body)
