"""Train a small LlamaGen class-to-image target on VQ tokens of the emoji data (arXiv 2406.06525).

The model is :class:`~relaxspec.models.llamagen.gpt.Transformer` unchanged (c2i, 2D RoPE, SwiGLU, RMSNorm,
head dim 64 as every LlamaGen size), scaled down: an 8x8 token grid (32 px through a 4x VQ),
the VQ's 1024 codes as vocabulary, one class per emoji subcategory plus the null class.

The recipe, nanoGPT style (one loop, a validated config, every field a command-line option):

* data: the train split, tokenised once by the (frozen) VQ tokenizer, ``copies`` times per image:
  copy 0 is the image itself, the others are augmented with random +-2 px translations on white
  and mirror flips (:func:`relaxspec.data.emoji.augment`). Why: with ~3.4k images a 30M-parameter
  model memorises the token sequences within a few epochs. A 2 px shift is half a token cell of
  the 4x tokenizer, so it changes *every* token of the sequence while leaving the emoji (and its
  class) intact, and a mirror image is another plausible emoji of the same class; the model has
  to learn what the class looks like rather than 64 fixed tokens. Larger shifts would cut into
  the emoji (they fill the frame); flips are skipped where mirroring changes meaning (text,
  digits, flags, clocks: :data:`~relaxspec.data.emoji.NO_FLIP`). The augmented tokens are made
  once, before training, so every step is a pure transformer step;
* classifier-free guidance: each label is replaced by the null class with probability
  ``class_dropout`` (LlamaGen: 0.1), so the unconditional stream is trained too;
* loss: next-token cross-entropy over the 64 image tokens; AdamW, warm-up + cosine (nanoGPT),
  weight decay on matrices only, bf16 autocast;
* held-out evaluation: NLL per token on the val split (emoji never seen, un-augmented) next to the
  same measure on as many un-augmented *train* images; the gap is the memorisation. The best-val
  weights are kept in ``out/best`` (and exported); training stops early after ``patience``
  evaluations without a better val NLL.

Randomness is a pure function of ``(seed, step)``; the tokens are cached in ``out/tokens.npz``;
a run resumed from ``out/train_state.pt`` continues bit for bit.

One command: ``relaxspec train-gpt --data data/emoji --vq-ckpt out/vq --out out/gpt``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq
from relaxspec.models.weights import load_strict, read_state, save_model
from relaxspec.data.emoji import ImageSet, augment, load_classes
from relaxspec.devices import resolve_device
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_threads
from relaxspec.threads import set_threads
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.models.llamagen.vq import VQModel
from relaxspec.runs import folder as run_folder
from relaxspec.training import common
from relaxspec.training.llamagen.vq import AUGMENT, load_images, to_pixels

STATE_VERSION = 1
RECIPE = "gpt"
TOKENS = "tokens.npz"
BEST = common.BEST
RUN_FIELDS = ("out", "data", "vq_ckpt", "device", "threads", "progress", "checkpoint_interval", "export",
              "patience")  # patience only decides when to stop: a stopped run may continue with more


@dataclass
class GPTTrainConfig(common.RecipeConfig):
    """Everything ``relaxspec train-gpt`` can set; the defaults are the embedded target's recipe."""

    what = "GPT training"

    out: str = "out/gpt"
    data: str = "data/emoji"
    vq_ckpt: str = "out/vq"
    # model (vocabulary, classes and grid come from the tokenizer and the data)
    dim: int = 384
    n_layer: int = 6
    n_head: int = 6
    init_from: str | None = None  # grow from this trained target (same width, fewer layers)
    # data
    copies: int = 16  # tokenised copies per training image: the image + (copies - 1) augmented
    max_shift: int = 2
    flip: bool = True
    class_dropout: float = 0.1
    # optimisation
    steps: int = 1500  # ~30 minutes on one busy CPU core at the default size (the shipped target)
    batch_size: int = 32
    lr: float = 1e-3  # nanoGPT shakespeare-char, a model of this size
    min_lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    warmup_steps: int = 100
    grad_clip: float = 1.0  # 0 = off
    seed: int = 0
    bf16: bool = True
    device: str = "cpu"
    threads: int | None = None
    eval_interval: int = 100
    patience: int = 5  # evaluations without a better val NLL before stopping; 0 = never stop early
    checkpoint_interval: int = 100
    progress: bool = True
    export: str | None = None  # also write the best-val weights here in fp16 (the shipped format)

    def __post_init__(self) -> None:
        self.betas = tuple(float(b) for b in self.betas)
        self.validate()

    def validate(self) -> None:
        need = common.need
        common.need_finite(self)
        need(bool(self.out), "out must name a folder")
        need(self.copies >= 1, f"copies must be >= 1, got {self.copies}")
        need(self.max_shift >= 0, f"max_shift must be >= 0, got {self.max_shift}")
        need(0 <= self.class_dropout < 1, f"class_dropout must lie in [0, 1), got {self.class_dropout}")
        need(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"need 0 <= min_lr <= lr and lr > 0, got {self.min_lr}, {self.lr}")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas must be two numbers in [0, 1), got {self.betas}")
        for name in ("weight_decay", "grad_clip", "warmup_steps", "patience"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        if self.threads is not None:
            check_threads(self.threads, "threads")
        need(self.eval_interval >= 1 and self.checkpoint_interval >= 1, "eval and checkpoint intervals must be >= 1")
        GPTConfig(dim=self.dim, n_layer=self.n_layer, n_head=self.n_head, vocab_size=16, num_classes=1, block_size=16)
        need(self.init_from is None or bool(self.init_from), "init_from must name a checkpoint")

    def model_config(self, vocab_size: int, num_classes: int, block_size: int) -> GPTConfig:
        return GPTConfig(dim=self.dim, n_layer=self.n_layer, n_head=self.n_head, vocab_size=vocab_size,
                         num_classes=num_classes, block_size=block_size, model_type="c2i")



# ------------------------------------------------------------------------------------------
# Tokens
# ------------------------------------------------------------------------------------------


@dataclass
class TokenSet:
    """``tokens [n, N]`` int64 image-token sequences and ``labels [n]`` class ids."""

    tokens: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]


