"""The emoji data set, built from a tiny synthetic stand-in for the npm package (no npm in CI):
the split keeps each emoji and its skin-tone variants together, the build is byte-for-byte
reproducible, a missing package is one clear line, class names resolve, augmentation is seeded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaxspec.cli.train import add_data_parser
from relaxspec.data import emoji as emoji_data
from relaxspec.data.emoji import (
    INSTALL_COMMAND,
    NO_FLIP,
    PACKAGE,
    augment,
    build_emoji_dataset,
    find_package,
    flippable,
    load_classes,
    load_split,
    resolve_classes,
)
from relaxspec.errors import RelaxspecError

from helpers.data import FAKE_CLASSES, make_fake_package  # noqa: E402


@pytest.fixture
def package(tmp_path: Path) -> Path:
    return make_fake_package(tmp_path / "npm")


# ---------------------------------------------------------------------------------- building


def test_split_keeps_each_emoji_with_its_variants(tmp_path, package) -> None:
    summary = build_emoji_dataset(tmp_path / "out", tmp_path / "npm", size=8, progress=False)
    train, val = load_split(tmp_path / "out", "train"), load_split(tmp_path / "out", "val")
    assert train.images.shape[1:] == (8, 8, 3) and train.images.dtype == np.uint8 and train.labels.dtype == np.int64
    assert not set(train.bases) & set(val.bases)  # no base emoji on both sides ...
    for split in (train, val):  # ... and every variant sits with its base
        for name, base in zip(split.names, split.bases):
            if "/" in name:
                assert base in {b for n, b in zip(split.names, split.bases) if "/" not in n}
    # 30 base emoji (the one without a Google image is skipped); 4 + 4 + 3 of them have 2 variants
    assert len(train) + len(val) == 30 + 22 and summary["train"] + summary["val"] == 52
    # per class, round(10%) of the base emoji: 1 of 10, 1 of 12, 1 of 8
    assert summary["val_emoji"] == 3 and sorted(set(val.labels.tolist())) == [0, 1, 2]
    names = load_classes(tmp_path / "out")
    assert names == sorted(FAKE_CLASSES)  # ids are indices in sorted order
    meta = json.loads((tmp_path / "out" / "classes.json").read_text())
    assert meta["num_classes"] == 3 and meta["null_class"] == 3
    for entry in meta["classes"]:
        assert entry["train"] == int((train.labels == entry["id"]).sum())
        assert entry["val"] == int((val.labels == entry["id"]).sum())
    for label, name in zip(train.labels, train.names):  # labels are the subcategories
        assert name.split("/")[0].rsplit("-", 1)[0] == names[label]
    source = (tmp_path / "out" / "SOURCE.md").read_text()
    assert "Apache License 2.0" in source and "MIT" in source and INSTALL_COMMAND in source


def test_build_is_reproducible(tmp_path, package) -> None:
    build_emoji_dataset(tmp_path / "a", package, size=8, progress=False)
    build_emoji_dataset(tmp_path / "b", package, size=8, progress=False)
    for name in ("train.npz", "val.npz", "classes.json", "SOURCE.md"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    build_emoji_dataset(tmp_path / "c", package, size=8, seed=1, progress=False)
    assert (tmp_path / "c" / "val.npz").read_bytes() != (tmp_path / "a" / "val.npz").read_bytes()


def test_images_are_composited_on_white(tmp_path) -> None:
    from PIL import Image

    package = make_fake_package(tmp_path / "npm", {"food-fruit": 1})
    clear = np.zeros((16, 16, 4), dtype=np.uint8)
    clear[4:12, 4:12] = (255, 0, 0, 255)
    Image.fromarray(clear, "RGBA").save(package / "img" / "google" / "64" / "1f401.png")
    build_emoji_dataset(tmp_path / "out", package, size=16, val_fraction=0.0, progress=False)
    image = load_split(tmp_path / "out", "train").images[0]
    assert (image[0, 0] == 255).all() and tuple(image[8, 8]) == (255, 0, 0)


def test_missing_or_wrong_package_is_one_clear_line(tmp_path, monkeypatch) -> None:
    with pytest.raises(RelaxspecError, match="npm install --no-audit --no-fund emoji-datasource-google@16.0.0") as err:
        build_emoji_dataset(tmp_path / "out", tmp_path / "nowhere", progress=False)
    assert "\n" not in str(err.value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(emoji_data, "_npm_global_root", lambda: None)
    with pytest.raises(RelaxspecError, match="not in ./node_modules"):
        find_package()
    make_fake_package(tmp_path)  # ./node_modules/emoji-datasource-google is found without --source
    assert find_package() == tmp_path / "node_modules" / PACKAGE
    make_fake_package(tmp_path / "old", version="15.1.2")
    with pytest.raises(RelaxspecError, match="version '15.1.2'"):
        find_package(tmp_path / "old")


def test_cli_builds_the_data(tmp_path, package, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_data_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", "--source", str(package), "--out", str(tmp_path / "d"), "--size", "8",
                              "--no-progress"])
    assert args.handler(args) == 0
    assert json.loads(capsys.readouterr().out)["classes"] == 3
    assert (tmp_path / "d" / "train.npz").is_file()


# ---------------------------------------------------------------------------------- classes


def test_class_names_resolve_to_ids() -> None:
    names = ["alphanum", "animal-mammal", "sky & weather"]
    assert resolve_classes("animal-mammal", names) == [1]
    assert resolve_classes("Animal_Mammal, 0,sky-&-weather", names) == [1, 0, 2]
    assert resolve_classes(["sky & weather", 1], names) == [2, 1]
    with pytest.raises(RelaxspecError, match="did you mean animal-mammal"):
        resolve_classes("animal-mamal", names)
    with pytest.raises(RelaxspecError, match="out of range"):
        resolve_classes("3", names)
    with pytest.raises(RelaxspecError, match="no classes"):
        resolve_classes(" , ", names)


def test_embedded_classes_resolve_by_name() -> None:
    assert emoji_data.EMBEDDED_CLASSES.is_file()  # shipped with the embedded model
    names = load_classes()
    assert resolve_classes("animal-mammal", names) == [names.index("animal-mammal")]


# ---------------------------------------------------------------------------------- augmentation


def test_augment_shifts_on_white_and_flips_only_where_allowed() -> None:
    images = torch.arange(2 * 6 * 6 * 3, dtype=torch.int64).remainder(200).to(torch.uint8).reshape(2, 6, 6, 3)
    may_flip = torch.tensor([True, False])
    out = augment(images, may_flip, torch.Generator().manual_seed(0), max_shift=2)
    assert out.shape == images.shape and out.dtype == torch.uint8
    assert torch.equal(out, augment(images, may_flip, torch.Generator().manual_seed(0), max_shift=2))
    # no shift: only flips, and never of the second image
    for seed in range(20):
        out = augment(images, may_flip, torch.Generator().manual_seed(seed), max_shift=0)
        assert torch.equal(out[1], images[1])
        assert torch.equal(out[0], images[0]) or torch.equal(out[0], images[0].flip(1))
    # a shift uncovers white: pixels with value 255 never occur in the input
    shifted = [augment(images, may_flip, torch.Generator().manual_seed(s), max_shift=2) for s in range(10)]
    assert any((s == 255).any() for s in shifted)
    assert flippable(["food-fruit", "country-flag"]).tolist() == [True, False] and "alphanum" in NO_FLIP
