"""Tree tables: ancestors, children in sibling order and attention masks, the one home of the
helpers drafting and verification share. Every function is batched and, given static bounds,
free of host syncs."""

from __future__ import annotations

import torch

from relaxspec.drafting.trees import TreeSpec


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``parents [B, T]`` -> ``[B, T, T]`` bool, ``[b, i, j]`` = j is i or one of its ancestors."""
    batch, nodes = parents.shape
    step = torch.zeros(batch, nodes, nodes, device=parents.device)
    rows = torch.arange(nodes, device=parents.device)
    has_parent = parents >= 0
    if batch == 1:  # (batch > 1 below; a [:, rows, parents[B, T]] index here would touch B*B*T entries)
        step[:, rows, parents.clamp(min=0)] = has_parent.float()
    if batch > 1:
        b_idx = torch.arange(batch, device=parents.device)[:, None].expand(batch, nodes)
        step[b_idx, rows.expand(batch, nodes), parents.clamp(min=0)] = has_parent.float()
    reach = torch.eye(nodes, device=parents.device).expand(batch, nodes, nodes).clone()
    hop = reach
    for _ in range(max_depth):
        hop = torch.bmm(hop, step)
        reach = reach + hop
    return reach > 0


def children_table(parents: torch.Tensor, valid: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Children of every node in ascending node order: ``[B, T]`` -> ``[B, T, C]`` (-1 padded).

    Only valid nodes are listed. ``C`` is ``width`` when given (a static bound on any node's
    number of children: no host sync), else the largest number of valid children of any node
    (read from the device).
    """
    batch, nodes = parents.shape
    node_ids = torch.arange(nodes, device=parents.device)
    # is_child[b, p, i]: node i is a valid child of node p.
    is_child = (parents.unsqueeze(1) == node_ids.view(1, nodes, 1)) & valid.unsqueeze(1)
    rank = is_child.long().cumsum(dim=2) - 1
    if width is None:
        width = max(1, int(is_child.sum(dim=2).max())) if nodes else 1
    table = torch.full((batch, nodes, width + 1), -1, dtype=torch.long, device=parents.device)
    # Non-children (and children past ``width``) are written to a spare last column that is
    # dropped afterwards.
    slot = torch.where(is_child, rank.clamp(max=width), torch.full_like(rank, width))
    table.scatter_(2, slot, node_ids.view(1, 1, nodes).expand(batch, nodes, nodes).clone())
    # Each real column has exactly one writer (a child's rank is unique); the spare column got
    # arbitrary writers and is dropped.
    return table[:, :, :width]


def static_children(spec: TreeSpec) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A fixed shape -> its children table ``[1, T, C]`` (:func:`children_table`) and the most
    children of a node at each depth that has children, built once on the host."""
    table = children_table(spec.parents[None], torch.ones(1, spec.num_nodes, dtype=torch.bool))
    counts = (table[0] >= 0).sum(dim=1)
    widths = tuple(int(counts[spec.depths == level].max()) for level in range(spec.depth))
    return table, widths


def tree_attention_mask(base: torch.Tensor, ancestors: torch.Tensor, kv_len: int,
                        queries: torch.Tensor | None = None) -> torch.Tensor:
    """Mask ``[B, Q, kv_len]`` for tree nodes stored at slots ``base + node``: every committed
    slot ``< base`` plus the query node's ancestors (and itself). ``queries [B, Q]`` selects
    which nodes ask (default all). ``kv_len`` is the whole cache: the shape never depends on
    where the tree sits."""
    batch, nodes, _ = ancestors.shape
    if queries is not None:
        ancestors = ancestors.gather(1, queries[:, :, None].expand(-1, -1, nodes))
    keys = torch.arange(kv_len, device=base.device)[None, None, :]
    rel = keys - base[:, None, None]
    in_tree = (rel >= 0) & (rel < nodes)
    anc = ancestors.gather(2, rel.clamp(0, nodes - 1).expand(batch, ancestors.shape[1], kv_len))
    return (rel < 0) | (in_tree & anc)
