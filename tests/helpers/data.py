"""A fake emoji-datasource package and the data set built from it (what the recipe tests train on)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from relaxspec.data.emoji import PACKAGE, VERSION, build_emoji_dataset

#: subcategory -> number of base emoji in the fake package.
FAKE_CLASSES = {"food-fruit": 10, "animal-mammal": 12, "alphanum": 8}


def make_fake_package(root: Path, classes: dict[str, int] = FAKE_CLASSES, version: str = VERSION,
                      image_size: int = 16) -> Path:
    """Write ``root/node_modules/emoji-datasource-google`` with ``emoji.json``, ``package.json`` and
    small RGBA PNGs; every third emoji has two skin-tone variants, one entry has no Google image."""
    from PIL import Image

    package = root / "node_modules" / PACKAGE
    images = package / "img" / "google" / "64"
    images.mkdir(parents=True)
    (package / "package.json").write_text(json.dumps({"name": PACKAGE, "version": version}))
    rng = np.random.default_rng(0)
    entries, code = [], 0x1F400

    def png(name: str) -> str:
        pixels = rng.integers(0, 256, (image_size, image_size, 4), dtype=np.uint8)
        pixels[..., 3] = np.where(rng.random((image_size, image_size)) < 0.3, 0, 255)  # some transparency
        Image.fromarray(pixels, "RGBA").save(images / name)
        return name

    for subcategory, count in classes.items():
        for i in range(count):
            code += 1
            unified = f"{code:X}"
            entry = {"unified": unified, "short_name": f"{subcategory}-{i}", "subcategory": subcategory,
                     "category": "Test", "image": png(f"{unified.lower()}.png"), "has_img_google": True}
            if i % 3 == 0:
                entry["skin_variations"] = {
                    tone: {"unified": f"{unified}-{tone}", "image": png(f"{unified.lower()}-{tone.lower()}.png"),
                           "has_img_google": True}
                    for tone in ("1F3FB", "1F3FF")
                }
            entries.append(entry)
    entries.append({"unified": "1F9FF", "short_name": "no-image", "subcategory": "food-fruit", "category": "Test",
                    "image": "1f9ff.png", "has_img_google": False})
    (package / "emoji.json").write_text(json.dumps(entries))
    return package


def build_fake_dataset(tmp_path: Path, size: int = 8, classes: dict[str, int] = FAKE_CLASSES) -> Path:
    """A built data set (``tmp_path/data``) from a fake package; what the recipe tests train on."""
    make_fake_package(tmp_path / "npm", classes)
    build_emoji_dataset(tmp_path / "data", tmp_path / "npm", size=size, progress=False)
    return tmp_path / "data"
