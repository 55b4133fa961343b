"""The diagnostic the relaxed methods are built on: *token selection ambiguity*.

LANTERN (arXiv 2410.03355) observed that visual AR models spread next-token probability thinly
over many interchangeable codes — top-1 probabilities far below a text LM's — so exact
speculative acceptance rarely fires. This module measures it on a model: the distribution of the
target's top-1 probability and entropy (of the same processed distribution speculative decoding
uses) over the model's own samples, teacher-forced.
"""

from __future__ import annotations

import torch

from relaxspec.decoding.ar import generate_ar
from relaxspec.models.base import TeacherForcedTarget
from relaxspec.sampling import SamplingConfig, process_logits

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@torch.no_grad()
def processed_distributions(model: TeacherForcedTarget, cond: torch.Tensor, tokens: torch.Tensor,
                            sampling: SamplingConfig) -> torch.Tensor:
    """Teacher-forced processed next-token laws ``[B, N, V]`` for ``tokens [B, N]`` under ``cond``."""
    if sampling.use_cfg:
        logits = torch.cat([model.forward_train(cond, tokens), model.forward_train(model.null_condition(cond), tokens)])
    else:
        logits = model.forward_train(cond, tokens)
    return process_logits(logits, sampling)


@torch.no_grad()
def ambiguity_report(model: TeacherForcedTarget, classes: list[int], sampling: SamplingConfig, *, samples_per_class: int = 4,
                     seed: int = 0, batch_size: int = 32) -> dict:
    """Sample from the model, then summarise top-1 probability and entropy (nats) per token.

    Returns quantiles, means, a 20-bin histogram of top-1 probability, and the share of tokens
    whose top-1 probability is below 0.1 / 0.3 / 0.5.
    """
    cond_all = torch.tensor([c for c in classes for _ in range(samples_per_class)], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    top1, entropy = [], []
    for start in range(0, len(cond_all), batch_size):
        cond = cond_all[start : start + batch_size]
        tokens = generate_ar(model, cond, sampling, generator=generator).tokens
        probs = processed_distributions(model, cond, tokens, sampling)
        top1.append(probs.max(dim=-1).values.flatten())
        entropy.append(-(probs * probs.clamp(min=1e-30).log()).sum(dim=-1).flatten())
    top1_all, entropy_all = torch.cat(top1), torch.cat(entropy)
    q = torch.tensor(QUANTILES)
    hist = torch.histc(top1_all, bins=20, min=0.0, max=1.0)
    return {
        "tokens": int(top1_all.numel()),
        "sampling": sampling.to_dict(),
        "top1_mean": float(top1_all.mean()),
        "top1_quantiles": dict(zip(map(str, QUANTILES), torch.quantile(top1_all, q).tolist())),
        "entropy_mean_nats": float(entropy_all.mean()),
        "entropy_quantiles_nats": dict(zip(map(str, QUANTILES), torch.quantile(entropy_all, q).tolist())),
        "top1_below": {str(t): float((top1_all < t).float().mean()) for t in (0.1, 0.3, 0.5)},
        "top1_histogram": {"edges": torch.linspace(0, 1, 21).tolist(), "counts": hist.long().tolist()},
    }
