"""`python`: run the model's code in the sandbox (sandbox.py) and show it what the code printed.

Each call is a fresh process: no state carries over between calls (the description says so, so the
model prints what it needs). The row's tools_kwargs may give `stdin` (text) and `files` ({name: text},
written into the scratch directory first), e.g. a task's input data.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from areal_like.tools.base import Tool, ToolResult
from areal_like.tools.sandbox import run_python

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PythonToolConfig:
    """Limits of one call (see sandbox.run_python)."""

    timeout_s: float = 5.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    file_mb: int = 16
    max_procs: int = 16
    output_chars: int = 1024
    network: bool = False

    def __post_init__(self) -> None:
        for key in ("timeout_s", "cpu_s", "memory_mb", "file_mb", "max_procs", "output_chars"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}={getattr(self, key)!r} must be > 0")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb={self.memory_mb} is too small for a Python interpreter to start: use >= 64")
        if self.max_procs < 2:
            raise ValueError(f"max_procs={self.max_procs}: use >= 2 (the interpreter itself is one process)")


_ROW_KWARGS = ("stdin", "files")


class PythonTool(Tool):
    Config = PythonToolConfig
    required_arguments = ("code",)
    default_schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": ("Run Python 3 code in a sandbox (no network, limited time and memory) and return what "
                            "it prints. Every call starts fresh: no variables persist between calls, so print() "
                            "the results you need."),
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "The Python program to run."}},
                "required": ["code"],
            },
        },
    }

    def __init__(self, config: PythonToolConfig, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        self.cfg = config
        self.output_chars = config.output_chars
        # the sandbox enforces timeout_s itself; this outer guard only catches a sandbox that hangs
        self.call_timeout_s = config.timeout_s + 10.0
        self._warned: set[str] = set()

    async def execute(self, arguments: dict, **tools_kwargs: Any) -> ToolResult:
        for key in tools_kwargs:
            if key not in _ROW_KWARGS and key not in self._warned:
                self._warned.add(key)
                logger.warning("python tool: ignoring tools_kwargs key %r (it reads only %s)", key,
                               ", ".join(_ROW_KWARGS))
        c = self.cfg
        r = await run_python(arguments["code"], timeout_s=c.timeout_s, cpu_s=c.cpu_s, memory_mb=c.memory_mb,
                             file_mb=c.file_mb, max_procs=c.max_procs, output_chars=c.output_chars,
                             network=c.network, stdin=tools_kwargs.get("stdin"), files=tools_kwargs.get("files"))
        metrics = {"sandbox_seconds": r.seconds, "cpu_s": r.cpu_s, "max_rss_mb": r.max_rss_mb}
        if r.error is None:
            return ToolResult(r.stdout if r.stdout else "(no output: print() the values you want to see)",
                              metrics=metrics)
        # the end of stdout so far, the error, then the end of stderr (the traceback's last lines)
        head = f"Error ({r.error}): {r.message}" if r.message else f"Error ({r.error})"
        budget = max(0, self.output_chars - len(head) - 2)
        err = _tail_lines(r.stderr.strip(), budget // 2)
        out = _tail_lines(r.stdout.rstrip("\n"), budget - len(err))
        text = "\n".join(p for p in (out, head, err) if p)
        return ToolResult(text, error=r.error, metrics=metrics)


def _tail_lines(text: str, limit: int) -> str:
    """The whole last lines of `text` that fit in `limit` chars, marked when lines were dropped."""
    if len(text) <= limit:
        return text
    marker = "...[earlier lines cut]...\n"
    room = limit - len(marker)
    if room <= 0:
        return ""
    tail = text[-room:]
    cut = tail.find("\n")
    if 0 <= cut < len(tail) - 1:
        tail = tail[cut + 1:]  # start at a line boundary; a single long line is kept cut
    return marker + tail
