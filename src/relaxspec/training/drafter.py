"""Train the EAGLE drafter on a frozen target's features (REFERENCE §1.6; arXiv 2401.15077).

One readable loop, nanoGPT style: a validated :class:`DrafterTrainConfig` whose defaults are
LANTERN's recipe (AdamW lr 1e-4, betas (0.9, 0.95), no weight decay, ~20 epochs; loss =
SmoothL1 on features + 0.1 x cross-entropy to the target's distribution; EAGLE's uniform feature
noise U(-0.1, 0.1)), and every field overridable from ``relaxspec train-drafter``.

The pairing, where an off-by-one would hide: the target's teacher-forced pass gives hidden row
``F_j`` and logits row ``z_j``, both *predicting* image token ``t_j``. Drafter input ``j`` is the
pair ``(F_j, t_j)``; its output at ``j`` must match ``F_{j+1}`` (SmoothL1) and its head the
target's ``softmax(z_{j+1})`` (soft cross-entropy), for ``j = 0 .. N-2``. That is exactly what
the drafter is asked while decoding: given the feature that predicted the last committed token
and that token, guess the next feature. :func:`drafter_inputs` and :func:`drafter_targets` are
that pairing as pure functions.

With CFG the drafter runs on both streams, so each sequence is also used under the null
condition (``null_fraction`` of every batch; 1.0 = every sequence contributes both streams).

**Distillation** (``law_loss`` ``"kl"``, ``"tv"`` or ``"kl+tv"``). Exact acceptance of a draft
token is ``1 - TV(p, q)`` between the laws decoding compares: the target's and the drafter's
logits each guided with the CFG scale (``[cond; null]`` rows), divided by the temperature and
filtered (top-k / top-p) exactly as :func:`relaxspec.sampling.process_logits` does while
decoding. The distillation losses compare those laws (forward KL against the drafter's guided
law renormalised on the support of the target's filtered one, so it stays finite and is 0 when
the laws agree; TV against the drafter's filtered law), instead of EAGLE's per-stream
cross-entropy to the raw law (``"ce"``).

**Depths.** While decoding, the drafter's ``d``-th draft after a committed token is made from its
own guesses of the ``d - 1`` features before it. :func:`unrolled` runs those depths in parallel
(a "training-time test"): level ``d`` reads level ``d - 1``'s output one position back, and an
attention mask (:func:`unrolled_mask`) lets it see the target's features only up to the committed
token, then its own chain. ``train_depths`` levels are trained (equal weights); ``eval_depths``
are measured. The metric logged at every evaluation and written to the model card is the mean
``1 - TV(p, q)`` per depth on held-out self-samples. With the target's own samples as the path
(accepted tokens are distributed as the target's), it estimates the probability that exact
speculative decoding accepts the ``d``-th draft given it accepted the ones before (for sampling;
greedy decoding accepts by argmax). ``chain_mal`` (``1 + sum_d prod_{i <= d} accept_i``, an
estimate of a chain of ``eval_depths`` drafts' tokens per step that treats the depths' mean rates
as independent) scores the evaluations of trained weights (step 0 is the untrained baseline): the
best of the scheduled evaluations and the run's last one are kept in ``out/best``, and training
stops after ``patience`` scheduled evaluations without a better one.

Randomness is a pure function of ``(seed, step)``: the data order of epoch ``e`` comes from
``(seed, e)`` and the feature noise of step ``s`` from ``(seed, s)``. Resuming from
``out/train_state.pt`` (weights, optimizer, step, config; plain tensors and dicts, so it loads
with ``weights_only=True``) therefore continues bit for bit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from relaxspec.models.llamagen.checkpoints import PRECISIONS, load_gpt, load_strict, load_vq
from relaxspec.drafting.eagle import LLAMAGEN, DrafterConfig, EagleDrafter, drafter_config, load_drafter
from relaxspec.errors import RelaxspecError
from relaxspec.models.base import TargetModel, TeacherForcedTarget, condition_tokens
from relaxspec.models.llamagen.vq import VQModel
from relaxspec.sampling import SamplingConfig, guide, process_logits
from relaxspec.training import common
from relaxspec.training.common import TRAIN_STATE
from relaxspec.devices import resolve_device as _device

STATE_VERSION = 1
#: A train state saved before training starts (while the self-samples are drawn): the config only.
PREPARING = "preparing"
#: A run's self-samples, saved batch by batch (sampling them is the slow part).
SELF_SAMPLES = "self_samples.npz"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
#: Fields a resumed run may change: how long it runs, where, and how chatty it is. Everything
#: else is the recipe and must stay what it was, or the continuation would not be exact.
RUN_FIELDS = ("out", "epochs", "steps", "device", "bf16", "progress", "checkpoint_interval",
              "eval_interval", "eval_sequences", "gpt_ckpt", "vq_ckpt", "model_path", "prompts_file", "t5_path",
              "patience", "export", "eval_depths")
#: Fields added after the first train states were written, and what a state without them did.
ADDED_FIELDS = {"law_loss": "ce", "distill_weight": 1.0, "train_depths": 1}
LAW_LOSSES = ("ce", "kl", "tv", "kl+tv")
BEST = common.BEST


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


@dataclass
class DrafterTrainConfig(common.RecipeConfig):
    """Everything ``relaxspec train-drafter`` can set. Defaults: LANTERN's recipe (REFERENCE §1.6)."""

    what = "drafter training"

    out: str = "out/drafter"
    # target (official files need gpt_model; our folders carry their config)
    gpt_ckpt: str | None = None
    gpt_model: str | None = None
    model_path: str | None = None  # a transformers folder (Janus, Emu3, Lumina-mGPT): trained on its own samples
    tokenizer_path: str | None = None  # Lumina-mGPT: Meta's Chameleon tokenizer folder
    prompts_file: str | None = None  # the self-samples' prompts, one per line (model_path, or t5_path)
    t5_path: str | None = None  # a LlamaGen t2i target: the Flan-T5 folder that encodes prompts_file
    negative_prompt: str | None = None  # Emu3's guidance (default: its family's)
    prompts_sha256: str | None = None  # set from prompts_file's prompts, so a resume cannot swap them
    image_size: int | None = None
    downsample: int = 16
    precision: str = "fp32"  # the target's weights; the drafter trains in fp32
    # data: token files, the target's own samples, and/or an image folder through a VQ model
    data: list[str] = field(default_factory=list)
    label: int | None = None  # class of sources that carry no labels
    self_samples: int = 0
    classes: list[int] | None = None  # classes of the self-samples (default: uniform over all)
    # The self-samples' sampling. `relaxspec train-drafter --model-path` fills in the folder's own
    # defaults (as generate does) for those not given; from Python, set them yourself.
    cfg_scale: float = 4.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float | None = None  # None = 1.0 (off)
    images: str | None = None
    vq_ckpt: str | None = None
    vq_model: str = "VQ-16"
    val_fraction: float = 0.02  # held out to measure draft accuracy
    # drafter
    n_layer: int = 1
    init_from: str | None = None  # start from this drafter's weights (or grow one with fewer blocks: grow_drafter)
    # optimisation
    epochs: float = 20.0
    steps: int | None = None  # overrides epochs
    batch_size: int = 16  # sequences per step (each gives up to two rows: cond and null stream)
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 100  # linear warm-up, then constant (so a run can be extended exactly)
    grad_clip: float = 0.5  # EAGLE's; 0 = off
    noise: float = 0.1  # input features get U(-noise, noise) (EAGLE)
    feature_weight: float = 1.0
    ce_weight: float = 0.1  # weight of the cross-entropy term (law_loss "ce")
    law_loss: str = "ce"  # "ce" (EAGLE's), or distil the decoding law: "kl", "tv", "kl+tv"
    distill_weight: float = 1.0  # weight of the distillation term (law_loss "kl" / "tv" / "kl+tv")
    train_depths: int = 1  # draft depths trained (unrolled on the drafter's own features)
    eval_depths: int = 4  # draft depths measured (1 - TV per depth)
    patience: int = 0  # evaluations without a better chain_mal before stopping; 0 = never stop early
    export: str | None = None  # also write the best weights here in fp16 (the shipped format)
    null_fraction: float = 1.0  # share of each batch also trained under the null condition
    seed: int = 0
    bf16: bool = False  # bf16 autocast (CPU or CUDA)
    device: str = "auto"
    # A Ctrl-C loses the steps since the last checkpoint (the loop saves nothing on an interrupt: it may
    # land inside an optimizer step). A checkpoint writes only the drafter and its AdamW moments: cheap
    # next to 100 steps, each a forward pass of the whole target.
    checkpoint_interval: int = 100
    eval_interval: int = 500
    eval_sequences: int = 256
    progress: bool = True

    def __post_init__(self) -> None:
        self.data = [str(p) for p in (self.data or [])]
        self.betas = tuple(float(b) for b in self.betas)
        if self.classes is not None:
            self.classes = [int(c) for c in self.classes]
        self.validate()

    def validate(self) -> None:
        need = common.need
        common.need_finite(self)  # inf / nan mean nothing here (inf epochs: an endless run)
        need(bool(self.out), "out must name a folder")
        need(self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        need(self.self_samples >= 0, f"self_samples must be >= 0, got {self.self_samples}")
        need(self.label is None or self.label >= 0, f"label must be a class id >= 0, got {self.label}")
        need(self.classes is None or (len(self.classes) > 0 and min(self.classes) >= 0),
             f"classes must be a non-empty list of class ids >= 0, got {self.classes}")
        need(0 <= self.val_fraction < 1, f"val_fraction must lie in [0, 1), got {self.val_fraction}")
        need(self.n_layer >= 1, f"n_layer must be >= 1, got {self.n_layer}")
        need(self.epochs > 0, f"epochs must be > 0, got {self.epochs}")
        need(self.steps is None or 0 <= self.steps <= common.MAX_STEPS,
             f"steps must lie in [0, {common.MAX_STEPS:,}], got {self.steps}")
        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas must be two numbers in [0, 1), got {self.betas}")
        need(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        need(self.noise >= 0, f"noise must be >= 0, got {self.noise}")
        law_weight = self.ce_weight if self.law_loss == "ce" else self.distill_weight
        need(self.feature_weight >= 0 and self.ce_weight >= 0 and self.feature_weight + law_weight > 0,
             f"loss weights must be >= 0 and not both 0, got feature {self.feature_weight} and "
             f"{'ce' if self.law_loss == 'ce' else 'distill'} {law_weight}")
        need(0 <= self.null_fraction <= 1, f"null_fraction must lie in [0, 1], got {self.null_fraction}")
        need(self.law_loss in LAW_LOSSES, f"law_loss must be one of {', '.join(LAW_LOSSES)}, got {self.law_loss!r}")
        need(self.distill_weight >= 0, f"distill_weight must be >= 0, got {self.distill_weight}")
        need(self.train_depths >= 1, f"train_depths must be >= 1, got {self.train_depths}")
        need(self.eval_depths >= 1, f"eval_depths must be >= 1, got {self.eval_depths}")
        need(self.patience >= 0, f"patience must be >= 0 (0 = never stop early), got {self.patience}")
        if self.law_loss != "ce":
            need(self.temperature > 0, "distilling the decoding law needs temperature > 0 (greedy decoding "
                                       "accepts by argmax, not by the law)")
            need(self.null_fraction == 1 or self.cfg_scale == 1.0,
                 "distilling the guided law needs both CFG streams of every sequence: null_fraction 1")
        need(self.null_fraction > 0 or self.cfg_scale == 1.0,
             "with CFG the drafter runs on both streams while decoding: null_fraction must be > 0")
        need(self.checkpoint_interval >= 1, f"checkpoint_interval must be >= 1, got {self.checkpoint_interval}")
        need(self.eval_interval >= 1, f"eval_interval must be >= 1, got {self.eval_interval}")
        need(self.eval_sequences >= 1, f"eval_sequences must be >= 1, got {self.eval_sequences}")
        need(self.images is None or self.vq_ckpt is not None, "--images needs --vq-ckpt to encode them")
        need(self.model_path is None or self.gpt_ckpt is None, "give --model-path or --gpt-ckpt, not both")
        need(self.model_path is None or (not self.data and self.images is None and self.classes is None),
             "a --model-path target trains on its own samples of prompts: give --self-samples COUNT and "
             "--prompts-file FILE (not --data / --images / --classes)")
        need(self.model_path is None or self.prompts_file is not None,
             "--model-path needs --prompts-file FILE (the prompts of its self-samples)")
        need(self.model_path is None or self.self_samples >= 1,
             "--model-path trains on the model's own samples: give --self-samples COUNT")
        need(self.prompts_file is None or self.model_path is not None or self.t5_path is not None,
             "--prompts-file goes with --model-path, or with --t5-path for a LlamaGen t2i target")
        need(self.t5_path is None or (self.prompts_file is not None and self.self_samples >= 1 and not self.data
                                      and self.images is None and self.classes is None),
             "--t5-path trains a t2i target on its own samples of prompts: give --self-samples COUNT and "
             "--prompts-file FILE (not --data / --images / --classes)")
        need(self.negative_prompt is None or self.model_path is not None, "--negative-prompt goes with --model-path")
        self.sampling  # validates

    @property
    def sampling(self) -> SamplingConfig:
        """How self-samples are drawn."""
        return SamplingConfig(cfg_scale=self.cfg_scale, temperature=self.temperature, top_k=self.top_k,
                              top_p=1.0 if self.top_p is None else self.top_p)



# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------


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
                       progress: bool = False, cache: str | Path | None = None) -> DrafterDataset:
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
                          batch_size=batch_size, progress=progress, cache=cache)


