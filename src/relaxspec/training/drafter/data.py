"""Where the drafter's training sequences come from: token files, the target's own samples, and
image folders encoded with a VQ model, gathered into one :class:`DrafterDataset`."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm
from PIL import Image, UnidentifiedImageError

from relaxspec.decoding.ar import generate_ar
from relaxspec.errors import RelaxspecError
from relaxspec.models.base import TargetModel, TeacherForcedTarget
from relaxspec.models.llamagen.vq import VQModel
from relaxspec.sampling import SamplingConfig
from relaxspec.training import common
from relaxspec.training.drafter.config import SELF_SAMPLES, DrafterTrainConfig
from relaxspec.training.drafter.cache import SampleCache

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass
class DrafterDataset:
    """Image-token sequences ``tokens [n, N]`` (int64) and their conditions ``labels``: class ids
    ``[n]``, or for a prompt-conditioned target its formatted prompts ``[n, ...]`` (token ids, or a
    LlamaGen t2i model's caption features) with ``cond_mask [n, C]`` where the engine masks them."""

    tokens: torch.Tensor
    labels: torch.Tensor
    cond_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens)
        self.labels = torch.as_tensor(self.labels)
        if self.labels.ndim <= 1:
            self.labels = self.labels.reshape(-1)
        if self.tokens.dtype.is_floating_point or self.tokens.dtype == torch.bool or self.tokens.ndim != 2:
            raise RelaxspecError(f"tokens must be an integer array [n, N], got {self.tokens.dtype} {tuple(self.tokens.shape)}")
        if self.labels.dtype == torch.bool or (self.labels.ndim == 1 and self.labels.dtype.is_floating_point):
            raise RelaxspecError(f"labels must be integer class ids, got {self.labels.dtype}")
        if self.labels.shape[0] != self.tokens.shape[0]:
            raise RelaxspecError(f"{self.tokens.shape[0]} token sequences but {self.labels.shape[0]} labels")
        if self.cond_mask is not None and self.cond_mask.shape[0] != self.tokens.shape[0]:
            raise RelaxspecError(f"{self.tokens.shape[0]} token sequences but {self.cond_mask.shape[0]} condition masks")
        # class ids and prompt token ids as int64; caption features (LlamaGen t2i) keep their dtype
        labels = self.labels if self.labels.dtype.is_floating_point else self.labels.long()
        self.tokens, self.labels = self.tokens.long().cpu(), labels.cpu()
        if self.cond_mask is not None:
            self.cond_mask = self.cond_mask.bool().cpu()

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def subset(self, index: torch.Tensor) -> "DrafterDataset":
        return DrafterDataset(self.tokens[index], self.labels[index],
                              None if self.cond_mask is None else self.cond_mask[index])

    @classmethod
    def concat(cls, parts: list["DrafterDataset"]) -> "DrafterDataset":
        lengths = {p.tokens.shape[1] for p in parts}
        if len(lengths) > 1:
            raise RelaxspecError(f"data sources have different sequence lengths {sorted(lengths)}")
        if len({p.labels.shape[1:] for p in parts}) > 1 or len({p.cond_mask is None for p in parts}) > 1:
            raise RelaxspecError("data sources have different kinds of conditions")
        masks = None if parts[0].cond_mask is None else torch.cat([p.cond_mask for p in parts])
        return cls(torch.cat([p.tokens for p in parts]), torch.cat([p.labels for p in parts]), masks)

    def check_for(self, target: TeacherForcedTarget) -> None:
        """Raise unless every sequence is a full image of ``target``'s grid, vocabulary and classes."""
        config = target.config
        if len(self) == 0:
            raise RelaxspecError("no training sequences: give --data, --self-samples or --images")
        if self.tokens.shape[1] != config.block_size:
            raise RelaxspecError(
                f"sequences have {self.tokens.shape[1]} tokens but the target's grid is "
                f"{config.grid_size}x{config.grid_size} = {config.block_size} (wrong --image-size or tokenizer?)"
            )
        if int(self.tokens.min()) < 0 or int(self.tokens.max()) >= config.vocab_size:
            raise RelaxspecError(f"token ids lie in [{int(self.tokens.min())}, {int(self.tokens.max())}], "
                                 f"outside the target's vocabulary [0, {config.vocab_size})")
        if config.model_type == "c2i" and (int(self.labels.min()) < 0 or int(self.labels.max()) >= config.num_classes):
            raise RelaxspecError(f"class ids lie in [{int(self.labels.min())}, {int(self.labels.max())}], "
                                 f"outside the target's classes [0, {config.num_classes})")

    def split(self, fraction: float, seed: int) -> tuple["DrafterDataset", "DrafterDataset"]:
        """A seeded (train, held-out) split; at least one sequence is held out when ``fraction > 0``
        and there are two or more."""
        held = min(len(self) - 1, max(1, round(fraction * len(self)))) if fraction > 0 and len(self) > 1 else 0
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        return self.subset(order[held:]), self.subset(order[:held])


