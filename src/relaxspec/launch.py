"""The ``relaxspec`` script and ``python -m relaxspec``: the command line, started so that a Ctrl-C
while it loads (importing torch takes seconds) ends in one line, as one later does, not in a
traceback of the imports, and so that torch's OpenMP threads sleep while they wait (below)."""

from __future__ import annotations

import os
import sys

#: OpenMP's wait policy for the command's process, unless the environment sets one. By default a
#: thread that reaches an op's barrier first spins; when another process holds one of the cores the
#: team's slowest thread waits for it, and the spinning threads take the time from it. With another
#: torch process busy on each of this machine's two cores, a 4.8M-parameter LlamaGen image took
#: 19.8 s on two threads with the default policy, 11.6 s with ``PASSIVE`` (10.7 s on one thread);
#: on the idle machine the two were alike (medians of six runs, 8.0 s and 7.6 s). It must be set
#: before torch loads its OpenMP runtime, hence here.
WAIT_POLICY = "PASSIVE"


def main() -> int:
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    try:
        from relaxspec.cli import main as command_line
    except KeyboardInterrupt:
        print("relaxspec: interrupted while starting", file=sys.stderr)
        return 130
    return command_line()


__all__ = ["main"]