@dataclass
class TokenData:
    train: TokenSet  # the augmented copies the model trains on
    train_clean: TokenSet  # copy 0 of every train image, for the train-side NLL
    val: TokenSet  # the val images, un-augmented
    seconds: float = 0.0  # time spent tokenising (0 when read from the cache)


@torch.no_grad()
def encode(vq: VQModel, images: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """uint8 ``[n, H, W, 3]`` -> tokens ``[n, N]`` int64 (fp32 VQ, as decoding will use it)."""
    chunks = [vq.encode(to_pixels(images[i : i + batch_size])) for i in range(0, images.shape[0], batch_size)]
    return torch.cat(chunks) if chunks else torch.zeros(0, 0, dtype=torch.long)


def tokenise(vq: VQModel, train: ImageSet, val: ImageSet, config: GPTTrainConfig) -> TokenData:
    """Copy 0 of each train image is the image; copy ``c >= 1`` is :func:`augment` with a
    generator seeded from ``(seed, c)`` over the whole train set."""
    start = time.perf_counter()
    clean = encode(vq, train.images)
    parts, labels = [clean], [train.labels]
    for copy in range(1, config.copies):
        generator = torch.Generator().manual_seed(common.mix(config.seed + 2, copy))
        images = augment(train.images, train.may_flip & config.flip, generator, config.max_shift, **AUGMENT)
        parts.append(encode(vq, images))
        labels.append(train.labels)
    return TokenData(TokenSet(torch.cat(parts), torch.cat(labels)), TokenSet(clean, train.labels),
                     TokenSet(encode(vq, val.images), val.labels), time.perf_counter() - start)


def _file_hash(folder: str | Path) -> str:
    path = Path(folder)
    path = path / "model.safetensors" if path.is_dir() else path
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def read_tokens(out: str | Path) -> tuple[dict, TokenData]:
    """``out/tokens.npz``: the key it was made under and the tokens."""
    path = Path(out) / TOKENS
    try:
        with np.load(path, allow_pickle=False) as cached:
            def part(name: str) -> TokenSet:
                return TokenSet(torch.from_numpy(cached[f"{name}_tokens"].astype(np.int64)),
                                torch.from_numpy(cached[f"{name}_labels"].astype(np.int64)))

            return json.loads(str(cached["key"])), TokenData(part("train"), part("train_clean"), part("val"))
    except (OSError, KeyError, ValueError) as err:
        raise RelaxspecError(f"{path}: not a token cache ({err})") from None


def load_or_make_tokens(out: Path, vq: VQModel, config: GPTTrainConfig, train: ImageSet, val: ImageSet,
                        resume: bool) -> TokenData:
    """The cached ``out/tokens.npz`` when it was made from the same tokenizer and recipe, else new
    tokens (refused when resuming: the run would not be the one it continues)."""
    key = {"vq_sha256": _file_hash(config.vq_ckpt), "copies": config.copies, "max_shift": config.max_shift,
           "flip": config.flip, "seed": config.seed, "train": len(train), "val": len(val)}
    path = out / TOKENS
    if path.is_file():
        cached_key, data = read_tokens(out)
        if cached_key == key:
            return data
        if resume:
            raise RelaxspecError(f"{path}: the cached tokens were made with another tokenizer or data; "
                                 f"this run cannot be resumed with --vq-ckpt {config.vq_ckpt}")
    data = tokenise(vq, train, val, config)
    arrays = {"key": np.array(json.dumps(key, sort_keys=True))}
    for name, split in (("train", data.train), ("train_clean", data.train_clean), ("val", data.val)):
        arrays[f"{name}_tokens"] = split.tokens.numpy().astype(np.int16 if vq.config.codebook_size <= 32768 else np.int32)
        arrays[f"{name}_labels"] = split.labels.numpy()
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (TOKENS + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)
    return data


# ------------------------------------------------------------------------------------------
# Loss and evaluation
# ------------------------------------------------------------------------------------------


def token_nll(model: Transformer, labels: torch.Tensor, tokens: torch.Tensor, bf16: bool) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) of ``tokens [B, N]`` under ``labels [B]``."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model.forward_train(labels, tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


