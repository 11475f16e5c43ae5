"""`ToolSet`: the tools of `rollout.tools_config` (built by config.py), and the one entry point that calls
them (`call` never raises: see base.py). Apart from base.py so that base.py, which every tool imports,
imports nothing of the YAML side."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from areal_like.metrics import TOOL_CALLS, TOOL_SECONDS
from areal_like.tools.base import _UNKNOWN_TOOL_LABEL, Tool, ToolResult, check_arguments
from areal_like.tools.config import load_tools
from areal_like.tools.sandbox import truncate_middle

logger = logging.getLogger(__name__)


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
