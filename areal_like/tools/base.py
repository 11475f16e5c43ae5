"""Tools a model may call during an agentic rollout: `Tool`, `ToolResult`, and the argument check
`ToolSet` (toolset.py, the one entry point that calls them) runs before a call.

`ToolSet.call` is the boundary between the model's text and our code: whatever the model writes (an
unknown name, arguments that are not JSON, a missing key) and whatever the tool does (raise, hang)
comes back as a `ToolResult` whose text the model sees next turn — a tool call never ends the episode
or the rollout worker. Every call is counted by outcome in `areal_like_tool_calls_total{tool, outcome}`.

This module knows nothing of chat templates or token ids (the `tool_agent` workflow turns schemas into
prompts and tool calls into `call`s), nor of YAML (config.py builds tools from the file, toolset.py the set from the tools).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar


_UNKNOWN_TOOL_LABEL = "_unknown"
"""Metric label for calls naming no configured tool: the name the model wrote would be unbounded."""


@dataclass
class ToolResult:
    """One tool call's outcome. `text` is the observation shown to the model, already within the tool's
    limit; `error` is None on success, else a short kind (timeout, exception, bad_arguments,
    unknown_tool, refused, memory, output_limit, …) that is also the metric's `outcome` label."""

    text: str
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class Tool:
    """A callable tool. Subclasses set `Config` (a dataclass: the YAML `config:` mapping is checked
    against its fields, unknown keys are errors) or leave it None to receive the mapping as a dict;
    `default_schema` (an OpenAI function schema) or require `tool_schema` in the YAML; and
    `required_arguments`, the argument names `execute` reads, which a user's schema must declare.

    `execute` gets arguments that passed the schema's required-key and type checks, plus the row's
    `tools_kwargs` for this tool (create_kwargs merged with execute_kwargs) as keyword arguments.
    It may raise: `ToolSet.call` turns any exception into an error observation."""

    Config: ClassVar[type | None] = None
    default_schema: ClassVar[dict | None] = None
    required_arguments: ClassVar[tuple[str, ...]] = ()
    output_chars: int = 4096
    """Observations longer than this are cut by `ToolSet.call` (head and tail kept)."""
    call_timeout_s: float = 60.0
    """`ToolSet.call` gives up on `execute` after this long (error kind "timeout")."""

    def __init__(self, config: Any = None, tool_schema: dict | None = None):
        schema = tool_schema if tool_schema is not None else self.default_schema
        if schema is None:
            raise ValueError(f"{type(self).__name__} has no default schema: give `tool_schema` in the tool config")
        self.config = config
        self.schema: dict = schema
        self.name: str = schema["function"]["name"]

    async def execute(self, arguments: dict, **tools_kwargs: Any) -> ToolResult:
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the tool holds (processes, connections). Default: nothing."""


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def check_arguments(parameters: dict, arguments: dict) -> str | None:
    """Why `arguments` do not fit the schema's `parameters` (required keys, JSON types, enums), or None.
    Not a full JSON-Schema validator: enough to turn the model's common slips into a clear observation."""
    props = parameters.get("properties") or {}
    missing = [k for k in parameters.get("required") or [] if k not in arguments]
    if missing:
        return f"missing required argument(s): {', '.join(missing)}"
    if parameters.get("additionalProperties") is False:
        extra = [k for k in arguments if k not in props]
        if extra:
            return f"unexpected argument(s): {', '.join(extra)} (allowed: {', '.join(props) or 'none'})"
    for key, value in arguments.items():
        spec = props.get(key)
        if not isinstance(spec, dict):
            continue
        types = spec.get("type")
        if types is not None:
            names = [types] if isinstance(types, str) else list(types)
            ok = False
            for t in names:
                py = _JSON_TYPES.get(t)
                if py is None:
                    ok = True  # a type we do not check
                elif isinstance(value, py) and not (isinstance(value, bool) and t in ("integer", "number")):
                    ok = True
            if not ok:
                return f"argument {key!r} must be of type {' or '.join(names)}, got {type(value).__name__}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument {key!r} must be one of {spec['enum']}, got {value!r}"
    return None