@torch.no_grad()
def evaluate_nll(model: Transformer, data: TokenSet, batch_size: int = 64, bf16: bool = True) -> float:
    """Mean NLL per token (nats) over ``data``, conditioned on the true classes."""
    was_training = model.training
    model.eval()
    device = model.output.weight.device
    total = 0.0
    for start in range(0, len(data), batch_size):
        stop = min(start + batch_size, len(data))
        nll = token_nll(model, data.labels[start:stop].to(device), data.tokens[start:stop].to(device), bf16)
        total += float(nll) * (stop - start)
    model.train(was_training)
    return total / max(len(data), 1)


def _param_groups(model: Transformer, weight_decay: float) -> list[dict]:
    """nanoGPT: decay matrices and embeddings, not norm gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------


def read_train_state(out: str | Path) -> dict:
    return run_folder.read_train_state(out, STATE_VERSION, RECIPE)


# ------------------------------------------------------------------------------------------
# Growing a trained target
# ------------------------------------------------------------------------------------------


def grow(model: Transformer, source: Transformer) -> list[int]:
    """Initialise ``model`` from the shallower trained ``source`` so that both compute the same
    function: source block ``i`` goes to block ``i * L // l`` (spread evenly), the other blocks
    keep their random weights but start as the identity (attention ``wo`` and FFN ``w2`` zeroed,
    so the residual stream passes through untouched; their first gradient step wakes them up),
    and embeddings, final norm and head are copied. Returns where the source blocks went.

    Function-preserving growth (Net2Net, arXiv 1511.05641; "stacking" for transformers,
    arXiv 2011.13635) lets a deeper target continue from the shallow one's loss instead of
    starting over — on a 2-core CPU that is the difference between an hour and three."""
    mine, theirs = model.config, source.config
    same = ("dim", "n_head", "n_kv_head", "vocab_size", "num_classes", "block_size", "model_type", "cls_token_num",
            "multiple_of", "ffn_dim_multiplier", "rope_base", "norm_eps")
    for name in same:
        if getattr(mine, name) != getattr(theirs, name):
            raise RelaxspecError(f"init_from: the source target has {name}={getattr(theirs, name)!r}, "
                                 f"this recipe builds {name}={getattr(mine, name)!r}; growth only adds layers")
    if theirs.n_layer > mine.n_layer:
        raise RelaxspecError(f"init_from: the source target has {theirs.n_layer} layers, more than the "
                             f"{mine.n_layer} asked for; growth only adds layers")
    placed = [i * mine.n_layer // theirs.n_layer for i in range(theirs.n_layer)]
    with torch.no_grad():
        for index, layer in enumerate(model.layers):
            if index in placed:
                layer.load_state_dict(source.layers[placed.index(index)].state_dict())
            else:
                common.start_as_identity(layer)
        for name in ("cls_embedding", "tok_embeddings", "norm", "output"):
            getattr(model, name).load_state_dict(getattr(source, name).state_dict())
    return placed


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


@dataclass
class GPTTrainResult:
    model: Transformer  # the best-val weights (the last ones when nothing was evaluated)
    step: int
    best: dict  # the best evaluation: {"step", "epoch", "train_nll", "val_nll", ...}
    history: list[dict]
    seconds: float  # training steps only
    sequences_per_second: float
    tokenise_seconds: float
    stopped_early: bool


def train_gpt(config: GPTTrainConfig, *, vq: VQModel | None = None, train: ImageSet | None = None,
              val: ImageSet | None = None, num_classes: int | None = None, resume: bool = False) -> GPTTrainResult:
    """Train (or, with ``resume``, continue) a c2i target on VQ tokens; writes ``config.out``."""
    out = Path(config.out)
    saved = run_folder.fresh_or_resume(out, resume, STATE_VERSION, RECIPE)
    if saved is not None:
        common.check_resumable(saved["config"], config.to_dict(), RUN_FIELDS)
    device = resolve_device(config.device)
    set_threads(config.threads, device, name="threads")
    vq = vq if vq is not None else load_vq(config.vq_ckpt, device="cpu")
    vq.eval().requires_grad_(False)
    train = (train if train is not None else load_images(config.data, "train")).tensors()
    val = (val if val is not None else load_images(config.data, "val")).tensors()
    num_classes = num_classes if num_classes is not None else len(load_classes(config.data))
    if len(train) == 0:
        raise RelaxspecError("no training images")
    common.check_trainable(f"--dim {config.dim:,} x --n-layer {config.n_layer:,}", "target", lambda n: Transformer(
        dataclasses.replace(config.model_config(vq.config.codebook_size, num_classes, 16), n_layer=n)),
        config.n_layer, device)
    out.mkdir(parents=True, exist_ok=True)
    data = load_or_make_tokens(out, vq, config, train, val, resume)
    grid = data.train.tokens.shape[1]
    model_config = config.model_config(vq.config.codebook_size, num_classes, grid)
    index = common.probe_index(len(data.train_clean), max(len(data.val), 256))  # train images, un-augmented
    probe = TokenSet(data.train_clean.tokens[index], data.train_clean.labels[index])

    torch.manual_seed(config.seed)
    model = Transformer(model_config)
    extra = {"vq_sha256": _file_hash(config.vq_ckpt), "recipe": "relaxspec train-gpt"}
    if config.init_from:
        extra["init_from_sha256"] = _file_hash(config.init_from)
        if saved is None:  # a resumed run loads its own weights below
            grow(model, load_gpt(config.init_from, device="cpu"))
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(_param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas)
    step, history, best, bad_evals, running = 0, [], {}, 0, []  # running: train losses since the last evaluation
    if saved is not None:
        load_strict(model, saved["model"], str(out / run_folder.TRAIN_STATE))
        optimizer.load_state_dict(saved["optimizer"])
        common.set_rng_state(saved["rng"])
        step, history, best = int(saved["step"]), list(saved["history"]), dict(saved["best"])
        bad_evals, running = int(saved["bad_evals"]), list(saved["running"])
        common.rewrite_metrics(out, history)
    steps_per_epoch = math.ceil(len(data.train) / config.batch_size)

    def evaluate(at: int) -> None:
        nonlocal bad_evals, best
        record = {"step": at, "epoch": round(at / steps_per_epoch, 3),
                  "image_epochs": round(at * config.batch_size / len(train), 2),
                  "train_loss": round(sum(running) / len(running), 5) if running else None,
                  "train_nll": evaluate_nll(model, probe, bf16=config.bf16)}
        if len(data.val):
            record["val_nll"] = evaluate_nll(model, data.val, bf16=config.bf16)
        running.clear()
        score = record.get("val_nll", record["train_nll"])
        improved = not best or score < best.get("val_nll", best["train_nll"])
        if improved:
            best, bad_evals = dict(record), 0
            common.publish_model(out, model, name=BEST, extra={"training": {**extra, "best": record}})
        else:
            bad_evals += 1
        record["best"] = improved
        history.append(record)
        line = f"step {at} (epoch {record['epoch']:.2f}): train nll {record['train_nll']:.4f}"
        if "val_nll" in record:
            line += f" val nll {record['val_nll']:.4f}"
        common.log_metrics(out, record, line + (" (best)" if improved else f" (best: step {best['step']})"))

    def checkpoint(at: int) -> None:
        common.publish_model(out, model, extra={"training": {**extra, "step": at}})
        run_folder.save_train_state(out, {
            "format_version": STATE_VERSION, "recipe": RECIPE, "step": at,
            "model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(), "rng": common.rng_state(), "config": config.to_dict(),
            "history": history, "best": best, "bad_evals": bad_evals, "running": running,
        })

    def evaluate_or_stop(at: int) -> bool:
        evaluate(at)
        if config.patience and bad_evals >= config.patience:
            checkpoint(at)
            tqdm.write(f"stopping early: no better val NLL in {bad_evals} evaluations (best: step {best['step']})")
            return True
        return False

    def step_loss(step: int, index: torch.Tensor):
        generator = torch.Generator().manual_seed(common.mix(config.seed + 1, step))
        labels = data.train.labels[index].clone()
        labels[torch.rand(len(index), generator=generator) < config.class_dropout] = num_classes  # the null class
        loss = token_nll(model, labels.to(device), data.train.tokens[index].to(device), config.bf16)
        return loss, {"loss": loss}

    first = step
    if first == 0 and config.steps > 0:
        evaluate(0)
    stopped = bool(config.patience) and bad_evals >= config.patience  # a resumed run that had stopped
    run = common.run_training(
        step_loss, optimizer, steps=first if stopped else config.steps, first=first, size=len(data.train),
        batch_size=config.batch_size, seed=config.seed, grad_clip=config.grad_clip, parameters=model.parameters(),
        lr=lambda at: common.warmup_cosine(at, config.steps, config.lr, config.warmup_steps, config.min_lr),
        on_step=lambda at, metrics: running.append(metrics["loss"]),
        hooks=[common.Every(config.eval_interval, evaluate_or_stop),
               common.Every(config.checkpoint_interval, checkpoint)],
        postfix=lambda m: {"loss": f"{m['loss']:.4f}", "lr": f"{optimizer.param_groups[0]['lr']:.2e}"},
        desc="train-gpt", progress=config.progress)
    stopped = stopped or run.stopped
    done = run.step
    if done == first:  # nothing left to train (resumed at the end): still leave a checkpoint
        checkpoint(done)
    if best:  # hand back (and export) the best-val weights, not the last
        model = Transformer(model_config)
        load_strict(model, read_state(out / BEST).state_dict, str(out / BEST))
        model = model.to(device)
    model.eval()
    if config.export:
        export_gpt(model, config.export, {**extra, "best": best}, {"train": probe, "val": data.val})
    return GPTTrainResult(model, done, best, history, run.seconds, run.per_second, data.seconds, stopped)


def export_gpt(model: Transformer, folder: str | Path, training: dict, measure: dict[str, TokenSet]) -> dict:
    """Write ``model`` in fp16 (the shipped format), with the NLLs of the fp16-rounded weights run
    in fp32 (as they will be loaded) on each set of ``measure`` recorded in its config.json."""
    rounded = Transformer(model.config)
    load_strict(rounded, {k: v.detach().cpu().to(torch.float16) for k, v in model.state_dict().items()}, "export")
    shipped = {f"{name}_nll": evaluate_nll(rounded, data, bf16=False) for name, data in measure.items() if len(data)}
    save_model(model, folder, dtype=torch.float16, extra={"training": {**training, "fp16_fp32": shipped}})
    return shipped
