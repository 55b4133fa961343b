"""A small CNN classifier trained on our own data: the offline feature network for quality metrics.

Inception (FID) and CLIP weights cannot be downloaded here (REFERENCE §3), so quality on the
embedded model is measured with a classifier we train ourselves on the same 32x32 images it was
trained on (e.g. emoji, one class per emoji subcategory). It gives

* ``logits(images)``: class accuracy of generated images w.r.t. their conditioning class;
* ``features(images)``: the penultimate layer (global average pool of the last conv layer,
  ``feature_dim``-d, 256 by default), the feature space of the FID-like distance and of
  precision/recall in :mod:`relaxspec.evaluation.metrics`.

The recipe runs the loop every training recipe shares (nanoGPT style,
:func:`relaxspec.training.common.run_training`): a validated :class:`ClassifierTrainConfig`,
augmentation by small random translations (replicate padding, then a random crop) and horizontal
flips, AdamW with linear warm-up and cosine decay, label smoothing, top-1 / top-5 on the
validation split after every epoch. Seeded: the same config and data give the same weights on
the same machine. Saved in our format (``model.safetensors`` + ``config.json``, kind
"classifier") with :func:`relaxspec.models.weights.save_model`; :func:`load_classifier` reads it.

Data: a folder with ``train.npz`` and ``val.npz``, each holding ``images`` (uint8
``[n, H, W, 3]``) and ``labels`` (int ``[n]``), as ``relaxspec data`` writes them, read into the
data layer's :class:`~relaxspec.data.emoji.ImageSet` by :func:`~relaxspec.data.emoji.load_data`
(re-exported here with ``ImageSet``, ``load_split`` and ``check_image_set``). Class names come
from its ``classes.json`` when present (else from an optional ``class_names`` array); they fix
the class count and which classes are never mirrored (text, flags, clocks:
:data:`relaxspec.data.emoji.NO_FLIP`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from relaxspec.models.weights import load_strict, read_folder, save_model
from relaxspec.data.emoji import ImageSet, check_image_set, flippable, load_data, load_split
from relaxspec.data.emoji import augment as data_augment
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_threads
from relaxspec.threads import set_threads
from relaxspec.devices import resolve_device
from relaxspec.training import common
from relaxspec.training.common import RecipeConfig
from relaxspec.evaluation.metrics import topk_hits

KIND = "classifier"

# ------------------------------------------------------------------------------------------
# Images in, tensors out
# ------------------------------------------------------------------------------------------


def to_model_input(images: np.ndarray | torch.Tensor, size: int | None = None) -> torch.Tensor:
    """Either image convention -> float32 ``[n, 3, H, W]`` in ``[-1, 1]`` (CPU).

    * uint8 ``[n, H, W, 3]`` (PNG pixels, :func:`relaxspec.models.llamagen.vq.to_uint8`'s output):
      ``x / 127.5 - 1``;
    * float ``[n, 3, H, W]`` in ``[-1, 1]`` (VQ decoder output): clamped to ``[-1, 1]``, as
      saving to PNG would. A float batch reaching past 2 is taken for 0..255 pixels and refused.

    ``size``: resize (bilinear, antialiased) to ``size x size`` when the images differ.
    """
    if isinstance(images, np.ndarray) and not images.flags.writeable:
        images = images.copy()  # torch refuses to wrap read-only memory without a warning
    x = torch.as_tensor(images)
    if x.ndim != 4:
        raise RelaxspecError(f"images must be uint8 [n, H, W, 3] or float [n, 3, H, W], got shape {tuple(x.shape)}")
    if x.dtype == torch.uint8:
        if x.shape[-1] != 3:
            raise RelaxspecError(f"uint8 images must be [n, H, W, 3] (channels last), got shape {tuple(x.shape)}")
        x = x.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)
    elif x.dtype.is_floating_point:
        if x.shape[1] != 3:
            raise RelaxspecError(f"float images must be [n, 3, H, W] (channels first), got shape {tuple(x.shape)}")
        x = x.float()
        if x.numel() and float(x.abs().max()) > 2.0:
            raise RelaxspecError("float images must lie in [-1, 1] (these reach past 2: 0..255 pixels? pass them as uint8)")
        x = x.clamp(-1.0, 1.0)
    else:
        raise RelaxspecError(f"images must be uint8 or floating point, got {x.dtype}")
    x = x.cpu().contiguous()
    if size is not None and tuple(x.shape[-2:]) != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False).clamp(-1.0, 1.0)
    return x


def flippable_classes(class_names: list[str] | None, num_classes: int) -> torch.Tensor:
    """bool ``[num_classes]``: may images of a class be mirrored? All, without names; with names,
    all but those whose mirror image is another or no emoji (:data:`relaxspec.data.emoji.NO_FLIP`)."""
    if class_names is None:
        return torch.ones(num_classes, dtype=torch.bool)
    return torch.from_numpy(flippable(list(class_names))).bool()


# ------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------


@dataclass
class ClassifierConfig(RecipeConfig):
    """The network, a small VGG: a 3x3 conv-BN-ReLU stem at full resolution, then per stage a
    2x max-pool and two 3x3 conv-BN-ReLU at ``channels[i]``, a 1x1 conv-BN-ReLU to
    ``feature_dim``, global average pool (the features), dropout, linear head.

    Sized for CPU: ~13 M multiply-adds per 32x32 image with the defaults (most of the cost of a
    wider net would sit in the full-resolution layers, which matter least for the class)."""

    num_classes: int
    image_size: int = 32
    channels: tuple[int, ...] = (32, 64, 128)
    feature_dim: int = 256
    dropout: float = 0.2
    class_names: list[str] | None = None

    def __post_init__(self) -> None:
        self.channels = tuple(int(c) for c in self.channels)
        if self.num_classes < 2:
            raise RelaxspecError(f"a classifier needs >= 2 classes, got {self.num_classes}")
        if not self.channels or min(self.channels) < 1 or self.feature_dim < 1:
            raise RelaxspecError(f"channels and feature_dim must be positive widths, got {self.channels}, {self.feature_dim}")
        if self.image_size < 2 ** len(self.channels):
            raise RelaxspecError(f"image_size {self.image_size} is too small for {len(self.channels)} 2x poolings")
        if not 0 <= self.dropout < 1:
            raise RelaxspecError(f"dropout must lie in [0, 1), got {self.dropout}")
        if self.class_names is not None and len(self.class_names) != self.num_classes:
            raise RelaxspecError(f"{len(self.class_names)} class names for {self.num_classes} classes")

    what = "classifier config"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "channels": list(self.channels)}


def _conv_bn_relu(cin: int, cout: int, kernel: int = 3) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class ImageClassifier(nn.Module):
    """``forward(x [n, 3, S, S] in [-1, 1]) -> logits [n, num_classes]``; ``logits`` /
    ``features`` take either image convention (see :func:`to_model_input`), run in eval mode
    and in batches, and return CPU float32 tensors."""

    def __init__(self, config: ClassifierConfig):
        super().__init__()
        self.config = config
        layers = _conv_bn_relu(3, config.channels[0])
        cin = config.channels[0]
        for cout in config.channels:
            layers += [nn.MaxPool2d(2), *_conv_bn_relu(cin, cout), *_conv_bn_relu(cout, cout)]
            cin = cout
        layers += _conv_bn_relu(cin, config.feature_dim, kernel=1)
        self.trunk = nn.Sequential(*layers)
        self.dropout = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.feature_dim, config.num_classes)
        #: Validation results of the run that trained it (saved in config.json).
        self.metrics: dict = {}

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """``[n, 3, S, S] -> [n, feature_dim]``: the penultimate layer (global average pool)."""
        return self.trunk(x).mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.embed(x)))

    @torch.no_grad()
    def _batched(self, images, fn, width: int, batch_size: int) -> torch.Tensor:
        x = to_model_input(images, self.config.image_size)
        device = next(self.parameters()).device
        was_training = self.training
        self.eval()
        try:
            out = [fn(x[i : i + batch_size].to(device)).float().cpu() for i in range(0, x.shape[0], batch_size)]
        finally:
            self.train(was_training)
        return torch.cat(out) if out else torch.empty(0, width)

    def logits(self, images, batch_size: int = 512) -> torch.Tensor:
        """``images`` (uint8 ``[n, H, W, 3]`` or float ``[n, 3, H, W]`` in [-1, 1]) -> ``[n, num_classes]``."""
        return self._batched(images, self.forward, self.config.num_classes, batch_size)

    def features(self, images, batch_size: int = 512) -> torch.Tensor:
        """``images`` -> penultimate-layer features ``[n, feature_dim]`` (256 by default)."""
        return self._batched(images, self.embed, self.config.feature_dim, batch_size)


def load_classifier(folder: str | Path, device: str | torch.device = "cpu") -> ImageClassifier:
    """Read a classifier folder written by :func:`save_classifier` (``config.json`` +
    ``model.safetensors``, kind "classifier"); returned in eval mode."""
    folder = Path(folder)
    loaded = read_folder(folder, "a classifier folder")
    if loaded.kind != KIND or not isinstance(loaded.config, dict):
        raise RelaxspecError(f"{folder}: not a classifier (this is a {loaded.kind!r} model)")
    try:
        config = ClassifierConfig.from_dict(loaded.config)
    except TypeError as err:
        raise RelaxspecError(f"{folder / 'config.json'}: bad classifier config ({err})") from None
    model = ImageClassifier(config)
    load_strict(model, loaded.state_dict, str(folder))
    model.metrics = dict(loaded.meta.get("metrics") or {})
    return model.to(device).eval()


def save_classifier(model: ImageClassifier, folder: str | Path, train_config: ClassifierTrainConfig | None = None) -> Path:
    """Write ``model.safetensors`` + ``config.json`` (kind "classifier", with its val metrics and
    the recipe that trained it)."""
    extra = {"metrics": model.metrics}
    if train_config is not None:
        extra["train_config"] = train_config.to_dict()
    return save_model(model, folder, kind=KIND, extra=extra)


# ------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------


@dataclass
class ClassifierTrainConfig(RecipeConfig):
    """Everything ``relaxspec train-classifier`` can set. The defaults are the recipe."""

    data: str = "data/emoji"
    out: str = "out/classifier"
    channels: tuple[int, ...] = (32, 64, 128)
    feature_dim: int = 256
    dropout: float = 0.2
    epochs: int = 30
    batch_size: int = 128
    lr: float = 2e-3
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_epochs: float = 1.0  # linear warm-up, then cosine decay to 0
    label_smoothing: float = 0.1
    translate: int = 3  # random shift of up to this many pixels each way
    flip: bool = True  # random horizontal flips (never for classes in relaxspec.data.emoji.NO_FLIP)
    seed: int = 0
    device: str = "auto"
    threads: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        self.channels = tuple(int(c) for c in self.channels)
        self.betas = tuple(float(b) for b in self.betas)

        def need(ok: bool, message: str) -> None:
            if not ok:
                raise RelaxspecError(message)

        need(len(self.channels) >= 1 and min(self.channels) >= 1, f"channels must be positive widths, got {self.channels}")
        need(self.feature_dim >= 1, f"feature_dim must be >= 1, got {self.feature_dim}")
        need(0 <= self.dropout < 1, f"dropout must lie in [0, 1), got {self.dropout}")
        need(self.epochs >= 1, f"epochs must be >= 1, got {self.epochs}")
        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas must be two numbers in [0, 1), got {self.betas}")
        need(self.warmup_epochs >= 0, f"warmup_epochs must be >= 0, got {self.warmup_epochs}")
        need(0 <= self.label_smoothing < 1, f"label_smoothing must lie in [0, 1), got {self.label_smoothing}")
        need(self.translate >= 0, f"translate must be >= 0 pixels, got {self.translate}")
        if self.threads is not None:
            check_threads(self.threads, "threads")

    what = "classifier training"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "channels": list(self.channels), "betas": list(self.betas)}


#: How this recipe augments (:func:`relaxspec.data.emoji.augment`): replicate padding (the
#: background extends), the y shift drawn before the x shift, nothing drawn for what is switched
#: off; the convention the shipped classifier was trained with, so a seeded run reproduces it.
AUGMENT = {"padding": "replicate", "shift_order": "yx", "draw_unused": False}


def augment(x: torch.Tensor, translate: int, flip: bool | torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """:func:`relaxspec.data.emoji.augment` with this recipe's conventions (:data:`AUGMENT`), for
    model inputs ``x [n, 3, S, S]``: each image shifted by up to ``translate`` pixels in each
    direction (replicate padding) and mirrored with probability 1/2 where ``flip`` (a bool, or
    bool ``[n]`` per image) allows it. The same draws as :func:`train_classifier`'s augmentation."""
    return data_augment(x.permute(0, 2, 3, 1), flip, generator, translate, **AUGMENT).permute(0, 3, 1, 2).contiguous()


def train_classifier(train: ImageSet | tuple, val: ImageSet | tuple, config: ClassifierTrainConfig | None = None) -> ImageClassifier:
    """Train an :class:`ImageClassifier` on ``train`` and measure it on ``val`` after every epoch.

    ``train`` / ``val``: :class:`ImageSet` or ``(images uint8 [n, S, S, 3], labels [n])``. The
    number of classes is the largest label in either split plus one. Returns the model in eval
    mode with ``model.metrics`` = final val top-1 / top-5, train accuracy and per-epoch history.
    """
    config = config or ClassifierTrainConfig()
    train, val = (check_image_set(data if isinstance(data, ImageSet) else ImageSet(*data), name)
                  for data, name in ((train, "train"), (val, "val")))
    if len(train.labels) == 0:
        raise RelaxspecError("the training split is empty")
    if train.images.shape[1:] != val.images.shape[1:]:
        raise RelaxspecError(f"train images are {train.images.shape[1:]} but val images {val.images.shape[1:]}")
    num_classes = int(max(train.labels.max(), val.labels.max() if len(val.labels) else 0)) + 1
    names = train.class_names or val.class_names
    if names is not None and len(names) < num_classes:
        raise RelaxspecError(f"{len(names)} class names but labels go up to {num_classes - 1}")
    device = resolve_device(config.device)
    set_threads(config.threads, device, name="threads")

    model_config = ClassifierConfig(num_classes=max(num_classes, len(names or ())), image_size=train.images.shape[1],
                                    channels=config.channels, feature_dim=config.feature_dim, dropout=config.dropout,
                                    class_names=names)
    with torch.random.fork_rng(devices=[]):  # seeded init without touching the caller's RNG
        torch.manual_seed(config.seed)
        model = ImageClassifier(model_config)
    # channels-last is ~25 % faster for these convs on CPU; the model goes back to the default
    # layout at the end, so a saved and re-loaded model runs the very same kernels.
    model.to(device=device, memory_format=torch.channels_last)
    images = torch.tensor(train.images)  # uint8 [n, S, S, 3]: augmented per batch, then made model input
    labels = torch.from_numpy(train.labels)
    may_flip = flippable_classes(names, model_config.num_classes) if config.flip else None
    val_images, val_labels = to_model_input(val.images), torch.from_numpy(val.labels)

    # AdamW without decay on norms and biases (the usual split: decaying BN gains only fights BN).
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=config.lr, betas=config.betas)
    steps_per_epoch = math.ceil(len(labels) / config.batch_size)
    total, warmup = config.epochs * steps_per_epoch, round(config.warmup_epochs * steps_per_epoch)

    def lr_at(step: int) -> float:
        if step < warmup:
            return config.lr * (step + 1) / warmup
        return config.lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    # One generator draws each epoch's order and then its batches' augmentation, in that sequence.
    generator = torch.Generator().manual_seed(config.seed)
    history: list[dict] = []
    tally = {"epoch": 1, "images": 0, "loss": 0.0, "correct": 0}  # this epoch's training batches so far

    def step_loss(step: int, index: torch.Tensor):
        flip = False if may_flip is None else may_flip[labels[index]]
        x = to_model_input(data_augment(images[index], flip, generator, config.translate, **AUGMENT))
        x = x.to(device).contiguous(memory_format=torch.channels_last)
        y = labels[index].to(device)
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=config.label_smoothing)
        return loss, {"loss": loss, "correct": (logits.detach().argmax(1) == y).sum(), "images": len(index)}

    def count(step: int, metrics: dict) -> None:
        tally["epoch"] = step // steps_per_epoch + 1
        tally["images"] += int(metrics["images"])
        tally["loss"] += metrics["loss"] * int(metrics["images"])
        tally["correct"] += int(metrics["correct"])

    def end_epoch(done: int) -> None:
        epoch = tally["epoch"]
        record = {"epoch": epoch, "train_loss": tally["loss"] / tally["images"],
                  "train_top1": tally["correct"] / tally["images"]}
        tally.update(images=0, loss=0.0, correct=0)
        if len(val_labels):
            val_logits = model.logits(val_images)
            record.update({f"val_top{k}": float(topk_hits(val_logits, val_labels, k).mean()) for k in (1, 5)})
        history.append(record)
        if config.progress:
            shown = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "epoch")
            tqdm.write(f"epoch {epoch}/{config.epochs}: {shown}")

    began = time.perf_counter()
    model.train()
    common.run_training(
        step_loss, optimizer, steps=total, size=len(labels), batch_size=config.batch_size,
        order=lambda epoch: torch.randperm(len(labels), generator=generator), lr=lr_at, on_step=count,
        hooks=[common.Every(steps_per_epoch, end_epoch)],
        postfix=lambda m: {"epoch": tally["epoch"], "loss": f"{tally['loss'] / tally['images']:.3f}",
                           "acc": f"{tally['correct'] / tally['images']:.3f}"},
        desc="train-classifier", progress=config.progress)
    model.to(memory_format=torch.contiguous_format).eval()
    final = history[-1]
    model.metrics = {
        "val_top1": final.get("val_top1"), "val_top5": final.get("val_top5"),
        "train_top1_augmented": final["train_top1"], "train_images": len(labels), "val_images": len(val_labels),
        "num_classes": model_config.num_classes, "seconds": round(time.perf_counter() - began, 1),
        "history": history,
    }
    return model


__all__ = [
    "ClassifierConfig", "ClassifierTrainConfig", "ImageClassifier", "ImageSet",
    "AUGMENT", "augment", "check_image_set", "flippable_classes", "load_classifier", "load_data", "load_split",
    "save_classifier", "to_model_input", "train_classifier",
]
