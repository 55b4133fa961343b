"""The drafter-free Jacobi window: SJD (arXiv 2410.01699) and its coupled variant (SCD-style,
arXiv 2510.24211)."""

from __future__ import annotations

import torch

from relaxspec.acceptance.base import one_hot
from relaxspec.drafting.base import DraftTree
from relaxspec.drafting.static_tree import StaticTree
from relaxspec.drafting.trees import TreeSpec
from relaxspec.noise import UNIFORMS32, UPDATE, StepNoise
from relaxspec.sampling import sample_from


class JacobiSource:
    """Speculative Jacobi decoding (arXiv 2410.01699): the draft is a window of ``window``
    future tokens, each drawn from the distribution the target gave for it in the previous
    iteration (uniform for fresh positions); verification is exact against those laws.

    ``coupled=True`` (SCD-style, arXiv 2510.24211): a redraw keeps the previous draft at its
    position with probability ``min(1, p_new/p_old)`` and otherwise samples
    ``norm(max(p_new - p_old, 0))`` — a maximal coupling, so the redraw still has law ``p_new``
    (exactness is untouched) while unchanged drafts survive.

    ``keep_likelier=True`` (PJD's code, github.com/boyaliao/PJD): a redraw keeps the previous
    draft at its position, with the law it was drawn from, wherever ``p_new / p_old > 0.5`` of it,
    and otherwise draws from ``p_new`` (a deterministic rule: the kept draft's law is no longer
    its proposal, so verification against it is not exact; rows in parallel only, never lossless).

    The window (``drafts [B, L]`` and the laws they were drawn from ``laws [B, L, V]``) is kept in
    tensors updated in place; a step's redraws read numbers reserved on the step's
    :class:`~relaxspec.sampling.StepNoise` (the fresh draws' clocks, then, coupled, the keep
    uniforms and the residual draws' clocks).
    """

    watch = None
    forwards_per_step = 0
    models = ()
    caption_rows = "upstream"  # reads no condition

    def __init__(self, window: int = 16, coupled: bool = False, keep_likelier: bool = False):
        if coupled and keep_likelier:
            raise ValueError("a Jacobi window keeps old drafts by one rule: coupled or keep_likelier")
        self.window, self.coupled, self.keep_likelier = window, coupled, keep_likelier
        self.max_nodes, self.max_depth = window + 1, window
        self.depth = window
        self.level_widths = (1,) * window
        self._chain = StaticTree(TreeSpec.chain(window), "topk")

    def start(self, first_tokens, first_probs, first_hidden, streams: int, num_tokens: int, generator,
              greedy: bool, *, condition_hidden=None, condition_tokens=None, noise: StepNoise | None = None,
              compile: bool = False, profiling=None) -> None:
        """Called once after the target's prefill; the first window is uniform random (drawn from
        ``generator`` here); the later windows' numbers are reserved on ``noise``."""
        self.greedy = greedy
        batch, self.vocab = first_tokens.shape[0], first_probs.shape[-1]
        device = first_tokens.device
        uniform = torch.full((batch, self.window, self.vocab), 1.0 / self.vocab, device=device)
        drafts = sample_from(uniform, generator, greedy)
        laws = self._as_proposal(uniform, drafts)
        if noise is not None:  # kept with the step's numbers, so a compiled step finds them where they were
            self.drafts = noise.kept("jacobi.drafts", drafts.shape, drafts.dtype).copy_(drafts)
            self.laws = noise.kept("jacobi.laws", laws.shape, laws.dtype).copy_(laws)
        else:
            self.drafts, self.laws = drafts, laws
        self._noise, self._slots = noise, None
        if noise is not None and not greedy:
            shape = (batch, self.window, self.vocab)
            self._slots = [noise.reserve(shape, phase=UPDATE)]
            if self.coupled:
                self._slots += [noise.reserve(shape[:2], UNIFORMS32, UPDATE), noise.reserve(shape, phase=UPDATE)]
        tab = self._chain.tables(device)
        n = self.window + 1
        valid = torch.ones(batch, n, dtype=torch.bool, device=device)
        offsets = torch.arange(self.window, device=device)
        if noise is not None:  # one address across decodes of a shape: a compiled step reads them
            valid, offsets = noise.kept("jacobi.valid", valid.shape, valid.dtype).copy_(valid), \
                noise.kept("jacobi.offsets", offsets.shape, offsets.dtype).copy_(offsets)
        self._tree = (tab["parents"].expand(batch, n), tab["depths"].expand(batch, n), valid,
                      tab["ancestors"].expand(batch, n, n), tab["children"], tab["level_widths"])
        self._offsets = offsets

    def _as_proposal(self, laws: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        # Greedy drafts are point masses: the proposal is the one-hot of the draft.
        if not self.greedy:
            return laws
        return one_hot(drafts.reshape(-1), self.vocab, laws.dtype).view_as(laws)

    def close(self) -> None:
        pass

    def propose(self, roots, root_index, greedy: bool) -> DraftTree:
        tokens = torch.cat([roots[:, None], self.drafts], dim=1)
        # The root is never tested; a one-hot row keeps it a distribution.
        proposals = torch.cat([one_hot(roots, self.vocab, self.laws.dtype)[:, None], self.laws], dim=1)
        parents, depths, valid, ancestors, children, widths = self._tree
        return DraftTree(tokens, parents, depths, proposals, valid, ancestors, children=children, level_widths=widths,
                         point_mass=self.greedy)

    def update(self, committed, path, count, root_index, target_probs, target_hidden) -> None:
        """New window after committing ``count = a + 1`` tokens: position ``j`` of the new window
        (0-based) was predicted by chain node ``a + 1 + j`` (conditioned on the old, possibly
        rejected drafts); positions past the old window start uniform. ``count`` 0 (a row in
        parallel that is not open yet) keeps the positions and refreshes their laws."""
        L = self.window
        a = count - 1
        src = a[:, None] + 1 + self._offsets  # chain node whose output predicts it
        have = src <= L
        new_laws = target_probs.gather(1, src.clamp(max=L)[:, :, None].expand(-1, -1, target_probs.shape[-1]))
        uniform = torch.full_like(new_laws, 1.0 / self.vocab)
        new_laws = torch.where(have[:, :, None], new_laws, uniform)
        if self.greedy:
            fresh = new_laws.argmax(dim=-1)
        else:
            fresh = sample_from(new_laws, clocks=self._noise.read(self._slots[0]))
        if (self.coupled or self.keep_likelier) and not self.greedy:
            # The old draft at the same image position sits at window index a + 1 + j.
            old_idx = src + 1  # window index (1-based chain node) of the old draft at that position
            old_have = old_idx <= L
            old_tok = self.drafts.gather(1, (old_idx - 1).clamp(max=L - 1))
            old_law = self.laws.gather(1, (old_idx - 1).clamp(max=L - 1)[:, :, None].expand(-1, -1, self.vocab))
            p_new = new_laws.gather(2, old_tok[:, :, None]).squeeze(2)
            p_old = old_law.gather(2, old_tok[:, :, None]).squeeze(2).clamp(min=1e-30)
        if self.keep_likelier and not self.greedy:
            kept = old_have & have & ((p_new / p_old).clamp(max=1.0) > 0.5)
            # after a row that committed no bonus (a lower row's prefix), the first position is the
            # one it rejected or left: its draft is the new prediction, as PJD's code carries it
            no_bonus = count == (path >= 0).sum(1) - 1
            kept &= ~(no_bonus[:, None] & (self._offsets == 0)[None, :])
            self.drafts.copy_(torch.where(kept, old_tok, fresh))
            self.laws.copy_(torch.where(kept[:, :, None], old_law, new_laws))
            return
        if self.coupled and not self.greedy:
            keep = self._noise.read(self._slots[1]) < (p_new / p_old).clamp(max=1.0)
            residual = (new_laws - old_law).clamp(min=0)
            mass = residual.sum(-1, keepdim=True)
            residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), new_laws)
            redraw = sample_from(residual, clocks=self._noise.read(self._slots[2]))
            coupled = torch.where(keep, old_tok, redraw)
            fresh = torch.where(old_have & have, coupled, fresh)
        self.drafts.copy_(fresh)
        self.laws.copy_(self._as_proposal(new_laws, fresh))
