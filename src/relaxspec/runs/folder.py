"""A run folder's settings identity and the refusal of a folder that holds another run.

Every command that resumes (generate, eval's shards, bench, tune) stores its settings beside its
records with their hash; a later start with the same hash continues, one with another hash is
refused with the keys that changed unless ``--overwrite`` replaces the old records.
"""

from __future__ import annotations

import hashlib
import json

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


__all__ = ["changed_keys", "different_settings", "settings_hash", "stored"]
