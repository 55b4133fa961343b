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
per batch element, so its cost is ``O(depth * max_children)`` batched rule calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from relaxspec.acceptance.base import AcceptanceRule


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


def children_table(parents: Tensor, valid: Tensor) -> Tensor:
    """Children of every node in ascending node order: ``[B, T]`` -> ``[B, T, C]`` (-1 padded).

    Only valid nodes are listed; ``C`` is the largest number of valid children of any node.
    """
    batch, nodes = parents.shape
    node_ids = torch.arange(nodes, device=parents.device)
    # is_child[b, p, i]: node i is a valid child of node p.
    is_child = (parents.unsqueeze(1) == node_ids.view(1, nodes, 1)) & valid.unsqueeze(1)
    rank = is_child.long().cumsum(dim=2) - 1
    width = max(1, int(is_child.sum(dim=2).max())) if nodes else 1
    table = torch.full((batch, nodes, width + 1), -1, dtype=torch.long, device=parents.device)
    # Non-children are written to a spare last column that is dropped afterwards.
    slot = torch.where(is_child, rank, torch.full_like(rank, width))
    table.scatter_(2, slot, node_ids.view(1, 1, nodes).expand(batch, nodes, nodes).clone())
    # Each real column has exactly one writer (a child's rank is unique); the spare column got
    # arbitrary writers and is dropped.
    return table[:, :, :width]


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

    Greedy mode ignores ``proposals`` and ``generator``: it is deterministic.
    """
    batch, nodes, vocab = target_probs.shape
    if parents.shape != (batch, nodes) or tokens.shape != (batch, nodes) or proposals.shape != target_probs.shape:
        raise ValueError("verify_tree: tokens/parents/depth/valid must be [B, T] and proposals [B, T, V]")
    if nodes and bool((parents[:, 0] != -1).any()):
        raise ValueError("verify_tree: node 0 must be the root (parent -1)")
    if nodes > 1:
        child_ids = torch.arange(1, nodes, device=parents.device)
        if bool(((parents[:, 1:] >= child_ids) | (parents[:, 1:] < 0)).any()):
            raise ValueError("verify_tree: every parent index must be in [0, child index)")

    device = target_probs.device
    rows = torch.arange(batch, device=device)
    valid = valid.to(torch.bool).clone()
    valid[:, 0] = False  # the root is committed already, never tested
    children = children_table(parents, valid)
    width = children.shape[2]
    levels = _tree_levels(parents, valid)

    path = torch.full((batch, levels + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    committed = torch.full((batch, levels + 1), -1, dtype=torch.long, device=device)
    step_tv = torch.zeros(batch, levels + 1, dtype=target_probs.dtype, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    tests = torch.zeros(batch, dtype=torch.long, device=device)
    rank_tests = torch.zeros(max(levels, 1), width, dtype=torch.long, device=device)
    rank_accepts = torch.zeros_like(rank_tests)

    current = torch.zeros(batch, dtype=torch.long, device=device)
    target = target_probs[:, 0].clone()
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    final_target = target.clone()  # the residual each row's bonus token is drawn from

    for level in range(levels + 1):
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        next_node = current.clone()
        for rank in range(width):
            child = children[rows, current, rank]
            testing = walking & ~moved & (child >= 0)
            if not bool(testing.any()):
                break
            safe = child.clamp(min=0)
            token = tokens[rows, safe]
            node_depth = depth[rows, safe]
            if greedy:
                accept = rule.greedy_accept(target, token, node_depth)
            else:
                proposal = proposals[rows, safe]
                alpha = rule.accept_prob(target, proposal, token, node_depth)
                uniform = torch.rand(batch, generator=generator, device=device, dtype=torch.float64)
                accept = uniform < alpha.double()  # P(U < alpha) = alpha for U ~ U[0, 1)
                if record_tv:
                    tv = rule.step_tv(target, proposal, token, node_depth)
                    step_tv[:, level] += torch.where(testing, tv.to(step_tv.dtype), torch.zeros_like(step_tv[:, 0]))
            tests += testing.long()
            accept = accept & testing
            if level < rank_tests.shape[0]:
                rank_tests[level, rank] += testing.sum()
                rank_accepts[level, rank] += accept.sum()
            reject = testing & ~accept
            # Sampling: a rejected sibling turns the target into the residual the next sibling is
            # tested against (and the bonus is drawn from, if it was the last one). Greedy: every
            # sibling is tested against the parent's own target (LANTERN's definition, REFERENCE
            # §4) and the correction is that target's argmax, so there is no residual at all.
            if not greedy and bool(reject.any()):  # (the residual costs several vocabulary-wide ops: only when used)
                residual = rule.residual(target, proposal, token, node_depth)
                target = torch.where(reject.unsqueeze(1), residual.to(target.dtype), target)
            moved |= accept
            next_node = torch.where(accept, child, next_node)

        if greedy and record_tv:
            # At temperature 0 the model's token is the node target's argmax: a committed draft
            # that is not departs from greedy AR (TV 1 between the two point masses); the
            # correction never does. So an image's sum counts its departures (docs/METHODS.md).
            departs = moved & (tokens[rows, next_node] != rule.greedy_correction(target))
            step_tv[:, level] = departs.to(step_tv.dtype)
        finishing = walking & ~moved
        final_target = torch.where(finishing.unsqueeze(1), target, final_target)
        walking = walking & moved
        current = next_node
        if level + 1 <= levels:
            path[:, level + 1] = torch.where(moved, current, path[:, level + 1])
        committed[:, level] = torch.where(moved, tokens[rows, current], committed[:, level])
        num_accepted += moved.long()
        target = torch.where(moved.unsqueeze(1), target_probs[rows, current], target)
        if not bool(walking.any()):
            break

    if greedy:
        next_token = rule.greedy_correction(final_target)
    else:
        next_token = torch.multinomial(final_target.float(), 1, generator=generator).squeeze(1)
    committed.scatter_(1, num_accepted.unsqueeze(1), next_token.unsqueeze(1))
    return VerifyResult(
        path=path,
        num_accepted=num_accepted,
        next_token=next_token,
        step_tv=step_tv,
        tests=tests,
        committed=committed,
        rank_tests=rank_tests,
        rank_accepts=rank_accepts,
    )
