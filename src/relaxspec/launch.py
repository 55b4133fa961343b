"""The ``relaxspec`` script and ``python -m relaxspec``: the command line, started so that a Ctrl-C
while it loads (importing torch takes seconds) ends in one line, as one later does, not in a
traceback of the imports."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from relaxspec.cli import main as command_line
    except KeyboardInterrupt:
        print("relaxspec: interrupted while starting", file=sys.stderr)
        return 130
    return command_line()


__all__ = ["main"]
