"""The emoji data set: Noto Color Emoji images from the npm package ``emoji-datasource-google``.

Offline, small and class-labelled, which is what the embedded default model needs (a VQ tokenizer
and a class-conditional target trained on CPU). The source is one pinned npm package
(``emoji-datasource-google@16.0.0``: metadata MIT, Noto images Apache-2.0); nothing else is
downloaded. :func:`build_emoji_dataset` turns it into

* ``train.npz`` / ``val.npz``: ``images`` uint8 ``[n, size, size, 3]`` (RGBA composited on white,
  Pillow LANCZOS resize), ``labels`` int64 ``[n]``, ``names`` (short name, ``name/skin-tone`` for
  variants), ``codes`` (the image's code points) and ``bases`` (code points of its base emoji);
* ``classes.json``: class id -> subcategory name and per-split counts;
* ``SOURCE.md``: where the images come from and under which licences.

Classes are the package's subcategories (``animal-mammal``, ``food-fruit``, ...), sorted by name;
a class id is the index in that order. Skin-tone variants are labelled like their base emoji and
the 90/10 train/val split is drawn per class *by base emoji*, so an emoji and its variants always
land in the same split and the validation set measures generalisation to unseen emoji, not to
recoloured copies of training images. Everything is a pure function of the package and
``(size, val_fraction, seed)``: the same inputs give byte-identical files.

Every recipe reads the splits the same way: :func:`load_split` / :func:`load_data` return an
:class:`ImageSet`, and :func:`augment` (random shifts and mirror flips) is the one augmentation,
each recipe passing its padding and draw conventions explicitly.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from tqdm.auto import tqdm

from relaxspec.errors import RelaxspecError
from relaxspec.files import load_array
from relaxspec.conditions import class_ids

PACKAGE = "emoji-datasource-google"
VERSION = "16.0.0"
INSTALL_COMMAND = f"npm install --no-audit --no-fund {PACKAGE}@{VERSION}"
IMAGE_DIR = ("img", "google", "64")
SPLITS = ("train", "val")
#: The classes of the shipped model (written by ``relaxspec data``, copied next to the weights).
EMBEDDED_CLASSES = Path(__file__).resolve().parent.parent / "embedded" / "classes.json"


# ------------------------------------------------------------------------------------------
# Finding the package
# ------------------------------------------------------------------------------------------


def _is_package(folder: Path) -> bool:
    return (folder / "emoji.json").is_file() and folder.joinpath(*IMAGE_DIR).is_dir()


def _npm_global_root() -> Path | None:
    npm = shutil.which("npm")
    if npm is None:
        return None
    try:
        done = subprocess.run([npm, "root", "-g"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    root = done.stdout.strip()
    return Path(root) if done.returncode == 0 and root else None


def find_package(source: str | Path | None = None) -> Path:
    """The folder of ``emoji-datasource-google``: in ``source`` (the package folder itself, or a
    folder holding ``node_modules/`` or the package), else ``./node_modules``, else ``npm root -g``.

    Raises :class:`RelaxspecError` (one line naming the install command) when it is not found, and
    when the version found is not the pinned one (another version is another data set).
    """
    if source is not None:
        source = Path(source)
        candidates = [source, source / "node_modules" / PACKAGE, source / PACKAGE]
        where = str(source)
    else:
        candidates = [Path.cwd() / "node_modules" / PACKAGE]
        root = _npm_global_root()
        if root is not None:
            candidates.append(root / PACKAGE)
        where = "./node_modules or `npm root -g`"
    for folder in candidates:
        if _is_package(folder):
            _check_version(folder)
            return folder
    raise RelaxspecError(f"the emoji images ({PACKAGE}@{VERSION}) are not in {where}; install them with "
                         f"`{INSTALL_COMMAND}` and run again from that folder (or pass --source DIR)")


def _check_version(folder: Path) -> None:
    try:
        version = json.loads((folder / "package.json").read_text()).get("version")
    except (OSError, json.JSONDecodeError, AttributeError):
        version = None
    if version != VERSION:
        raise RelaxspecError(f"{folder}: found {PACKAGE} version {version!r}, but the data set is defined on "
                             f"{VERSION}; install it with `{INSTALL_COMMAND}`")


# ------------------------------------------------------------------------------------------
# The catalogue
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EmojiImage:
    """One image of the catalogue: a base emoji or one of its skin-tone variants."""

    name: str  # short name; "name/1f3fb" for a variant
    code: str  # the image's code points, e.g. "1F385-1F3FB"
    base: str  # the base emoji's code points (the split unit)
    subcategory: str
    file: str  # under img/google/64


def list_emoji(package: str | Path) -> list[EmojiImage]:
    """Every emoji (and skin-tone variant) of ``package`` that has a Google image, sorted by
    (subcategory, base code, code)."""
    package = Path(package)
    try:
        entries = json.loads((package / "emoji.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise RelaxspecError(f"{package / 'emoji.json'}: unreadable ({err})") from None
    if not isinstance(entries, list):
        raise RelaxspecError(f"{package / 'emoji.json'}: expected a list of emoji entries")
    images = package.joinpath(*IMAGE_DIR)
    found = []
    for entry in entries:
        try:
            base, short, subcategory = entry["unified"], entry["short_name"], entry["subcategory"]
        except (KeyError, TypeError):
            raise RelaxspecError(f"{package / 'emoji.json'}: an entry lacks unified / short_name / subcategory") from None
        variants = [(base, short, entry)]
        for key, variant in sorted((entry.get("skin_variations") or {}).items()):
            variants.append((variant.get("unified", f"{base}-{key}"), f"{short}/{key.lower()}", variant))
        for code, name, record in variants:
            if record.get("has_img_google") and record.get("image") and (images / record["image"]).is_file():
                found.append(EmojiImage(name, code, base, subcategory, record["image"]))
    if not found:
        raise RelaxspecError(f"{package}: no emoji with Google images found")
    return sorted(found, key=lambda e: (e.subcategory, e.base, e.code))


def split_by_base(emoji: list[EmojiImage], classes: list[str], val_fraction: float, seed: int) -> set[str]:
    """The base emoji held out for validation: per class, ``round(val_fraction * bases)`` of its
    base emoji drawn with a generator seeded ``seed`` (classes visited in id order)."""
    rng = np.random.default_rng(seed)
    held = set()
    for name in classes:
        bases = sorted({e.base for e in emoji if e.subcategory == name})
        count = math.floor(val_fraction * len(bases) + 0.5)
        held.update(bases[i] for i in rng.permutation(len(bases))[:count])
    return held


def load_image(path: str | Path, size: int) -> np.ndarray:
    """An emoji PNG composited on white and resized (LANCZOS) -> ``uint8 [size, size, 3]``."""
    try:
        with Image.open(path) as image:
            rgba = image.convert("RGBA")
    except (OSError, UnidentifiedImageError) as err:
        raise RelaxspecError(f"{path}: not a readable image ({err})") from None
    rgb = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), resample=Image.LANCZOS)
    return np.asarray(rgb, dtype=np.uint8)


# ------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------


def save_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez_compressed`` with fixed zip timestamps (byte-identical for identical arrays),
    written atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w") as archive:
        for name, array in arrays.items():
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.ascontiguousarray(array), allow_pickle=False)
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, buffer.getvalue())
    os.replace(tmp, path)


def build_emoji_dataset(out: str | Path, source: str | Path | None = None, *, size: int = 32,
                        val_fraction: float = 0.1, seed: int = 0, progress: bool = True) -> dict:
    """Write ``train.npz``, ``val.npz``, ``classes.json`` and ``SOURCE.md`` into ``out``; returns
    a summary (counts, classes, file hashes)."""
    if size < 1:
        raise RelaxspecError(f"size must be a positive number of pixels, got {size}")
    if not 0 <= val_fraction < 1:
        raise RelaxspecError(f"val_fraction must lie in [0, 1), got {val_fraction}")
    package = find_package(source)
    emoji = list_emoji(package)
    classes = sorted({e.subcategory for e in emoji})
    label_of = {name: i for i, name in enumerate(classes)}
    held = split_by_base(emoji, classes, val_fraction, seed)
    images_dir = package.joinpath(*IMAGE_DIR)
    pixels = [load_image(images_dir / e.file, size)
              for e in tqdm(emoji, desc="emoji", disable=not progress, leave=False)]

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    counts = {split: [0] * len(classes) for split in SPLITS}
    hashes = {}
    for split in SPLITS:
        rows = [i for i, e in enumerate(emoji) if (e.base in held) == (split == "val")]
        for i in rows:
            counts[split][label_of[emoji[i].subcategory]] += 1
        arrays = {
            "images": np.stack([pixels[i] for i in rows]) if rows else np.zeros((0, size, size, 3), np.uint8),
            "labels": np.array([label_of[emoji[i].subcategory] for i in rows], dtype=np.int64),
            "names": np.array([emoji[i].name for i in rows], dtype=np.str_),
            "codes": np.array([emoji[i].code for i in rows], dtype=np.str_),
            "bases": np.array([emoji[i].base for i in rows], dtype=np.str_),
        }
        save_npz(out / f"{split}.npz", arrays)
        hashes[split] = hashlib.sha256((out / f"{split}.npz").read_bytes()).hexdigest()
    meta = {
        "source": f"{PACKAGE}@{VERSION}",
        "image_size": size,
        "val_fraction": val_fraction,
        "seed": seed,
        "num_classes": len(classes),
        "null_class": len(classes),
        "classes": [{"id": i, "name": name, "train": counts["train"][i], "val": counts["val"][i]}
                    for i, name in enumerate(classes)],
    }
    (out / "classes.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "SOURCE.md").write_text(_source_text(meta, counts, hashes))
    return {"out": str(out), "package": str(package), "classes": len(classes),
            "train": sum(counts["train"]), "val": sum(counts["val"]),
            "train_emoji": len({e.base for e in emoji} - held), "val_emoji": len(held), "sha256": hashes}


def _source_text(meta: dict, counts: dict, hashes: dict) -> str:
    return f"""# Emoji data set

