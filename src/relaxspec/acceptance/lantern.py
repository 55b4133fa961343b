"""LANTERN / LANTERN++: relaxed acceptance over latent neighbours (REFERENCE §1.2, §1.3).

LANTERN (arXiv 2410.03355) and LANTERN++ (arXiv 2502.06352). Visual AR models spread probability
over many interchangeable codes, so the drafted code ``x`` is credited with the mass of its
nearest codebook neighbours ``n_1..n_k`` (proximity order, self excluded):

* ``S_j = t(n_1) + ... + t(n_j)``; ``m`` is the longest *prefix* with ``S_m <= B`` -- a heavy
  neighbour is never skipped to take lighter ones behind it (the cumulative sum is monotone, so
  "the prefix" and "all j with S_j <= B" are the same set);
* ``p~(x) = t(x) + S_m``: the relaxed target ``p~_x`` moves the mass of ``A_x = {n_1..n_m}`` onto
  ``x``, so ``TV(t, p~_x) = S_m <= B``;
* nothing is merged onto a token outside the target's support (``B = 0`` where ``t(x) = 0``), so
  ``p~`` keeps the support of ``t``: no relaxed method undoes the user's top-k or top-p.

The bound ``B`` is either additive, ``B = delta`` (LANTERN), or multiplicative,
``B = (lam - 1) * t(x)`` i.e. ``p~(x) <= lam * t(x)`` (LANTERN++). The official code overloads
one number for both (``delta <= 1`` / ``> 1``); here they are two named parameters. An optional
``delta_schedule`` gives an additive budget per draft depth (neighbour relaxation with an
annealed budget, in the spirit of COOL-SD arXiv 2601.09212).

Residual after a rejection: the official code has three mutually inconsistent variants (it
zeroes ``k + 1`` neighbours instead of the ``m`` merged, in ``q`` on one path and in ``p`` on
another). ``residual="relaxed"`` is the sound one: ``norm(max(p~_x - q, 0))``, so the one-step
law of a point-mass draft is exactly ``p~_x``; ``residual="plain"`` is ``norm(max(t - q, 0))``,
which COOL-SD shows is TV-optimal for any acceptance at least as permissive as the exact one.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

from relaxspec.acceptance.base import AcceptanceRule, as_depth, gather_at, normalise
from relaxspec.caching import PerObject
from relaxspec.errors import RelaxspecError

# S_j is a float cumulative sum of float32 probabilities; a prefix whose exact sum equals the
# budget must not be cut by rounding, so the comparison allows this relative slack.
PREFIX_RTOL = 1e-7
# one_step_law materialises [batch, chunk, k] neighbour probabilities (fp32) in chunks of a fixed
# size over the whole vocabulary; this bounds batch * chunk * k.
LAW_CHUNK_ELEMENTS = 1 << 22

ResidualKind = Literal["relaxed", "plain"]


#: Neighbour tables checked and moved to a device, per live table object (see LanternRule).
_PREPARED = PerObject(kept=4)


def _checked_table(neighbours: Tensor, k: int, vocab: int) -> Tensor:
    """The first ``k`` columns as an int64 host table, refused when they are not a neighbour table."""
    table = neighbours[:, :k].to(dtype=torch.long, device="cpu").contiguous()
    if table.numel():
        if int(table.min()) < 0 or int(table.max()) >= vocab:
            raise RelaxspecError(f"The neighbour table holds ids outside [0, {vocab}).")
        # The table excludes each code itself: x's own mass is already in p~(x), and a
        # self-entry would double-count it (and break the scatter that builds p~_x).
        if bool((table == torch.arange(vocab).unsqueeze(1)).any()):
            raise RelaxspecError("The neighbour table must exclude each code itself (row c must not contain c).")
        ordered = table.sort(dim=1).values
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise RelaxspecError("The neighbour table has a repeated code in a row.")
    return table


def merged_prefix(neighbour_probs: Tensor, budget: Tensor) -> Tensor:
    """Which neighbours are merged: ``[..., k]`` probabilities, ``[...]`` budgets -> ``[..., k]`` bool.

    ``S_j <= B`` on the running sum (in float64). Because ``S_j`` never decreases, the selected
    set is always a prefix ``n_1..n_m``: a neighbour heavier than the remaining budget stops the
    merge even when lighter neighbours behind it would fit (REFERENCE §1.2).
    """
    running = neighbour_probs.double().cumsum(dim=-1)
    limit = budget.double().unsqueeze(-1)
    return running <= limit * (1.0 + PREFIX_RTOL)


class LanternRule(AcceptanceRule):
    """LANTERN (additive ``delta``) / LANTERN++ (multiplicative ``lam``) relaxed acceptance.

    Args:
        neighbours: ``[V, K]`` int64, row ``c`` = the other codes in proximity order (self
            excluded; see :func:`relaxspec.acceptance.neighbours.neighbour_table`).
        k: how many leading neighbours to consider, ``0 <= k <= K`` (official default 1000).
        delta: additive TV budget ``B = delta`` in ``[0, 1]`` (LANTERN).
        lam: multiplicative bound ``B = (lam - 1) t(x)``, ``lam >= 1`` (LANTERN++).
        residual: ``"relaxed"`` (``norm(max(p~_x - q, 0))``) or ``"plain"``
            (``norm(max(t - q, 0))``).
        delta_schedule: additive budgets per draft depth, ``delta_schedule[i - 1]`` at depth
            ``i``; depths beyond the schedule use its last value.

    Exactly one of ``delta``, ``lam``, ``delta_schedule`` must be given.
    """

    name = "lantern"

    def __init__(
        self,
        neighbours: Tensor,
        k: int,
        delta: float | None = None,
        lam: float | None = None,
        residual: ResidualKind = "relaxed",
        delta_schedule: Sequence[float] | None = None,
    ) -> None:
        if not isinstance(neighbours, Tensor) or neighbours.dim() != 2:
            raise RelaxspecError("LANTERN needs a neighbour table: an integer tensor [vocab, K].")
        if neighbours.dtype.is_floating_point or neighbours.dtype == torch.bool:
            raise RelaxspecError(f"The neighbour table must hold integer code ids, got {neighbours.dtype}.")
        vocab, width = neighbours.shape
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= width:
            raise RelaxspecError(f"LANTERN k must be an integer in [0, {width}] (the table's width), got {k!r}.")
        given = [name for name, value in (("delta", delta), ("lam", lam), ("delta_schedule", delta_schedule))
                 if value is not None]
        if len(given) != 1:
            raise RelaxspecError(
                "LANTERN needs exactly one bound: delta (additive TV budget), lam (multiplicative, "
                f"LANTERN++) or delta_schedule (additive per depth); got {given or 'none'}."
            )
        if delta is not None and not 0.0 <= float(delta) <= 1.0:
            raise RelaxspecError(f"LANTERN delta is an additive TV budget in [0, 1], got {delta}.")
        if lam is not None and not 1.0 <= float(lam) < float("inf"):
            raise RelaxspecError(f"LANTERN++ lam is a multiplicative bound >= 1, got {lam}.")
        if delta_schedule is not None:
            delta_schedule = tuple(float(b) for b in delta_schedule)
            if not delta_schedule or not all(0.0 <= b <= 1.0 for b in delta_schedule):
                raise RelaxspecError(
                    f"LANTERN delta_schedule must be a non-empty list of budgets in [0, 1], got {delta_schedule}."
                )
        if residual not in ("relaxed", "plain"):
            raise RelaxspecError(f"LANTERN residual must be 'relaxed' or 'plain', got {residual!r}.")

        # Checked once per table object and k (the methods' cache hands every decode of a model
        # the same table): the checks read the table.
        self._source, self._key = neighbours, (k, neighbours._version)
        table = _PREPARED.get(neighbours, self._key, lambda: _checked_table(neighbours, k, vocab))

        self.vocab = vocab
        self.k = k
        self.delta = None if delta is None else float(delta)
        self.lam = None if lam is None else float(lam)
        self.delta_schedule = delta_schedule
        self.residual_kind: ResidualKind = residual
        #: which bound the rule has (what changes its ops); its value is one of numbers()
        self.bound = given[0]
        self._host_table = table  # moved to each device once (prepare), never indexed on the host
        self._tables: dict[torch.device, Tensor] = {}

    # ------------------------------------------------------------------ helpers
    @property
    def lossless(self) -> bool:
        # A zero budget still merges zero-probability neighbours, which moves no mass.
        if self.k == 0:
            return True
        if self.delta is not None:
            return self.delta == 0.0
        if self.lam is not None:
            return self.lam == 1.0
        return all(b == 0.0 for b in self.delta_schedule)

    def _table(self, device: torch.device) -> Tensor:
        if device not in self._tables:  # one copy per table and device, kept across decodes
            self._tables[device] = _PREPARED.get(self._source, (*self._key, str(device)),
                                                 lambda: self._host_table.to(device))
        return self._tables[device]

    def numbers(self) -> dict[str, float | tuple[float, ...]]:
        """The bound's value: ``delta``, ``lam`` or the ``delta_schedule``."""
        return {self.bound: getattr(self, self.bound)}

    def prepare(self, device: torch.device, owner: object | None = None) -> None:
        super().prepare(device, owner)
        self._table(torch.device(device))

    def _check(self, target: Tensor) -> None:
        if target.dim() != 2 or target.shape[1] != self.vocab:
            raise ValueError(f"target must be [batch, {self.vocab}], got {tuple(target.shape)}")

    def _budget(self, target_at_x: Tensor, depth: Tensor) -> Tensor:
        """The bound ``B`` (float64) for drafted tokens with probabilities ``target_at_x [B, ...]``.

        ``B = 0`` where ``t(x) = 0``: a relaxed method never commits a token outside the support of
        the target's processed law (CFG, temperature, top-k, top-p), so no mass is merged onto such
        a token and ``p~(x) = 0`` (the official code would credit it its neighbours' mass and undo
        the user's top-k; docs/METHODS.md). The multiplicative bound is 0 there by itself."""
        x64 = target_at_x.double()
        bound = self.number(self.bound, x64.device)  # a device tensor: a new value compiles nothing
        if self.bound == "lam":
            return (bound - 1.0) * x64
        if self.bound == "delta":
            return torch.where(x64 > 0, bound, 0.0)
        index = depth.clamp(1, bound.shape[0]) - 1
        per_row = bound[index]
        return torch.where(x64 > 0, per_row.view(-1, *([1] * (x64.dim() - 1))).expand_as(x64), 0.0)

    def _merge(self, target: Tensor, token: Tensor, depth: Tensor | int):
        """Neighbours ``[B, k]``, their probabilities, the merged mask ``[B, k]`` and ``S_m [B]``."""
        self._check(target)
        depth = as_depth(depth, target.shape[0], target.device)
        nbrs = self._table(target.device)[token.long()]
        nbr_probs = target.gather(1, nbrs)
        merged = merged_prefix(nbr_probs, self._budget(gather_at(target, token), depth))
        moved = (nbr_probs.double() * merged).sum(dim=1)
        return nbrs, nbr_probs, merged, moved

    # ------------------------------------------------------------------ the rule
    def relaxed_prob(self, target: Tensor, token: Tensor, depth: Tensor | int = 1) -> Tensor:
        """``p~(x) = t(x) + S_m``, ``[B]``."""
        _, _, _, moved = self._merge(target, token, depth)
        return (gather_at(target, token).double() + moved).to(target.dtype)

    def relaxed_target(self, target: Tensor, token: Tensor, depth: Tensor | int = 1) -> Tensor:
        """``p~_x [B, V]``: the merged neighbours' mass moved onto the drafted token."""
        nbrs, nbr_probs, merged, moved = self._merge(target, token, depth)
        relaxed = (gather_at(target, token).double() + moved).to(target.dtype)
        out = target.scatter(1, nbrs, torch.where(merged, torch.zeros_like(nbr_probs), nbr_probs))
        return out.scatter_(1, token.long().unsqueeze(1), relaxed.unsqueeze(1))

    def residual(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int = 1) -> Tensor:
        """Next target ``[B, V]`` after rejecting ``token``.

        ``"relaxed"``: ``norm(max(p~_x - q, 0))`` -- for a point-mass draft this zeroes ``x`` and
        exactly the ``m`` merged neighbours (not ``k + 1``, as the official code does).
        ``"plain"``: ``norm(max(t - q, 0))``.
        """
        if self.residual_kind == "plain":
            return normalise((target - proposal).clamp(min=0), target)
        relaxed = self.relaxed_target(target, token, depth)
        return normalise((relaxed - proposal).clamp(min=0), relaxed)

    def one_step_law(self, target: Tensor, proposal: Tensor, depth: Tensor | int = 1) -> Tensor:
        """Exact output law ``[B, V]`` of one test with ``x ~ proposal`` marginalised, O(V k) per row.

        Accepted mass: drafting ``y`` and accepting it has probability
        ``a(y) = q(y) min(1, p~_y(y)/q(y)) = min(q(y), t(y) + S(y))``, ``S(y)`` being ``y``'s own
        merged mass. Rejection of ``x`` has probability ``r_x = q(x) - a(x)``.

        * plain residual ``R = norm((t - q)_+)`` does not depend on ``x``:
          ``law = a + (1 - sum a) R``.
        * relaxed residual after drafting ``x``: ``(p~_x - q)_+`` is ``(t - q)_+`` with the entries
          of ``A_x`` zeroed (``p~_x = 0`` there) and the entry of ``x`` zeroed (whenever
          ``r_x > 0``, ``p~_x(x) < q(x)``); its mass ``Z_x = Z - sum_{A_x} (t-q)_+ - (t-q)_+(x)``
          equals ``sum (q - p~_x)_+ >= r_x``, so ``c_x = r_x / Z_x`` lies in ``[0, 1]`` and is
          only needed where ``Z_x > 0``. Then
          ``law(y) = a(y) + (t(y) - q(y))_+ (sum_x c_x - sum_{x: y in A_x} c_x - c_y)``;
          the middle sum is a scatter-add over the neighbour table masked to each merged prefix,
          and the ``c_y`` term vanishes (``c_y > 0`` forces ``t(y) < q(y)``) but is kept so the
          formula reads like the residual it marginalises.
        """
        self._check(target)
        batch, vocab = target.shape
        depth = as_depth(depth, batch, target.device)
        table = self._table(target.device)
        # at least float32, and float64 kept: the law's merge decisions are those of accept and
        # residual, which compute in the inputs' dtype (a float32 law of float64 inputs can merge
        # otherwise at a boundary and under-count the step's TV record)
        dtype = torch.promote_types(torch.promote_types(target.dtype, proposal.dtype), torch.float32)
        t, q = target.to(dtype), proposal.to(dtype)
        excess = (t - q).clamp(min=0)  # (t - q)_+
        # Where q(x) <= t(x) nothing about x's neighbourhood matters: a(x) = q(x) (p~_x(x) >= t(x)
        # >= q(x)) and nothing is rejected (c_x = 0); the formulas below give exactly that, so
        # every column goes through them in chunks of a fixed size (no data-dependent shapes).
        accepted = torch.empty_like(t)
        scale = torch.zeros_like(t)  # c_x
        removed = torch.zeros_like(t)  # sum_{x: y in A_x} c_x
        total_excess = excess.sum(dim=1, keepdim=True)
        chunk = max(1, LAW_CHUNK_ELEMENTS // max(1, batch * max(1, self.k)))
        for start in range(0, vocab, chunk):
            cols = slice(start, min(start + chunk, vocab))
            nbrs = table[cols]  # [c, k]
            nbr_probs = t[:, nbrs]  # [B, c, k]
            t_x = t[:, cols]
            merged = merged_prefix(nbr_probs, self._budget(t_x, depth))
            relaxed = t_x + (nbr_probs * merged).sum(dim=2)
            acc = torch.minimum(q[:, cols], relaxed)
            accepted[:, cols] = acc
            if self.residual_kind == "relaxed":
                kept = total_excess - (excess[:, nbrs] * merged).sum(dim=2) - excess[:, cols]
                rejected = q[:, cols] - acc
                usable = (rejected > 0) & (kept > 0)
                c_x = torch.where(usable, rejected / torch.where(usable, kept, torch.ones_like(kept)), 0.0)
                c_x = c_x.clamp(0.0, 1.0)
                scale[:, cols] = c_x
                contrib = (c_x.unsqueeze(2) * merged).reshape(batch, -1)
                removed.scatter_add_(1, nbrs.reshape(1, -1).expand(batch, -1), contrib)
        if self.residual_kind == "plain":
            leftover = (1.0 - accepted.sum(dim=1, keepdim=True)).clamp(min=0)
            law = accepted + leftover * normalise(excess, t)
        else:
            law = accepted + excess * (scale.sum(dim=1, keepdim=True) - removed - scale)
        return law.clamp(min=0).to(target.dtype)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        bound = (f"delta={self.delta}" if self.delta is not None
                 else f"lam={self.lam}" if self.lam is not None
                 else f"delta_schedule={list(self.delta_schedule)}")
        return f"LanternRule(k={self.k}, {bound}, residual={self.residual_kind!r})"
