"""The interface every acceptance rule implements, and the logic they all share.

A *test* of a draft token ``x ~ q`` against a target ``t`` (REFERENCE §1.1, Leviathan et al.
arXiv 2211.17192, Chen et al. arXiv 2302.01318): accept ``x`` with probability
``min(1, p~(x) / q(x))``, where ``p~(x)`` is the rule's (possibly relaxed) probability of ``x``;
otherwise the next target is the rule's residual. Exact speculative sampling has
``p~(x) = t(x)`` and the residual ``norm(max(t - q, 0))``; the relaxed rules (LANTERN arXiv
2410.03355, LANTERN++ arXiv 2502.06352, COOL-SD arXiv 2601.09212) change one or both.

Conventions (docs/ARCHITECTURE.md): ``target`` and ``proposal`` are float tensors
``[batch, vocab]`` whose rows sum to 1, ``token`` is int64 ``[batch]``, ``depth`` the 1-based
draft position int64 ``[batch]`` (a Python int is accepted and broadcast). Every method is pure
and batched; nothing here draws random numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import Tensor

from relaxspec.caching import kept_buffer

# A proposal row whose drafted token carries at least this much mass is treated as a point mass
# (a deterministic draft): the law of the step is then the law given that token.
ONE_HOT_ATOL = 1e-6


def one_hot(token: Tensor, vocab: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Point-mass proposals: ``token [B]`` -> ``[B, vocab]`` rows with a 1 at ``token``."""
    out = torch.zeros(token.shape[0], vocab, dtype=dtype, device=token.device)
    return out.scatter_(1, token.long().unsqueeze(1), 1.0)


def normalise(mass: Tensor, fallback: Tensor) -> Tensor:
    """Rows of ``mass [B, V]`` divided by their sums; rows with no mass become ``fallback``.

    A residual has zero mass exactly when the test accepts with probability 1, so the fallback
    row is never sampled; it only keeps the output a valid distribution (no NaN) for the batched
    ``torch.where`` callers.
    """
    total = mass.sum(dim=-1, keepdim=True)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    return torch.where(total > 0, mass / safe, fallback)


def as_depth(depth: Tensor | int, batch: int, device: torch.device) -> Tensor:
    """``depth`` as an int64 ``[batch]`` tensor (a Python int is broadcast)."""
    if isinstance(depth, Tensor):
        return depth.to(device=device, dtype=torch.long).expand(batch)
    return torch.full((batch,), int(depth), dtype=torch.long, device=device)


def gather_at(rows: Tensor, token: Tensor) -> Tensor:
    """``rows [B, V]`` at ``token [B]`` -> ``[B]``."""
    return rows.gather(1, token.long().unsqueeze(1)).squeeze(1)