Built by `relaxspec data --size {meta['image_size']} --val-fraction {meta['val_fraction']} --seed {meta['seed']}` from the
npm package `{PACKAGE}@{VERSION}` (installed with `{INSTALL_COMMAND}`).

- Images: Noto Color Emoji (Google), `img/google/64/*.png`, composited on white and resized to
  {meta['image_size']}x{meta['image_size']} px with Pillow's LANCZOS filter. Licence: Apache License 2.0,
  https://github.com/googlefonts/noto-emoji/blob/main/LICENSE (as stated by the package's README).
- Metadata (`emoji.json`: names, categories, subcategories): emoji-data by Cal Henderson,
  https://github.com/iamcal/emoji-data, MIT License, Copyright (c) 2013 Cal Henderson.

Classes: the {meta['num_classes']} subcategories, sorted by name (see `classes.json`); skin-tone variants carry
their base emoji's class. Split: per class, {meta['val_fraction']:.0%} of the *base* emoji (variants follow
their base) go to validation, drawn with seed {meta['seed']}.

| split | images | sha256 |
|---|---|---|
| train | {sum(counts['train'])} | `{hashes['train']}` |
| val | {sum(counts['val'])} | `{hashes['val']}` |
"""


# ------------------------------------------------------------------------------------------
# Reading
# ------------------------------------------------------------------------------------------


@dataclass
class ImageSet:
    """A labelled image set, the one type every recipe reads (tokenizer, target, classifier).

    ``images`` uint8 ``[n, S, S, 3]``, ``labels`` int64 ``[n]`` (class ids), ``class_names`` (id ->
    name) when known, and for a ``relaxspec data`` split the emoji's ``names`` / ``bases`` (str
    ``[n]``). The arrays are NumPy as :func:`load_split` returns them; :meth:`tensors` gives the same
    set as torch tensors (sharing memory), which is what the training recipes index.
    """

    images: np.ndarray | torch.Tensor
    labels: np.ndarray | torch.Tensor
    class_names: list[str] | None = None
    names: np.ndarray | None = None
    bases: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def may_flip(self) -> np.ndarray | torch.Tensor:
        """bool ``[n]``, of the labels' kind: may each image be mirrored? By class name (see
        :data:`NO_FLIP`); every image when the class names are unknown."""
        if isinstance(self.labels, np.ndarray):
            if self.class_names is None:
                return np.ones(len(self.labels), dtype=bool)
            return flippable(list(self.class_names))[self.labels]

        if self.class_names is None:
            return torch.ones(len(self.labels), dtype=torch.bool)
        return torch.from_numpy(flippable(list(self.class_names)))[self.labels]

    def tensors(self) -> ImageSet:
        """The same set with ``images`` and ``labels`` as torch tensors (no copy)."""
        return replace(self, images=torch.as_tensor(self.images), labels=torch.as_tensor(self.labels))


def check_image_set(data: ImageSet, source: str = "data") -> ImageSet:
    """Validate shapes and dtypes (``images`` uint8 ``[n, S, S, 3]``, integer ``labels [n] >= 0``,
    a name for every class id used); labels become int64, arrays NumPy."""
    images, labels = np.asarray(data.images), np.asarray(data.labels)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise RelaxspecError(f"{source}: images must be uint8 [n, H, W, 3], got {images.dtype} {images.shape}")
    if images.shape[1] != images.shape[2]:
        raise RelaxspecError(f"{source}: images must be square, got {images.shape[1]}x{images.shape[2]}")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0] or not np.issubdtype(labels.dtype, np.integer):
        raise RelaxspecError(f"{source}: labels must be integers [n] with n = {images.shape[0]}, got {labels.dtype} {labels.shape}")
    if len(labels) and labels.min() < 0:
        raise RelaxspecError(f"{source}: class ids must be >= 0, got {labels.min()}")
    names = data.class_names
    if names is not None and len(labels) and labels.max() >= len(names):
        raise RelaxspecError(f"{source}: {len(names)} class names but labels go up to {labels.max()}")
    return replace(data, images=images, labels=labels.astype(np.int64))


def load_split(source: str | Path, split: str | None = None) -> ImageSet:
    """One split of a data set: ``source/{split}.npz`` (a folder ``relaxspec data`` wrote), or the
    ``.npz`` file ``source`` itself when ``split`` is None.

    The file holds ``images`` uint8 ``[n, S, S, 3]`` and ``labels`` int ``[n]``, and optionally
    ``class_names``, ``names`` and ``bases`` (:func:`build_emoji_dataset` writes the last two).
    Class names come from the ``classes.json`` beside the file when there is one (see
    :func:`load_classes`), else from its ``class_names`` array. Validated by
    :func:`check_image_set`."""
    path = Path(source) if split is None else Path(source) / f"{split}.npz"
    if not path.is_file():
        raise RelaxspecError(f"{path}: no such file; build the data set with `relaxspec data --out {path.parent}`")
    archive = load_array(str(path))
    if not isinstance(archive, dict):
        raise RelaxspecError(f"{path}: expected an .npz with arrays 'images' and 'labels', got a single .npy array")
    missing = [key for key in ("images", "labels") if key not in archive]
    if missing:
        raise RelaxspecError(f"{path}: needs arrays 'images' and 'labels' (has {', '.join(archive) or 'none'})")
    if (path.parent / "classes.json").is_file():
        class_names = load_classes(path.parent / "classes.json")
    elif "class_names" in archive:
        class_names = [str(n) for n in archive["class_names"]]
    else:
        class_names = None
    data = ImageSet(archive["images"], archive["labels"], class_names, archive.get("names"), archive.get("bases"))
    return check_image_set(data, str(path))


def load_data(folder: str | Path) -> tuple[ImageSet, ImageSet]:
    """The ``train`` and ``val`` splits of ``folder`` (:func:`load_split`), checked to hold images
    of one size."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RelaxspecError(f"{folder}: no such data folder (expected train.npz and val.npz in it)")
    train, val = (load_split(folder, split) for split in SPLITS)
    if train.images.shape[1:] != val.images.shape[1:]:
        raise RelaxspecError(f"{folder}: train images are {train.images.shape[1:]} but val images {val.images.shape[1:]}")
    return train, val


