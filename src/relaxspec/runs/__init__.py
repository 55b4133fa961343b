"""Resumable run folders, one implementation for every command that writes one.

* :mod:`.folder`: a run's settings identity (a hash of everything that makes its records what
  they are), the one-line refusal of a folder holding another setting's records (with the keys
  that changed, and the relaxspec that wrote it), and ``--overwrite``.
* :mod:`.images`: an image run (``relaxspec generate`` and each of ``relaxspec eval``'s shards):
  PNGs, ``tokens.npy`` and ``stats.json``, written batch by batch so an interrupted run resumes
  without redoing or losing a finished image.

``relaxspec bench`` (:mod:`relaxspec.bench.run`) and ``relaxspec tune``
(:mod:`relaxspec.tuning`) keep their own records in their folders and check them with
:mod:`.folder`.
"""

from relaxspec.runs.folder import changed_keys, different_settings, settings_hash, stored

__all__ = ["changed_keys", "different_settings", "settings_hash", "stored"]