def load_token_file(path: str | Path, label: int | None = None) -> DrafterDataset:
    """Read token sequences: an ``.npz`` with ``tokens [n, N]`` and ``labels [n]``, or a ``.npy``
    ``[n, N]`` whose labels come from a ``labels.npy`` beside it, or the ``stats.json`` that
    ``relaxspec generate`` writes beside its ``tokens.npy`` (only the images it records as done are
    used), else from ``label``."""
    path = Path(path)
    if not path.is_file():
        raise RelaxspecError(f"{path}: no such token file")
    labels, rows = None, None
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                if "tokens" not in archive:
                    raise RelaxspecError(f"{path}: an .npz needs a 'tokens' array (has {', '.join(archive.files)})")
                tokens = archive["tokens"]
                for key in ("labels", "classes"):
                    if key in archive:
                        labels = archive[key]
                        break
        elif path.suffix == ".npy":
            tokens = np.load(path, allow_pickle=False)
            if (path.parent / "labels.npy").is_file():
                labels = np.load(path.parent / "labels.npy", allow_pickle=False)
            elif (path.parent / "stats.json").is_file():
                rows, labels = _generate_labels(path.parent / "stats.json")
        else:
            raise RelaxspecError(f"{path}: token data must be an .npy or .npz file")
    except RelaxspecError:
        raise
    except (OSError, ValueError) as err:
        raise RelaxspecError(f"{path}: not a readable numpy file ({err})") from None
    if tokens.ndim != 2:
        raise RelaxspecError(f"{path}: tokens must have shape [n, N], got {tokens.shape}")
    if rows is not None:
        if rows and max(rows) >= len(tokens):
            raise RelaxspecError(f"{path}: stats.json records image {max(rows)} but the file has {len(tokens)} rows")
        tokens = tokens[rows]
    if labels is None:
        if label is None:
            raise RelaxspecError(f"{path}: no labels found (no 'labels' in the file, no labels.npy or stats.json "
                                 f"with classes beside it); pass --label CLASS")
        labels = np.full(len(tokens), label)
    try:
        return DrafterDataset(torch.from_numpy(np.ascontiguousarray(tokens)), torch.from_numpy(np.asarray(labels)))
    except RelaxspecError as err:
        raise RelaxspecError(f"{path}: {err}") from None


