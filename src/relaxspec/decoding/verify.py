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
from relaxspec.drafting.tree_tables import children_table
from relaxspec.sampling import exponential_clocks, sample_from

__all__ = ["VerifyResult", "children_table", "verify_tree", "walk_tests", "walk_tree"]


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


def verify_tree(
    rule: AcceptanceRule,
    target_probs: Tensor,
    tokens: Tensor,
    parents: Tensor,
    proposals: Tensor,
    depth: Tensor,
    valid: Tensor,
    greedy: bool = False,
    generator: torch.Generator | None = None,
    record_tv: bool = True,
    *,
    children: Tensor | None = None,
    level_widths: tuple[int, ...] | None = None,
    point_mass: bool | None = None,
    check: bool = True,
    walk=None,
    uniforms: Tensor | None = None,
    clocks: Tensor | None = None,
) -> VerifyResult:
    """Walk a batch of draft trees and pick the accepted path and the next token.

    Args:
        rule: the acceptance rule.
        target_probs: ``[B, T, V]`` the target's distribution at every node (of its children).
        tokens: ``[B, T]`` int64 drafted token per node (node 0, the root, is ignored).
        parents: ``[B, T]`` parent index, -1 for the root, ``parents[:, i] < i``.
        proposals: ``[B, T, V]`` the law each node's token was drawn from (one-hot for
            deterministic drafts).
        depth: ``[B, T]`` 1-based draft position (root 0), passed to the rule.
        valid: ``[B, T]`` False for placeholder nodes, which are never tested.
        greedy: temperature 0: ``rule.greedy_accept`` of every sibling against its parent's own
            target, the correction / bonus ``rule.greedy_correction`` (the argmax).
        generator: source of all randomness (acceptance uniforms and the bonus draw).
        record_tv: compute ``step_tv`` (costs one ``rule.step_tv`` per test; off -> zeros). In
            greedy mode the record of a committed token is 1 where it differs from its node
            target's argmax (a departure from greedy AR) and 0 elsewhere.
        children, level_widths, point_mass: the tree's static structure, when the caller knows
            it (:class:`relaxspec.drafting.base.DraftTree` carries it): ``children [B or 1,
            T, C]`` node ids of each node's children in sibling order (-1 padded; invalid ones
            are skipped), ``level_widths[d]`` the most children of any node at depth ``d`` (its
            length is the number of levels that hold drafts), ``point_mass`` whether every
            proposal is one-hot. With all three the walk has a fixed number of batched ops and
            never reads the device; without, they are read from the tensors.
        check: validate the shapes and parent indices (host syncs; the engine builds its trees
            valid and skips it).
        walk: the function that walks (default :func:`walk_tree`; profile mode passes it compiled).
        uniforms, clocks: the step's random numbers, drawn ahead (a decoding step's
            :class:`relaxspec.noise.StepNoise`): ``uniforms [sum(level_widths), B]`` float64, one per
            sibling test in walk order, and exponential ``clocks [B, V]`` for the bonus draw; when not
            given (and not greedy) they are drawn here from ``generator``, in that order.

    Greedy mode ignores ``proposals`` and ``generator``: it is deterministic.
    """
    batch, nodes, vocab = target_probs.shape
    if check:
        _check_tree(target_probs, tokens, parents, proposals)
    valid = valid.to(torch.bool)
    valid = torch.cat([torch.zeros_like(valid[:, :1]), valid[:, 1:]], dim=1)  # the root is never tested
    if children is None:
        children = children_table(parents, valid)
    if level_widths is None:
        level_widths = (children.shape[2],) * _tree_levels(parents, valid)
    if greedy:
        uniforms = clocks = None
    elif uniforms is None:  # all of the step's randomness in two draws, ahead of the walk
        uniforms = torch.rand(walk_tests(level_widths), batch, generator=generator, device=target_probs.device,
                              dtype=torch.float64)
        clocks = exponential_clocks((batch, vocab), generator, target_probs.device)
    return VerifyResult(*(walk or walk_tree)(rule, target_probs, tokens, proposals, depth, valid, children, uniforms,
                                             clocks, level_widths=level_widths, greedy=greedy, record_tv=record_tv,
                                             point_mass=point_mass))


