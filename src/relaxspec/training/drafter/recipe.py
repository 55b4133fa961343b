"""The recipe: train an EAGLE drafter on a frozen target's features, one readable loop (nanoGPT
style) around :func:`relaxspec.training.common.run_training`.

``chain_mal`` (``1 + sum_d prod_{i <= d} accept_i``, an estimate of a chain of ``eval_depths``
drafts' tokens per step that treats the depths' mean rates as independent) scores the evaluations
of trained weights (step 0 is the untrained baseline): the best of the scheduled evaluations and
the run's last one are kept in ``out/best``, and training stops after ``patience`` scheduled
evaluations without a better one. With CFG the drafter runs on both streams, so each sequence is
also used under the null condition (``null_fraction`` of every batch; 1.0 = every sequence
contributes both streams).

Randomness is a pure function of ``(seed, step)``: the data order of epoch ``e`` comes from
``(seed, e)`` and the feature noise of step ``s`` from ``(seed, s)``. Resuming from
``out/train_state.pt`` (weights, optimizer, step, config; plain tensors and dicts, so it loads
with ``weights_only=True``) therefore continues bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from relaxspec.devices import check_fits, resolve_device
from relaxspec.drafting.eagle import LLAMAGEN, DrafterConfig, EagleDrafter, drafter_config, load_drafter
from relaxspec.errors import RelaxspecError, SaidByRankZero
from relaxspec.models.base import TargetModel, TeacherForcedTarget
from relaxspec.models.weights import load_strict
from relaxspec.training import common, distributed
from relaxspec.runs.folder import TRAIN_STATE, hold_folder, save_train_state
from relaxspec.runs.shards import local_processes
from relaxspec.threads import set_threads
from relaxspec.training.drafter.checkpoints import (
    ACCEPT_PLOT,
    export_drafter,
    plot_acceptance,
    prior_state,
    save_checkpoint,
)
from relaxspec.training.drafter.config import BEST, PREPARING, STATE_VERSION, DrafterTrainConfig, check_resume
from relaxspec.training.drafter.data import DrafterDataset, Shard, build_dataset
from relaxspec.training.drafter.maths import chain_mal
from relaxspec.training.drafter.passes import batch_loss
from relaxspec.files import read_prompts_file
from relaxspec.models.llamagen.gpt import Transformer
from relaxspec.pipelines.llamagen import llamagen_pipeline, open_tokenizer
from relaxspec.pipelines import open_pipeline
from relaxspec.pipelines.open import choose_family
from relaxspec.pipelines.families import file_families


@torch.no_grad()
def evaluate_drafter(drafter: EagleDrafter, dataset: DrafterDataset, config: DrafterTrainConfig | None = None,
                     *, max_sequences: int | None = None) -> dict:
    """Without noise, averaged over the rows of ``dataset``: the loss and its terms, and per draft
    depth ``1 .. config.eval_depths`` the mean ``1 - TV(p, q)`` (``accept``, a list) and top-1
    agreement (``top1``); ``accuracy`` is depth 1's, ``chain_mal`` the chain's tokens per step.
    Under CFG every row runs both streams, as decoding runs them (``null_fraction`` is what
    training uses; at 0.5 an evaluation batch of one row would have had no law to measure)."""
    config = config or DrafterTrainConfig()
    if config.sampling.use_cfg and config.null_fraction < 1.0:
        config = dataclasses.replace(config, null_fraction=1.0)
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


def _measure(config: DrafterTrainConfig) -> dict:
    """What an evaluation's chain MAL depends on besides the weights (a resume may change it)."""
    return {"eval_depths": config.eval_depths, "eval_sequences": config.eval_sequences}


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
    prompts = read_prompts_file(config.prompts_file)
    if not prompts:
        raise RelaxspecError(f"--prompts-file {config.prompts_file}: no prompts in the file")
    return prompts


def _around(target: TargetModel, inputs: dict):
    """The pipeline of a LlamaGen target given in memory: it formats conditions (a t2i one's
    prompts with its ``t5_path``) and paints nothing. ``None`` for a target of another kind."""
    return llamagen_pipeline(target, **inputs) if isinstance(target, Transformer) else None


