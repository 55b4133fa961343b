"""What a drafter run leaves in its folder and reads back: the checkpoint and train state, the
fp16 export of its best weights, and the plot of acceptance per draft depth."""

from __future__ import annotations

from pathlib import Path

import torch

from relaxspec.drafting.eagle import EagleDrafter, load_drafter
from relaxspec.errors import RelaxspecError
from relaxspec.models.base import TargetModel
from relaxspec.training import common
from relaxspec.runs import folder as run_folder
from relaxspec.runs.folder import TRAIN_STATE
from relaxspec.training.drafter.config import PREPARING, STATE_VERSION, DrafterTrainConfig


def save_checkpoint(out: Path, drafter: EagleDrafter, optimizer: torch.optim.Optimizer, step: int,
                    config: DrafterTrainConfig, history: list[dict], best: dict | None = None,
                    bad_evals: int = 0, measure: dict | None = None, scheduled_best: float | None = None) -> None:
    """``model.safetensors`` + ``config.json`` (what decoding loads) and ``train_state.pt`` (what
    ``--resume`` loads: weights too, so it alone is a consistent snapshot), each replaced atomically."""
    common.publish_model(out, drafter, kind="drafter",
                         extra={"training": {"step": step, "recipe": "relaxspec train-drafter"}})
    run_folder.save_train_state(out, {
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
    return run_folder.read_train_state(out, STATE_VERSION, "drafter")


def prior_state(out: Path, resume: bool) -> dict | None:
    """The saved state a run continues (``None``: a fresh run). A state saved while the self-samples
    were drawn (``preparing``) holds no training: the plain command starts over on it (the
    samples drawn so far are cached), ``--resume`` continues with its recipe."""
    if not resume and (out / TRAIN_STATE).is_file():
        try:
            if read_train_state(out).get(PREPARING):
                return None
        except RelaxspecError:
            pass  # not ours: refused below as a run this one must not overwrite
    return run_folder.fresh_or_resume(out, resume, STATE_VERSION, "drafter")
