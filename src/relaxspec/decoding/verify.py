"""The tree-verification walk: which drafted path a target forward accepts (REFERENCE §1.1-1.4).

Starting at the root, the children of the current node are tested in node order against the
current residual target (recursive rejection sampling: EAGLE-1 arXiv 2401.15077, SpecTr-style
multi-draft verification). Accepting a child moves the walk there, and that child's target row
becomes the new target; rejecting it replaces the target by the rule's residual, against which
the next sibling is tested. When every child is rejected (or there is none) the bonus /
correction token is sampled from the current residual and the step ends. With exact acceptance
every committed token has exactly the target's law (the sibling proposals must be the laws the
siblings were drawn from, see :mod:`relaxspec.drafting.siblings`).

At temperature 0 there is no residual (REFERENCE §4): every sibling is tested against its
parent's own target with ``rule.greedy_accept`` and the correction is that target's argmax, so a
lossless rule commits exactly the greedy AR tokens.

A tree marked ``longest_row`` (SJD-PAC's official code, ``relaxspec.methods.jacobi``) is walked
as that code walks it: every node is tested, with its own uniform, against its parent's target
less the siblings before it (whether those passed or not), and the longest accepted path is
committed, the first of equal ones; the bonus is drawn from its end's target less all its
children. Not the model's law with more than one sibling at a node (docs/METHODS.md).

The walk is vectorised over the batch: it loops over tree levels and sibling ranks, with a mask
per batch element, so its cost is ``O(depth * max_children)`` batched rule calls. Given the
tree's static structure (children table, per-level widths, whether drafts are point masses) it
makes the same fixed sequence of ops every step -- every test is computed and masked, nothing
stops early -- and never reads a value back from the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relaxspec.acceptance.base import AcceptanceRule
from relaxspec.drafting.base import DraftTree
from relaxspec.drafting.tree_tables import children_table
from relaxspec.sampling import exponential_clocks, sample_from

__all__ = ["VerifyResult", "WalkNoise", "children_table", "verify_tree", "walk_tests", "walk_tree"]


@dataclass
class VerifyResult:
    """Outcome of one verification step for a batch.

    Attributes:
        path: ``[B, Dmax + 1]`` node indices of the accepted path, starting with the root 0,
            padded with -1.
        num_accepted: ``[B]`` drafted nodes accepted (root excluded).
        next_token: ``[B]`` the bonus / correction token from the final residual target.
        step_tv: ``[B, Dmax + 1]`` per committed token (accepted tokens, then the bonus; zero
            padded), the sum of ``rule.step_tv`` over the sibling tests that decided it.
        tests: ``[B]`` number of sibling tests made.
        committed: ``[B, Dmax + 1]`` the committed tokens (accepted drafts, then
            ``next_token``), padded with -1; ``num_accepted + 1`` of them are real.
        rank_tests, rank_accepts: ``[Dmax, C]`` counts over the batch of sibling tests and
            acceptances by draft depth and sibling rank -- the measured rates a static tree
            shape is chosen from (:func:`relaxspec.drafting.trees.build_tree`).
    """

    path: Tensor
    num_accepted: Tensor
    next_token: Tensor
    step_tv: Tensor
    tests: Tensor
    committed: Tensor
    rank_tests: Tensor | None = None
    rank_accepts: Tensor | None = None


def _tree_levels(parents: Tensor, valid: Tensor) -> int:
    """The deepest valid node's distance from the root (structural, from ``parents``)."""
    batch, nodes = parents.shape
    level = torch.zeros(batch, nodes, dtype=torch.long, device=parents.device)
    rows = torch.arange(batch, device=parents.device)
    for i in range(1, nodes):  # parent index < child index, so one pass suffices
        level[:, i] = level[rows, parents[:, i].clamp(min=0)] + 1
    usable = valid.clone()
    usable[:, 0] = True
    return int(torch.where(usable, level, torch.zeros_like(level)).max()) if nodes else 0