@torch.no_grad()
def sample_prompts(target: TargetModel, cond: torch.Tensor, cond_mask: torch.Tensor | None, count: int, *,
                   sampling: SamplingConfig, seed: int = 0, batch_size: int = 16, progress: bool = False,
                   cache: str | Path | None = None) -> DrafterDataset:
    """``count`` images sampled from a prompt-conditioned target with :func:`generate_ar`, its
    formatted prompts ``cond [P, ...]`` (mask ``cond_mask``) cycled. Batch ``b`` samples with a
    generator seeded ``mix(seed, b)``; with ``cache`` (an ``.npz``) every finished batch is saved,
    and a run of the same conditions and settings picks up where an interrupted one stopped."""
    import hashlib

    from relaxspec.decoding.ar import generate_ar
    from relaxspec.files import write_atomic

    index = torch.arange(count) % cond.shape[0]
    conds, masks = cond[index], None if cond_mask is None else cond_mask[index]
    digest = hashlib.sha256()
    for part in (cond, cond_mask):
        if part is not None:
            digest.update(str(tuple(part.shape)).encode() + part.cpu().numpy().tobytes())
    key = json.dumps({"conditions": digest.hexdigest(), "count": count, "seed": seed, "batch_size": batch_size,
                      "sampling": sampling.to_dict(), "tokens": target.config.block_size}, sort_keys=True)
    tokens = np.full((count, target.config.block_size), -1, dtype=np.int64)
    done = 0
    cache = None if cache is None else Path(cache)
    if cache is not None and cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as old:
                if str(old["key"]) == key and old["tokens"].shape == tokens.shape:
                    tokens, done = old["tokens"].copy(), int(old["done"])
        except (OSError, ValueError, KeyError):
            done = 0  # unreadable: sample again
    starts = list(range(0, count, batch_size))
    bar = tqdm(total=len(starts), initial=sum(start < done for start in starts), desc="self-samples",
               disable=not progress, leave=False)
    for batch, start in enumerate(starts):
        if start < done:
            continue
        rows = slice(start, start + batch_size)
        generator = torch.Generator(device=target.device).manual_seed(common.mix(seed, batch))
        tokens[rows] = generate_ar(target, conds[rows], sampling, generator=generator,
                                   cond_mask=None if masks is None else masks[rows]).tokens.cpu().numpy()
        done = min(start + batch_size, count)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(cache, lambda temp: np.savez(temp, tokens=tokens, done=done, key=key))
        bar.update(1)
    bar.close()
    return DrafterDataset(torch.from_numpy(tokens), conds, masks)


