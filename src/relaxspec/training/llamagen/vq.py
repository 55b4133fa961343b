"""Train a small LlamaGen VQ tokenizer on the emoji data (arXiv 2406.06525, REFERENCE §2.3).

The architecture is :class:`~relaxspec.models.llamagen.vq.VQModel` unchanged, scaled down (32 px, ch_mult
(1, 2, 2): 4x downsampling, an 8x8 = 64-token grid; a 1024 x 8 codebook, L2-normalised at lookup
as upstream). The training-time parts of upstream's ``VectorQuantizer`` live here, not in the
model, so inference stays exactly what the official checkpoints run:

* the nearest code is searched exactly as at inference (:meth:`VectorQuantizer.nearest`);
* codebook loss ``|sg[z] - e|^2`` and commitment loss ``beta |z - sg[e]|^2`` (beta 0.25), both on
  the L2-normalised vectors, as upstream computes them;
* the straight-through estimator ``z + sg[e - z]`` carries the decoder's gradient to the encoder;
* reconstruction: L1 + L2 in pixel space. Upstream adds LPIPS and a GAN loss; neither network can
  be downloaded here, and at 32 px the plain losses already give sharp enough emoji.
* dead-code restart (not upstream; VQGAN-era practice, e.g. Dhariwal et al. 2005.00341 / Zeghidour
  et al. 2107.03312): every ``restart_interval`` steps, codes no batch has used since the last
  restart are moved onto random encoder outputs of the current batch, keeping usage high.

Training images are the train split with random +-2 px shifts on white and mirror flips (where a
mirrored emoji is still that emoji, :data:`relaxspec.data.emoji.NO_FLIP`), the same augmentation
the target's tokens are made with. Randomness is a pure function of ``(seed, step)``, so a run
resumed from ``out/train_state.pt`` continues bit for bit. Reported on the val split (unseen
emoji): PSNR of the uint8 reconstructions, and codebook usage (share of codes used, perplexity).

One command: ``relaxspec train-vq --data data/emoji --out out/vq`` (options: :mod:`relaxspec.cli.train`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from relaxspec.models.weights import load_strict, save_model
from relaxspec.data.emoji import ImageSet, augment, load_split
from relaxspec.devices import resolve_device
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_threads
from relaxspec.threads import set_threads
from relaxspec.models.llamagen.vq import VQConfig, VQModel, to_uint8
from relaxspec.runs import folder as run_folder
from relaxspec.training import common

STATE_VERSION = 1
RECIPE = "vq"
#: Fields a resumed run may change; everything else is the recipe.
RUN_FIELDS = ("out", "data", "device", "threads", "progress", "checkpoint_interval", "eval_interval",
              "export")


@dataclass
class VQTrainConfig(common.RecipeConfig):
    """Everything ``relaxspec train-vq`` can set; the defaults are the embedded tokenizer's recipe."""

    what = "VQ training"

    out: str = "out/vq"
    data: str = "data/emoji"
    # model: LlamaGen's VQ, scaled down
    codebook_size: int = 1024
    codebook_embed_dim: int = 8
    z_channels: int = 64
    ch: int = 32
    ch_mult: tuple[int, ...] = (1, 2, 2)
    num_res_blocks: int = 1
    norm_groups: int = 16
    # loss
    l1_weight: float = 1.0
    l2_weight: float = 1.0
    codebook_weight: float = 1.0
    commit_weight: float = 0.25  # upstream's beta
    restart_interval: int = 50  # steps between dead-code restarts (none in the last tenth); 0 = off
    # augmentation
    max_shift: int = 2
    flip: bool = True
    # optimisation
    steps: int = 1200  # ~15 minutes on one busy CPU core
    batch_size: int = 32
    lr: float = 1e-3
    min_lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 100
    grad_clip: float = 1.0  # 0 = off
    seed: int = 0
    bf16: bool = True  # bf16 autocast for the convolutions (the quantiser stays fp32)
    device: str = "cpu"
    threads: int | None = None  # torch CPU threads (default: relaxspec.threads.default_threads)
    eval_interval: int = 200
    checkpoint_interval: int = 200
    progress: bool = True
    export: str | None = None  # also write the final weights here in fp16 (the shipped format)

    def __post_init__(self) -> None:
        self.ch_mult = tuple(int(m) for m in self.ch_mult)
        self.betas = tuple(float(b) for b in self.betas)
        self.validate()

    def validate(self) -> None:
        need = common.need
        common.need_finite(self)
        need(bool(self.out), "out must name a folder")
        for name in ("l1_weight", "l2_weight", "codebook_weight", "commit_weight", "weight_decay", "grad_clip"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.l1_weight + self.l2_weight > 0, "l1_weight and l2_weight cannot both be 0")
        need(self.restart_interval >= 0, f"restart_interval must be >= 0 (0 = off), got {self.restart_interval}")
        need(self.max_shift >= 0, f"max_shift must be >= 0, got {self.max_shift}")
        need(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.lr > 0 and 0 <= self.min_lr <= self.lr, f"need 0 <= min_lr <= lr and lr > 0, got {self.min_lr}, {self.lr}")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas must be two numbers in [0, 1), got {self.betas}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.threads is not None:
            check_threads(self.threads, "threads")
        need(self.eval_interval >= 1 and self.checkpoint_interval >= 1, "eval and checkpoint intervals must be >= 1")
        self.model_config()  # validates the architecture

    def model_config(self) -> VQConfig:
        return VQConfig(codebook_size=self.codebook_size, codebook_embed_dim=self.codebook_embed_dim,
                        z_channels=self.z_channels, ch=self.ch, ch_mult=self.ch_mult,
                        num_res_blocks=self.num_res_blocks, norm_groups=self.norm_groups)



