"""Copies of model folders with an edited config.json (tests of refusals)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def edited_folder(source: Path, folder: Path, *, files: tuple[str, ...] | None = None, **changes) -> Path:
    """``source`` copied to ``folder`` (all of it, or only ``files`` beside config.json) with
    config.json's keys set to ``changes`` (``None`` removes a key)."""
    folder.mkdir(parents=True, exist_ok=True)
    if files is None:
        shutil.copytree(source, folder, dirs_exist_ok=True)
    else:
        for name in files:
            shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder
