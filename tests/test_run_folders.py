"""Run folders written before LlamaGen became one family among the others (issue 44) still
resume: for the same command, today's code records the settings the older code recorded (golden
data made by that code, ``tests/data/runs/settings_before_44.json``), so their hash, what a
folder is resumed by, is the same. ``relaxspec.runs.folder.open_run`` is the one place that
compares it, for every command."""

from __future__ import annotations

import json
from pathlib import Path

from relaxspec import embedded
from relaxspec.cli import main

GOLDEN = json.loads((Path(__file__).parent / "data" / "runs" / "settings_before_44.json").read_text())


def normalised(value, key=None):
    """Settings with this machine's parts taken out: the embedded model's folder as ``{EMBEDDED}``
    and every file's identity as its size (its modification time is this checkout's)."""
    root = str(embedded.ROOT.resolve())
    if isinstance(value, dict):
        if key == "files":
            return {role: {name: [stamp[0]] for name, stamp in files.items()} if isinstance(files, dict) else files
                    for role, files in value.items()}
        return {k: normalised(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [normalised(v) for v in value]
    if isinstance(value, str) and value.startswith(root):
        return "{EMBEDDED}" + value[len(root):]
    return value


def test_generate_and_bench_record_what_they_recorded_before(tmp_path, capsys):
    assert main(["generate", "--classes", "heart,time,animal-mammal", "--method", "sjd", "--no-progress",
                 "--out", str(tmp_path / "gen")]) == 0, capsys.readouterr().err
    stats = json.loads((tmp_path / "gen" / "stats.json").read_text())
    assert normalised(stats["settings"]) == GOLDEN["generate"]
    assert main(["bench", "--classes", "1,2", "--methods", "sjd", "--no-plots", "--no-progress", "--warmup", "0",
                 "--out", str(tmp_path / "bench")]) == 0, capsys.readouterr().err
    settings = json.loads((tmp_path / "bench" / "settings.json").read_text())
    assert normalised(settings["settings"]) == GOLDEN["bench"]
