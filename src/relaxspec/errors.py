"""User-facing errors.

Everything a user can get wrong (a path, a model name, a sampling setting) raises
:class:`RelaxspecError` with one clear sentence; the CLI prints it on one line and exits 2.
"""


class RelaxspecError(ValueError):
    """Bad input from the user: a message meant to be read, never a traceback."""
