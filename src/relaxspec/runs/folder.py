"""A run folder's settings identity, the refusal of a folder that holds another run, and the
lock a run holds on its folder.

Every command that resumes (generate, eval's shards, bench, tune) stores its settings beside its
records with their hash; a later start with the same hash continues, one with another hash is
refused with the keys that changed unless ``--overwrite`` replaces the old records. Every command
that writes a folder holds it (:func:`hold_folder`) from before it reads the old records to its
last write, so two runs never mix one folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from relaxspec import __version__
from relaxspec.errors import RelaxspecError


def stored(settings: dict) -> dict:
    """``settings`` as a JSON file stores them (tuples as lists, paths and other objects as text)."""
    return json.loads(json.dumps(settings, default=str))


def settings_hash(settings: dict) -> str:
    """The identity of a run's settings: 16 hex digits of the SHA-256 of their sorted JSON."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def changed_keys(now: dict, before) -> list[str]:
    """The top-level keys whose values differ between ``now`` and the stored ``before``."""
    before = before if isinstance(before, dict) else {}
    now = stored(now)
    return sorted(key for key in set(now) | set(before) if now.get(key) != before.get(key))


def different_settings(out, what: str, now: dict, old: dict | None, *, settings_key: str = "settings") -> RelaxspecError:
    """The one-line refusal of ``--out`` holding ``what`` (``"a run"``, ``"a benchmark"``) made with
    other settings: the keys that changed, and the relaxspec that wrote it when another did."""
    old = old if isinstance(old, dict) else {}
    changed = changed_keys(now, old.get(settings_key))
    version = old.get("relaxspec_version")
    by = f"; written by relaxspec {version}" if isinstance(version, str) and version != __version__ else ""
    return RelaxspecError(f"--out {out} holds {what} with different settings (changed: {', '.join(changed) or '?'}"
                          f"{by}); choose another folder or pass --overwrite")




#: The file a running command holds locked in its output folder.
LOCK_FILE = ".lock"


@contextlib.contextmanager
def hold_folder(out, command: str):
    """Hold the folder ``out`` for one run of ``command``: a second run given the same folder while
    this one lives is refused in one line (its writes would interleave with this run's). The
    lock is the operating system's (``flock``) on ``out/.lock``, so a killed run leaves no stale
    lock: the file stays, the lock goes with the process."""
    import fcntl

    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise RelaxspecError(f"--out {folder}: exists and is not a folder")
    folder.mkdir(parents=True, exist_ok=True)
    handle = open(folder / LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise RelaxspecError(f"--out {folder} is in use by another run ({holder}); wait for it to end or choose "
                                 "another folder") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"relaxspec {command}, pid {os.getpid()}")
        handle.flush()
        yield folder
    finally:
        handle.close()


__all__ = ["LOCK_FILE", "changed_keys", "different_settings", "hold_folder", "settings_hash", "stored"]
