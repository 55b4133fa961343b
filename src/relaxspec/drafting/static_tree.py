"""Fixed tree shapes for an EAGLE drafter (chains are the one-path case): siblings sampled from
the drafter's law without replacement, or its top-k (LANTERN++, arXiv 2502.06352)."""

from __future__ import annotations

import torch

from relaxspec.caching import ByContent
from relaxspec.drafting.base import DraftTree, FeatureDrafter
from relaxspec.drafting.siblings import sample_siblings, topk_siblings
from relaxspec.drafting.tree_tables import ancestor_matrix, static_children
from relaxspec.drafting.trees import TreeSpec


#: Index tables of recent tree shapes, by (paths, device): a decode builds a new StaticTree, and its
#: tables -- tens of small host->device copies -- depend on the shape alone (issue 22).
_SHAPE_TABLES = ByContent(kept=16)


class StaticTree:
    """A fixed tree shape (:class:`TreeSpec`); siblings "sampled" from ``q`` without replacement
    or deterministic "topk". A chain is ``TreeSpec.chain(L)``. Every table the step needs
    (parents, depths, ancestors, children, per-level slots and ranks) is built once per shape and
    device, and kept across decodes."""

    def __init__(self, spec: TreeSpec, siblings: str = "sampled"):
        self.spec, self.siblings = spec, siblings
        self.max_nodes, self.depth = spec.num_nodes, spec.depth
        self.drafter_slots = spec.num_nodes
        # Per level (the paths' own numbers, no tensor): the parents its nodes hang from, and the
        # most children one of them has there.
        self._parents_at = [sorted({path[:-1] for path in spec.paths if len(path) == d}) for d in range(1, spec.depth + 1)]
        children: dict[tuple, int] = {}
        for path in spec.paths:
            children[path[:-1]] = children.get(path[:-1], 0) + 1
        self._widths = tuple(max(children[parent] for parent in parents) for parents in self._parents_at)
        # the drafter runs once per level whose nodes have children (the last level's never do)
        self.expansions = len(self._parents_at) - 1
        self._tables: dict[torch.device, dict] = {}

    def level_widths(self, vocab: int) -> tuple[int, ...]:
        return self._widths

    def prepare(self, device: torch.device) -> None:
        """The shape's tables on ``device``, built before the first step (a step compiled as one
        graph only reads them)."""
        self.tables(device)

    def reserve(self, noise, rows: int, vocab: int, greedy: bool) -> list:
        """Sampled siblings draw one clock per parent and token at every level (Gumbel-top-k):
        ``[rows * parents, V]`` a level; top-k and greedy siblings draw nothing."""
        if greedy or self.siblings == "topk":
            return []
        return [noise.reserve((rows * len(parents), vocab)) for parents in self._parents_at]

    def tables(self, device: torch.device) -> dict:
        """The shape's index tables on ``device``, made once per shape and device for every tree
        of that shape (read-only: nothing writes into them)."""
        if device not in self._tables:
            key = (tuple(tuple(path) for path in self.spec.paths), str(device))
            self._tables[device] = _SHAPE_TABLES.get(key, lambda: self._build_tables(device))
        return self._tables[device]

    def _build_tables(self, device: torch.device) -> dict:
        """The index tables, built on the host and copied to ``device``."""
        spec = self.spec
        children, widths = static_children(spec)
        levels = []
        # Per level: its nodes, the parents that have children there, each child's (parent
        # slot, rank), the width of the sibling draw and the nodes whose q the drafter computes.
        for d in range(1, spec.depth + 1):
            nodes = spec.level(d)
            parents = spec.parents[nodes]
            parent_list = torch.unique(parents)
            slot = torch.searchsorted(parent_list, parents)
            expand = nodes[spec.num_children[nodes] > 0]
            levels.append(dict(nodes=nodes, node_parents=parents, parent_list=parent_list, slot=slot,
                               ranks=spec.ranks[nodes], width=int(spec.num_children[parent_list].max()),
                               expand=expand, expand_parents=spec.parents[expand]))
        host = dict(parents=spec.parents[None], depths=spec.depths[None],
                    ancestors=ancestor_matrix(spec.parents[None], spec.depth), children=children)
        moved = {k: v.to(device) for k, v in host.items()}
        moved["levels"] = [{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in lv.items()}
                           for lv in levels]
        moved["level_widths"] = widths
        return moved

    def draft(self, source: FeatureDrafter, roots, root_index, greedy: bool, clocks: list) -> DraftTree:
        spec, batch = self.spec, roots.shape[0]
        device = roots.device
        tab = self.tables(device)
        vocab = source.root_q.shape[-1]
        nodes_n = spec.num_nodes
        tokens = torch.zeros(batch, nodes_n, dtype=torch.long, device=device)
        tokens[:, 0] = roots
        proposals = torch.zeros(batch, nodes_n, vocab, device=device)
        valid = torch.ones(batch, nodes_n, dtype=torch.bool, device=device)
        q_at = torch.zeros(batch, nodes_n, vocab, device=device)
        q_at[:, 0] = source.root_q
        feats = source.root_feature.new_zeros(source.root_feature.shape[0], nodes_n, source.root_feature.shape[-1])
        feats[:, 0] = source.root_feature
        ancestors = tab["ancestors"].expand(batch, nodes_n, nodes_n)
        depths = tab["depths"][0]
        point_mass = greedy or self.siblings == "topk"
        for index, level in enumerate(tab["levels"]):
            nodes, width, expand = level["nodes"], level["width"], level["expand"]
            q_parents = q_at[:, level["parent_list"]].reshape(-1, vocab)  # [B*P, V]
            if point_mass:
                sib_tok, sib_prop, sib_valid = topk_siblings(q_parents, width)
            else:
                sib_tok, sib_prop, sib_valid = sample_siblings(q_parents, width, clocks=clocks[index])
            P = level["parent_list"].shape[0]
            pick = (level["slot"], level["ranks"])
            tokens[:, nodes] = sib_tok.view(batch, P, width)[:, pick[0], pick[1]]
            proposals[:, nodes] = sib_prop.view(batch, P, width, vocab)[:, pick[0], pick[1]]
            valid[:, nodes] = sib_valid.view(batch, P, width)[:, pick[0], pick[1]] & valid[:, level["node_parents"]]
            if expand.shape[0]:
                slots, mask = source.node_inputs(root_index, ancestors, expand)
                out, q = source.expand(feats[:, level["expand_parents"]], tokens[:, expand],
                                       root_index[:, None] + depths[expand], slots, mask)
                feats[:, expand] = out
                q_at[:, expand] = q
        return DraftTree(tokens, tab["parents"].expand(batch, -1), tab["depths"].expand(batch, -1), proposals,
                         valid, ancestors, children=tab["children"], level_widths=tab["level_widths"],
                         point_mass=point_mass)
