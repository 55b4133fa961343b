"""The drafter-free Jacobi window: SJD (arXiv 2410.01699), its coupled variant (SCD-style,
arXiv 2510.24211) and SJD-PAC's proactive tree over it (arXiv 2603.18599)."""

from __future__ import annotations

from itertools import product

import torch

from relaxspec.acceptance.base import one_hot
from relaxspec.caching import ByContent
from relaxspec.drafting.base import DraftTree
from relaxspec.drafting.siblings import siblings_after, without_replacement_laws
from relaxspec.drafting.static_tree import StaticTree
from relaxspec.drafting.trees import MAX_TREE_NODES, TreeSpec, check_tree_size
from relaxspec.errors import RelaxspecError
from relaxspec.noise import UNIFORMS32, UPDATE, StepNoise
from relaxspec.sampling import exponential_clocks, sample_from


#: Each window layout's index tables, by (window, width, depth, device): made once, not copied to the
#: device again for every decode.
_LAYOUT_TABLES = ByContent(kept=16)


def tree_drafts(width: int, depth: int) -> int:
    """The drafts of a proactive tree of ``width`` siblings and ``depth`` levels counting its root
    (SJD-PAC's ``tree_width``, ``tree_depth``): ``width + width**2 + ... + width**(depth-1)``; none
    for width 1 (no tree: the window is its chain). Past :data:`MAX_TREE_NODES` the sum stops
    (some number above it)."""
    if width <= 1:
        return 0
    total, level = 0, 1
    for _ in range(1, depth):
        level *= width
        total += level
        if total > MAX_TREE_NODES:  # (past what a step verifies the sum is only ever refused)
            break
    return total


def least_window(width: int, depth: int) -> int:
    """The smallest window that holds the proactive tree (its chain then ends with it)."""
    return max(tree_drafts(width, depth), 1)


def chain_length(window: int, width: int = 1, depth: int = 1) -> int:
    """The deepest draft of a window of ``window`` drafts with a proactive tree of ``width`` and
    ``depth`` (:func:`window_layout`): ``window - tree_drafts + depth - 1`` (the window itself
    without a tree)."""
    return window - tree_drafts(width, depth) + (depth - 1 if width > 1 else 0)