def _check_tree(target_probs: Tensor, tokens: Tensor, parents: Tensor, proposals: Tensor) -> None:
    batch, nodes, _ = target_probs.shape
    if parents.shape != (batch, nodes) or tokens.shape != (batch, nodes) or proposals.shape != target_probs.shape:
        raise ValueError("verify_tree: tokens/parents/depth/valid must be [B, T] and proposals [B, T, V]")
    if nodes and bool((parents[:, 0] != -1).any()):
        raise ValueError("verify_tree: node 0 must be the root (parent -1)")
    if nodes > 1:
        child_ids = torch.arange(1, nodes, device=parents.device)
        if bool(((parents[:, 1:] >= child_ids) | (parents[:, 1:] < 0)).any()):
            raise ValueError("verify_tree: every parent index must be in [0, child index)")


@dataclass(eq=False)
class WalkNoise:
    """One walk's random numbers, drawn ahead (a decoding step's :class:`relaxspec.noise.StepNoise`):
    ``uniforms [sum(level_widths), B]`` float64, one per sibling test in walk order, and
    exponential ``clocks [B, V]`` for the bonus draw."""

    uniforms: Tensor
    clocks: Tensor


def verify_tree(rule: AcceptanceRule, tree: DraftTree, target_probs: Tensor, *, greedy: bool = False,
                generator: torch.Generator | None = None, record_tv: bool = True, noise: WalkNoise | None = None,
                check: bool = True, walk=None) -> VerifyResult:
    """Walk a batch of draft trees and pick the accepted path and the next token.

    Args:
        rule: the acceptance rule.
        tree: the drafts (:class:`relaxspec.drafting.base.DraftTree`; its ``ancestors`` are not
            read): ``tokens [B, T]`` (node 0, the root, is ignored), ``parents [B, T]`` (-1 for the
            root, ``parents[:, i] < i``), ``depth [B, T]`` 1-based draft position (root 0, passed
            to the rule), ``proposals [B, T, V]`` the law each node's token was drawn from
            (one-hot for deterministic drafts), ``valid [B, T]`` (False for placeholder nodes,
            never tested); and, when the source knows it, its static structure: ``children [B or
            1, T, C]`` each node's children in sibling order (-1 padded; invalid ones are
            skipped), ``level_widths[d]`` the most children of any node at depth ``d`` (one entry
            per level that holds drafts) and ``point_mass`` (every proposal one-hot). With all
            three the walk has a fixed number of batched ops and never reads the device; without,
            they are read from the tensors.
        target_probs: ``[B, T, V]`` the target's distribution at every node (of its children).
        greedy: temperature 0: ``rule.greedy_accept`` of every sibling against its parent's own
            target, the correction / bonus ``rule.greedy_correction`` (the argmax); deterministic.
        generator: where ``noise`` is drawn from when not given.
        record_tv: compute ``step_tv`` (costs one ``rule.step_tv`` per test; off -> zeros). In
            greedy mode the record of a committed token is 1 where it differs from its node
            target's argmax (a departure from greedy AR) and 0 elsewhere.
        noise: the walk's random numbers (:class:`WalkNoise`); when not given (and not greedy)
            they are drawn here from ``generator``, uniforms then clocks.
        check: validate the shapes and parent indices (host syncs; the engine builds its trees
            valid and skips it).
        walk: the function that walks (default :func:`walk_tree`; profile mode passes it compiled).
    """
    batch, nodes, vocab = target_probs.shape
    if check:
        _check_tree(target_probs, tree.tokens, tree.parents, tree.proposals)
    valid = tree.valid.to(torch.bool)
    valid = torch.cat([torch.zeros_like(valid[:, :1]), valid[:, 1:]], dim=1)  # the root is never tested
    children = tree.children if tree.children is not None else children_table(tree.parents, valid)
    level_widths = tree.level_widths
    if level_widths is None:
        level_widths = (children.shape[2],) * _tree_levels(tree.parents, valid)
    walked = DraftTree(tree.tokens, tree.parents, tree.depth, tree.proposals, valid, tree.ancestors,
                       children=children, level_widths=level_widths, point_mass=tree.point_mass,
                       longest_row=tree.longest_row)
    if greedy:
        noise = None
    elif noise is None:  # all of the step's randomness in two draws, ahead of the walk
        tests = walk_tests(level_widths, nodes if tree.longest_row else None)
        noise = WalkNoise(torch.rand(tests, batch, generator=generator, device=target_probs.device,
                                     dtype=torch.float64),
                          exponential_clocks((batch, vocab), generator, target_probs.device))
    return VerifyResult(*(walk or walk_tree)(rule, walked, target_probs, noise, greedy=greedy, record_tv=record_tv))


