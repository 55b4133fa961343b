"""Ship a ``relaxspec tune`` result of the embedded model as one of its presets (maintainers only).

    python benchmarks/ship_presets.py tune-exact/tune.json      # the exact preset (--method sd)
    python benchmarks/ship_presets.py tune-relaxed/tune.json    # the relaxed preset and default method

The preset's tree is copied to ``src/relaxspec/trees/emoji-exact.json`` (exact methods) or
``emoji-METHOD.json`` (a relaxed one, e.g. ``emoji-lantern.json``), and
``src/relaxspec/embedded/defaults.json`` gets the preset's setting as the model's preset of that
method name (a relaxed one also becomes the default method; the presets of the other relaxed
methods keep their own trees). Fields
equal to the registry's values are left out, and so is ``compile`` (the quick command must not
pay a compilation). The embedded model's card says which tune commands made them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from relaxspec import methods
from relaxspec.pipelines.presets import read_preset

ROOT = Path(__file__).resolve().parents[1] / "src" / "relaxspec"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("preset", help="tune.json of a relaxspec tune run of the embedded model")
    args = parser.parse_args()
    preset = read_preset(args.preset)
    fields = dict(preset["method"])
    name = fields.pop("method")
    relaxed = methods.resolve(name, fields).family.relaxed
    registry = methods.resolve(name).to_dict()
    shipped = {}
    draft = fields.get("draft")
    if isinstance(draft, str) and draft.endswith(".json"):
        tree = f"emoji-{name}" if relaxed else "emoji-exact"
        facts = json.loads(Path(draft).read_text())
        measured = preset.get("measured", {}).get("heldout") or {}
        speed = measured.get("speedup") or [None]
        record = {"paths": facts["paths"],
                  "about": f"chosen for the embedded emoji model on the project's 2-core CPU (1 thread) by "
                           f"`{preset.get('command')}` (docs/bench/tune-{'relaxed' if relaxed else 'exact'}/): "
                           f"{name} on it{', compiled,' if fields.get('compile') else ''} measured {speed[0]:.2f}x eager AR on "
                           "held-out classes" if speed[0] else "",
                  **{k: v for k, v in facts.items() if k not in ("paths", "about")}}
        (ROOT / "trees" / f"{tree}.json").write_text(json.dumps(record) + "\n")
        shipped.update(draft="static", tree=tree)
    settings = methods.settings()
    for key, value in fields.items():
        if key in ("draft", "compile") or (key in registry and registry[key] == value and key not in ("k", "delta")):
            continue
        if key not in registry and settings[key].default == value:
            continue
        shipped[key] = value
    path = ROOT / "embedded" / "defaults.json"
    defaults = json.loads(path.read_text())
    defaults["presets"][name] = shipped
    if relaxed:
        defaults["method"] = {"method": name}
    path.write_text(json.dumps(defaults, indent=2) + "\n")
    print(f"{path}: presets[{name!r}] = {shipped}" + (f"; default method {name}" if relaxed else ""))
    if shutil.which("git"):
        print("check: git diff src/relaxspec/embedded/defaults.json src/relaxspec/trees/")


if __name__ == "__main__":
    main()
