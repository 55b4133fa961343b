"""Standard, lossless speculative sampling (REFERENCE §1.1).

Leviathan et al. arXiv 2211.17192, Chen et al. arXiv 2302.01318: accept ``x ~ q`` with
``min(1, t(x)/q(x))``, on rejection sample ``norm(max(t - q, 0))``; the output law is exactly
``t``. With a point-mass proposal (a deterministic draft) this is "accept with probability
``t(x)``, else zero ``x`` and renormalise", with no special case. At temperature 0 the draft is
accepted iff it is the target's argmax and the correction is the argmax.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaxspec.acceptance.base import AcceptanceRule, gather_at, normalise


class ExactRule(AcceptanceRule):
    """Exact speculative sampling: ``p~(x) = t(x)``, residual ``norm(max(t - q, 0))``."""

    name = "exact"

    @property
    def lossless(self) -> bool:
        return True

    def relaxed_prob(self, target: Tensor, token: Tensor, depth: Tensor | int = 1) -> Tensor:
        """``t(x)``: ``[B, V], [B] -> [B]``."""
        return gather_at(target, token)

    def residual(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int = 1) -> Tensor:
        """``norm(max(t - q, 0))``, ``[B, V]`` (independent of the drafted token)."""
        return normalise((target - proposal).clamp(min=0), target)

    def one_step_law(self, target: Tensor, proposal: Tensor, depth: Tensor | int = 1) -> Tensor:
        """The target itself: the rule is lossless (arXiv 2211.17192, Theorem 1)."""
        return target.clone()

    def step_tv(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int = 1,
                point_mass: bool | None = None) -> Tensor:
        """Zero, ``[B]``: the output law is the target."""
        return torch.zeros(target.shape[0], dtype=target.dtype, device=target.device)
