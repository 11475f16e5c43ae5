"""Another local account for the security tests (issue 24): uid/gid 65534 (nobody) via `setpriv`.

The tests run as root, which reads anything, so only a real second uid shows what file modes and
listeners allow. Directories the other account must reach live under `open_base_dir()` (pytest's
tmp_path sits in a 0700 /tmp/pytest-of-<user>/, which would hide everything behind its parent).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

NOBODY = 65534


def as_nobody(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run `argv` as uid/gid 65534 with no supplementary groups; skips the test where that cannot be done."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed: no second uid to test as")
    if os.geteuid() != 0:
        pytest.skip("switching to uid nobody needs root")
    return subprocess.run([setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                          capture_output=True, text=True, errors="replace", timeout=timeout)


def open_base_dir() -> str:
    """A new 0755 directory under /tmp: every account can traverse to what is made inside it (the caller
    removes it)."""
    base = tempfile.mkdtemp(prefix="areal_like-open-", dir="/tmp")
    os.chmod(base, 0o755)
    return base