def load_classes(path: str | Path | None = None) -> list[str]:
    """Class names indexed by id, from a ``classes.json`` (or a folder holding one); by default
    the embedded model's."""
    path = Path(path) if path is not None else EMBEDDED_CLASSES
    if path.is_dir():
        path = path / "classes.json"
    try:
        meta = json.loads(path.read_text())
        entries = sorted(meta["classes"], key=lambda c: c["id"])
        names = [str(c["name"]) for c in entries]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise RelaxspecError(f"{path}: not a classes.json ({err})") from None
    if [c["id"] for c in entries] != list(range(len(names))):
        raise RelaxspecError(f"{path}: class ids must be 0 .. n-1")
    return names


def resolve_classes(spec: str | list, names: list[str]) -> list[int]:
    """Class ids for a comma-separated list of class names or ids (``"animal-mammal, 3"``):
    :func:`relaxspec.conditions.class_ids`, the one class check, over these names."""
    return class_ids(spec, len(names), names)


# ------------------------------------------------------------------------------------------
# Augmentation
# ------------------------------------------------------------------------------------------

#: Classes whose mirror image is a different or a wrong emoji: text and digits (alphanum, keycap,
#: punctuation, math, currency, the ©/™ of other-symbol, the signs' lettering, the "18" of
#: warning), flags (a mirrored flag is another or no country's), clock faces and zodiac glyphs.
#: Everything else (faces, people, animals, food, objects) stays itself when mirrored.
NO_FLIP = frozenset({"alphanum", "keycap", "punctuation", "math", "currency", "other-symbol", "transport-sign",
                     "warning", "zodiac", "time", "country-flag", "subdivision-flag", "flag"})


