"""`areal_like.api.process.exit_now`: a role that ends without the interpreter's finalization still
leaves everything it wrote — buffered stdout and stderr, a logging handler's file — and its exit status."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_now_flushes_streams_and_log_files_and_keeps_the_status(tmp_path):
    log_file = tmp_path / "role.log"
    script = textwrap.dedent(f"""
        import logging, sys
        from areal_like.api.process import exit_now
        log = logging.getLogger("role")
        log.addHandler(logging.FileHandler({str(log_file)!r}))
        log.setLevel(logging.INFO)
        log.info("last line of the role's log")
        sys.stdout.write("partial stdout line without newline")   # still in the buffer (a pipe)
        sys.stderr.write("stderr tail")
        exit_now(3)
        print("never reached")
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3
    assert p.stdout == "partial stdout line without newline"
    assert p.stderr.endswith("stderr tail")
    assert log_file.read_text() == "last line of the role's log\n"


def test_exit_now_with_none_is_success():
    p = subprocess.run([sys.executable, "-c", "from areal_like.api.process import exit_now; exit_now(None)"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
