"""Run folders, for every command that writes one: the one module that opens, resumes, replaces,
locks and refuses them.

Every command that resumes by its settings (generate and eval's shards, bench and its shard merge,
tune) opens its folder with :func:`open_run` and its :class:`RunKind`: the settings are stored
beside the records with their hash; a later start with the same hash continues, one with another
hash is refused with the keys that changed unless ``--overwrite`` replaces the old run. The
training recipes keep a ``train_state.pt`` instead and continue with ``--resume``
(:func:`fresh_or_resume`). Every command that writes a folder holds it (:func:`hold_folder`) from
before it reads the old records to its last write, so two runs never mix one folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from relaxspec import __version__
from relaxspec.errors import RelaxspecError
from relaxspec.files import read_json


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


# ------------------------------------------------------------------------------------------
# Opening a run folder: continue the run of the same settings, refuse another, or replace it
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunKind:
    """How one command keeps its runs in a folder.

    Args:
        what: what a refusal calls such a run (``"a run"``, ``"a benchmark"``, ``"a tuning run"``).
        meta: the file holding the run's ``settings`` and their ``settings_hash``.
        state: what a refusal calls that file when this code did not write it.
        owned: the files (or folders) the run writes besides ``meta``: without ``meta`` they are
            another run's leftovers (refused), and ``--overwrite`` removes them.
        problem: what is wrong with a ``meta`` read back, beyond a settings hash (``None``: nothing).
    """

    what: str
    meta: str
    state: str
    owned: tuple[str, ...] = ()
    problem: Callable[[dict], str | None] | None = None


def _meta_problem(kind: RunKind, meta) -> str | None:
    if not isinstance(meta, dict):
        return "not a JSON object"
    if not isinstance(meta.get("settings_hash"), str):
        return "no settings_hash"
    return kind.problem(meta) if kind.problem is not None else None


def open_run(out, kind: RunKind, settings: dict, *, overwrite: bool = False, digest: str | None = None,
             clear: Callable[[Path, dict | None], None] | None = None) -> dict | None:
    """Open the folder ``out`` for a run of ``kind`` with ``settings`` (``digest``: their hash,
    by default :func:`settings_hash`): the saved ``meta`` of the run of the same settings, to
    continue; else ``None``, a fresh run (the folder made). Refused in one line unless
    ``overwrite``: a ``meta`` this code did not write, a run of other settings (the keys that
    changed), ``owned`` files without a ``meta``. Replacing a run removes its ``owned`` files, and
    ``clear(out, old_meta)`` removes what else it wrote (``old_meta`` ``None`` when unreadable)."""
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise RelaxspecError(f"--out {folder}: exists and is not a folder")
    digest = digest if digest is not None else settings_hash(settings)
    path = folder / kind.meta
    old = None
    if path.exists():
        try:
            old = read_json(path)
        except RelaxspecError:  # not JSON, not UTF-8 text, nested too deeply
            old, problem = None, "not JSON"
        else:
            problem = _meta_problem(kind, old)
        if problem is not None:
            if not overwrite:
                raise RelaxspecError(f"--out {folder}: {kind.meta} is not {kind.state} this relaxspec wrote "
                                     f"({problem}); remove it or pass --overwrite")
            old = None
        elif old["settings_hash"] == digest:
            return old
        elif not overwrite:
            raise different_settings(folder, kind.what, settings, old)
    else:
        leftovers = [name for name in kind.owned if (folder / name).exists()]
        if leftovers and not overwrite:
            raise RelaxspecError(f"--out {folder} holds {leftovers[0]} but no {kind.meta}; choose another folder or "
                                 "pass --overwrite")
    if clear is not None:
        clear(folder, old)
    for name in kind.owned:
        stale = folder / name
        if stale.is_dir():
            shutil.rmtree(stale)
        elif stale.exists():
            stale.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    return None


def run_meta(settings: dict, digest: str | None = None, **fields) -> dict:
    """What a run's ``meta`` file starts with: the relaxspec that wrote it, the settings' hash and
    the settings as stored, then ``fields``."""
    return {"relaxspec_version": __version__, "settings_hash": digest or settings_hash(settings),
            "settings": stored(settings), **fields}


# ------------------------------------------------------------------------------------------
# A training run's state (train_state.pt): a fresh run, or --resume
# ------------------------------------------------------------------------------------------

#: The file a training run keeps its state in (weights, optimizer, step, config).
TRAIN_STATE = "train_state.pt"


def save_train_state(out, state: dict) -> None:
    """``torch.save(state, out/train_state.pt)`` atomically. ``state`` must hold only what
    ``weights_only=True`` loads (tensors, numbers, strings, lists, dicts)."""
    path = Path(out) / TRAIN_STATE
    temp = path.with_name(TRAIN_STATE + ".tmp")
    torch.save(state, temp)
    os.replace(temp, path)


def read_train_state(out, version: int, what: str) -> dict:
    """``out/train_state.pt``, loaded with ``weights_only=True``; ``what`` names the recipe in the
    error for a file of another recipe or version."""
    path = Path(out) / TRAIN_STATE
    if not path.is_file():
        raise RelaxspecError(f"{path}: no training state to resume from")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise RelaxspecError(f"{path}: cannot be read ({err.strerror or err})") from None
    except Exception:  # noqa: BLE001 - any other failure means "not our training state"
        # torch's own message advises loading with weights_only=False, which would run whatever code
        # the pickle holds: never pass that on (REFERENCE §2.3).
        raise RelaxspecError(f"{path}: not a relaxspec training state, or it cannot be read safely (a training "
                             f"state holds only tensors, numbers, strings, lists and dicts)") from None
    if not isinstance(state, dict) or state.get("format_version") != version or state.get("recipe", what) != what:
        raise RelaxspecError(f"{path}: not a relaxspec {what} training state (version {version})")
    return state


def fresh_or_resume(out, resume: bool, version: int, what: str) -> dict | None:
    """A training run's saved state when resuming; ``None`` for a fresh run, which must not
    overwrite one."""
    if resume:
        return read_train_state(out, version, what)
    if (Path(out) / TRAIN_STATE).exists():
        raise RelaxspecError(f"{out} already holds a training run; pass --resume to continue it or choose another --out")
    return None


__all__ = ["LOCK_FILE", "TRAIN_STATE", "RunKind", "changed_keys", "different_settings", "fresh_or_resume", "hold_folder",
           "open_run", "read_train_state", "run_meta", "save_train_state", "settings_hash", "stored"]
