"""`exit_rank` — how a learner pool rank's process ends (os._exit, no interpreter finalization):
the exit code is the one given, and what the rank printed or logged is not lost on the way out.
It is `areal_like.api.process.exit_now`, which every role (server, rollout worker, learner) ends with."""

from __future__ import annotations

import subprocess
import sys
import textwrap

RANK = textwrap.dedent("""
    import atexit, logging, logging.handlers, sys
    from areal_like.learner.parallel.spawn import exit_rank

    # a buffering handler: it writes its records when it is closed (logging's shutdown)
    buffered = logging.handlers.MemoryHandler(100, target=logging.FileHandler(sys.argv[1]))
    logging.basicConfig(handlers=[buffered], level=logging.INFO)
    logging.getLogger("rank").info("last log line")
    atexit.register(lambda: print("finalization ran"))
    sys.stdout.write("last line without a newline")  # block-buffered: stdout is a pipe
    exit_rank(7)
""")


def test_exit_rank_keeps_the_code_and_the_buffered_output_and_skips_finalization(tmp_path):
    log = tmp_path / "rank.log"
    p = subprocess.run([sys.executable, "-c", RANK, str(log)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 7, p.stderr
    assert p.stdout == "last line without a newline"  # flushed; the atexit handler never ran
    assert log.read_text() == "last log line\n"  # logging's handlers flushed and closed
