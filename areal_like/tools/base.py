"""Tools a model may call during an agentic rollout, and `ToolSet`, the one entry point that calls them.

`ToolSet.call` is the boundary between the model's text and our code: whatever the model writes (an
unknown name, arguments that are not JSON, a missing key) and whatever the tool does (raise, hang)
comes back as a `ToolResult` whose text the model sees next turn — a tool call never ends the episode
or the rollout worker. Every call is counted by outcome in `areal_like_tool_calls_total{tool, outcome}`.

This module knows nothing of chat templates or token ids (the `tool_agent` workflow turns schemas into
prompts and tool calls into `call`s), nor of YAML (config.py builds tools from the file).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from areal_like.metrics import TOOL_CALLS, TOOL_SECONDS
from areal_like.tools.sandbox import truncate_middle

logger = logging.getLogger(__name__)

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


class ToolSet:
    """The tools of one rollout worker, by name. Build it with `from_config(path)`; call tools with
    `call`; `close()` at the end."""

    def __init__(self, tools: list[Tool]):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(f"two tools are named {tool.name!r}: tool names must be unique "
                                 "(set a different `tool_schema.function.name`)")
            self._tools[tool.name] = tool

    @classmethod
    def from_config(cls, path: str) -> "ToolSet":
        """The tools declared in the YAML file `path` (verl's shape: `tools: [{class_name, config,
        tool_schema}]`). Raises ValueError naming the file, the tool and the key for any mistake."""
        from areal_like.tools.config import load_tools  # config.py imports Tool from here

        return cls(load_tools(path))

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[dict]:
        """OpenAI tool schemas, in config order (what chat templates take as `tools=`)."""
        return [t.schema for t in self._tools.values()]

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    async def call(self, name: str, arguments: dict | str,
                   tools_kwargs: dict | None = None) -> ToolResult:
        """Run tool `name`. Never raises (cancellation aside): every failure is an error observation.
        `arguments` is the model's JSON object (or its text); `tools_kwargs` is the row's
        `extra_info.tools_kwargs` ({tool: {"create_kwargs": {…}, "execute_kwargs": {…}}})."""
        t0 = time.monotonic()
        tool = self._tools.get(name)
        label = name if tool is not None else _UNKNOWN_TOOL_LABEL
        try:
            result = await self._call(tool, name, arguments, tools_kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the contract: nothing escapes but cancellation (and interpreter exits)
            logger.exception("tool %s: unexpected failure outside execute", label)
            result = ToolResult(f"Error: {type(e).__name__}: {e}", error="exception")
        if tool is not None:
            result.text = truncate_middle(result.text, tool.output_chars)
        seconds = time.monotonic() - t0
        result.metrics.setdefault("tool_seconds", seconds)
        TOOL_CALLS.labels(tool=label, outcome=result.error or "ok").inc()
        TOOL_SECONDS.labels(tool=label).observe(seconds)
        return result

    async def _call(self, tool: Tool | None, name: str, arguments: dict | str,
                    tools_kwargs: dict | None) -> ToolResult:
        if tool is None:
            return ToolResult(f"Error: unknown tool {name!r}; available tools: {', '.join(self._tools) or 'none'}",
                              error="unknown_tool")
        if isinstance(arguments, str):
            if not arguments.strip():
                arguments = {}  # models write "" for a call without arguments
            else:
                try:
                    arguments = json.loads(arguments)
                except ValueError as e:
                    return ToolResult(f"Error: the arguments of {name} are not valid JSON ({e}); "
                                      "write them as a JSON object", error="bad_arguments")
        if not isinstance(arguments, dict):
            return ToolResult(f"Error: the arguments of {name} must be a JSON object, got "
                              f"{type(arguments).__name__}", error="bad_arguments")
        problem = check_arguments(tool.schema["function"].get("parameters") or {}, arguments)
        if problem is not None:
            return ToolResult(f"Error: {name}: {problem}", error="bad_arguments")
        kwargs, problem = _row_kwargs(tools_kwargs, name)
        if problem is not None:
            # the dataset's fault, not the model's; still an observation, so the episode goes on
            logger.warning("tool %s: %s", name, problem)
            return ToolResult(f"Error: {name}: {problem}", error="bad_tools_kwargs")
        try:
            result = await asyncio.wait_for(tool.execute(arguments, **kwargs), tool.call_timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(f"Error: {name} timed out after {tool.call_timeout_s:g}s", error="timeout")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.debug("tool %s raised", name, exc_info=True)
            return ToolResult(f"Error: {name} raised {type(e).__name__}: {e}", error="exception")
        if isinstance(result, str):
            return ToolResult(result)
        if not isinstance(result, ToolResult):
            return ToolResult(f"Error: {name} returned {type(result).__name__}, not a ToolResult", error="exception")
        return result

    async def close(self) -> None:
        """Close every tool; one failing does not stop the others."""
        for tool in self._tools.values():
            try:
                await tool.close()
            except Exception:
                logger.exception("closing tool %s failed", tool.name)


def _row_kwargs(tools_kwargs: dict | None, name: str) -> tuple[dict, str | None]:
    """(create_kwargs merged with execute_kwargs for `name`, problem or None)."""
    if not tools_kwargs:
        return {}, None
    if not isinstance(tools_kwargs, dict):
        return {}, ("extra_info.tools_kwargs must be a mapping of tool name → kwargs, got "
                    f"{type(tools_kwargs).__name__}")
    entry = tools_kwargs.get(name)
    if entry is None:
        return {}, None
    if not isinstance(entry, dict):
        return {}, f"extra_info.tools_kwargs[{name!r}] must be a mapping, got {type(entry).__name__}"
    merged: dict = {}
    for part in ("create_kwargs", "execute_kwargs"):
        value = entry.get(part) or {}
        if not isinstance(value, dict):
            return {}, f"extra_info.tools_kwargs[{name!r}][{part!r}] must be a mapping, got {type(value).__name__}"
        merged.update(value)
    return merged, None
