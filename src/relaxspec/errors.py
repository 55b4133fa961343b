"""User-facing errors.

Everything a user can get wrong (a path, a model name, a sampling setting) raises
:class:`RelaxspecError` with one clear sentence; the CLI prints it on one line and exits 2.
:func:`shown` quotes what the user gave inside such a sentence, cut to a readable length (a
100 KB class name is not echoed whole).
"""

#: The most characters of a user's value a message quotes.
SHOWN_CHARS = 80


class RelaxspecError(ValueError):
    """Bad input from the user: a message meant to be read, never a traceback."""


class SaidByRankZero(RelaxspecError):
    """An error every process of a multi-process run meets alike (a bad setting, a folder in use):
    rank 0 says it; the others exit with it without repeating the line."""


class NotJoined(RelaxspecError):
    """The processes of a multi-process run did not all start: each process says so itself (rank 0
    may be the one missing)."""


class PeerLost(RelaxspecError):
    """Another process of a multi-process run stopped, so this one stops too. Its process group is
    broken: the command line says the line and leaves at once (tearing the group down can abort)."""


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)``, or its first ``limit`` characters and how long it was."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"
