"""Tools for agentic RLVR (the `tool_agent` workflow): `ToolSet.from_config(rollout.tools_config)`,
then `await toolset.call(name, arguments, tools_kwargs)` → `ToolResult` (never raises).

Built-ins: `python` (sandboxed code, sandbox.py), `search` (BM25 over a parquet corpus), `calculator`
(arithmetic by AST, no eval). A user's tool is any `Tool` subclass named by dotted path in the YAML.

The names below are imported on first use (PEP 562): the code reward runs in reward worker processes
and imports `areal_like.tools.sandbox` alone (standard library only), without Prometheus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_like._lazy import lazy_exports

_EXPORTS = {
    "Tool": "base", "ToolResult": "base", "ToolSet": "toolset",
    "SandboxResult": "sandbox", "run_python": "sandbox", "run_python_sync": "sandbox",
}

__all__ = ["SandboxResult", "Tool", "ToolResult", "ToolSet", "run_python", "run_python_sync"]

if TYPE_CHECKING:
    from areal_like.tools.base import Tool, ToolResult
    from areal_like.tools.toolset import ToolSet
    from areal_like.tools.sandbox import SandboxResult, run_python, run_python_sync


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