def center_crop(image, size: int) -> np.ndarray:
    """Upstream's (ADM) ``center_crop_arr``: box-halve while large, bicubic-resize the short side
    to ``size``, crop the centre. -> ``uint8 [size, size, 3]``."""
    from PIL import Image

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
    from PIL import Image, UnidentifiedImageError

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


def build_dataset(config: DrafterTrainConfig, target: TargetModel, prompts=None) -> DrafterDataset:
    """All the sources ``config`` names, concatenated (token files, then self-samples, then images).
    ``prompts``: ``(cond, cond_mask)`` of a prompt-conditioned target, what its self-samples cycle."""
    parts = [load_token_file(path, config.label) for path in config.data]
    if config.self_samples and prompts is not None:
        parts.append(sample_prompts(target, *prompts, config.self_samples, sampling=config.sampling, seed=config.seed,
                                    batch_size=config.batch_size, progress=config.progress,
                                    cache=Path(config.out) / SELF_SAMPLES))
    elif config.self_samples:
        parts.append(sample_from_target(target, config.self_samples, classes=config.classes, sampling=config.sampling,
                                        seed=config.seed, batch_size=config.batch_size, progress=config.progress,
                                        cache=Path(config.out) / SELF_SAMPLES))
    if config.images is not None:
        vq = load_vq(config.vq_ckpt, config.vq_model, device=target.device)
        size = target.config.grid_size * vq.config.downsample_factor
        parts.append(encode_images(config.images, vq, size, label=config.label, batch_size=config.batch_size,
                                   progress=config.progress))
    if not parts:
        raise RelaxspecError("no training data: give --data FILE, --self-samples COUNT or --images DIR")
    return DrafterDataset.concat(parts)


# ------------------------------------------------------------------------------------------
# Target features, the pairing, the loss
# ------------------------------------------------------------------------------------------


