"""Files: atomic writes (a reader never sees half a file; an interrupted job leaves the last
good copy), PNGs and grids, checkpoint identities, and NumPy array inputs read without pickles."""

from __future__ import annotations

import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from relaxspec.errors import RelaxspecError, shown

GRID_FILE = "grid.png"


def read_prompts_file(path: str | Path) -> list[str]:
    """The prompts of ``--prompts-file``: a ``.json`` file is a captions file
    (:func:`read_captions_json`: MS-COCO's annotations, or a JSON list or object of captions);
    any other file holds one prompt per line, blank lines skipped, UTF-8 (a byte-order mark is not
    part of the first prompt)."""
    path = Path(path)
    if not path.is_file():
        raise RelaxspecError(f"--prompts-file {path}: no such file")
    if path.suffix.lower() == ".json":
        return read_captions_json(path)
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError:
        raise RelaxspecError(f"--prompts-file {path}: not UTF-8 text") from None
    return [line for line in lines if line.strip()]


# ------------------------------------------------------------------------------------------
# Caption files the text-to-image papers evaluate on, read as prompts:
# * MS-COCO's annotations (``captions_val2017.json``: ``{"annotations": [{"image_id", "id",
#   "caption"}, ...], "images": [...]}``): one caption per image, the image's first caption in the
#   file's order (pycocotools' first: ``coco.imgToAnns`` keeps file order), images sorted by
#   ``image_id`` so the first N prompts are the same subset whatever order the file lists its
#   images in. val2017 gives 5,000 prompts.
# * A JSON list of caption strings, in order: LANTERN's ``captions_val2017_longest.json`` (the
#   longest caption of each image) reads as is.
# * A JSON object whose values are caption strings, in the file's order.
# ------------------------------------------------------------------------------------------
FORMATS = ('a COCO captions file ({"annotations": [{"image_id": ..., "caption": ...}, ...]}), or a JSON list or '
           'object of caption strings')


def _caption(value, where: str) -> str:
    if not isinstance(value, str):
        raise RelaxspecError(f"{where} is not text; {FORMATS}")
    if not value.strip():
        raise RelaxspecError(f"{where} is empty")
    return value  # as written, as the papers' code passes it


def coco_captions(data: dict, where: str) -> list[str]:
    """The first caption of every image in COCO's annotations, images sorted by ``image_id``."""
    annotations = data["annotations"]
    if not isinstance(annotations, list) or not annotations:
        raise RelaxspecError(f"{where}: 'annotations' is not a non-empty list; {FORMATS}")
    first: dict = {}
    for n, entry in enumerate(annotations):
        if not isinstance(entry, dict) or "image_id" not in entry or "caption" not in entry:
            raise RelaxspecError(f"{where}: annotation {n} has no 'image_id' and 'caption'; {FORMATS}")
        image = entry["image_id"]
        if isinstance(image, bool) or not isinstance(image, (int, str)):
            raise RelaxspecError(f"{where}: annotation {n}'s image_id is not an integer or a string")
        caption = _caption(entry["caption"], f"{where}: annotation {n}'s caption")
        first.setdefault(image, caption)
    if len({type(image) for image in first}) > 1:
        raise RelaxspecError(f"{where}: image_ids mix integers and strings")
    return [first[image] for image in sorted(first)]


def read_captions_json(path: str | Path, flag: str = "--prompts-file") -> list[str]:
    """The prompts of a captions JSON file (the formats above), in order; one-line errors."""
    where = f"{flag} {path}"
    data = read_json(path, where)
    if isinstance(data, dict) and "annotations" in data:
        captions = coco_captions(data, where)
    elif isinstance(data, list):
        captions = [_caption(value, f"{where}: entry {n}") for n, value in enumerate(data)]
    elif isinstance(data, dict):
        captions = [_caption(value, f"{where}: entry {shown(key)}") for key, value in data.items()]
    else:
        raise RelaxspecError(f"{where}: not a captions file; {FORMATS}")
    if not captions:
        raise RelaxspecError(f"{where}: no captions in the file")
    return captions