def _tokenizer_of(target: TargetModel, config: DrafterTrainConfig):
    """The image tokenizer of a target given in memory, for ``images``: a LlamaGen target's VQ file
    alone (its family's ``vq_ckpt``), any other's with the model ``config`` names."""
    if isinstance(target, Transformer):
        return open_tokenizer(config.inputs, target.device)
    return _open_named(config, None, target.device).tokenizer


def _open_named(config: DrafterTrainConfig, prompts: list[str] | None, device: torch.device | None = None):
    """The pipeline of the target ``config`` names, opened as every command opens one
    (:func:`relaxspec.pipelines.open_pipeline`: any family's files or model folder, with its
    ``config.inputs``); its image tokenizer only where ``images`` needs it (a family may leave out
    one of its own files then)."""
    device = device or resolve_device(config.device)
    if choose_family(config.model_path, config.inputs) is None:
        named = " or ".join(["--model-path DIR"] + [f"{f.opened_with} ({f.family})" for f in file_families()])
        raise RelaxspecError(f"no target: give {named}")
    return open_pipeline(config.model_path, device=device, precision=config.precision, image_size=config.image_size,
                         prompts=prompts, with_drafter=False, with_tokenizer=config.images is not None,
                         **config.inputs)


def _open(config: DrafterTrainConfig, target: TargetModel | None, dataset: DrafterDataset | None,
          device: torch.device | None = None):
    """:func:`open_target`, and the image tokenizer it opened with the target (for ``images``),
    else ``None``."""
    prompts = None
    if config.prompts_file is not None and (target is None or dataset is None):
        prompts = _read_prompts(config)
    vq = None
    if target is None:
        pipeline = _open_named(config, prompts, device)
        target, vq = pipeline.target, pipeline.tokenizer
    else:  # already open: only its prompts may need formatting (a LlamaGen target's, by its pipeline)
        pipeline = _around(target, config.inputs) if prompts is not None and dataset is None else None
        if config.images is not None and dataset is None:  # the tokenizer that encodes them, by the family's inputs
            vq = _tokenizer_of(target, config)
    conditions = None
    if prompts is not None and dataset is None:
        if pipeline is None:
            raise RelaxspecError("--prompts-file: a target given in memory (not LlamaGen) formats no prompts here; "
                                 "give its dataset, or name it (model_path) so that its family formats them")
        condition = pipeline.conditions(prompts=prompts)
        conditions = (condition.cond, condition.mask)
    if target.config.model_type != "c2i" and conditions is None and (dataset is None or dataset.labels.ndim == 1):
        raise RelaxspecError("this target is t2i: give --prompts-file FILE (and its family's inputs, e.g. --t5-path DIR "
                             "for LlamaGen) to train on its own samples of prompts")
    return target, conditions, vq


def open_target(config: DrafterTrainConfig, target: TargetModel | None = None,
                dataset: DrafterDataset | None = None) -> tuple[TargetModel, tuple | None]:
    """``target``, else the one ``config`` names (``model_path`` or its family's files, with its family's
    ``inputs``), and what its self-samples cycle for a prompt-conditioned target: ``(cond,
    cond_mask)``, the family's own conditions of ``prompts_file`` (else ``None``)."""
    target, conditions, _ = _open(config, target, dataset)
    return target, conditions