def walk_tests(level_widths: tuple[int, ...], longest_row_nodes: int | None = None) -> int:
    """The uniforms one walk of a tree with ``level_widths`` reads per row: one per sibling test
    (at least one, so the buffer is never empty); for a ``longest_row`` tree of
    ``longest_row_nodes`` nodes, one per node but the root (every node is tested)."""
    if longest_row_nodes is not None:
        return max(longest_row_nodes - 1, 1)
    return max(sum(level_widths), 1)


def _greedy_reach(rule: AcceptanceRule, target_probs: Tensor, tokens: Tensor, depth: Tensor, valid: Tensor,
                  children: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """Temperature 0: ``(accepted [B, T], rank [B, T])`` -- whether each node passes
    ``rule.greedy_accept`` against its parent's own target, and how good the best accepted path
    through it is (``-1`` where the node itself fails): deepest first, then the first by leaf, as
    official LANTERN / EAGLE-2 take the first longest of their root-to-leaf paths in node order (the
    path of a deepest accepted node ``m`` is, for them, the first leaf at or below ``m``). Static
    shapes, no host read."""
    batch, nodes, vocab = target_probs.shape
    width = children.shape[2]
    device = tokens.device
    # Each node's parent, from the children table (-1 entries land in a spare column).
    spare = torch.where(children >= 0, children, torch.full_like(children, nodes)).reshape(batch, -1)
    owners = torch.arange(nodes, device=device).repeat_interleave(width, output_size=nodes * width)
    parent = torch.zeros(batch, nodes + 1, dtype=torch.long, device=device)
    parent = parent.scatter(1, spare, owners.expand(batch, -1))[:, :nodes]
    node_target = target_probs.gather(1, parent.unsqueeze(2).expand(-1, -1, vocab))
    accepted = rule.greedy_accept(node_target.reshape(batch * nodes, vocab), tokens.reshape(-1),
                                  depth.reshape(-1)).view(batch, nodes) & valid
    return accepted, _path_rank(accepted, depth, valid, children, levels)


def _path_rank(accepted: Tensor, depth: Tensor, valid: Tensor, children: Tensor, levels: int,
               by_leaf: bool = True) -> Tensor:
    """``rank [B, T]``: how good the best path of ``accepted`` nodes through each node is (``-1``
    where the node itself is not accepted): deepest first, then (``by_leaf``) the first by leaf in
    node order; without, the depth alone (a walk then takes the first sibling of equal rank: the
    first path in sibling-rank order, SJD-PAC's rows). Static shapes, no host read."""
    batch, nodes, width = accepted.shape[0], accepted.shape[1], children.shape[2]
    device = accepted.device
    safe = children.clamp(min=0).reshape(batch, -1)
    own = depth  # by depth alone; by leaf too: depth * (T + 1) + (T - first leaf at or below), largest best
    if by_leaf:  # the first leaf at or below each node (a node with no valid child is a leaf)
        has_kid = ((children >= 0) & valid.gather(1, safe).view(batch, nodes, width)).any(2)
        index = torch.arange(nodes, device=device).expand(batch, -1)
        first_leaf = torch.where(has_kid, torch.full_like(index, nodes), index)
        for _ in range(levels):
            below = first_leaf.gather(1, safe).view(batch, nodes, width)
            below = below.masked_fill((children < 0) | ~valid.gather(1, safe).view(batch, nodes, width), nodes).amin(2)
            first_leaf = torch.where(has_kid, below, index)
        own = depth * (nodes + 1) + (nodes - first_leaf)
    rank = torch.where(accepted, own, torch.full_like(depth, -1))
    for _ in range(levels):  # one level of the tree per pass, from the leaves up
        below = rank.gather(1, safe).view(batch, nodes, width).masked_fill(children < 0, -1).amax(2)
        rank = torch.where(accepted, torch.maximum(rank, below), torch.full_like(depth, -1))
    return rank


def walk_tree(rule: AcceptanceRule, tree: DraftTree, target_probs: Tensor, noise: WalkNoise | None, *,
              greedy: bool, record_tv: bool) -> tuple[Tensor, ...]:
    """The walk of :func:`verify_tree` as a pure function of records: ``tree`` with the root's
    ``valid`` cleared and its ``children`` and ``level_widths`` given, ``noise`` the step's numbers
    (``None`` when greedy). A fixed sequence of ops for given static arguments -- what
    ``--compile`` compiles. Returns the fields of :class:`VerifyResult` in order."""
    walk = _Walk(tree, target_probs)
    if greedy:
        _greedy_levels(rule, tree, target_probs, walk, record_tv)
        next_token = rule.greedy_correction(walk.final_target)
    elif tree.longest_row:
        _longest_row_levels(rule, tree, target_probs, walk, noise.uniforms)
        next_token = sample_from(walk.final_target, clocks=noise.clocks)
    else:
        _sampled_levels(rule, tree, walk, noise.uniforms, record_tv)
        next_token = sample_from(walk.final_target, clocks=noise.clocks)
    return walk.result(next_token, len(tree.level_widths))


class _Walk:
    """The walk's running state over a batch, level by level: the node each row stands on, the
    target it tests against, whether it is still walking, and the columns of the result."""

    def __init__(self, tree: DraftTree, target_probs: Tensor):
        batch, device = target_probs.shape[0], target_probs.device
        self.tree, self.target_probs = tree, target_probs
        self.rows = torch.arange(batch, device=device)
        self.children = tree.children.expand(batch, -1, -1)
        self.width = self.children.shape[2]
        self.no = torch.zeros(batch, dtype=torch.bool, device=device)
        self.zero_tv = torch.zeros(batch, dtype=target_probs.dtype, device=device)
        self.current = torch.zeros(batch, dtype=torch.long, device=device)
        self.target = target_probs[:, 0]
        self.walking = torch.ones(batch, dtype=torch.bool, device=device)
        self.final_target = self.target  # the residual each row's bonus token is drawn from
        self.path_cols, self.committed_cols, self.tv_cols = [self.current], [], []
        self.tested: list[Tensor] = []
        self.accepted: list[Tensor] = []

    def kids(self):
        """The current node's children ``[B, C]``, whether each is a valid test, their tokens and
        depths: everything a level's tests read, gathered once."""
        tree = self.tree
        kids = self.children[self.rows, self.current]
        safe = kids.clamp(min=0)
        return kids, (kids >= 0) & tree.valid.gather(1, safe), tree.tokens.gather(1, safe), tree.depth.gather(1, safe)

    def test(self, testing: Tensor, accept: Tensor) -> None:
        self.tested.append(testing)
        self.accepted.append(accept)

    def pad(self, level_width: int) -> None:
        self.tested.extend([self.no] * (self.width - level_width))
        self.accepted.extend([self.no] * (self.width - level_width))

    def moved_token(self, next_node: Tensor) -> Tensor:
        return self.tree.tokens.gather(1, next_node[:, None]).squeeze(1)

    def advance(self, moved: Tensor, next_node: Tensor, moved_token: Tensor, level_tv: Tensor) -> None:
        """The level's outcome: rows that moved stand on ``next_node`` and test against its target;
        the others stop, their bonus drawn from their current target."""
        self.tv_cols.append(level_tv)
        self.final_target = torch.where((self.walking & ~moved).unsqueeze(1), self.target, self.final_target)
        self.walking = self.walking & moved
        self.current = next_node
        self.path_cols.append(torch.where(moved, next_node, torch.full_like(next_node, -1)))
        self.committed_cols.append(torch.where(moved, moved_token, torch.full_like(next_node, -1)))
        self.target = torch.where(moved.unsqueeze(1), self.target_probs[self.rows, next_node], self.target)

    def result(self, next_token: Tensor, levels: int) -> tuple[Tensor, ...]:
        current, width = self.current, self.width
        num_accepted = (torch.stack(self.committed_cols, 1) >= 0).sum(1) if levels else torch.zeros_like(current)
        committed = torch.stack(self.committed_cols + [torch.full_like(current, -1)], 1)
        committed = committed.scatter(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
        step_tv = torch.stack(self.tv_cols + [self.zero_tv], 1)
        if levels:
            batch = current.shape[0]
            counts = torch.stack([torch.stack(self.tested), torch.stack(self.accepted)]).view(2, levels, width, batch)
            summed = counts.sum(3)
            rank_tests, rank_accepts = summed[0], summed[1]
            tests = torch.stack(self.tested).sum(0)
        else:
            rank_tests = rank_accepts = torch.zeros(1, width, dtype=torch.long, device=current.device)
            tests = torch.zeros_like(current)
        return (torch.stack(self.path_cols, 1), num_accepted, next_token, step_tv, tests, committed, rank_tests,
                rank_accepts)


def _sampled_levels(rule: AcceptanceRule, tree: DraftTree, walk: _Walk, uniforms: Tensor, record_tv: bool) -> None:
    """Recursive rejection sampling, level by level: the children of the current node are tested
    in sibling order, each rejection turning the target into the rule's residual, against which
    the next sibling is tested (and the bonus drawn, after the last)."""
    test_index = 0
    for level_width in tree.level_widths:
        moved, next_node, level_tv = walk.no, walk.current, walk.zero_tv
        kids, kid_ok, kid_tokens, kid_depths = walk.kids()
        safe = kids.clamp(min=0)[:, :level_width, None]
        kid_proposals = tree.proposals.gather(1, safe.expand(-1, -1, tree.proposals.shape[2]))
        for rank in range(level_width):
            testing = walk.walking & kid_ok[:, rank] & ~moved
            token, node_depth, proposal = kid_tokens[:, rank], kid_depths[:, rank], kid_proposals[:, rank]
            target = walk.target
            alpha = rule.accept_prob(target, proposal, token, node_depth)
            accept = uniforms[test_index] < alpha.double()  # P(U < alpha) = alpha for U ~ U[0, 1)
            test_index += 1
            if record_tv:
                tv = rule.step_tv(target, proposal, token, node_depth, point_mass=tree.point_mass)
                level_tv = level_tv + torch.where(testing, tv.to(level_tv.dtype), walk.zero_tv)
            accept = accept & testing
            walk.test(testing, accept)
            residual = rule.residual(target, proposal, token, node_depth)
            walk.target = torch.where((testing & ~accept).unsqueeze(1), residual.to(target.dtype), target)
            next_node = torch.where(accept, kids[:, rank], next_node)
            moved = moved | accept
        walk.pad(level_width)
        walk.advance(moved, next_node, walk.moved_token(next_node), level_tv)
    walk.final_target = torch.where(walk.walking.unsqueeze(1), walk.target, walk.final_target)  # a deepest node


def _longest_row_levels(rule: AcceptanceRule, tree: DraftTree, target_probs: Tensor, walk: _Walk,
                        uniforms: Tensor) -> None:
    """SJD-PAC's official choice (``SJDPACSpeculativeSampler`` L152-197 of its code): every node is
    tested, node ``n`` with ``uniforms[n - 1]`` (one a node, shared by every root-to-leaf row
    through it), against its parent's target less each earlier sibling (the rule's residual after
    it, whether it passed or not); the longest path of passing nodes is committed, the first of
    equal ones in sibling-rank order (its ``argmax`` over rows, numbered by their ranks); its end's
    target less all its children is what the bonus is drawn from. Its TV is not recorded (not a
    one-step rule's: the step's law depends on every node's test)."""
    batch, nodes, vocab = target_probs.shape
    tokens, depth, valid = tree.tokens, tree.depth, tree.valid
    children = walk.children
    safe = children.clamp(min=0)
    kid_ok = (children >= 0) & valid.gather(1, safe.reshape(batch, -1)).view_as(children)
    spare = torch.full_like(safe[:, :, 0], nodes)  # a column that takes the tests of missing children
    passed = torch.zeros(batch, nodes + 1, dtype=torch.bool, device=target_probs.device)
    node_uniforms = uniforms.transpose(0, 1)  # [B, tests]: node n's is column n - 1
    target = target_probs  # each node's target for its next child, less the children before it
    for rank in range(children.shape[2]):
        kid, ok = safe[:, :, rank], kid_ok[:, :, rank]
        token, kid_depth = tokens.gather(1, kid).reshape(-1), depth.gather(1, kid).reshape(-1)
        proposal = tree.proposals.gather(1, kid.unsqueeze(2).expand(-1, -1, vocab)).reshape(-1, vocab)
        flat = target.reshape(-1, vocab)
        alpha = rule.accept_prob(flat, proposal, token, kid_depth).view(batch, nodes)
        draw = node_uniforms.gather(1, (kid - 1).clamp(min=0))
        passed = passed.scatter(1, torch.where(ok, kid, spare), ok & (draw < alpha.double()))
        residual = rule.residual(flat, proposal, token, kid_depth).view(batch, nodes, vocab)
        target = torch.where(ok.unsqueeze(2), residual.to(target.dtype), target)
    accepted = passed[:, :nodes] & valid
    _follow_reach(tree, walk, accepted, _path_rank(accepted, depth, valid, children, len(tree.level_widths),
                                                   by_leaf=False))
    walk.final_target = target[walk.rows, walk.current]


def _greedy_levels(rule: AcceptanceRule, tree: DraftTree, target_probs: Tensor, walk: _Walk, record_tv: bool) -> None:
    """Temperature 0 (REFERENCE §4): every sibling is tested against its parent's own target with
    ``rule.greedy_accept`` and there is no residual; LANTERN's greedy rule then commits the
    longest accepted path (ties: the first in sibling rank order), which a walk can only follow
    knowing how deep each child's accepted subtree reaches."""
    node_ok, reach = _greedy_reach(rule, target_probs, tree.tokens, tree.depth, tree.valid, walk.children,
                                   len(tree.level_widths))

    def departures(moved: Tensor, moved_token: Tensor) -> Tensor:
        # At temperature 0 the model's token is the node target's argmax: a committed draft that is
        # not departs from greedy AR (TV 1 between the two point masses); the correction never does.
        # So an image's sum counts its departures (docs/METHODS.md).
        return (moved & (moved_token != rule.greedy_correction(walk.target))).to(walk.zero_tv.dtype)

    _follow_reach(tree, walk, node_ok, reach, departures if record_tv else None)
    walk.final_target = torch.where(walk.walking.unsqueeze(1), walk.target, walk.final_target)


def _follow_reach(tree: DraftTree, walk: _Walk, accepted: Tensor, reach: Tensor, level_tv=None) -> None:
    """Walk down the tree through ``accepted`` nodes, at each level to the child whose accepted
    path reaches deepest (``reach``, :func:`_path_rank`; ties: the first in sibling rank order),
    counting every valid child as tested; ``level_tv(moved, moved_token)`` is each level's record
    (zeros without it)."""
    for level_width in tree.level_widths:
        moved, next_node = walk.no, walk.current
        kids, kid_ok, _, _ = walk.kids()
        safe = kids.clamp(min=0)
        kid_pass, kid_reach = accepted.gather(1, safe), reach.gather(1, safe)
        best = torch.full_like(walk.current, -1)
        for rank in range(level_width):
            testing = walk.walking & kid_ok[:, rank]
            accept = kid_pass[:, rank] & testing
            walk.test(testing, accept)
            better = accept & (kid_reach[:, rank] > best)  # the sibling whose accepted path reaches deepest
            best = torch.where(better, kid_reach[:, rank], best)
            next_node = torch.where(better, kids[:, rank], next_node)
            moved = moved | accept
        walk.pad(level_width)
        moved_token = walk.moved_token(next_node)
        walk.advance(moved, next_node, moved_token, walk.zero_tv if level_tv is None else level_tv(moved, moved_token))