def flippable(names: list[str]) -> np.ndarray:
    """``bool [num_classes]``: may images of class ``i`` be mirrored (see :data:`NO_FLIP`)."""
    return np.array([name not in NO_FLIP for name in names], dtype=bool)


#: How :func:`augment` fills the border a shift uncovers: ``"white"`` (the background of every
#: emoji: 255, or 1.0 for float images in [-1, 1]) or ``"replicate"`` (the edge pixels extend).
PADDINGS = ("white", "replicate")


def augment(images, may_flip, generator, max_shift: int = 2, *, padding: str = "white", shift_order: str = "xy",
            draw_unused: bool = True):
    """Random translations by up to ``max_shift`` px and, where ``may_flip``, horizontal flips with
    probability 1/2: the one augmentation of every recipe.

    ``images`` ``[B, H, W, C]`` (torch; uint8, or float in [-1, 1]), ``may_flip`` bool ``[B]`` (or
    one bool for the batch), ``generator`` a ``torch.Generator``; returns ``[B, H, W, C]`` of the
    same dtype. ``padding`` (one of :data:`PADDINGS`) fills the uncovered border.

    The draws depend only on the generator, so a seeded generator gives the same batch: ``B``
    shifts per axis (the x axis first for ``shift_order="xy"``, the y axis first for ``"yx"``),
    then ``B`` flip coins. With ``draw_unused`` they are drawn whatever the settings (3 ``B`` draws
    per call); without it the shifts are not drawn when ``max_shift`` is 0, nor the coins when
    ``may_flip`` is ``False``. Each recipe passes the convention its seeded runs were made with."""
    if padding not in PADDINGS:
        raise RelaxspecError(f"padding must be one of {', '.join(PADDINGS)}, got {padding!r}")
    if shift_order not in ("xy", "yx"):
        raise RelaxspecError(f"shift_order must be 'xy' or 'yx', got {shift_order!r}")
    b, h, w, _ = images.shape
    if max_shift or draw_unused:
        first, second = (torch.randint(0, 2 * max_shift + 1, (b,), generator=generator) for _ in range(2))
        dx, dy = (first, second) if shift_order == "xy" else (second, first)
    flip = None
    if may_flip is not False or draw_unused:
        flip = (torch.rand(b, generator=generator) < 0.5) & torch.as_tensor(may_flip, dtype=torch.bool)
    if max_shift:
        rows = (dy[:, None] + torch.arange(h) - max_shift)[:, :, None]  # [B, H, 1] in the unpadded image
        cols = (dx[:, None] + torch.arange(w) - max_shift)[:, None, :]  # [B, 1, W]
        shifted = images[torch.arange(b)[:, None, None], rows.clamp(0, h - 1), cols.clamp(0, w - 1)]
        if padding == "white":
            outside = (rows < 0) | (rows >= h) | (cols < 0) | (cols >= w)  # [B, H, W]
            shifted.masked_fill_(outside[..., None], 255 if images.dtype == torch.uint8 else 1.0)
        images = shifted
    if flip is None:
        return images
    return torch.where(flip[:, None, None, None], images.flip(2), images)