@torch.no_grad()
def grow_drafter(drafter: EagleDrafter, start: EagleDrafter, name: str = "init_from") -> None:
    """Warm-start ``drafter`` from the trained ``start`` of the same family and target: ``fc`` and
    ``start``'s layers carry over, and any further layers start as the identity
    (:func:`relaxspec.training.common.start_as_identity`), so a deeper drafter begins as exactly
    the function ``start`` computes. A fused-feature drafter also keeps a fused ``start``'s
    ``fuse`` and norms (of the same target layers), or starts them fresh from an EAGLE-1/2 one."""
    if start.config.family != drafter.config.family:
        raise RelaxspecError(f"--init-from {name}: that drafter is of the {start.config.family} "
                             f"family, this run trains one of the {drafter.config.family} family")
    if start.config.n_layer > drafter.config.n_layer:
        raise RelaxspecError(f"--init-from {name}: that drafter has {start.config.n_layer} blocks, this run trains "
                             f"{drafter.config.n_layer} (a warm start keeps or adds blocks)")
    if start.config.fused and start.config.fused_layers != drafter.config.fused_layers:
        raise RelaxspecError(f"--init-from {name}: that drafter reads target layers {start.config.fused_layers}, "
                             f"this run trains one that reads {drafter.config.fused_layers or 'the final state'}")
    drafter.fc.load_state_dict(start.fc.state_dict())
    if start.config.fused:  # a fused one's own parts; from an EAGLE-1/2 drafter they start fresh
        for part in ("fuse", "feature_norm", "out_norm"):
            getattr(drafter, part).load_state_dict(getattr(start, part).state_dict())
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

    ``target`` and ``dataset`` default to what ``config`` names (its model; ``data`` /
    ``self_samples`` / ``images``). The target is frozen in place (``eval()``, no gradients).
    Writes ``config.out``, which no other run may use meanwhile (:func:`relaxspec.runs.folder.hold_folder`);
    returns the trained drafter and its evaluation history.

    Under torchrun (``WORLD_SIZE`` > 1) the processes form one run
    (:mod:`relaxspec.training.distributed`): each draws its share of the self-samples into the
    shared cache, trains on its ``batch_size / world`` rows of every step's batch
    (DistributedDataParallel; the null rows, noise and means are the whole batch's, so the weights
    are the one-process run's up to float rounding), and rank 0 evaluates, checkpoints and exports
    (its result holds the history; the other ranks' holds none). ``--out`` must be a folder every
    process sees. A process that stops takes the others down with one line.
    """
    rank, world, _ = distributed.distributed()
    with distributed.alike(rank):
        if config.batch_size % world:
            raise RelaxspecError(f"--batch-size {config.batch_size} is the global batch: it does not divide over the "
                                 f"{world} processes of this run (WORLD_SIZE {world})")
        device = target.device if target is not None else resolve_device(config.device)
        group, device = distributed.join(device)
        set_threads(config.threads, device, processes=local_processes(), name="--threads")
    lost = False
    try:
        with _hold(config.out, group):
            return _train(config, target=target, dataset=dataset, resume=resume, group=group, device=device)
    except RelaxspecError:
        raise
    except Exception as err:
        if group.world > 1 and distributed.peer_lost(err):
            lost = True
            said = re.sub(r"^\[[^\]]*\]\s*", "", (str(err).strip() or type(err).__name__).splitlines()[0])
            said = said.split(". ")[0][:160]  # gloo's: "Read error [host]:port: Connection reset by peer"
            raise distributed.PeerLost(
                f"rank {group.rank}: another process of this run stopped ({said}); {config.out} keeps the last "
                "checkpoint: --resume continues, with any number of processes") from None
        raise
    finally:
        if not lost:  # a broken group is not torn down: that can abort or hang
            distributed.leave()


@contextlib.contextmanager
def _hold(out: str | Path, group: distributed.Group):
    """Hold ``out`` for this run (:func:`relaxspec.runs.folder.hold_folder`, taken by rank 0) and check that every
    process sees the folder rank 0 writes (several nodes need a file system they share)."""
    if group.world == 1:
        with hold_folder(out, "train-drafter"):
            yield
        return
    with contextlib.ExitStack() as held:
        refusal = None
        if group.main:
            try:
                held.enter_context(hold_folder(out, "train-drafter"))
            except RelaxspecError as err:
                refusal = str(err)
        if group.agree(refusal is not None):
            raise RelaxspecError(refusal) if group.main else SaidByRankZero(f"--out {out} is refused")
        mark = Path(out) / WORLD_MARK
        nonce = group.share(secrets.randbits(62) if group.main else 0)
        if group.main:
            mark.write_text(str(nonce))
        group.barrier()
        seen = mark.read_text().strip() if mark.is_file() else ""
        blind = int(group.sum(torch.tensor([int(seen != str(nonce))], device=group.device)).item())
        if blind:
            with distributed.alike(group.rank):
                raise RelaxspecError(f"--out {out}: {blind} process(es) of this run do not see the folder rank 0 "
                                     "writes; across nodes --out must be on a file system they all share")
        yield


def check_run_size(config: DrafterTrainConfig, target, device: torch.device, sampling: bool) -> None:
    """Refuse, before any sample is drawn or weight allocated, a run whose self-samples (their
    tokens, held twice: the cache and the training set; ``sampling``: this run draws them) or
    whose drafter (fp32 weights, gradients and AdamW's two moments, four copies) do not fit in
    the memory free now; one line each, with both sizes."""
    if sampling and config.self_samples:
        count, length = config.self_samples, target.config.block_size
        check_fits(f"--self-samples {count:,} ({length} tokens each, held twice)", 2 * 8 * count * length, "cpu")
    common.check_trainable(f"--n-layer {config.n_layer:,}", "drafter",
                           lambda n: EagleDrafter(drafter_config(target, n), target), config.n_layer, device)


#: Written by rank 0 of a multi-process run for every rank to read back (:func:`_hold`).
WORLD_MARK = ".world"


def _train(config: DrafterTrainConfig, *, target, dataset, resume: bool, group: distributed.Group,
           device: torch.device) -> DrafterTrainResult:
    out = Path(config.out)
    with distributed.alike(group.rank):  # every process reads the same folder and settings
        saved = prior_state(out, resume)
        if config.prompts_file is not None and target is None:
            config.prompts_sha256 = hashlib.sha256("\n".join(_read_prompts(config)).encode()).hexdigest()
        if saved is not None:
            check_resume(saved["config"], config)
            if saved.get(PREPARING):  # stopped while drawing its self-samples: start training from step 0
                saved = None
    group.barrier()  # all have read the folder before rank 0 writes in it
    main = group.main
    target, prompts, vq = _open(config, target, dataset, device)
    device = target.device
    target.eval().requires_grad_(False)
    with distributed.alike(group.rank):
        check_run_size(config, target, device, dataset is None)
    out.mkdir(parents=True, exist_ok=True)
    if dataset is None and config.self_samples and saved is None and main:
        # Drawing the self-samples is slow and cached batch by batch: name the recipe now, so that
        # --resume after a Ctrl-C while drawing them continues with it (and reuses the cache).
        save_train_state(out, {"format_version": STATE_VERSION, "step": 0, "config": config.to_dict(),
                                      PREPARING: True})
    if dataset is None:
        dataset = build_dataset(config, target, prompts, vq=vq, shard=Shard(group.rank, group.world, group.barrier))
    with distributed.alike(group.rank):
        dataset.check_for(target)
    train_set, val_set = dataset.split(config.val_fraction, config.seed)
    eval_set, eval_name = (val_set, "val") if len(val_set) else (train_set, "train")

    # The drafter is of the target's family (LlamaGen blocks, or a transformers target's own decoder
    # layers); a resumed run rebuilds the one it saved (a run saved before drafters had families
    # trained LlamaGen blocks).
    start = load_drafter(config.init_from, target, dtype=torch.float32) if config.init_from and saved is None else None
    if saved is None:
        shape = drafter_config(target, config.n_layer, fused_layers=config.fused_layers or config.fused)
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
    if main:
        common.rewrite_metrics(out, history)  # a fresh run drops what one stopped before its first checkpoint logged
    forward = drafter
    if group.world > 1:  # gradients averaged over the processes (each step's loss is scaled to match)
        forward = torch.nn.parallel.DistributedDataParallel(
            drafter, device_ids=[device] if device.type == "cuda" else None, forward_sync_buffers=False)

    steps_per_epoch = math.ceil(len(train_set) / config.batch_size)
    total = common.run_length(config.steps, config.epochs, steps_per_epoch)
    # who trained it: the processes and each one's device (a run resumed on other ones says the last)
    extra = {"recipe": "relaxspec train-drafter", "law_loss": config.law_loss, "train_depths": config.train_depths,
             "processes": group.world, "devices": group.gather(str(device))}

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
        feature = f" feature {metrics['feature_loss']:.4f}" if "feature_loss" in metrics else ""
        common.log_metrics(out, record, f"step {at}: {eval_name} loss {metrics['loss']:.4f}{feature} "
                                        f"{law} | 1-TV by depth {accept} | chain MAL "
                                        f"{metrics['chain_mal']:.3f} | top-1 {metrics['accuracy']:.3f}"
                                        + (" (best)" if improved else " (baseline)" if at == 0
                                           else f" (best: step {best.get('step')})"))
        if config.patience and bad_evals >= config.patience:
            tqdm.write(f"stopping: no better chain MAL in {bad_evals} evaluations (best: step {best.get('step')})")
            checkpoint(at)
            return True
        return False

    def checkpoint(at: int) -> None:
        if main:
            save_checkpoint(out, drafter, optimizer, at, config, history, best, bad_evals, _measure(config),
                            scheduled_best)

    def step_loss(step: int, index: torch.Tensor):
        noise = torch.Generator(device=device).manual_seed(common.mix(config.seed, step))
        share, weight = group.rows(len(index)), 1.0
        if group.world == 1:
            share = None
        elif share.start == share.stop:  # a short last batch left this rank none: a row weighted 0
            share, weight = slice(0, 1), 0.0  # (DDP needs every rank's backward)
        rows = index if share is None else index[share]
        losses = batch_loss(drafter, train_set.tokens[rows], train_set.labels[rows], config, noise_generator=noise,
                            cond_mask=None if train_set.cond_mask is None else train_set.cond_mask[rows],
                            share=share, batch=len(index), forward=forward)
        metrics = {name: value for name, value in losses.items() if value.ndim == 0}
        metrics["accept_1"] = losses["accept"][0]
        if share is None:
            return losses["loss"], metrics
        # each rank's values are its part of the batch's: summed, they are the batch's
        total = group.sum(torch.stack([value.detach().float() for value in metrics.values()]).to(group.device) * weight)
        return losses["loss"] * (weight * group.world), dict(zip(metrics, total))

    def evaluate_once(at: int) -> bool:  # rank 0 evaluates; every rank stops where it says
        return group.agree(evaluate(at) if main else False)

    first = step
    if first == 0 and total > 0 and not history and main:  # a run resumed at step 0 has its baseline already
        evaluate(0)
    stopped_before = bool(config.patience) and bad_evals >= config.patience  # a resumed run that had stopped
    law_name = "ce" if config.law_loss == "ce" else config.law_loss.split("+")[0]
    # epoch e visits a permutation drawn from (seed, e) (common.shuffled); a short last batch is kept
    run = common.run_training(
        step_loss, optimizer, steps=first if stopped_before else total, first=first, size=len(train_set),
        batch_size=config.batch_size, seed=config.seed, grad_clip=config.grad_clip, parameters=drafter.parameters(),
        lr=lambda at: common.warmup_constant(at, config.lr, config.warmup_steps),
        hooks=[common.Every(config.eval_interval, evaluate_once), common.Every(config.checkpoint_interval, checkpoint)],
        postfix=lambda m: {"loss": f"{m['loss']:.4f}", law_name: f"{m[law_name]:.3f}",
                           "1-TV": f"{m['accept_1']:.3f}"},
        desc="train-drafter", progress=config.progress and main)
    if run.step == first:  # nothing left to train (e.g. resumed at the end): still leave a checkpoint
        checkpoint(first)
    if not main:
        return DrafterTrainResult(drafter.eval(), run.step, [], run.seconds, run.per_second, {},
                                  run.stopped or stopped_before)
    try:
        plot_acceptance(history, out / ACCEPT_PLOT)
    except (OSError, ValueError, RuntimeError) as err:  # a plot never costs the run its export
        tqdm.write(f"could not plot {out / ACCEPT_PLOT}: {err}")
    if config.export and best:
        export_drafter(out / BEST, config.export, target, {**extra, "best": best})
    return DrafterTrainResult(drafter.eval(), run.step, history, run.seconds, run.per_second, best,
                              run.stopped or stopped_before)