class AcceptanceRule(ABC):
    """An acceptance rule: relaxed probability, acceptance test, residual and their laws.

    Subclasses implement :meth:`relaxed_prob`, :meth:`residual`, :meth:`one_step_law` and
    :attr:`lossless`; acceptance probability, greedy acceptance, the greedy correction token and
    the TV record are derived here once, so a new rule only states its mathematics.
    """

    name: str = "rule"

    # ------------------------------------------------------------------ what a rule must define
    @property
    @abstractmethod
    def lossless(self) -> bool:
        """True when :meth:`one_step_law` equals the target for every input."""

    @abstractmethod
    def relaxed_prob(self, target: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """``p~(x)``, the probability the test compares with ``q(x)``: ``[B, V], [B] -> [B]``."""

    @abstractmethod
    def residual(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """The normalised next target ``[B, V]`` after ``token`` (drawn from ``proposal``) is rejected."""

    @abstractmethod
    def one_step_law(self, target: Tensor, proposal: Tensor, depth: Tensor | int) -> Tensor:
        """Closed-form output law ``[B, V]`` of: draw ``x ~ proposal``, test it, on rejection
        sample the residual (the draft marginalised out)."""

    def numbers(self) -> dict[str, float | tuple[float, ...]]:
        """The rule's numbers that change no shape of its ops -- a TV budget, a bound, a weight
        schedule -- by name (default: none). Its methods read each as a float64 device tensor
        (:meth:`number`), never as a Python float: a Python float would be a constant of a
        compiled step (one graph per value), a tensor is the step's data (issue 51)."""
        return {}

    def prepare(self, device: torch.device, owner: object | None = None) -> None:
        """Put the rule's :meth:`numbers` (and whatever tables it keeps) on ``device`` now, before
        a decoding loop, so no step pays a host->device copy and a compiled step reads them as
        data. ``owner`` (the decode's target model): the numbers are kept with it, one tensor per
        rule class and name refilled by every decode (:func:`relaxspec.caching.kept_buffer`), so
        a CUDA graph that reads them replays on a new value."""
        device = torch.device(device)
        tensors = {}
        for name, value in self.numbers().items():
            values = tuple(value) if isinstance(value, (tuple, list)) else None
            shape = () if values is None else (len(values),)
            tensor = torch.empty(shape, dtype=torch.float64, device=device) if owner is None else \
                kept_buffer(owner, f"{type(self).__name__}.{name}", shape, torch.float64, device)
            if values is None:
                tensor.fill_(float(value))
            for index, entry in enumerate(values or ()):  # fills: nothing is copied from the host
                tensor[index].fill_(float(entry))
            tensors[name] = tensor
        self._numbers = tensors

    #: The numbers :meth:`prepare` put on a device, by name.
    _numbers: dict[str, Tensor] = {}

    def number(self, name: str, device: torch.device) -> Tensor:
        """``numbers()[name]`` as a float64 tensor on ``device`` (``[]``, or ``[n]`` for a
        schedule): :meth:`prepare`'s, or made now for a rule used outside a decoding loop."""
        tensor = self._numbers.get(name)
        if tensor is None or tensor.device != device:
            tensor = torch.tensor(self.numbers()[name], dtype=torch.float64, device=device)
        return tensor

    # ------------------------------------------------------------------ shared logic
    def accept_prob(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """``min(1, p~(x) / q(x))``, ``[B]``; 0 wherever ``p~(x) = 0`` (REFERENCE §4: a token the
        relaxed target gives no mass is never committed, whatever source drafted it).

        ``q(x) = 0`` cannot happen for ``x ~ q``; such rows get 1 when ``p~(x) > 0`` so that
        callers enumerating all tokens never see NaN (their weight ``q(x)`` is 0 anyway).
        """
        relaxed = self.relaxed_prob(target, token, depth)
        drafted = gather_at(proposal, token).to(relaxed.dtype)
        ratio = relaxed / torch.where(drafted > 0, drafted, torch.ones_like(drafted))
        alpha = torch.where(drafted > 0, ratio.clamp(max=1.0), torch.ones_like(ratio))
        return torch.where(relaxed > 0, alpha, torch.zeros_like(alpha))

    def token_law(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """Law ``[B, V]`` of the step's output *given* the drafted ``token``:
        ``accept_prob * delta_x + (1 - accept_prob) * residual``. For a point-mass proposal this
        is the whole step's law."""
        alpha = self.accept_prob(target, proposal, token, depth).unsqueeze(1)
        res = self.residual(target, proposal, token, depth)
        return alpha * one_hot(token, target.shape[1], res.dtype) + (1 - alpha) * res

    def greedy_scores(self, target: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """Scores ``[B, V]`` whose argmax decides greedy acceptance (REFERENCE §4): the target with
        ``x``'s entry raised to ``max(t(x), p~(x))``, every other code keeping its own ``t``.

        This is LANTERN's definition and its published code ("boost p(x) to p~(x) and accept iff
        it is then the argmax"): neighbours merged into ``x`` are *not* removed from the
        comparison. The ``max`` keeps a rule whose ``p~(x) < t(x)`` (COOL-SD with ``w < 1``, an
        exactly lossless position) from ever demoting the argmax.
        """
        boosted = torch.maximum(self.relaxed_prob(target, token, depth).to(target.dtype), gather_at(target, token))
        return target.scatter(1, token.long().unsqueeze(1), boosted.unsqueeze(1))

    def greedy_accept(self, target: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """Temperature-0 acceptance ``[B]`` bool: ``x`` is the argmax of :meth:`greedy_scores`.

        Ties go to the lowest index, as in ``torch.argmax`` and plain greedy decoding: a draft
        whose boosted score ties a lower id is rejected, one that ties a higher id is accepted.
        So the exact rule (and any zero relaxation) reproduces greedy AR token for token, and a
        draft equal to the argmax is never rejected. An accepted draft always has ``p~(x) > 0``
        (the maximum of a distribution is positive).
        """
        return self.greedy_scores(target, token, depth).argmax(dim=1) == token

    def greedy_correction(self, target: Tensor, token: Tensor | None = None, depth: Tensor | int | None = None) -> Tensor:
        """Temperature-0 correction token ``[B]`` after a rejection: the node target's own argmax
        (REFERENCE §4), never the argmax of a residual -- with ``w < 1`` COOL-SD's residual keeps
        mass on the rejected token and its argmax is the runner-up. Every greedy sibling is tested
        against the same ``target``, so this is also the bonus after several rejections.
        ``token`` and ``depth`` are not used; they keep the call shape of the other greedy methods."""
        return target.argmax(dim=1)

    def step_tv(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int,
                point_mass: bool | None = None) -> Tensor:
        """``0.5 * sum |one_step_law - target|``, ``[B]``.

        For a point-mass proposal (``q(x) >= 1 - 1e-6``) the step's law is :meth:`token_law` of
        that token, which costs O(V) instead of the rule's full marginalisation; other rows use
        :meth:`one_step_law` (the drafted token is then irrelevant: the draft is marginalised).
        ``point_mass``: whether every row is a point mass, when the caller knows (the draft
        source does); ``None`` reads it from ``proposal`` (a host sync).
        """
        if point_mass is None:
            point_rows = gather_at(proposal, token) >= 1.0 - ONE_HOT_ATOL
            if bool(point_rows.any()) and not bool(point_rows.all()):
                law = torch.where(point_rows.unsqueeze(1), self.token_law(target, proposal, token, depth),
                                  self.one_step_law(target, proposal, depth).to(target.dtype))
                return 0.5 * (law - target).abs().sum(dim=1)
            point_mass = bool(point_rows.all())
        if point_mass:
            law = self.token_law(target, proposal, token, depth)
        else:
            law = self.one_step_law(target, proposal, depth).to(target.dtype)
        return 0.5 * (law - target).abs().sum(dim=1)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"{type(self).__name__}()"