# ------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------


def to_pixels(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[B, H, W, 3]`` -> float ``[B, 3, H, W]`` in ``[-1, 1]`` (the inverse of
    :func:`~relaxspec.models.llamagen.vq.to_uint8`: ``to_uint8(to_pixels(x)) == x``)."""
    return images.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


#: The augmentation of the tokenizer and the target (:func:`relaxspec.data.emoji.augment`): the
#: uncovered border is white (every emoji's background), x shifts drawn before y, every draw made.
AUGMENT = {"padding": "white", "shift_order": "xy", "draw_unused": True}


def load_images(folder: str | Path, split: str) -> ImageSet:
    """A split of the emoji data set (:func:`relaxspec.data.emoji.load_split`) as tensors. The
    recipes mirror images only where their class allows it, so the class names must be known."""
    data = load_split(folder, split)
    if data.class_names is None:
        raise RelaxspecError(f"{Path(folder) / 'classes.json'}: no such file, and {split}.npz names no classes; "
                             f"which images may be mirrored depends on them (`relaxspec data --out {folder}` writes it)")
    return data.tensors()


# ------------------------------------------------------------------------------------------
# The training-time quantiser and the loss
# ------------------------------------------------------------------------------------------


def quantise(vq: VQModel, latents: torch.Tensor) -> dict[str, torch.Tensor]:
    """Upstream ``VectorQuantizer.forward`` for training: ``latents [B, D, h, w]`` (after
    ``quant_conv``) -> straight-through ``quantised [B, D, h, w]``, ``indices [B, h, w]``, the
    codebook loss ``mean |sg[z] - e|^2`` and the (unweighted) commitment loss ``mean |z - sg[e]|^2``,
    with ``z`` and ``e`` L2-normalised when the codebook is."""
    latents = latents.float()
    with torch.no_grad():
        indices = vq.quantize.nearest(latents)  # the same search as inference
    z = latents.permute(0, 2, 3, 1)
    if vq.config.codebook_l2_norm:
        z = F.normalize(z, p=2, dim=-1)
    e = vq.quantize.lookup_table()[indices]  # [B, h, w, D]
    codebook_loss = (e - z.detach()).pow(2).mean()
    commit_loss = (z - e.detach()).pow(2).mean()
    quantised = z + (e - z).detach()  # straight-through: forward e, backward identity
    return {"quantised": quantised.permute(0, 3, 1, 2), "indices": indices, "z": z.detach(),
            "codebook_loss": codebook_loss, "commit_loss": commit_loss}


def vq_loss(vq: VQModel, pixels: torch.Tensor, config: VQTrainConfig) -> dict[str, torch.Tensor]:
    """Encode, quantise, decode ``pixels [B, 3, H, W]``; the weighted loss and its parts."""
    with torch.autocast(pixels.device.type, dtype=torch.bfloat16, enabled=config.bf16):
        latents = vq.quant_conv(vq.encoder(pixels))
    q = quantise(vq, latents)
    with torch.autocast(pixels.device.type, dtype=torch.bfloat16, enabled=config.bf16):
        recon = vq.decoder(vq.post_quant_conv(q["quantised"])).float()
    l1 = (recon - pixels).abs().mean()
    l2 = (recon - pixels).pow(2).mean()
    loss = (config.l1_weight * l1 + config.l2_weight * l2 + config.codebook_weight * q["codebook_loss"]
            + config.commit_weight * q["commit_loss"])
    return {"loss": loss, "l1": l1, "l2": l2, "codebook_loss": q["codebook_loss"],
            "commit_loss": q["commit_loss"], "indices": q["indices"], "z": q["z"]}


@torch.no_grad()
def restart_dead_codes(vq: VQModel, optimizer: torch.optim.Optimizer, usage: torch.Tensor, z: torch.Tensor,
                       generator: torch.Generator) -> int:
    """Move every code with ``usage == 0`` onto a random row of ``z [N, D]`` (this batch's
    normalised encoder outputs) and clear its AdamW moments; returns how many moved."""
    dead = torch.nonzero(usage == 0).flatten()
    if dead.numel() == 0:
        return 0
    pick = torch.randint(0, z.shape[0], (dead.numel(),), generator=generator)
    weight = vq.quantize.embedding.weight
    weight[dead] = z[pick].to(weight.dtype)
    state = optimizer.state.get(weight, {})
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key][dead] = 0
    return int(dead.numel())


@torch.no_grad()
def evaluate_vq(vq: VQModel, images: torch.Tensor, batch_size: int = 128) -> dict[str, float]:
    """Reconstruct uint8 ``images [n, H, W, 3]`` in fp32 and measure what a user sees.

    ``psnr``: mean over images of ``10 log10(255^2 / MSE)`` between the image and its uint8
    reconstruction (capped at 100 dB); ``l1``: mean absolute pixel error in [0, 255];
    ``usage``: share of the codebook these images use; ``perplexity``: ``exp`` of the entropy of
    their code histogram (the number of equally used codes it is worth)."""
    was_training = vq.training
    vq.eval()
    psnrs, l1s, counts = [], [], torch.zeros(vq.config.codebook_size)
    for start in range(0, images.shape[0], batch_size):
        batch = images[start : start + batch_size]
        tokens = vq.encode(to_pixels(batch))
        counts += torch.bincount(tokens.flatten(), minlength=vq.config.codebook_size).float()
        recon = to_uint8(vq.decode(tokens)).float()
        err = recon - batch.float()
        mse = err.pow(2).flatten(1).mean(1)
        psnrs.append(torch.where(mse > 0, 10 * torch.log10(255.0**2 / mse.clamp_min(1e-10)), torch.full_like(mse, 100.0)))
        l1s.append(err.abs().flatten(1).mean(1))
    vq.train(was_training)
    share = counts / counts.sum().clamp_min(1)
    entropy = -(share[share > 0] * share[share > 0].log()).sum()
    return {"psnr": float(torch.cat(psnrs).mean()), "l1": float(torch.cat(l1s).mean()),
            "usage": float((counts > 0).float().mean()), "perplexity": float(entropy.exp())}


# ------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------


def read_train_state(out: str | Path) -> dict:
    return run_folder.read_train_state(out, STATE_VERSION, RECIPE)


def _save_checkpoint(out: Path, vq: VQModel, optimizer: torch.optim.Optimizer, step: int, usage: torch.Tensor,
                     restarted: int, config: VQTrainConfig, history: list[dict]) -> None:
    extra = {"training": {"step": step, "recipe": "relaxspec train-vq", "metrics": history[-1] if history else {}}}
    common.publish_model(out, vq, kind="vq", extra=extra)
    run_folder.save_train_state(out, {
        "format_version": STATE_VERSION, "recipe": RECIPE, "step": step,
        "model": {k: v.detach().cpu().clone() for k, v in vq.state_dict().items()},
        "optimizer": optimizer.state_dict(), "usage": usage.clone(), "restarted": restarted, "rng": common.rng_state(),
        "config": config.to_dict(), "history": history,
    })


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


@dataclass
class VQTrainResult:
    vq: VQModel
    step: int
    history: list[dict]  # evaluations: {"step", "val": {...}, "train": {...}, "loss", "restarted"}
    seconds: float  # training steps only
    images_per_second: float


def train_vq(config: VQTrainConfig, *, train: ImageSet | None = None, val: ImageSet | None = None,
             resume: bool = False) -> VQTrainResult:
    """Train (or, with ``resume``, continue) a VQ tokenizer; writes ``config.out``."""
    out = Path(config.out)
    saved = run_folder.fresh_or_resume(out, resume, STATE_VERSION, RECIPE)
    if saved is not None:
        common.check_resumable(saved["config"], config.to_dict(), RUN_FIELDS)
    device = resolve_device(config.device)
    set_threads(config.threads, device, name="threads")
    train = (train if train is not None else load_images(config.data, "train")).tensors()
    val = (val if val is not None else load_images(config.data, "val")).tensors()
    if len(train) == 0:
        raise RelaxspecError("no training images")
    size = train.images.shape[1]
    if size % config.model_config().downsample_factor:
        raise RelaxspecError(f"{size} px images do not divide into the tokenizer's "
                             f"{config.model_config().downsample_factor}x downsampling")
    train_probe = train.images[common.probe_index(len(train), max(len(val), 256))]  # un-augmented, vs val

    torch.manual_seed(config.seed)
    vq = VQModel(config.model_config()).to(device).train()
    optimizer = torch.optim.AdamW(vq.parameters(), lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    usage = torch.zeros(config.codebook_size, dtype=torch.long)  # code counts since the last restart
    step, history, restarted = 0, [], 0  # restarted: codes moved since the last evaluation
    out.mkdir(parents=True, exist_ok=True)
    if saved is not None:
        load_strict(vq, saved["model"], str(out / run_folder.TRAIN_STATE))
        optimizer.load_state_dict(saved["optimizer"])
        common.set_rng_state(saved["rng"])
        step, history, usage = int(saved["step"]), list(saved["history"]), saved["usage"].clone()
        restarted = int(saved.get("restarted", 0))
        common.rewrite_metrics(out, history)
    steps_per_epoch = math.ceil(len(train) / config.batch_size)
    last_loss: dict[str, float] = {}

    def evaluate(at: int) -> None:
        nonlocal restarted
        record = {"step": at, "epoch": round(at / steps_per_epoch, 2), **last_loss, "restarted": restarted,
                  "train": evaluate_vq(vq, train_probe)}
        if len(val):
            record["val"] = evaluate_vq(vq, val.images)
        restarted = 0
        history.append(record)
        shown = record.get("val", record["train"])
        common.log_metrics(out, record, f"step {at}: {'val' if len(val) else 'train'} psnr {shown['psnr']:.2f} dB "
                           f"(train {record['train']['psnr']:.2f}) usage {shown['usage']:.3f} "
                           f"perplexity {shown['perplexity']:.0f} loss {last_loss.get('loss', float('nan')):.4f}")

    def checkpoint(at: int) -> None:
        _save_checkpoint(out, vq, optimizer, at, usage, restarted, config, history)

    train_may_flip = train.may_flip & config.flip
    batch: dict = {}  # the last step's codes, encoder outputs and generator, for the dead-code restart

    def step_loss(step: int, index: torch.Tensor):
        generator = torch.Generator().manual_seed(common.mix(config.seed + 1, step))
        pixels = to_pixels(augment(train.images[index], train_may_flip[index], generator, config.max_shift,
                                   **AUGMENT)).to(device)
        losses = vq_loss(vq, pixels, config)
        batch.update(indices=losses["indices"], z=losses["z"], generator=generator)
        return losses["loss"], {k: losses[k] for k in ("loss", "l1", "l2", "codebook_loss", "commit_loss")}

    def after_step(step: int, metrics: dict) -> None:
        nonlocal restarted, last_loss
        usage.add_(torch.bincount(batch["indices"].flatten().cpu(), minlength=config.codebook_size))
        done = step + 1
        # no restarts in the last tenth: let the final codes settle with the decoder
        if config.restart_interval and done % config.restart_interval == 0 and done <= 0.9 * config.steps:
            restarted += restart_dead_codes(vq, optimizer, usage.to(device), batch["z"].flatten(0, 2),
                                            batch["generator"])
            usage.zero_()
        last_loss = metrics

    first = step
    if first == 0 and config.steps > 0:
        evaluate(0)
    run = common.run_training(
        step_loss, optimizer, steps=config.steps, first=first, size=len(train), batch_size=config.batch_size,
        seed=config.seed, grad_clip=config.grad_clip, parameters=vq.parameters(), on_step=after_step,
        lr=lambda at: common.warmup_cosine(at, config.steps, config.lr, config.warmup_steps, config.min_lr),
        hooks=[common.Every(config.eval_interval, evaluate), common.Every(config.checkpoint_interval, checkpoint)],
        postfix=lambda m: {"loss": f"{m['loss']:.4f}", "l1": f"{m['l1']:.4f}"},
        desc="train-vq", progress=config.progress)
    if run.step == first:  # nothing left to train (resumed at the end): still leave a checkpoint
        checkpoint(first)
    vq.eval()
    if config.export:
        export_vq(vq, config.export, history[-1] if history else {}, val)
    return VQTrainResult(vq, run.step, history, run.seconds, run.per_second)


def export_vq(vq: VQModel, folder: str | Path, metrics: dict, val: ImageSet | None = None) -> dict:
    """Write ``vq`` in fp16 (the shipped format). Given ``val``, the fp16-rounded weights are
    measured as they will be loaded (into fp32) and recorded as ``val_fp16`` in its config.json."""
    shipped = {}
    if val is not None and len(val):
        rounded = VQModel(vq.config)
        load_strict(rounded, {k: v.detach().cpu().to(torch.float16) if v.is_floating_point() else v
                              for k, v in vq.state_dict().items()}, "export")
        shipped = evaluate_vq(rounded.eval(), val.images)
    training = {"recipe": "relaxspec train-vq", "metrics": metrics, **({"val_fp16": shipped} if shipped else {})}
    save_model(vq, folder, dtype=torch.float16, extra={"training": training})
    return shipped