def window_layout(window: int, width: int = 1, depth: int = 1) -> tuple[TreeSpec, int]:
    """The shape of a Jacobi window of ``window`` drafts (nodes past the root, what one forward
    verifies) with a proactive tree (SJD-PAC's layout, ``generate_tree_mask_and_retrieve`` of its
    code): at each of the first ``depth - 1`` positions ``width`` siblings, every node there the
    parent of the next position's ``width`` (one set of tokens a position, shared by every parent);
    the first siblings' path then goes on as one chain to the window's end. Returns the
    :class:`TreeSpec` and the chain's length (:func:`chain_length`; official 64 nodes with the root,
    width 3, depth 3: 53)."""
    check_tree_size(window, f"a Jacobi window of {window:,}")
    if tree_drafts(width, depth) > MAX_TREE_NODES:
        raise RelaxspecError(f"a proactive tree of width {width:,} and depth {depth:,} drafts more than "
                             f"{MAX_TREE_NODES} tokens per step; a step verifies at most {MAX_TREE_NODES}")
    branched = depth - 1 if width > 1 else 0
    chain = chain_length(window, width, depth)
    if chain < max(branched, 1):
        raise RelaxspecError(f"--window {window:,} holds fewer drafts than the proactive tree of width {width} and "
                             f"depth {depth}: at least {least_window(width, depth):,}")
    paths = [(0,) * d for d in range(1, chain + 1)]
    paths += [ranks for d in range(1, branched + 1) for ranks in product(range(width), repeat=d)]
    return TreeSpec.from_paths(paths), chain


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

    ``official=True`` (SJD-PAC's code, github.com/KangJialiang/SJD-PAC, coupled, with a tree): the
    tree's other siblings are drawn as that code draws them, from the residual
    ``norm(max(p_new - p_old, 0))`` without replacement after the position's residual draw (its
    ``torch.multinomial(res_p, K)``), while their declared laws stay ``p_new`` without the siblings
    before them; its trees are walked as its code walks them (:attr:`DraftTree.longest_row`). Not
    the model's law (:attr:`lossless` is False; docs/METHODS.md).

    The window (``drafts [B, L]`` and the laws they were drawn from ``laws [B, L, V]``) is kept in
    tensors updated in place; a step's redraws read numbers reserved on the step's
    :class:`~relaxspec.sampling.StepNoise` (the fresh draws' clocks, then, coupled, the keep
    uniforms and the residual draws' clocks, then, with a tree, its other siblings' clocks).
    """

    watch = None
    forwards_per_step = 0
    models = ()
    caption_rows = "upstream"  # reads no condition

    def __init__(self, window: int = 16, coupled: bool = False, keep_likelier: bool = False, width: int = 1,
                 depth: int = 1, official: bool = False):
        if coupled and keep_likelier:
            raise ValueError("a Jacobi window keeps old drafts by one rule: coupled or keep_likelier")
        if keep_likelier and width > 1:
            raise ValueError("PJD's kept drafts have no law to draw siblings from: width 1 with keep_likelier")
        if official and not coupled:
            raise ValueError("SJD-PAC's official siblings are drawn from the coupled redraw's residual: coupled=True")
        self.window, self.coupled, self.keep_likelier = window, coupled, keep_likelier
        self.longest_row = official
        self.lossless = not official
        spec, chain = window_layout(window, width, depth)
        self.width, self.branched, self.chain = width, (depth - 1 if width > 1 else 0), chain
        self.max_nodes, self.max_depth = window + 1, chain
        self.depth = chain
        self._shape = StaticTree(spec, "topk")
        self.level_widths = self._shape.level_widths(0)
        # Where each node's token and law are kept: the first ``branched`` positions' ``width``
        # siblings, then the chain's positions past them; and the chain's node at each depth.
        index = {path: i + 1 for i, path in enumerate(spec.paths)}
        slot = [0] + [(len(p) - 1) * width + p[-1] if len(p) <= self.branched
                      else self.branched * width + len(p) - self.branched - 1 for p in spec.paths]
        self._layout = (window, width, depth)
        self._slot_of = torch.tensor(slot[1:])
        self._chain_of = torch.tensor([0] + [index[(0,) * d] for d in range(1, chain + 1)])
        # descend[n, s]: the node s first-sibling steps below node n (-1 where the tree ends)
        nodes = [()] + list(spec.paths)
        descend = [[index.get(path + (0,) * steps, -1) if path or steps else 0 for steps in range(chain + 2)]
                   for path in nodes]
        self._descend = torch.tensor(descend)

    def _layout_tables(self, device) -> tuple[torch.Tensor, ...]:
        """``(slot_of, chain_of, descend)`` on ``device``, made once per layout and device."""
        return _LAYOUT_TABLES.get((*self._layout, str(device)),
                                  lambda: tuple(t.to(device) for t in (self._slot_of, self._chain_of, self._descend)))

    def start(self, first_tokens, first_probs, first_hidden, streams: int, num_tokens: int, generator,
              greedy: bool, *, condition_hidden=None, condition_tokens=None, noise: StepNoise | None = None,
              compile: bool = False, profiling=None) -> None:
        """Called once after the target's prefill; the first window is uniform random (drawn from
        ``generator`` here); the later windows' numbers are reserved on ``noise``."""
        self.greedy = greedy
        batch, self.vocab = first_tokens.shape[0], first_probs.shape[-1]
        device = first_tokens.device
        uniform = torch.full((batch, self.chain, self.vocab), 1.0 / self.vocab, device=device)
        drafts = sample_from(uniform, generator, greedy)
        laws = self._as_proposal(uniform, drafts)
        branched, others = self.branched, self.width - 1

        def kept(name, value):  # kept with the step's numbers, so a compiled step finds them where they were
            return value if noise is None else noise.kept(f"jacobi.{name}", value.shape, value.dtype).copy_(value)

        self.drafts, self.laws = kept("drafts", drafts), kept("laws", laws)
        if branched:  # the first window's other siblings: uniform draws without replacement, as its first
            first = uniform[:, :branched].reshape(-1, self.vocab)
            clocks = None if greedy else exponential_clocks(first.shape, generator, device)
            siblings, sibling_valid = siblings_after(first, drafts[:, :branched].reshape(-1), others, clocks)
            self.siblings = kept("siblings", siblings.view(batch, branched, others))
            self.sibling_valid = kept("sibling_valid", sibling_valid.view(batch, branched, others))
        self._noise, self._slots = noise, None
        if noise is not None and not greedy:
            shape = (batch, self.chain, self.vocab)
            self._slots = [noise.reserve(shape, phase=UPDATE)]
            if self.coupled:
                self._slots += [noise.reserve(shape[:2], UNIFORMS32, UPDATE), noise.reserve(shape, phase=UPDATE)]
            if branched:
                self._slots.append(noise.reserve((batch * branched, self.vocab), phase=UPDATE))
        tab = self._shape.tables(device)
        n = self.window + 1
        # one address across decodes of a shape: a compiled step reads them
        self._offsets = kept("offsets", torch.arange(self.chain, device=device))
        slot_of, chain_of, descend = self._layout_tables(device)
        self._slot_at, self._chain_at = kept("slot_of", slot_of), kept("chain_of", chain_of)
        self._descend_at, self._depth_at = kept("descend", descend), tab["depths"][0]
        self._ones = kept("ones", torch.ones(batch, self.chain, dtype=torch.bool, device=device))
        self._tree = (tab["parents"].expand(batch, n), tab["depths"].expand(batch, n),
                      tab["ancestors"].expand(batch, n, n), tab["children"], tab["level_widths"])

    def _as_proposal(self, laws: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        # Greedy drafts are point masses: the proposal is the one-hot of the draft.
        if not self.greedy:
            return laws
        return one_hot(drafts.reshape(-1), self.vocab, laws.dtype).view_as(laws)

    def close(self) -> None:
        pass

    def propose(self, roots, root_index, greedy: bool) -> DraftTree:
        batch, branched, vocab = roots.shape[0], self.branched, self.vocab
        slot_tokens, slot_laws, slot_valid = self.drafts, self.laws, self._ones
        if branched:  # the proactive tree's positions: every sibling, in rank order, then the chain past them
            tree_tokens = torch.cat([self.drafts[:, :branched, None], self.siblings], dim=2)
            tree_valid = torch.cat([self._ones[:, :branched, None], self.sibling_valid], dim=2)
            if self.greedy:
                tree_laws = one_hot(tree_tokens.reshape(-1), vocab, self.laws.dtype).view(batch, -1, vocab)
            else:
                tree_laws = without_replacement_laws(self.laws[:, :branched].reshape(-1, vocab),
                                                     tree_tokens.reshape(-1, self.width),
                                                     tree_valid.reshape(-1, self.width)).view(batch, -1, vocab)
            slot_tokens = torch.cat([tree_tokens.flatten(1), self.drafts[:, branched:]], dim=1)
            slot_laws = torch.cat([tree_laws, self.laws[:, branched:]], dim=1)
            slot_valid = torch.cat([tree_valid.flatten(1), self._ones[:, : self.chain - branched]], dim=1)
            # the tree's nodes share their position's tokens (one set a position): node order from slot order
            slot_tokens, slot_laws, slot_valid = (x.index_select(1, self._slot_at)
                                                  for x in (slot_tokens, slot_laws, slot_valid))
        tokens = torch.cat([roots[:, None], slot_tokens], dim=1)
        # The root is never tested; a one-hot row keeps it a distribution.
        proposals = torch.cat([one_hot(roots, vocab, self.laws.dtype)[:, None], slot_laws], dim=1)
        valid = torch.cat([self._ones[:, :1], slot_valid], dim=1)
        parents, depths, ancestors, children, widths = self._tree
        return DraftTree(tokens, parents, depths, proposals, valid, ancestors, children=children, level_widths=widths,
                         point_mass=self.greedy, longest_row=self.longest_row)

    def update(self, committed, path, count, root_index, target_probs, target_hidden) -> None:
        """New window after committing ``count = a + 1`` tokens: position ``j`` of the new window
        (0-based) was predicted by the node at depth ``a + 1 + j`` below the last accepted one along
        first siblings (the rejected one, then the old drafts after it), or, where the tree has no
        such node (below a later sibling, past the proactive tree), by the chain's node at that
        depth; positions past the old window start uniform. (In a chain both are the chain node
        ``a + 1 + j``; in a tree the first is conditioned on the accepted path, as the official
        code's accepted row.) ``count`` 0 (a row in parallel that is not open yet) keeps the
        positions and refreshes their laws."""
        L = self.chain
        a = count - 1
        src = a[:, None] + 1 + self._offsets  # depth of the node whose output predicts it
        have = src <= L
        node = self._chain_at[src.clamp(max=L)]
        if self.branched:  # below the accepted path where the tree goes on there
            last = path.gather(1, a.clamp(min=0)[:, None])  # the last accepted node (the root if none)
            steps = src - self._depth_at[last]
            below = self._descend_at[last, steps.clamp(0, L + 1)]
            node = torch.where((steps >= 0) & (below >= 0), below, node)
        new_laws = target_probs.gather(1, node[:, :, None].expand(-1, -1, target_probs.shape[-1]))
        uniform = torch.full_like(new_laws, 1.0 / self.vocab)
        new_laws = torch.where(have[:, :, None], new_laws, uniform)
        sibling_law = sibling_after = None  # what the tree's other siblings are drawn from, and after
        if self.greedy:
            fresh = new_laws.argmax(dim=-1)
        else:
            fresh = sample_from(new_laws, clocks=self._noise.read(self._slots[0]))
        if (self.coupled or self.keep_likelier) and not self.greedy:
            # The old draft at the same image position sits at chain depth a + 2 + j.
            old_idx = src + 1  # chain depth of the old draft at that position
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
            old_position = old_have & have
            if self.longest_row:  # the official code's siblings: the residual's next draws after its first
                tree = slice(0, self.branched)
                sibling_law = torch.where(old_position[:, tree, None], residual[:, tree], new_laws[:, tree])
                sibling_after = torch.where(old_position, redraw, fresh)
            fresh = torch.where(old_position, coupled, fresh)
        if sibling_after is None:  # the next draws from the position's law, after its draft
            sibling_law, sibling_after = new_laws, fresh
        self.drafts.copy_(fresh)
        self.laws.copy_(self._as_proposal(new_laws, fresh))
        if self.branched:  # the tree's other siblings: the next draws from each position's law
            first = sibling_law[:, : self.branched].reshape(-1, self.vocab)
            clocks = None if self.greedy else self._noise.read(self._slots[-1])
            siblings, valid = siblings_after(first, sibling_after[:, : self.branched].reshape(-1), self.width - 1,
                                             clocks)
            self.siblings.copy_(siblings.view_as(self.siblings))
            self.sibling_valid.copy_(valid.view_as(self.sibling_valid))