def walk_tests(level_widths: tuple[int, ...]) -> int:
    """The uniforms one walk of a tree with ``level_widths`` reads per row: one per sibling test
    (at least one, so the buffer is never empty)."""
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
    # The first leaf at or below each node (a node with no valid child is a leaf).
    safe = children.clamp(min=0).reshape(batch, -1)
    has_kid = ((children >= 0) & valid.gather(1, safe).view(batch, nodes, width)).any(2)
    index = torch.arange(nodes, device=device).expand(batch, -1)
    first_leaf = torch.where(has_kid, torch.full_like(index, nodes), index)
    for _ in range(levels):
        below = first_leaf.gather(1, safe).view(batch, nodes, width)
        below = below.masked_fill((children < 0) | ~valid.gather(1, safe).view(batch, nodes, width), nodes).amin(2)
        first_leaf = torch.where(has_kid, below, index)
    # Rank = depth reached, then the earlier leaf: depth * (T + 1) + (T - leaf), largest best.
    rank = torch.where(accepted, depth * (nodes + 1) + (nodes - first_leaf), torch.full_like(depth, -1))
    for _ in range(levels):  # one level of the tree per pass, from the leaves up
        below = rank.gather(1, safe).view(batch, nodes, width).masked_fill(children < 0, -1).amax(2)
        rank = torch.where(accepted, torch.maximum(rank, below), torch.full_like(depth, -1))
    return accepted, rank


