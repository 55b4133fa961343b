"""Sibling drafts for one tree node: sampled without replacement, or deterministic top-k.

Sampled siblings (EAGLE-1 / SpecTr-style multi-candidate verification, REFERENCE §1.1): sibling
``j`` is drawn from ``q`` with siblings ``0..j-1`` removed and renormalised, and *that*
distribution is its proposal in the acceptance test -- this is what keeps recursive rejection
sampling exact. Deterministic siblings (EAGLE-2 dynamic tree, arXiv 2406.16858) are point
masses: their proposals are one-hot rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaxspec.acceptance.base import one_hot
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import race_keys


def _check(q: Tensor, n: int) -> None:
    if q.dim() != 2:
        raise ValueError(f"q must be [batch, vocab], got {tuple(q.shape)}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise RelaxspecError(f"The number of siblings must be a non-negative integer, got {n!r}.")


def sample_siblings(
    q: Tensor, n: int, generator: torch.Generator | None = None, clocks: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Draw ``n`` distinct siblings from ``q [B, V]`` without replacement, in one top-k, with the
    exponential ``clocks [B, V]`` drawn ahead (a decoding step's, :class:`relaxspec.sampling.StepNoise`)
    or drawn here from ``generator``.

    Returns ``tokens [B, n]`` int64, ``proposals [B, n, V]`` (``proposals[:, j]`` = ``q`` with
    siblings ``0..j-1`` removed, renormalised: the law sibling ``j`` was drawn from) and
    ``valid [B, n]`` bool. The order of the ``n`` largest exponential-race keys
    (:func:`relaxspec.sampling.race_keys`) has exactly the law of ``n`` successive draws
    without replacement. Where ``q`` has fewer than ``n`` nonzero entries the extra siblings are
    invalid: their token is 0 and their proposal the one-hot row of token 0 (placeholders that
    keep every row a distribution; callers must skip them).
    """
    _check(q, n)
    batch, vocab = q.shape
    top = min(n, vocab)
    keys, tokens = race_keys(q, generator, clocks).topk(top, dim=1)
    valid = keys > 0
    if top < n:  # more siblings asked for than the vocabulary has: pad with invalid ones
        tokens = torch.cat([tokens, tokens.new_zeros(batch, n - top)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(batch, n - top)], dim=1)
    tokens = torch.where(valid, tokens, torch.zeros_like(tokens))
    return tokens, without_replacement_laws(q, tokens, valid), valid


def without_replacement_laws(q: Tensor, tokens: Tensor, valid: Tensor) -> Tensor:
    """The law each of ``n`` siblings drawn from ``q [B, V]`` without replacement was drawn from:
    ``[B, n, V]``, row ``j`` = ``q`` with siblings ``0..j-1`` (``tokens [B, n]``) removed and
    renormalised; an invalid sibling's (``valid [B, n]`` False: its token 0) the one-hot row of
    token 0, a placeholder that keeps every row a distribution."""
    batch, vocab = q.shape
    n = tokens.shape[1]
    drawn = one_hot(tokens.reshape(-1), vocab, q.dtype).view(batch, n, vocab) * valid[:, :, None].to(q.dtype)
    removed = (drawn.cumsum(dim=1) - drawn).clamp(max=1)  # siblings before j (a token repeated once only)
    remaining = q[:, None, :] * (1 - removed)
    mass = remaining.sum(dim=2, keepdim=True)
    placeholder = one_hot(torch.zeros(batch * n, dtype=torch.long, device=q.device), vocab, q.dtype).view(batch, n, vocab)
    return torch.where(valid[:, :, None], remaining / mass.clamp(min=torch.finfo(q.dtype).tiny), placeholder)


def siblings_after(q: Tensor, first: Tensor, n: int, clocks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``n`` more siblings of a draft ``first [B]`` drawn from ``q [B, V]``: the next ``n`` draws
    from ``q`` without replacement (``first`` removed), by the exponential race with ``clocks
    [B, V]``; without clocks, the ``n`` likeliest tokens other than ``first`` (deterministic
    siblings). Where ``first`` is itself a draw from ``q``, the ``n + 1`` tokens are ``n + 1``
    draws without replacement (the Plackett-Luce law of the rest given the first is the same
    law on what remains), so :func:`without_replacement_laws` gives each its proposal.

    Returns ``tokens [B, n]`` and ``valid [B, n]`` (False where ``q`` has no mass left: token 0)."""
    rest = q.scatter(1, first[:, None], 0.0)
    keys = rest if clocks is None else race_keys(rest, clocks=clocks)
    top, tokens = keys.topk(min(n, q.shape[1] - 1), dim=1)
    valid = top > 0
    if tokens.shape[1] < n:  # more siblings asked for than the vocabulary has: invalid ones
        pad = n - tokens.shape[1]
        tokens = torch.cat([tokens, tokens.new_zeros(q.shape[0], pad)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(q.shape[0], pad)], dim=1)
    return torch.where(valid, tokens, torch.zeros_like(tokens)), valid


def topk_siblings(q: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``n`` most probable tokens of ``q [B, V]`` as deterministic siblings.

    Returns ``tokens [B, n]`` (descending ``q``), one-hot ``proposals [B, n, V]`` and
    ``valid [B, n]`` (False for tokens with ``q = 0`` and for ``j >= V``).
    """
    _check(q, n)
    batch, vocab = q.shape
    top = min(n, vocab)
    values, tokens = q.topk(top, dim=1)
    valid = values > 0
    if top < n:  # more siblings asked for than the vocabulary has: pad with invalid ones
        pad = n - top
        tokens = torch.cat([tokens, torch.zeros(batch, pad, dtype=torch.long, device=q.device)], dim=1)
        valid = torch.cat([valid, torch.zeros(batch, pad, dtype=torch.bool, device=q.device)], dim=1)
    proposals = one_hot(tokens.reshape(-1), vocab, q.dtype).reshape(batch, n, vocab)
    return tokens, proposals, valid
