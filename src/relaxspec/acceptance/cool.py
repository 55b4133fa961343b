"""COOL-SD: annealed relaxed acceptance with the optimal residual (REFERENCE §1.4).

COOL-SD, arXiv 2601.09212 (AAAI 2026; no public code). At draft position ``i`` (1-based,
restarting every speculative step) the draft is accepted with ``min(1, w_i t(x) / q(x))``:
``w_i = 1`` is exact, ``w_i > 1`` relaxes. On rejection it samples the residual that minimises
the paper's TV bound, ``G*_i = norm(max(t - min(q, w_i t), 0))``; for ``w >= 1`` this is the
exact residual ``norm(max(t - q, 0))``, for ``w < 1`` it keeps the position exactly lossless
(the plain residual would be biased there). With ``G*`` the one-step TV is
``sum_x max(min(q, w t) - t, 0)``.

Annealing relaxes early positions more than late ones: ``w_i = delta * exp(-nu * i - mu)``
(paper: ``nu = 0.7``, ``delta`` in {1.1, 2}). No source we could read pins ``mu`` down; the most
likely reading, and the default here, is a mean-normalisation: ``mu`` is chosen so that
``mean_{i=1..horizon} w_i = delta``. It pushes late positions *below* 1 (lossless positions with
G*). ``normalisation="none"`` takes ``mu = 0``, and ``weights=`` sets the schedule explicitly.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
from torch import Tensor

from relaxspec.acceptance.base import AcceptanceRule, as_depth, gather_at, normalise
from relaxspec.errors import RelaxspecError


def cool_weights(delta: float, nu: float = 0.7, normalisation: str = "mean", horizon: int = 5,
                 cap: float | None = None) -> tuple[float, ...]:
    """The annealed weights ``(w_1, ..., w_horizon)``, ``w_i = delta * exp(-nu * i - mu)``.

    ``"mean"``: ``mu = log(mean_i exp(-nu * i))``, so that ``mean_i w_i = delta``;
    ``"none"``: ``mu = 0``.

    ``cap``: the largest weight allowed (1 for a schedule of additive TV budgets, e.g. LANTERN's
    ``delta_schedule``). With ``"mean"`` the weights above it are set to ``cap`` and the others
    scaled up together so that the mean is still ``delta`` (water-filling; the schedule stays
    non-increasing; needs ``delta <= cap``); with ``"none"`` they are only clipped.
    """
    decay = [math.exp(-nu * i) for i in range(1, horizon + 1)]
    mu = math.log(sum(decay) / horizon) if normalisation == "mean" else 0.0
    weights = tuple(delta * d * math.exp(-mu) for d in decay)
    if cap is None or max(weights) <= cap:
        return weights
    if normalisation != "mean":
        return tuple(min(cap, w) for w in weights)
    if delta > cap:
        raise RelaxspecError(f"a schedule with mean {delta} cannot have every weight <= cap {cap}")
    # decay is non-increasing: clip the first `clipped` positions to the cap and scale the rest
    # so the total stays horizon * delta; the first count for which the rest fits is the answer
    # (with none left, delta == cap and every weight is the cap).
    for clipped in range(1, horizon):
        rest = decay[clipped:]
        scale = (horizon * delta - clipped * cap) / sum(rest)
        if scale * rest[0] <= cap:
            return (float(cap),) * clipped + tuple(scale * d for d in rest)
    return (float(cap),) * horizon


class CoolRule(AcceptanceRule):
    """COOL-SD acceptance ``min(1, w_i t(x)/q(x))`` with the optimal residual ``G*``.

    Args:
        delta: the one knob of the schedule (paper: 1.1 and 2), ``> 0``.
        nu: annealing rate (paper: 0.7), ``>= 0``.
        normalisation: ``"mean"`` (``mean_i w_i = delta``) or ``"none"`` (``mu = 0``).
        horizon: number of positions in the schedule; deeper positions use ``w_horizon``.
        weights: an explicit schedule ``(w_1, ...)`` instead of ``delta``/``nu``/``normalisation``
            (its length is the horizon).

    Exactly one of ``delta`` and ``weights`` must be given.
    """

    name = "cool"

    def __init__(
        self,
        delta: float | None = None,
        nu: float = 0.7,
        normalisation: Literal["mean", "none"] = "mean",
        horizon: int = 5,
        weights: Sequence[float] | None = None,
    ) -> None:
        if (delta is None) == (weights is None):
            raise RelaxspecError("COOL-SD needs exactly one of delta (annealed schedule) and weights (explicit).")
        if weights is not None:
            weights = tuple(float(w) for w in weights)
            if not weights or not all(0.0 < w < float("inf") for w in weights):
                raise RelaxspecError(f"COOL-SD weights must be a non-empty list of positive numbers, got {weights}.")
        else:
            if not 0.0 < float(delta) < float("inf"):
                raise RelaxspecError(f"COOL-SD delta must be a positive number, got {delta}.")
            if not 0.0 <= float(nu) < float("inf"):
                raise RelaxspecError(f"COOL-SD nu must be >= 0, got {nu}.")
            if normalisation not in ("mean", "none"):
                raise RelaxspecError(f"COOL-SD normalisation must be 'mean' or 'none', got {normalisation!r}.")
            if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
                raise RelaxspecError(f"COOL-SD horizon must be a positive integer, got {horizon!r}.")
            weights = cool_weights(float(delta), float(nu), normalisation, horizon)
        self.delta = None if delta is None else float(delta)
        self.nu = float(nu)
        self.normalisation = normalisation
        self.weights: tuple[float, ...] = weights
        self.horizon = len(weights)

    @property
    def lossless(self) -> bool:
        # With G*, a position with w <= 1 outputs the target exactly.
        return all(w <= 1.0 for w in self.weights)

    def numbers(self) -> dict[str, tuple[float, ...]]:
        """The schedule ``(w_1, ..., w_horizon)``."""
        return {"weights": self.weights}

    def weight(self, depth: Tensor | int, batch: int = 1, device: torch.device | str = "cpu") -> Tensor:
        """``w_i`` (float64) for 1-based depths: a tensor of any shape keeps its shape, an int gives
        ``[batch]``. Depths past the horizon use ``w_horizon``, depths below 1 use ``w_1``."""
        if not isinstance(depth, Tensor):
            depth = as_depth(depth, batch, torch.device(device))
        table = self.number("weights", depth.device)  # a device tensor: a new schedule compiles nothing
        return table[depth.long().clamp(1, self.horizon) - 1]

    def _weight_for(self, target: Tensor, depth: Tensor | int) -> Tensor:
        depth = as_depth(depth, target.shape[0], target.device)
        return self.weight(depth).unsqueeze(1)

    def relaxed_prob(self, target: Tensor, token: Tensor, depth: Tensor | int = 1) -> Tensor:
        """``w_i t(x)``, ``[B]`` (may exceed 1; the test clips the ratio)."""
        w = self._weight_for(target, depth).squeeze(1)
        return (w * gather_at(target, token).double()).to(target.dtype)

    def _accepted_mass(self, target: Tensor, proposal: Tensor, depth: Tensor | int) -> Tensor:
        """``min(q, w t)`` ``[B, V]`` in float64: the mass accepted at each token."""
        return torch.minimum(proposal.double(), self._weight_for(target, depth) * target.double())

    def residual(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int = 1) -> Tensor:
        """``G* = norm(max(t - min(q, w t), 0))``, ``[B, V]`` (independent of the drafted token)."""
        excess = (target.double() - self._accepted_mass(target, proposal, depth)).clamp(min=0)
        return normalise(excess, target.double()).to(target.dtype)

    def one_step_law(self, target: Tensor, proposal: Tensor, depth: Tensor | int = 1) -> Tensor:
        """``min(q, w t) + (1 - sum min(q, w t)) G*``, ``[B, V]``."""
        accepted = self._accepted_mass(target, proposal, depth)
        excess = (target.double() - accepted).clamp(min=0)
        leftover = (1.0 - accepted.sum(dim=1, keepdim=True)).clamp(min=0)
        return (accepted + leftover * normalise(excess, target.double())).to(target.dtype)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"CoolRule(weights={tuple(round(w, 4) for w in self.weights)})"