@torch.no_grad()
def target_features(target: TargetModel, tokens: torch.Tensor, labels: torch.Tensor,
                    null_rows: int, cond_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target's teacher-forced pass over ``tokens [B, N]``, under each sequence's
    condition and, for the first ``null_rows`` sequences, also under the null condition.

    Returns hidden states ``[R, N, dim]`` and logits ``[R, N, vocab]`` (``R = B + null_rows``; row
    ``k`` predicts token ``k``): condition rows first, then null rows. A target without
    ``forward_train``, or conditions with a mask, run through its decoding interface
    (:func:`teacher_forced`).
    """
    cond, tokens, mask = _with_null_rows(target, tokens, labels, null_rows, cond_mask)
    if isinstance(target, TeacherForcedTarget) and mask is None:  # forward_train reads no mask
        logits, hidden = target.forward_train(cond, tokens, return_hidden=True)
        return hidden, logits
    logits, hidden = teacher_forced(target, cond, tokens, mask)
    return hidden, logits


def target_features_with_condition(target: TargetModel, tokens: torch.Tensor, labels: torch.Tensor, null_rows: int,
                                   cond_mask: torch.Tensor | None = None):
    """:func:`target_features`, and what a drafter that reads the condition takes, as decoding
    hands them over: the hidden states at every condition position ``[R, C, dim]`` and, for a
    target conditioned on tokens, those tokens ``[R, C]`` (else ``None``). Returns ``(hidden,
    logits, condition, condition_tokens)``."""
    cond, tokens, mask = _with_null_rows(target, tokens, labels, null_rows, cond_mask)
    logits, hidden, condition = teacher_forced(target, cond, tokens, mask, with_condition=True)
    return hidden, logits, condition, condition_tokens(target, cond)


def _with_null_rows(target: TargetModel, tokens: torch.Tensor, labels: torch.Tensor, null_rows: int,
                    cond_mask: torch.Tensor | None):
    """The batch's conditions, tokens and mask with the first ``null_rows`` repeated under the null
    condition."""
    cond = torch.cat([labels, target.null_condition(labels[:null_rows])])
    mask = None if cond_mask is None else torch.cat([cond_mask, cond_mask[:null_rows]])
    return cond, torch.cat([tokens, tokens[:null_rows]]), mask


@torch.no_grad()
def teacher_forced(target: TargetModel, cond: torch.Tensor, tokens: torch.Tensor,
                   cond_mask: torch.Tensor | None = None, with_condition: bool = False):
    """Logits ``[R, N, V]`` and hidden states ``[R, N, D]`` of whole images ``tokens [R, N]``
    through the decoding interface: a prefill, then one causal step over tokens ``0 .. N-2``; row
    ``k`` predicts token ``k``. These are the features decoding shows the drafter, exactly.
    ``with_condition``: also the prefill's hidden states at every condition position ``[R, C, D]``
    (what decoding hands a drafter that reads the condition)."""
    from relaxspec.decoding.target import attention_mask

    rows, count = tokens.shape
    cls = target.config.cls_token_num
    length = cls + count
    target.setup_caches(rows, length)
    key_valid = None
    if cond_mask is not None:
        key_valid = torch.ones(rows, length, dtype=torch.bool, device=target.device)
        key_valid[:, :cls] = cond_mask.to(target.device)
    slots = torch.arange(cls, device=target.device).expand(rows, cls)
    first_logits, first_hidden = target.prefill(cond.to(target.device), slots, slots,
                                                attention_mask(slots, None, key_valid, length))
    positions = torch.arange(cls, length - 1, device=target.device).expand(rows, count - 1)
    logits, hidden = target.step(tokens[:, :-1].to(target.device), positions, positions,
                                 attention_mask(positions, None, key_valid, length))
    logits, hidden = torch.cat([first_logits[:, -1:], logits], 1), torch.cat([first_hidden[:, -1:], hidden], 1)
    return (logits, hidden, first_hidden) if with_condition else (logits, hidden)


def drafter_inputs(features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pair ``j`` = (feature that predicted ``t_j``, ``t_j``) for ``j = 0 .. N-2``.

    ``features [R, N, dim]``, ``tokens [R, N]`` -> ``features [R, N-1, dim]``, ``tokens [R, N-1]``,
    RoPE ``positions [R, N-1]`` (image-token index ``j``)."""
    rows, n = tokens.shape
    positions = torch.arange(n - 1, device=tokens.device).expand(rows, n - 1)
    return features[:, :-1], tokens[:, :-1], positions


def drafter_targets(features: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What pair ``j`` must predict: the feature that predicts ``t_{j+1}`` and the target's
    logits of ``t_{j+1}``.

    ``features [R, N, dim]``, ``logits [R, N, vocab]`` -> ``next_features [R, N-1, dim]``,
    ``next_logits [R, N-1, vocab]`` (raw: no guidance, temperature or filter)."""
    return features[:, 1:], logits[:, 1:]


def unrolled_mask(count: int, depths: int, device=None) -> torch.Tensor:
    """Who may attend whom when ``depths`` levels of ``count`` pairs run as one sequence (level
    ``d`` occupies positions ``(d - 1) * count .. d * count - 1``), as :func:`unrolled` lays them
    out: ``[depths * count, depths * count]`` bool, True = may attend.

    Level ``k``'s query at pair ``i`` is the ``k``-th draft after committed token
    ``j = i - k + 1``: it sees level 1 (the target's features) at pairs ``<= j``, and level ``m``
    (``2 <= m <= k``) only at pair ``j + m - 1``, the drafts of its own chain (itself included).
    Level 1 alone is the causal mask."""
    level = torch.arange(depths, device=device).repeat_interleave(count)
    pair = torch.arange(count, device=device).repeat(depths)
    q_level, q_pair, k_level, k_pair = level[:, None], pair[:, None], level[None, :], pair[None, :]
    committed = (k_level == 0) & (k_pair <= q_pair - q_level)
    chain = (k_level >= 1) & (k_level <= q_level) & (k_pair == q_pair - q_level + k_level)
    return committed | chain


def unrolled(drafter: EagleDrafter, features: torch.Tensor, tokens: torch.Tensor, depths: int, *,
             noise: torch.Tensor | None = None, condition: torch.Tensor | None = None,
             condition_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's guesses at draft depths ``1 .. depths`` for every pair, as decoding makes
    them: depth 1 from the target's features (``features [R, N, dim]`` of ``tokens [R, N]``,
    plus ``noise`` on them when given), depth ``d`` at pair ``i`` from its own depth-``d - 1``
    guess at pair ``i - 1`` and token ``t_i`` (:func:`unrolled_mask`).

    Returns ``features [R, depths, N-1, dim]`` and logits ``[R, depths, N-1, vocab]``; at depth
    ``d`` pairs ``i < d - 1`` have no chain (their values are meaningless). Levels below the last
    are computed without gradients (each pass recomputes the levels before it); the last pass,
    which produces every output, carries them. One depth is the plain causal pass. ``condition
    [R, C, dim]``: the target's hidden states at the condition positions, and ``condition_tokens
    [R, C]`` the condition's tokens, for a drafter that reads them (official LANTERN's)."""
    in_features, in_tokens, positions = drafter_inputs(features, tokens)
    reads = {name: value for name, value in (("condition", condition), ("condition_tokens", condition_tokens))
             if value is not None}
    rows, count = in_tokens.shape
    levels = [in_features.float() if noise is None else in_features.float() + noise]
    out_features = out_logits = None
    for depth in range(1, depths + 1):
        if depth > 1:  # level d, pair i reads level d-1's guess at pair i-1 (pair 0 has no chain)
            previous = out_features[:, (depth - 2) * count : (depth - 1) * count].detach().float()
            levels.append(torch.cat([torch.zeros_like(previous[:, :1]), previous[:, :-1]], dim=1))
        mask = None if depth == 1 else unrolled_mask(count, depth, tokens.device).expand(rows, -1, -1)
        with torch.set_grad_enabled(torch.is_grad_enabled() and depth == depths):
            out_features, out_logits = drafter(torch.cat(levels, dim=1), in_tokens.repeat(1, depth),
                                               positions.repeat(1, depth), attn_mask=mask, **reads)
    return (out_features.reshape(rows, depths, count, -1), out_logits.reshape(rows, depths, count, -1))


def guided_log_law(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log of the decoding law before its filters: ``[cond; null]`` rows guided, divided by the
    temperature, ``log_softmax`` (fp32)."""
    logits = logits.float()
    if sampling.use_cfg:
        logits = guide(logits, sampling.cfg_scale)
    return (logits / max(sampling.temperature, 1e-5)).log_softmax(dim=-1)


def chain_mal(accept: torch.Tensor) -> torch.Tensor:
    """Tokens per step of a chain of ``len(accept)`` drafts accepted at those per-depth rates:
    ``1 + sum_d prod_{i <= d} accept_i``."""
    return 1 + accept.cumprod(dim=0).sum()


def drafter_loss(pred_features: torch.Tensor, pred_logits: torch.Tensor, next_features: torch.Tensor,
                 next_logits: torch.Tensor, *, feature_weight: float = 1.0, ce_weight: float = 0.1,
                 law_loss: str = "ce", distill_weight: float = 1.0, sampling: SamplingConfig | None = None,
                 train_depths: int | None = None, law_rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The loss over draft depths, and what it measures per depth.

    ``pred_features [R, D, T, dim]`` / ``pred_logits [R, D, T, vocab]`` (:func:`unrolled`),
    ``next_features [R, T, dim]`` / ``next_logits [R, T, vocab]`` (:func:`drafter_targets`). At
    depth ``d`` pairs ``i >= d - 1`` count. Over the first ``train_depths`` depths (default all),
    equally weighted:

    - ``feature_loss``: SmoothL1 to the target's next feature (EAGLE);
    - ``ce`` (``law_loss="ce"``, EAGLE's): cross-entropy of each row's raw law under the drafter's
      (its floor is the target's entropy, not 0);
    - ``kl`` / ``tv`` (distillation): forward KL from the decoding law ``p`` (guided, tempered,
      filtered: :func:`~relaxspec.sampling.process_logits` with ``sampling``) to the drafter's
      guided, tempered law renormalised on ``p``'s support, and TV between the two decoding laws;
      ``"kl+tv"`` adds them.

    The laws are those of ``law_rows`` (default all): the ``[cond; null]`` pairs under CFG, the
    condition's rows without (decoding runs no other stream).

    ``loss = feature_weight * feature_loss + ce_weight * ce`` (or ``+ distill_weight * law``).
    Measured on every depth: ``accept [D]``, the mean ``1 - TV(p, q)`` of the decoding laws;
    ``top1 [D]``, how often the drafter's most likely token is the target's; ``accuracy`` = depth
    1's ``top1``. ``chain_mal``: ``1 + sum_d prod_{i <= d} accept_i``."""
    sampling = sampling or SamplingConfig()
    rows, depths, count = pred_logits.shape[:3]
    train_depths = depths if train_depths is None else train_depths
    device = pred_logits.device
    # [D, T]: depth d (0-based) has a chain from pair d on
    valid = torch.arange(count, device=device)[None, :] >= torch.arange(depths, device=device)[:, None]
    per_depth = valid.sum(dim=1).clamp_min(1).float()

    def mean_per_depth(values: torch.Tensor) -> torch.Tensor:  # [rows, D, T] -> [D]
        return (values * valid).sum(dim=(0, 2)) / (per_depth * values.shape[0])

    trained = slice(0, train_depths)
    feature = F.smooth_l1_loss(pred_features.float(), next_features[:, None].float().expand_as(pred_features),
                               reduction="none").mean(dim=-1)
    result = {"feature_loss": mean_per_depth(feature)[trained].mean()}
    if law_loss == "ce":
        probs = next_logits.float().softmax(dim=-1)[:, None]
        ce = -(probs * pred_logits.float().log_softmax(dim=-1)).sum(dim=-1)
        result["ce"] = mean_per_depth(ce)[trained].mean()
        law = ce_weight * result["ce"]
    if law_rows is not None:  # the rows decoding compares: paired [cond; null] under CFG, else cond
        pred_logits, next_logits = pred_logits[law_rows], next_logits[law_rows]
    p = process_logits(next_logits, sampling)[:, None]  # [B, 1, T, V]: the decoding laws
    with torch.set_grad_enabled(torch.is_grad_enabled() and "tv" in law_loss):  # else a measure only
        q = process_logits(pred_logits, sampling)  # [B, D, T, V]
        tv = 0.5 * (p - q).abs().sum(dim=-1)
    if law_loss != "ce":
        law = torch.zeros((), device=device)
        if "kl" in law_loss:
            log_q = guided_log_law(pred_logits, sampling)
            if sampling.top_k > 0 or sampling.top_p < 1.0:  # q renormalised on p's support: finite, 0 at q = p
                log_q = log_q - torch.logsumexp(log_q.masked_fill(p == 0, float("-inf")), dim=-1, keepdim=True)
            kl = (torch.xlogy(p, p) - p * log_q).sum(dim=-1)
            result["kl"] = mean_per_depth(kl)[trained].mean()
            law = law + result["kl"]
        if "tv" in law_loss:
            result["tv"] = mean_per_depth(tv)[trained].mean()
            law = law + result["tv"]
        law = distill_weight * law
    result["loss"] = feature_weight * result["feature_loss"] + law
    with torch.no_grad():
        accept = mean_per_depth(1 - tv)
        top1 = mean_per_depth((q.argmax(dim=-1) == p.argmax(dim=-1)).float())
    result.update(accept=accept, top1=top1, accuracy=top1[0], chain_mal=chain_mal(accept))
    return result


def batch_loss(drafter: EagleDrafter, tokens: torch.Tensor, labels: torch.Tensor, config: DrafterTrainConfig, *,
               noise_generator: torch.Generator | None = None, cond_mask: torch.Tensor | None = None,
               depths: int | None = None) -> dict[str, torch.Tensor]:
    """Target features for one batch, the drafter unrolled over ``depths`` draft depths (default
    ``config.train_depths``; the loss counts the first ``train_depths``) on the (noised) pairs,
    the loss and its per-depth measures (:func:`drafter_loss`)."""
    target = drafter.target
    device = target.device
    tokens, labels = tokens.to(device), labels.to(device)
    null_rows = round(config.null_fraction * tokens.shape[0])
    depths = max(depths or 1, config.train_depths)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.bf16):
        mask = None if cond_mask is None else cond_mask.to(device)
        if drafter.config.condition_pairs:  # official LANTERN's layout reads the condition too
            features, logits, condition, condition_tokens = target_features_with_condition(
                target, tokens, labels, null_rows, mask)
        else:
            (features, logits), condition, condition_tokens = target_features(target, tokens, labels, null_rows,
                                                                              mask), None, None
        noise = None
        if noise_generator is not None and config.noise > 0:
            uniform = torch.rand(features[:, :-1].shape, generator=noise_generator, device=device)
            noise = (2 * uniform - 1) * config.noise
        pred_features, pred_logits = unrolled(drafter, features, torch.cat([tokens, tokens[:null_rows]]), depths,
                                              noise=noise, condition=condition,
                                              condition_tokens=condition_tokens)
        next_features, next_logits = drafter_targets(features, logits)
    batch = tokens.shape[0]
    law_rows = None  # every row: [cond B; null B] under CFG
    if config.sampling.use_cfg and null_rows < batch:
        law_rows = torch.cat([torch.arange(null_rows), torch.arange(batch, batch + null_rows)]).to(device)
    elif not config.sampling.use_cfg and null_rows:  # decoding runs the condition's stream only
        law_rows = torch.arange(batch, device=device)
    return drafter_loss(pred_features, pred_logits, next_features, next_logits, feature_weight=config.feature_weight,
                        ce_weight=config.ce_weight, law_loss=config.law_loss, distill_weight=config.distill_weight,
                        sampling=config.sampling, train_depths=config.train_depths, law_rows=law_rows)


@torch.no_grad()
def evaluate_drafter(drafter: EagleDrafter, dataset: DrafterDataset, config: DrafterTrainConfig | None = None,
                     *, max_sequences: int | None = None) -> dict:
    """Without noise, averaged over the rows of ``dataset`` (both streams per
    ``config.null_fraction``): the loss and its terms, and per draft depth ``1 ..
    config.eval_depths`` the mean ``1 - TV(p, q)`` (``accept``, a list) and top-1 agreement
    (``top1``); ``accuracy`` is depth 1's, ``chain_mal`` the chain's tokens per step."""
    config = config or DrafterTrainConfig()
    count = len(dataset) if max_sequences is None else min(len(dataset), max_sequences)
    totals: dict[str, torch.Tensor] = {}
    was_training = drafter.training
    drafter.eval()
    for start in range(0, count, config.batch_size):
        stop = min(start + config.batch_size, count)
        losses = batch_loss(drafter, dataset.tokens[start:stop], dataset.labels[start:stop], config,
                            cond_mask=None if dataset.cond_mask is None else dataset.cond_mask[start:stop],
                            depths=config.eval_depths)
        for name, value in losses.items():
            if name in ("accept", "top1"):
                value = value[: config.eval_depths]
            totals[name] = totals.get(name, 0.0) + value.double() * (stop - start)
    drafter.train(was_training)
    means = {name: value / max(count, 1) for name, value in totals.items()}
    if "accept" in means:  # the chain's tokens per step from the mean per-depth rates
        means["chain_mal"] = chain_mal(means["accept"])
    return {name: value.tolist() if value.ndim else float(value) for name, value in means.items()}


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------


def _save_checkpoint(out: Path, drafter: EagleDrafter, optimizer: torch.optim.Optimizer, step: int,
                     config: DrafterTrainConfig, history: list[dict], best: dict | None = None,
                     bad_evals: int = 0, measure: dict | None = None, scheduled_best: float | None = None) -> None:
    """``model.safetensors`` + ``config.json`` (what decoding loads) and ``train_state.pt`` (what
    ``--resume`` loads: weights too, so it alone is a consistent snapshot), each replaced atomically."""
    common.publish_model(out, drafter, kind="drafter",
                         extra={"training": {"step": step, "recipe": "relaxspec train-drafter"}})
    common.save_train_state(out, {
        "format_version": STATE_VERSION,
        "step": step,
        "model": {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()},
        "optimizer": optimizer.state_dict(),
        "rng": common.rng_state(),
        "config": config.to_dict(),
        "drafter": drafter.config.to_dict(),  # what a resume rebuilds
        "history": history,
        "best": best or {},
        "bad_evals": bad_evals,  # scheduled evaluations since the best scheduled one (patience)
        "scheduled_best": scheduled_best,  # that one's chain MAL
        "measure": measure,  # what the best's score was measured on
    })


def _measure(config: DrafterTrainConfig) -> dict:
    """What an evaluation's chain MAL depends on besides the weights (a resume may change it)."""
    return {"eval_depths": config.eval_depths, "eval_sequences": config.eval_sequences}


ACCEPT_PLOT = "accept.png"


def plot_acceptance(history: list[dict], path: str | Path) -> Path | None:
    """``1 - TV(p, q)`` per draft depth against training steps (and the chain MAL), from the
    evaluations in ``history``; ``None`` (nothing written) without matplotlib or evaluations."""
    records = [r for r in history if r.get("accept")]
    try:
        from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone
    except ImportError:
        return None
    if not records:
        return None

    figure = Figure(figsize=(7, 3.6), layout="constrained")
    accept, chain = figure.subplots(1, 2, width_ratios=[3, 2])
    steps = [r["step"] for r in records]
    for depth in range(len(records[-1]["accept"])):
        accept.plot(steps, [r["accept"][depth] if depth < len(r["accept"]) else float("nan") for r in records],
                    marker=".", label=f"depth {depth + 1}")
    accept.set(xlabel="step", ylabel="mean 1 - TV(p, q)", title="exact acceptance per draft depth")
    accept.grid(alpha=0.3)
    accept.legend(fontsize=8)
    chain.plot(steps, [r["chain_mal"] for r in records], marker=".", color="black")
    chain.set(xlabel="step", ylabel="tokens per step", title=f"chain of {len(records[-1]['accept'])} drafts")
    chain.grid(alpha=0.3)
    figure.savefig(path, dpi=110)
    return Path(path)


def export_drafter(source: str | Path, folder: str | Path, target: TargetModel, training: dict) -> None:
    """Write the drafter in ``source`` to ``folder`` in fp16 (the shipped format), recording
    ``training`` in its config.json."""
    drafter = load_drafter(source, target, dtype=torch.float32)  # fp32 -> fp16 directly, never via the target's
    common.publish_model(folder, drafter, kind="drafter", dtype=torch.float16, extra={"training": training})


def read_train_state(out: str | Path) -> dict:
    """``out/train_state.pt``, loaded with ``weights_only=True``. A run stopped while drawing its
    self-samples has one too, holding only its config (and ``preparing``)."""
    return common.read_train_state(out, STATE_VERSION, "drafter")


def _prior_state(out: Path, resume: bool) -> dict | None:
    """The saved state a run continues (``None``: a fresh run). A state saved while the self-samples
    were drawn (``preparing``) holds no training: the plain command starts over on it (the
    samples drawn so far are cached), ``--resume`` continues with its recipe."""
    if not resume and (out / TRAIN_STATE).is_file():
        try:
            if read_train_state(out).get(PREPARING):
                return None
        except RelaxspecError:
            pass  # not ours: refused below as a run this one must not overwrite
    return common.check_fresh_or_resume(out, resume, STATE_VERSION, "drafter")


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


@dataclass
class DrafterTrainResult:
    drafter: EagleDrafter
    step: int
    history: list[dict]  # evaluations: {"step", "loss", "feature_loss", "ce" | "kl" | "tv", "accept", "top1", ...}
    seconds: float  # training steps only (no evaluation, checkpoints or data preparation)
    sequences_per_second: float
    best: dict = field(default_factory=dict)  # the evaluation of the weights in out/best
    stopped_early: bool = False


def _read_prompts(config: DrafterTrainConfig) -> list[str]:
    """The self-samples' prompts (``prompts_file``, blank lines skipped)."""
    from relaxspec.files import read_prompts_file

    prompts = read_prompts_file(config.prompts_file)
    if not prompts:
        raise RelaxspecError(f"--prompts-file {config.prompts_file}: no prompts in the file")
    return prompts


def _encode_prompts(config: DrafterTrainConfig, target) -> tuple[torch.Tensor, torch.Tensor]:
    """A LlamaGen t2i target's self-sample conditions: ``prompts_file`` encoded with ``t5_path`` as
    ``relaxspec generate --t5-path`` encodes prompts (caption features and mask)."""
    from relaxspec.pipelines.llamagen import LlamaGenT2I

    if target.config.model_type != "t2i":
        raise RelaxspecError("--t5-path encodes prompts for a text-to-image (t2i) target; this one is c2i")
    condition = LlamaGenT2I(target, None, t5_path=config.t5_path).encode(_read_prompts(config))
    return condition.cond, condition.mask


def _open_folder(config: DrafterTrainConfig, device) -> tuple[TargetModel, tuple]:
    """A transformers folder's target and its self-samples' formatted prompts."""
    from relaxspec.pipelines import open_pipeline

    prompts = _read_prompts(config)
    pipeline = open_pipeline(model_path=config.model_path, tokenizer_path=config.tokenizer_path, prompts=prompts,
                             device=device, precision=config.precision, image_size=config.image_size,
                             negative_prompt=config.negative_prompt)
    condition = pipeline.conditions(prompts=prompts)
    return pipeline.target, (condition.cond, condition.mask)


@torch.no_grad()
def grow_drafter(drafter: EagleDrafter, start: EagleDrafter, name: str = "init_from") -> None:
    """Warm-start ``drafter`` from the trained ``start`` of the same family and target: ``fc`` and
    ``start``'s layers carry over, and any further layers start as the identity
    (:func:`relaxspec.training.common.start_as_identity`), so a deeper drafter begins as exactly
    the function ``start`` computes."""
    if start.config.family != drafter.config.family:
        raise RelaxspecError(f"--init-from {name}: that drafter is of the {start.config.family} "
                             f"family, this run trains one of the {drafter.config.family} family")
    if start.config.n_layer > drafter.config.n_layer:
        raise RelaxspecError(f"--init-from {name}: that drafter has {start.config.n_layer} blocks, this run trains "
                             f"{drafter.config.n_layer} (a warm start keeps or adds blocks)")
    drafter.fc.load_state_dict(start.fc.state_dict())
    if start.config.own_embedding and drafter.config.own_embedding:  # LANTERN's own (frozen) token table
        drafter.embed_tokens.load_state_dict(start.embed_tokens.state_dict())
    for index, layer in enumerate(drafter.layers):
        if index < len(start.layers):
            layer.load_state_dict(start.layers[index].state_dict())
        else:
            common.start_as_identity(layer)


def train_drafter(config: DrafterTrainConfig, *, target: TeacherForcedTarget | None = None,
                  dataset: DrafterDataset | None = None, resume: bool = False) -> DrafterTrainResult:
    """Train (or, with ``resume``, continue training) an EAGLE drafter for ``target``, of its
    family (:func:`relaxspec.drafting.eagle.drafter_config`: LlamaGen blocks, or a transformers
    target's own decoder layers).

    ``target`` and ``dataset`` default to what ``config`` names (``gpt_ckpt``; ``data`` /
    ``self_samples`` / ``images``). The target is frozen in place (``eval()``, no gradients).
    Writes ``config.out``; returns the trained drafter and its evaluation history.
    """
    out = Path(config.out)
    saved = _prior_state(out, resume)
    if config.prompts_file is not None and target is None:
        import hashlib

        config.prompts_sha256 = hashlib.sha256("\n".join(_read_prompts(config)).encode()).hexdigest()
    if saved is not None:
        common.check_resumable({**ADDED_FIELDS, **saved["config"]}, config.to_dict(), RUN_FIELDS)
        if saved.get(PREPARING):  # stopped while drawing its self-samples: start training from step 0
            saved = None
    device = _device(config.device)
    prompts = None
    if target is None and config.model_path is not None:
        target, prompts = _open_folder(config, device)
    elif target is None:
        if config.gpt_ckpt is None:
            raise RelaxspecError("no target: give --gpt-ckpt (and --gpt-model for an official file) or --model-path")
        target = load_gpt(config.gpt_ckpt, config.gpt_model, image_size=config.image_size,
                          downsample=config.downsample, precision=config.precision, device=device)
    device = target.device
    if config.t5_path is not None and prompts is None and dataset is None:
        prompts = _encode_prompts(config, target)
    if target.config.model_type != "c2i" and prompts is None and (dataset is None or dataset.labels.ndim == 1):
        raise RelaxspecError("this target is t2i: give --prompts-file FILE with --t5-path DIR (LlamaGen) to train on "
                             "its own samples of prompts")
    target.eval().requires_grad_(False)
    out.mkdir(parents=True, exist_ok=True)
    if dataset is None and config.self_samples and saved is None:
        # Drawing the self-samples is slow and cached batch by batch: name the recipe now, so that
        # --resume after a Ctrl-C while drawing them continues with it (and reuses the cache).
        common.save_train_state(out, {"format_version": STATE_VERSION, "step": 0, "config": config.to_dict(),
                                      PREPARING: True})
    if dataset is None:
        dataset = build_dataset(config, target, prompts)
    dataset.check_for(target)
    train_set, val_set = dataset.split(config.val_fraction, config.seed)
    eval_set, eval_name = (val_set, "val") if len(val_set) else (train_set, "train")

    # The drafter is of the target's family (LlamaGen blocks, or a transformers target's own decoder
    # layers); a resumed run rebuilds the one it saved (a run saved before drafters had families
    # trained LlamaGen blocks).
    start = load_drafter(config.init_from, target, dtype=torch.float32) if config.init_from and saved is None else None
    if saved is None:
        shape = drafter_config(target, config.n_layer)
        if start is not None and start.config.lantern_layout:  # official LANTERN's drafter keeps its layout
            shape = start.config.with_layers(config.n_layer)
    elif "drafter" in saved:
        shape = DrafterConfig(**saved["drafter"])
    else:
        shape = drafter_config(target, config.n_layer, family=LLAMAGEN)
    torch.manual_seed(config.seed)
    drafter = EagleDrafter(shape, target).to(device).attach(target)
    if start is not None:
        grow_drafter(drafter, start, config.init_from)
    drafter.train()
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    # best: the evaluation whose weights out/best holds; scheduled_best: the best chain MAL of the
    # scheduled evaluations, what patience counts from (see evaluate)
    step, history, best, bad_evals, scheduled_best = 0, [], {}, 0, None
    if saved is not None:
        load_strict(drafter, saved["model"], str(out / TRAIN_STATE))
        optimizer.load_state_dict(saved["optimizer"])
        common.set_rng_state(saved["rng"])
        step, history = int(saved["step"]), list(saved["history"])
        best, bad_evals = dict(saved.get("best") or {}), int(saved.get("bad_evals", 0))
        if best.get("step") == 0:  # saved before the untrained baseline stopped being a candidate
            best = {}
        # states saved before the two were kept apart: their best was a scheduled evaluation
        scheduled_best = saved.get("scheduled_best", best.get("chain_mal"))
        if saved.get("measure") != _measure(config):  # scores of another measure do not compare
            best, bad_evals, scheduled_best = {}, 0, None
    common.rewrite_metrics(out, history)  # a fresh run drops what one stopped before its first checkpoint logged

    steps_per_epoch = math.ceil(len(train_set) / config.batch_size)
    total = common.run_length(config.steps, config.epochs, steps_per_epoch)
    extra = {"recipe": "relaxspec train-drafter", "law_loss": config.law_loss, "train_depths": config.train_depths}

    def evaluate(at: int) -> bool:
        # Step 0 is the untrained baseline: logged, never a candidate for out/best. Every later
        # evaluation (the scheduled ones and a run's last step) competes for out/best, so a finished
        # run always leaves its best trained weights there. Only the scheduled ones count for
        # patience: a split run is also evaluated where its first part ended, and must still stop
        # where a whole one does.
        nonlocal best, bad_evals, scheduled_best
        metrics = evaluate_drafter(drafter, eval_set, config, max_sequences=config.eval_sequences)
        score = metrics["chain_mal"]
        improved = at > 0 and (not best or score > best["chain_mal"])
        record = {"step": at, "split": eval_name, **metrics, "best": improved}
        history.append(record)
        if at > 0 and at % config.eval_interval == 0:
            if scheduled_best is None or score > scheduled_best:
                scheduled_best, bad_evals = score, 0
            else:
                bad_evals += 1
        if improved:
            best = dict(record)
            common.publish_model(out, drafter, kind="drafter", name=BEST, extra={"training": {**extra, "best": record}})
        if improved or at == 0:
            checkpoint(at)  # the saved state always names what out/best holds (and holds the baseline)
        law = " ".join(f"{name} {metrics[name]:.4f}" for name in ("ce", "kl", "tv") if name in metrics)
        accept = " ".join(f"{a:.3f}" for a in metrics["accept"])
        common.log_metrics(out, record, f"step {at}: {eval_name} loss {metrics['loss']:.4f} feature "
                                        f"{metrics['feature_loss']:.4f} {law} | 1-TV by depth {accept} | chain MAL "
                                        f"{metrics['chain_mal']:.3f} | top-1 {metrics['accuracy']:.3f}"
                                        + (" (best)" if improved else " (baseline)" if at == 0
                                           else f" (best: step {best.get('step')})"))
        if config.patience and bad_evals >= config.patience:
            tqdm.write(f"stopping: no better chain MAL in {bad_evals} evaluations (best: step {best.get('step')})")
            checkpoint(at)
            return True
        return False

    def checkpoint(at: int) -> None:
        _save_checkpoint(out, drafter, optimizer, at, config, history, best, bad_evals, _measure(config),
                         scheduled_best)

    def step_loss(step: int, index: torch.Tensor):
        noise = torch.Generator(device=device).manual_seed(common.mix(config.seed, step))
        losses = batch_loss(drafter, train_set.tokens[index], train_set.labels[index], config, noise_generator=noise,
                            cond_mask=None if train_set.cond_mask is None else train_set.cond_mask[index])
        scalars = {name: value for name, value in losses.items() if value.ndim == 0}
        return losses["loss"], {**scalars, "accept_1": losses["accept"][0]}

    first = step
    if first == 0 and total > 0 and not history:  # a run resumed at step 0 has its baseline already
        evaluate(0)
    stopped_before = bool(config.patience) and bad_evals >= config.patience  # a resumed run that had stopped
    law_name = "ce" if config.law_loss == "ce" else config.law_loss.split("+")[0]
    # epoch e visits a permutation drawn from (seed, e) (common.shuffled); a short last batch is kept
    run = common.run_training(
        step_loss, optimizer, steps=first if stopped_before else total, first=first, size=len(train_set),
        batch_size=config.batch_size, seed=config.seed, grad_clip=config.grad_clip, parameters=drafter.parameters(),
        lr=lambda at: common.warmup_constant(at, config.lr, config.warmup_steps),
        hooks=[common.Every(config.eval_interval, evaluate), common.Every(config.checkpoint_interval, checkpoint)],
        postfix=lambda m: {"loss": f"{m['loss']:.4f}", law_name: f"{m[law_name]:.3f}",
                           "1-TV": f"{m['accept_1']:.3f}"},
        desc="train-drafter", progress=config.progress)
    if run.step == first:  # nothing left to train (e.g. resumed at the end): still leave a checkpoint
        checkpoint(first)
    try:
        plot_acceptance(history, out / ACCEPT_PLOT)
    except (OSError, ValueError, RuntimeError) as err:  # a plot never costs the run its export
        tqdm.write(f"could not plot {out / ACCEPT_PLOT}: {err}")
    if config.export and best:
        export_drafter(out / BEST, config.export, target, {**extra, "best": best})
    return DrafterTrainResult(drafter.eval(), run.step, history, run.seconds, run.per_second, best,
                              run.stopped or stopped_before)