def _generate_labels(stats: Path) -> tuple[list[int] | None, list[int] | None]:
    """Rows and classes from ``relaxspec generate``'s stats.json (``images: [{index, class}]``);
    ``(None, None)`` when it records no classes (e.g. a t2i run)."""
    try:
        meta = json.loads(stats.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise RelaxspecError(f"{stats}: unreadable ({err})") from None
    images = meta.get("images") if isinstance(meta, dict) else None
    if not isinstance(images, list) or not all(isinstance(r, dict) and "class" in r and "index" in r for r in images):
        return None, None
    records = sorted(images, key=lambda r: r["index"])
    return [int(r["index"]) for r in records], [int(r["class"]) for r in records]


@torch.no_grad()
def sample_from_target(target: TeacherForcedTarget, count: int, *, classes: list[int] | None = None,
                       sampling: SamplingConfig | None = None, seed: int = 0, batch_size: int = 16,
                       progress: bool = False, cache: str | Path | None = None, shard: Shard | None = None
                       ) -> DrafterDataset:
    """``count`` images sampled from a class-conditional target with :func:`generate_ar` (classes
    cycled from ``classes``, or drawn uniformly from ``seed``), batch by batch as
    :func:`sample_prompts` draws them: with ``cache``, an interrupted run picks up where it
    stopped."""
    sampling = sampling or SamplingConfig()
    if classes and max(classes) >= target.config.num_classes:
        raise RelaxspecError(f"self-sample classes must lie in [0, {target.config.num_classes}), got {max(classes)}")
    if classes:
        labels = torch.tensor(classes)[torch.arange(count) % len(classes)]
    else:
        labels = torch.randint(target.config.num_classes, (count,), generator=torch.Generator().manual_seed(seed))
    return sample_prompts(target, labels.to(target.device), None, count, sampling=sampling, seed=seed,
                          batch_size=batch_size, progress=progress, cache=cache, shard=shard)


@dataclass(frozen=True)
class Shard:
    """Which batches this process draws: batch ``todo[i]`` for ``i % world == rank`` of those not
    cached yet; ``barrier`` waits for every process of the run (the processes must agree on what
    is cached before drawing, and each read all batches once every one is drawn)."""

    rank: int = 0
    world: int = 1
    barrier: Callable[[], None] = lambda: None


@torch.no_grad()
def sample_prompts(target: TargetModel, cond: torch.Tensor, cond_mask: torch.Tensor | None, count: int, *,
                   sampling: SamplingConfig, seed: int = 0, batch_size: int = 16, progress: bool = False,
                   cache: str | Path | None = None, shard: Shard | None = None) -> DrafterDataset:
    """``count`` images sampled from a prompt-conditioned target with :func:`generate_ar`, its
    formatted prompts ``cond [P, ...]`` (mask ``cond_mask``) cycled. Batch ``b`` samples with a
    generator seeded ``mix(seed, b)``, whichever process draws it; with ``cache`` (an ``.npz``,
    :class:`~relaxspec.training.drafter.cache.SampleCache`) every finished batch is kept, and a
    run of the same conditions and settings, on any number of processes, picks up where an
    interrupted one stopped. With ``shard`` this process draws its share of the batches; every
    process returns all of them (the cache is how they meet, so it is required)."""
    shard = shard or Shard()
    if shard.world > 1 and cache is None:
        raise RelaxspecError("self-samples drawn by several processes meet in their cache: give cache")
    index = torch.arange(count) % cond.shape[0]
    conds, masks = cond[index], None if cond_mask is None else cond_mask[index]
    digest = hashlib.sha256()
    for part in (cond, cond_mask):
        if part is not None:
            digest.update(str(tuple(part.shape)).encode() + part.cpu().numpy().tobytes())
    key = json.dumps({"conditions": digest.hexdigest(), "count": count, "seed": seed, "batch_size": batch_size,
                      "sampling": sampling.to_dict(), "tokens": target.config.block_size}, sort_keys=True)
    store = None if cache is None else SampleCache(cache, key, count, batch_size, target.config.block_size)
    if store is not None and store.complete():
        return DrafterDataset(torch.from_numpy(store.load()[0]), conds, masks)
    if store is not None:
        tokens, done = store.load()
    else:
        tokens, done = np.full((count, target.config.block_size), -1, dtype=np.int64), [False] * math.ceil(count / batch_size)
    shard.barrier()  # every process has read what is cached before any draws more
    mine = [batch for batch, drawn in enumerate(done) if not drawn][shard.rank :: shard.world]
    bar = tqdm(total=len(done), initial=sum(done), desc="self-samples",
               disable=not progress, leave=False)
    for batch in mine:
        rows = slice(batch * batch_size, min((batch + 1) * batch_size, count))
        generator = torch.Generator(device=target.device).manual_seed(common.mix(seed, batch))
        tokens[rows] = generate_ar(target, conds[rows], sampling, generator=generator,
                                   cond_mask=None if masks is None else masks[rows]).tokens.cpu().numpy()
        if store is not None:
            store.write(batch, tokens[rows])
        bar.update(min(shard.world, bar.total - bar.n))  # the others draw theirs meanwhile
    bar.close()
    if store is not None:
        shard.barrier()  # every batch is drawn
        tokens, done = store.load()
        if not all(done):
            raise RelaxspecError(f"{cache}: {done.count(False)} batch(es) of self-samples drawn by other processes are "
                                 "not there: --out must be on a file system every node of the run shares")
        shard.barrier()  # every process has read them
        if shard.rank == 0:
            store.finish(tokens)
    return DrafterDataset(torch.from_numpy(tokens), conds, masks)


def center_crop(image, size: int) -> np.ndarray:
    """Upstream's (ADM) ``center_crop_arr``: box-halve while large, bicubic-resize the short side
    to ``size``, crop the centre. -> ``uint8 [size, size, 3]``."""
    while min(*image.size) >= 2 * size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = size / min(*image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    arr = np.asarray(image.convert("RGB"))
    top, left = (arr.shape[0] - size) // 2, (arr.shape[1] - size) // 2
    return arr[top : top + size, left : left + size]


def list_images(folder: str | Path, label: int | None = None) -> tuple[list[Path], list[int]]:
    """Image files under ``folder`` and their classes: ``label`` for all, else one class per
    sub-folder (its name if numeric, else its index in sorted order, as torchvision's ImageFolder,
    which gives ImageNet's class ids for ``n01440764``-style names)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise RelaxspecError(f"{folder}: no such image folder")

    def images_in(d: Path) -> list[Path]:
        return sorted(p for p in d.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)

    if label is not None:
        files = images_in(folder)
        labels = [label] * len(files)
    else:
        subdirs = sorted(d for d in folder.iterdir() if d.is_dir())
        if not subdirs:
            raise RelaxspecError(f"{folder}: no class sub-folders; pass --label CLASS for a flat folder")
        numeric = all(d.name.isdigit() for d in subdirs)
        files, labels = [], []
        for index, d in enumerate(subdirs):
            found = images_in(d)
            files += found
            labels += [int(d.name) if numeric else index] * len(found)
    if not files:
        raise RelaxspecError(f"{folder}: no images ({', '.join(IMAGE_SUFFIXES)})")
    return files, labels


@torch.no_grad()
def encode_images(folder: str | Path, vq: VQModel, image_size: int, *, label: int | None = None,
                  batch_size: int = 16, progress: bool = False) -> DrafterDataset:
    """Encode every image under ``folder`` (center-cropped to ``image_size``) with ``vq``."""
    files, labels = list_images(folder, label)
    device = next(vq.parameters()).device
    chunks = []
    for start in tqdm(range(0, len(files), batch_size), desc="encode", disable=not progress, leave=False):
        pixels = []
        for path in files[start : start + batch_size]:
            try:
                with Image.open(path) as image:
                    pixels.append(center_crop(image.convert("RGB"), image_size))
            except (OSError, UnidentifiedImageError) as err:
                raise RelaxspecError(f"{path}: not a readable image ({err})") from None
        batch = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
        chunks.append(vq.encode(batch.to(device)).cpu())
    return DrafterDataset(torch.cat(chunks), torch.tensor(labels))


def build_dataset(config: DrafterTrainConfig, target: TargetModel, prompts=None, vq: VQModel | None = None,
                  shard: Shard | None = None) -> DrafterDataset:
    """All the sources ``config`` names, concatenated (token files, then self-samples, then images).
    ``prompts``: ``(cond, cond_mask)`` of a prompt-conditioned target, what its self-samples cycle.
    ``vq``: the image tokenizer ``images`` are encoded with (the target's family opens it).
    ``shard``: this process's share of the self-samples (every process gets all of them)."""
    progress = config.progress and (shard is None or shard.rank == 0)
    parts = [load_token_file(path, config.label) for path in config.data]
    if config.self_samples and prompts is not None:
        parts.append(sample_prompts(target, *prompts, config.self_samples, sampling=config.sampling, seed=config.seed,
                                    batch_size=config.batch_size, progress=progress,
                                    cache=Path(config.out) / SELF_SAMPLES, shard=shard))
    elif config.self_samples:
        parts.append(sample_from_target(target, config.self_samples, classes=config.classes, sampling=config.sampling,
                                        seed=config.seed, batch_size=config.batch_size, progress=progress,
                                        cache=Path(config.out) / SELF_SAMPLES, shard=shard))
    if config.images is not None:
        if vq is None:
            raise RelaxspecError("--images: the target's image tokenizer encodes them: give its family's tokenizer input "
                                 "(LlamaGen: --vq-ckpt PATH)")
        size = target.config.grid_size * vq.config.downsample_factor
        parts.append(encode_images(config.images, vq, size, label=config.label, batch_size=config.batch_size,
                                   progress=progress))
    if not parts:
        raise RelaxspecError("no training data: give --data FILE, --self-samples COUNT or --images DIR")
    return DrafterDataset.concat(parts)
