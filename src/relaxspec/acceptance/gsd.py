"""GSD, grouped speculative decoding (So et al., arXiv 2508.07747, ICCV 2025): a drafted token is
accepted for the mass of a *group* of near-equivalent tokens built around it at each test.

For a draft ``x ~ q`` against the target ``p`` (REFERENCE §1.5; the published code,
junhyukso/GSD ``scheduler/jacobi_iteration_lumina_mgpt.py``, ``SpeculativeSampler.__call__``):

* candidates: the tokens next to ``x`` in ``p``'s ranking -- positions ``r - R .. r + R - 1`` of
  the ascending order, ``r`` being ``x``'s (``R = 7`` in the code: seven less likely tokens, ``x``
  and six more likely ones);
* the group ``C(x)`` keeps the candidates whose probability is close to ``x``'s,
  ``|p(y) - p(x)| < p_gap`` (0.15), and whose embedding is close to ``x``'s, squared L2 distance
  ``< distance`` (0.5, on the target's input token embeddings in the code); ``x`` is always in
  its own group;
* accept with ``min(1, P(x) / Q(x))``, ``P(x) = sum_{C(x)} p``, ``Q(x) = sum_{C(x)} q``;
* on rejection resample the plain residual ``norm(max(p - q, 0))``.

The one-step law of a step is ``out(y) = q(y) a(y) + beta r(y)`` with ``a`` the acceptance
probability of ``y`` as a draft, ``beta = 1 - sum_x q(x) a(x)`` and ``r`` the residual: lossy
whenever a group has more than one token (docs/METHODS.md, "GSD", says what differs from the
code and why).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relaxspec.acceptance.base import AcceptanceRule, gather_at, normalise
from relaxspec.caching import PerObject, kept_copy
from relaxspec.errors import RelaxspecError

# one_step_law tests every token as a draft, [batch, chunk, 2R] at a time; this bounds batch * chunk * 2R.
LAW_CHUNK_ELEMENTS = 1 << 22
# The [V, V] table of which codes are close is built in row blocks of this many codes.
CLOSE_BLOCK = 1024
# Closeness tables of live models: every decode builds a new rule, and a table costs seconds and
# V^2 bytes to build for a LlamaGen-sized vocabulary. Keyed by the object the vectors come from
# (never by an address, which a new tensor can reuse), so only a few owners are kept.
_CLOSE_TABLES = PerObject(kept=2)


class GroupRule(AcceptanceRule):
    """GSD's grouped acceptance.

    Args:
        embeddings: ``[V, D]`` the latent vectors the distance test reads (the target's input
            token embeddings in the published code; any ``[V, D]`` table works).
        ranks: ``R``, the candidates are ``R`` ranks below and ``R - 1`` above ``x`` (0: the
            group is ``{x}`` and the rule is exact).
        p_gap: keep candidates with ``|p(y) - p(x)| < p_gap``.
        distance: keep candidates with ``||e_y - e_x||^2 < distance``.
        owner: the object ``embeddings`` comes from (the target model, the VQ tokenizer), so rules
            built on the same live owner share one closeness table; default: the tensor itself
            (or the tensor it is a view of).
    """

    name = "gsd"

    def __init__(self, embeddings: Tensor, ranks: int = 7, p_gap: float = 0.15, distance: float = 0.5,
                 owner: object | None = None):
        if embeddings.dim() != 2:
            raise RelaxspecError(f"GSD's embeddings must be [vocab, dim], got shape {tuple(embeddings.shape)}")
        if ranks < 0 or p_gap < 0 or distance < 0:
            raise RelaxspecError(f"GSD's ranks, p_gap and distance must be >= 0, got {ranks}, {p_gap}, {distance}")
        # A view's own object is new at every slice; the tensor it views is what lives on.
        self._owner = owner if owner is not None else (embeddings if embeddings._base is None else embeddings._base)
        self._source = embeddings.detach()
        self.embeddings = self._source.float()
        self.ranks, self.p_gap, self.distance = int(ranks), float(p_gap), float(distance)
        self.offsets = torch.arange(-self.ranks, max(self.ranks, 1))  # always holds 0: x itself
        self._close: Tensor | None = None

    @property
    def lossless(self) -> bool:
        return self.ranks == 0 or self.p_gap == 0 or self.distance == 0

    def numbers(self) -> dict[str, float]:
        """The probability gap (the distance is in the closeness table, one per distance)."""
        return {"p_gap": self.p_gap}

    def prepare(self, device: torch.device, owner: object | None = None) -> None:
        """Move the tables to ``device`` and build the closeness table there (once per distance and
        owner of the vectors); the candidates' offsets kept with ``owner`` (one address a shape)."""
        super().prepare(device, owner)
        self.embeddings = self.embeddings.to(device)
        offsets = torch.arange(-self.ranks, max(self.ranks, 1), device=device)  # made there: no copy
        self.offsets = offsets if owner is None else kept_copy(owner, "GroupRule.offsets", offsets)
        self.close_table(device)

    def close_table(self, device: torch.device) -> Tensor:
        """``[V, V]`` bool: ``||e_y - e_x||^2 < distance``. The distance test depends on the codes
        only, so it is computed once (in blocks; V^2 bytes, 268 MB for LlamaGen's 16384 codes) and
        every test reads it by index instead of gathering ``[.., 2R, D]`` embeddings. Rules over
        the same live owner (see the constructor), unchanged vectors, distance and device share
        one table."""
        device = torch.device(device)
        if self._close is not None and self._close.device == device:
            return self._close
        source = self._source
        key = (source.storage_offset(), tuple(source.shape), tuple(source.stride()), source.dtype,
               source._version, self.distance, str(device))
        self._close = _CLOSE_TABLES.get(self._owner, key, lambda: self._build_close(device))
        return self._close

    def _build_close(self, device: torch.device) -> Tensor:
        e = self.embeddings.to(device)
        norms = e.square().sum(1)
        blocks = []
        for i in range(0, e.shape[0], CLOSE_BLOCK):
            part = e[i : i + CLOSE_BLOCK]
            squared = norms[i : i + CLOSE_BLOCK, None] + norms[None, :] - 2.0 * part @ e.T
            blocks.append(squared < self.distance)
        return torch.cat(blocks)

    # ------------------------------------------------------------------ the group
    def _groups(self, target: Tensor, order: Tensor, rank: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """For drafts ``tokens [B, T]``: candidates ``[B, T, 2R]`` and which are in the group."""
        vocab = target.shape[1]
        offsets = self.offsets.to(target.device)
        at = rank.gather(1, tokens)[..., None] + offsets  # [B, T, 2R] positions in the ascending order
        inside = (at >= 0) & (at < vocab)
        candidates = order.gather(1, at.clamp(0, vocab - 1).flatten(1)).view(at.shape)
        p_cand = target.gather(1, candidates.flatten(1)).view(at.shape)
        p_x = target.gather(1, tokens)[..., None]
        near = self.close_table(target.device)[tokens[..., None], candidates]
        # x itself (offset 0) is always in; slots past either end of the ranking never are.
        close = ((p_cand - p_x).abs() < self.number("p_gap", target.device)) & near  # data, not a constant
        return candidates, inside & (close | (offsets == 0))

    @staticmethod
    def _ranking(target: Tensor) -> tuple[Tensor, Tensor]:
        """The ascending order of ``target [B, V]`` (ties by token id) and each token's rank in it."""
        order = torch.sort(target, dim=1, stable=True).indices
        positions = torch.arange(target.shape[1], device=target.device).expand_as(order)
        return order, torch.empty_like(order).scatter_(1, order, positions)

    def _masses(self, target: Tensor, proposal: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """``P(x)``, ``Q(x)`` for drafts ``tokens [B, T]`` -> two ``[B, T]``."""
        order, rank = self._ranking(target)
        candidates, keep = self._groups(target, order, rank, tokens)
        flat = candidates.flatten(1)
        p = (target.gather(1, flat).view(candidates.shape) * keep).sum(-1)
        q = (proposal.to(target.dtype).gather(1, flat).view(candidates.shape) * keep).sum(-1)
        return p, q

    # ------------------------------------------------------------------ the rule
    def relaxed_prob(self, target: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """``P(x)``, the group's target mass (0 when ``p(x) = 0``): what greedy acceptance boosts
        ``x`` to, as LANTERN's ``p~(x)``."""
        token = token.long()
        p, _ = self._masses(target, target, token[:, None])
        return torch.where(gather_at(target, token) > 0, p[:, 0], torch.zeros_like(p[:, 0]))

    def _accept(self, target: Tensor, proposal: Tensor, tokens: Tensor) -> Tensor:
        p, q = self._masses(target, proposal, tokens)
        alpha = torch.where(q > 0, (p / torch.where(q > 0, q, torch.ones_like(q))).clamp(max=1.0), torch.ones_like(p))
        # REFERENCE §4: never commit a token the target gives no mass (the published code can).
        return torch.where(target.gather(1, tokens) > 0, alpha, torch.zeros_like(alpha))

    def accept_prob(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """``min(1, P(x) / Q(x))`` ``[B]``; 0 where ``p(x) = 0``."""
        return self._accept(target, proposal, token.long()[:, None])[:, 0]

    def residual(self, target: Tensor, proposal: Tensor, token: Tensor, depth: Tensor | int) -> Tensor:
        """The published code's plain residual ``norm(max(p - q, 0))``."""
        return normalise((target - proposal.to(target.dtype)).clamp(min=0), target)

    def one_step_law(self, target: Tensor, proposal: Tensor, depth: Tensor | int) -> Tensor:
        """``q(y) a(y) + beta r(y)``, every token's acceptance computed in chunks of the vocabulary."""
        batch, vocab = target.shape
        proposal = proposal.to(target.dtype)
        chunk = max(1, LAW_CHUNK_ELEMENTS // max(1, batch * 2 * max(self.ranks, 1)))
        tokens = torch.arange(vocab, device=target.device).expand(batch, vocab)
        alpha = torch.cat([self._accept(target, proposal, tokens[:, i : i + chunk]) for i in range(0, vocab, chunk)], 1)
        accepted = proposal * alpha
        beta = (1.0 - accepted.sum(dim=1, keepdim=True)).clamp(min=0.0)
        return accepted + beta * self.residual(target, proposal, tokens[:, 0], depth)

    def __repr__(self) -> str:  # pragma: no cover - cosmetic
        return f"GroupRule(ranks={self.ranks}, p_gap={self.p_gap}, distance={self.distance})"