def walk_tree(rule: AcceptanceRule, target_probs: Tensor, tokens: Tensor, proposals: Tensor, depth: Tensor,
              valid: Tensor, children: Tensor, uniforms: Tensor | None, clocks: Tensor | None, *,
              level_widths: tuple[int, ...], greedy: bool, record_tv: bool,
              point_mass: bool | None) -> tuple[Tensor, ...]:
    """The walk of :func:`verify_tree` as a pure function of tensors: ``valid`` with the root
    cleared, ``uniforms [tests, B]`` (one per sibling test, in walk order) and exponential
    ``clocks [B, V]`` for the bonus draw (both None when greedy). A fixed sequence of ops for
    given static arguments -- what ``--compile`` compiles. Returns the fields of
    :class:`VerifyResult` in order."""
    batch = target_probs.shape[0]
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    children = children.expand(batch, -1, -1)
    levels, width = len(level_widths), children.shape[2]

    no = torch.zeros(batch, dtype=torch.bool, device=device)
    zero_tv = torch.zeros(batch, dtype=target_probs.dtype, device=device)
    current = torch.zeros(batch, dtype=torch.long, device=device)
    if greedy:
        # Every node's test depends only on its parent's own target (REFERENCE §4), so all are made
        # at once; LANTERN's greedy rule then commits the longest accepted path (ties: the first in
        # sibling rank order), which a walk can only follow knowing how deep each child's accepted
        # subtree reaches.
        node_ok, reach = _greedy_reach(rule, target_probs, tokens, depth, valid, children, levels)
    target = target_probs[:, 0]
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    final_target = target  # the residual each row's bonus token is drawn from
    path_cols, committed_cols, tv_cols, tested, accepted = [current], [], [], [], []
    test_index = 0

    for level, level_width in enumerate(level_widths):
        moved = no
        next_node = current
        level_tv = zero_tv
        kids = children[rows, current]  # [B, C] the current node's children
        safe_kids = kids.clamp(min=0)
        # Everything the level's tests read, gathered once: [B, C] (and [B, C, V]).
        kid_ok = (kids >= 0) & valid.gather(1, safe_kids)
        kid_tokens = tokens.gather(1, safe_kids)
        kid_depths = depth.gather(1, safe_kids)
        if not greedy:
            kid_proposals = proposals.gather(1, safe_kids[:, :level_width, None].expand(-1, -1, proposals.shape[2]))
        if greedy:
            kid_pass, kid_reach = node_ok.gather(1, safe_kids), reach.gather(1, safe_kids)
            best = torch.full_like(current, -1)
        for rank in range(level_width):
            child = kids[:, rank]
            testing = walking & kid_ok[:, rank] & (~moved if not greedy else walking)
            token = kid_tokens[:, rank]
            node_depth = kid_depths[:, rank]
            if greedy:
                accept = kid_pass[:, rank]
            else:
                proposal = kid_proposals[:, rank]
                alpha = rule.accept_prob(target, proposal, token, node_depth)
                accept = uniforms[test_index] < alpha.double()  # P(U < alpha) = alpha for U ~ U[0, 1)
                test_index += 1
                if record_tv:
                    tv = rule.step_tv(target, proposal, token, node_depth, point_mass=point_mass)
                    level_tv = level_tv + torch.where(testing, tv.to(level_tv.dtype), zero_tv)
            accept = accept & testing
            tested.append(testing)
            accepted.append(accept)
            if not greedy:
                # A rejected sibling turns the target into the residual the next sibling is
                # tested against (and the bonus is drawn from, if it was the last one). Greedy:
                # every sibling is tested against the parent's own target (LANTERN's
                # definition, REFERENCE §4) and the correction is that target's argmax, so there
                # is no residual at all.
                residual = rule.residual(target, proposal, token, node_depth)
                target = torch.where((testing & ~accept).unsqueeze(1), residual.to(target.dtype), target)
            if greedy:  # the sibling whose accepted path reaches deepest (then the earlier leaf)
                better = accept & (kid_reach[:, rank] > best)
                best = torch.where(better, kid_reach[:, rank], best)
                next_node = torch.where(better, child, next_node)
            else:
                next_node = torch.where(accept, child, next_node)
            moved = moved | accept
        tested.extend([no] * (width - level_width))
        accepted.extend([no] * (width - level_width))

        moved_token = tokens.gather(1, next_node[:, None]).squeeze(1)
        if greedy and record_tv:
            # At temperature 0 the model's token is the node target's argmax: a committed draft
            # that is not departs from greedy AR (TV 1 between the two point masses); the
            # correction never does. So an image's sum counts its departures (docs/METHODS.md).
            level_tv = (moved & (moved_token != rule.greedy_correction(target))).to(level_tv.dtype)
        tv_cols.append(level_tv)
        final_target = torch.where((walking & ~moved).unsqueeze(1), target, final_target)
        walking = walking & moved
        current = next_node
        path_cols.append(torch.where(moved, current, torch.full_like(current, -1)))
        committed_cols.append(torch.where(moved, moved_token, torch.full_like(current, -1)))
        target = torch.where(moved.unsqueeze(1), target_probs[rows, current], target)
    final_target = torch.where(walking.unsqueeze(1), target, final_target)  # accepted a deepest node

    num_accepted = (torch.stack(committed_cols, 1) >= 0).sum(1) if levels else torch.zeros_like(current)
    if greedy:
        next_token = rule.greedy_correction(final_target)
    else:
        next_token = sample_from(final_target, clocks=clocks)
    committed = torch.stack(committed_cols + [torch.full_like(current, -1)], 1)
    committed = committed.scatter(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
    step_tv = torch.stack(tv_cols + [zero_tv], 1)
    if levels:
        counts = torch.stack([torch.stack(tested), torch.stack(accepted)]).view(2, levels, width, batch).sum(3)
        rank_tests, rank_accepts = counts[0], counts[1]
        tests = torch.stack(tested).sum(0)
    else:
        rank_tests = rank_accepts = torch.zeros(1, width, dtype=torch.long, device=device)
        tests = torch.zeros_like(current)
    return (torch.stack(path_cols, 1), num_accepted, next_token, step_tv, tests, committed, rank_tests, rank_accepts)
