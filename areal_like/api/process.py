"""How a role's process ends once its `main` returned, and whether a process is running (no torch, no asyncio).

A role that imported torch and transformers spends 1–4 s in the interpreter's finalization after its
work is done (tearing down hundreds of modules and their native state; measured on the 2-core CPU
machine, more under load), and the launcher waits for it on every stop and every restart. Each role
closes what it opened before its `main` returns — HTTP sites, Redis connections, reward and tool
subprocesses, trackers, files — so nothing is left for the finalization to do but flush the standard
streams and the logging handlers. `exit_now` does that and ends the process at once.

Only the normal return takes this path: an exception still propagates from `main` and the
interpreter prints it and finalizes as usual.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int | None) -> NoReturn:
    """End this process with exit status `code` (None → 0): flush the logging handlers, stdout and
    stderr, then `os._exit` without the interpreter's finalization (see the module docstring)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to flush into it
            pass
    os._exit(0 if code is None else int(code))


def process_running(pid: int) -> bool:
    """Whether process `pid` is alive here: it exists and is not a zombie (an exited process its parent
    has not reaped yet keeps its /proc entry — waiting on that would wait for the parent, not the run)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
