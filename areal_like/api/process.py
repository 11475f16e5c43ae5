"""How a role's process ends once its `main` returned (no torch, no asyncio).

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