def read_json(path: str | Path, what: str | None = None):
    """A JSON file's value; one-line errors for a missing or unreadable file and for anything that
    is not JSON text (binary data, bad UTF-8, nesting deeper than the parser goes). ``what``:
    how the message names the file (default: its path)."""
    path = Path(path)
    what = what or str(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RelaxspecError(f"{what}: no such file") from None
    except IsADirectoryError:
        raise RelaxspecError(f"{what}: a folder, not a JSON file") from None
    except UnicodeDecodeError:
        raise RelaxspecError(f"{what}: not JSON (not UTF-8 text)") from None
    except RecursionError:
        raise RelaxspecError(f"{what}: not JSON this reader takes (nested too deeply)") from None
    except ValueError as err:
        raise RelaxspecError(f"{what}: not JSON ({err})") from None


def write_atomic(path: Path, write) -> None:
    """``write(temp_path)`` then rename over ``path``: readers never see a half-written file."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    if path.is_dir():  # the rename would fail naming the temporary file
        raise RelaxspecError(f"{path}: is a folder where a file is written; move it away")
    try:
        write(temp)
        os.replace(temp, path)
    finally:
        if temp.exists():
            temp.unlink()


def write_json(path: Path, data: dict) -> None:
    write_atomic(path, lambda temp: temp.write_text(json.dumps(data, indent=2) + "\n"))


def write_png(path: Path, pixels: np.ndarray) -> None:
    """``pixels [H, W, 3]`` uint8."""
    write_atomic(path, lambda temp: Image.fromarray(pixels).save(temp, format="PNG"))


def png_is_whole(path: Path) -> bool:
    """Whether ``path`` is a PNG read to its end without error (a file cut short by a crash or a
    full disk is not: a resumed run draws that image again)."""
    try:
        with Image.open(path) as image:
            image.load()
        return True
    except (OSError, SyntaxError, ValueError):
        return False


def grid_shape(count: int, max_aspect: int = 3) -> tuple[int, int]:
    """``(rows, cols)`` for ``count`` images: the fewest empty cells among layouts no wider than
    ``max_aspect`` times their height, then the squarest (8 images: 2 x 4, not 3 x 3 with an
    empty ninth cell; 5: 2 x 3, whose one empty cell shows the background)."""
    best = None
    for cols in range(math.ceil(math.sqrt(count)), count + 1):
        rows = math.ceil(count / cols)
        if cols > max_aspect * rows:
            break
        key = (rows * cols - count, cols / rows)
        if best is None or key < best[0]:
            best = (key, (rows, cols))
    return best[1] if best else (1, count)


def write_grid(out: Path, files: list[str], padding: int = 2, name: str = GRID_FILE,
               max_side: int = 8192) -> None:
    """``out/name``: a grid of the PNGs ``out/files`` (:func:`grid_shape`) on a black background
    (like torchvision's save_image); cells nobody fills show the background. A grid wider or
    taller than ``max_side`` pixels takes every n-th pixel of each image (nearest neighbour), so
    large upscaled images never make a grid too large to write."""
    if not files:
        return
    images = []
    for file in files:
        with Image.open(out / file) as image:
            images.append(np.asarray(image.convert("RGB")))
    rows, cols = grid_shape(len(images))
    height, width = images[0].shape[:2]
    step = max(1, math.ceil(max(cols * width, rows * height) / max_side))
    if step > 1:
        images = [image[::step, ::step] for image in images]
        height, width = images[0].shape[:2]
    grid = np.zeros((rows * (height + padding) + padding, cols * (width + padding) + padding, 3), dtype=np.uint8)
    for n, image in enumerate(images):
        r, c = divmod(n, cols)
        top, left = padding + r * (height + padding), padding + c * (width + padding)
        grid[top : top + height, left : left + width] = image[:height, :width]
    write_png(out / name, grid)


def file_identity(path: str) -> dict:
    """Enough to notice that a checkpoint was replaced: resolved path, size and mtime (per file
    for a model folder)."""
    path_ = Path(path)
    files = sorted(p for p in path_.iterdir() if p.is_file()) if path_.is_dir() else [path_]
    return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def missing_file(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a file one can read, in a few words (``None`` when it is one): what is
    there is named -- a folder, a named pipe, a device, a socket -- not "no such file" (a FIFO or
    /dev/zero would block or never end as a file read)."""
    path = Path(path)
    if path.is_file():
        return None
    for kind, said in ((Path.is_dir, "a folder"), (Path.is_fifo, "a named pipe (FIFO)"),
                       (Path.is_char_device, "a device"), (Path.is_block_device, "a device"),
                       (Path.is_socket, "a socket")):
        if kind(path):
            return f"is {said}, not a file"
    return "no such file"


NUMPY_MAGIC = b"\x93NUMPY"


def load_array(path: str) -> np.ndarray | dict:
    """A ``.npy`` array or an ``.npz``'s arrays as a dict, refusing pickles (object arrays) and
    anything that is not a NumPy array file, each with one clear message."""
    if missing_file(path):
        raise RelaxspecError(f"{path}: {missing_file(path)}")
    with open(path, "rb") as handle:
        magic = handle.read(6)
    if magic != NUMPY_MAGIC and not magic.startswith(b"PK"):
        raise RelaxspecError(f"{path}: not a .npy / .npz array file")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                return {key: loaded[key] for key in loaded.files}
        return loaded
    except ValueError as err:
        if "allow_pickle" in str(err):  # object arrays are pickles: refused, as everywhere else
            raise RelaxspecError(f"{path}: refusing to load: the array holds Python objects (a pickle); "
                                 "save plain float / bool arrays") from None
        raise RelaxspecError(f"{path}: not a readable .npy / .npz file ({err})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise RelaxspecError(f"{path}: not a readable .npy / .npz file ({err})") from None


def load_caption_features(path: str, mask_path: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``.npy`` features ``[N, C, D]`` (+ optional ``.npy`` mask ``[N, C]``), or ``.npz`` with
    ``features`` and optional ``mask``."""
    data = load_array(path)
    mask = None
    if isinstance(data, dict):
        if "features" not in data:
            raise RelaxspecError(f"{path}: an .npz of captions needs an array named 'features' (and optionally 'mask')")
        features, mask = data["features"], data.get("mask")
    else:
        features = data
    if mask_path:
        mask = load_array(mask_path)
        if isinstance(mask, dict):
            raise RelaxspecError(f"{mask_path}: expected a .npy array [N, tokens]")
    if features.ndim != 3 or not np.issubdtype(features.dtype, np.floating):
        raise RelaxspecError(f"{path}: caption features must be a float array [N, tokens, dim], "
                             f"got {features.dtype} {features.shape}")
    if features.shape[0] == 0:
        raise RelaxspecError(f"{path}: no captions in the file")
    mask_t = None
    if mask is not None:
        if mask.ndim != 2 or not (mask.dtype == bool or np.issubdtype(mask.dtype, np.integer)):
            raise RelaxspecError(f"caption mask must be a bool or integer array [N, tokens], got {mask.dtype} {mask.shape}")
        mask_t = torch.from_numpy(np.ascontiguousarray(mask != 0))
    return torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)), mask_t
