"""Draft sources: where a speculative step's draft tree comes from.

A source answers ``propose`` with a :class:`DraftTree` (node 0 = the root, the last committed
token) and is told the outcome with ``update``. The engine knows nothing else about it.

* :class:`EagleSource` — an EAGLE drafter (arXiv 2401.15077) laid out by a drafting structure:
  :class:`StaticTree` (a fixed shape of rank paths; chains are the one-path case; sampled or
  top-k siblings — LANTERN++, arXiv 2502.06352) or :class:`DynamicTree` (EAGLE-2's
  confidence-ranked tree, arXiv 2406.16858, deterministic top-k siblings).
* :class:`JacobiSource` — no drafter: a window of future tokens refined by the target's own
  previous predictions (SJD, arXiv 2410.01699), optionally with coupled redraws so unchanged
  drafts survive (SCD-style, arXiv 2510.24211).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relaxspec.acceptance.base import one_hot
from relaxspec.compiling import compiled
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.drafting.siblings import sample_siblings, topk_siblings
from relaxspec.drafting.trees import TreeSpec
from relaxspec.sampling import SamplingConfig, process_logits, sample_from, stream_rows
from relaxspec.timing import Stopwatch


@dataclass
class DraftTree:
    """One step's drafts for a batch; all ``[B, T]`` unless noted.

    ``tokens`` (node 0 = root), ``parents`` (-1 for the root, parent < child), ``depth`` (root 0),
    ``proposals [B, T, V]`` the law each token was drawn from, ``valid`` (False = never test),
    ``ancestors [B, T, T]`` node i may attend to node j (self included).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    proposals: torch.Tensor
    valid: torch.Tensor
    ancestors: torch.Tensor
    #: Static structure (optional; a source that knows it lets the walk run without host syncs):
    #: ``children [B or 1, T, C]`` each node's children in sibling order (-1 padded),
    #: ``level_widths[d]`` the most children of a node at depth ``d`` (one entry per level that
    #: holds drafts), ``point_mass`` whether every proposal is one-hot.
    children: torch.Tensor | None = None
    level_widths: tuple[int, ...] | None = None
    point_mass: bool | None = None

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


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


# ------------------------------------------------------------------------------------------
# EAGLE drafter
# ------------------------------------------------------------------------------------------


def drafter_step(drafter: EagleDrafter, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, mask: torch.Tensor | None, sampling: SamplingConfig,
                 streams: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One drafter forward on every CFG stream: ``features [S*B, M, d]``, per-image ``tokens``,
    ``positions``, ``slots`` and ``mask [B, M, cache]`` (default causal by slot) -> predicted
    features ``[S*B, M, d]`` and processed draft laws ``q [B, M, V]``. What ``--compile``
    compiles for the drafter."""
    def rows(x):
        return stream_rows(x, streams)

    # Padding pairs and finished rows may point past the image; their outputs are never used.
    positions = positions.clamp(max=drafter.rope.shape[0] - 1)
    feats, logits = drafter(features, rows(tokens), rows(positions), cache_slots=rows(slots), attn_mask=rows(mask))
    return feats, process_logits(logits, sampling)


class EagleSource:
    """Drafts with an :class:`EagleDrafter` on both CFG streams, laid out by ``structure``.

    Drafter cache: pair ``j`` (feature that predicted token ``j``, token ``j``) lives in slot
    ``j``; a step's tree node ``i`` uses slot ``root_index + i`` (the root's own pair is slot
    ``root_index``, already committed), so draft slots are overwritten by the next catch-up.
    """

    def __init__(self, drafter: EagleDrafter, structure: "StaticTree | DynamicTree", sampling: SamplingConfig,
                 compile: bool = False):
        self.drafter, self.structure, self.sampling = drafter, structure, sampling
        self.max_nodes = structure.max_nodes
        self.max_depth = structure.depth
        self.forwards = 0
        self.compile = compile

    # -- plumbing shared by the structures ----------------------------------------------
    def start(self, first_tokens, first_probs, first_hidden, streams: int, num_tokens: int, generator,
              greedy: bool) -> None:
        """Called once after the target's prefill: ``first_tokens [B]`` (image token 0), the law it
        was drawn from ``first_probs [B, V]`` and the hidden state that predicted it
        ``first_hidden [S*B, 1, d]``. Feeds pair 0 so the first proposal has its root law."""
        self.batch, self.streams = first_tokens.shape[0], streams
        self.drafter.setup_caches(self.batch * streams, num_tokens + self.structure.drafter_slots + 1)
        self.cache_length = self.drafter.cache_length
        device = first_tokens.device
        self._step = compiled(drafter_step, device) if self.compile else drafter_step
        self.forwards = 0
        self.watch = Stopwatch(first_tokens.device)  # time inside the drafter's forward calls
        zero = torch.zeros_like(first_tokens)
        self.catch_up(first_hidden, first_tokens[:, None], zero, torch.ones_like(zero))

    def close(self) -> None:
        """The drafter's cache stays allocated for the next decode of the same shape, as the
        target's does (``drafter.clear_caches()`` frees it)."""

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return stream_rows(x, self.streams)

    def expand(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward: ``features [S*B, M, d]`` (of the inputs' parents), ``tokens
        [B, M]`` ... -> predicted features ``[S*B, M, d]`` and processed draft laws ``q [B, M, V]``.
        ``mask [B, M, cache_length]`` (default: causal by slot over the whole cache)."""
        with self.watch:
            feats, q = self._step(self.drafter, features, tokens, positions, slots, mask, self.sampling, self.streams)
        self.forwards += 1
        return feats, q

    def catch_up(self, features: torch.Tensor, tokens: torch.Tensor, first: torch.Tensor, count: torch.Tensor) -> None:
        """Feed the newly committed pairs: ``features [S*B, M, d]`` (target states that predicted
        ``tokens [B, M]``), pair ``m`` of row b at slot ``first[b] + m``, ``count [B]`` real pairs.
        Leaves the root's predicted feature and draft law for the next :meth:`propose`."""
        width = tokens.shape[1]
        slots = first[:, None] + torch.arange(width, device=first.device)
        feats, q = self.expand(features, tokens, slots, slots, None)
        last = (count - 1).clamp(min=0)
        self.root_q = q[torch.arange(self.batch), last]
        self.root_feature = feats[torch.arange(feats.shape[0]), self.rows(last)]

    def propose(self, roots: torch.Tensor, root_index: torch.Tensor, generator, greedy: bool) -> DraftTree:
        return self.structure.draft(self, roots, root_index, generator, greedy)

    def update(self, committed: torch.Tensor, path: torch.Tensor, count: torch.Tensor, root_index: torch.Tensor,
               target_probs: torch.Tensor, target_hidden: torch.Tensor, generator=None) -> None:
        """After verification: pairs for tokens ``root_index + 1 ..`` are (target state at the
        path node before, committed token)."""
        nodes = path.clamp(min=0)[:, : committed.shape[1]]
        feats = target_hidden.gather(1, self.rows(nodes)[:, :, None].expand(-1, -1, target_hidden.shape[-1]))
        self.catch_up(feats, committed.clamp(min=0), root_index + 1, count)


class StaticTree:
    """A fixed tree shape (:class:`TreeSpec`); siblings "sampled" from ``q`` without replacement
    or deterministic "topk". A chain is ``TreeSpec.chain(L)``. Every table the step needs
    (parents, depths, ancestors, children, per-level slots and ranks) is built once per device."""

    def __init__(self, spec: TreeSpec, siblings: str = "sampled"):
        self.spec, self.siblings = spec, siblings
        self.max_nodes, self.depth = spec.num_nodes, spec.depth
        self.drafter_slots = spec.num_nodes
        self._tables: dict[torch.device, dict] = {}

    def tables(self, device: torch.device) -> dict:
        """The shape's index tables on ``device`` (copied there once)."""
        if device not in self._tables:
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
            self._tables[device] = moved
        return self._tables[device]

    def draft(self, source: EagleSource, roots, root_index, generator, greedy: bool) -> DraftTree:
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
        base = root_index  # drafter slot of node i is root_index + i
        point_mass = greedy or self.siblings == "topk"
        for level in tab["levels"]:
            nodes, width, expand = level["nodes"], level["width"], level["expand"]
            q_parents = q_at[:, level["parent_list"]].reshape(-1, vocab)  # [B*P, V]
            if point_mass:
                sib_tok, sib_prop, sib_valid = topk_siblings(q_parents, width)
            else:
                sib_tok, sib_prop, sib_valid = sample_siblings(q_parents, width, generator)
            P = level["parent_list"].shape[0]
            pick = (level["slot"], level["ranks"])
            tokens[:, nodes] = sib_tok.view(batch, P, width)[:, pick[0], pick[1]]
            proposals[:, nodes] = sib_prop.view(batch, P, width, vocab)[:, pick[0], pick[1]]
            valid[:, nodes] = sib_valid.view(batch, P, width)[:, pick[0], pick[1]] & valid[:, level["node_parents"]]
            if expand.shape[0]:
                queries = expand.expand(batch, -1)
                mask = tree_attention_mask(base, ancestors, source.cache_length, queries)
                out, q = source.expand(feats[:, level["expand_parents"]], tokens[:, expand],
                                       root_index[:, None] + depths[expand], base[:, None] + expand, mask)
                feats[:, expand] = out
                q_at[:, expand] = q
        return DraftTree(tokens, tab["parents"].expand(batch, -1), tab["depths"].expand(batch, -1), proposals,
                         valid, ancestors, children=tab["children"], level_widths=tab["level_widths"],
                         point_mass=point_mass)


class DynamicTree:
    """EAGLE-2's dynamic tree (arXiv 2406.16858): at each of ``depth`` levels expand the
    ``top_k`` children of the ``top_k`` best nodes by cumulative drafter log-probability, then keep
    the ``total_tokens - 1`` best nodes overall. Siblings are deterministic (one-hot proposals)."""

    def __init__(self, top_k: int = 10, depth: int = 5, total_tokens: int = 59):
        self.top_k, self.depth, self.total = top_k, depth, total_tokens
        self.max_nodes = total_tokens
        # The drafter writes every expanded beam (top_k per level below the root) to its own slot.
        self.drafter_slots = max(total_tokens, (depth - 1) * top_k + 1)

    def draft(self, source: EagleSource, roots, root_index, generator, greedy: bool) -> DraftTree:
        batch, device = roots.shape[0], roots.device
        k = self.top_k
        vocab = source.root_q.shape[-1]
        kk = min(k, vocab)
        # Candidate pool: tokens, scores, parent candidate (-1 = root), depth, drafter slot of the
        # candidate when it was expanded (-1 otherwise).
        top = source.root_q.topk(kk, dim=-1)
        cand_tok = [top.indices]
        cand_score = [top.values.clamp(min=1e-30).log()]
        cand_parent = [torch.full((batch, kk), -1, device=device, dtype=torch.long)]
        cand_depth = [torch.ones(batch, kk, dtype=torch.long, device=device)]
        # Expanded beams: their drafter slots are root_index + 1 + j for beam j in expansion order.
        beam_cand: list[torch.Tensor] = []  # candidate index of each expanded beam, [B] each
        beam_anc = torch.zeros(batch, 0, 0, dtype=torch.bool, device=device)
        feats_root = source.root_feature
        beam_feats = feats_root.new_zeros(feats_root.shape[0], 0, feats_root.shape[-1])
        level_start, level_size = 0, kk
        kv_len = source.cache_length
        for d in range(2, self.depth + 1):
            scores = torch.cat(cand_score, dim=1)
            level_scores = scores[:, level_start : level_start + level_size]
            nb = min(k, level_size)
            chosen = level_scores.topk(nb, dim=-1).indices + level_start  # candidate ids [B, nb]
            toks = torch.cat(cand_tok, dim=1).gather(1, chosen)
            parents = torch.cat(cand_parent, dim=1).gather(1, chosen)
            # Parent beam index of each chosen candidate (-1 = the root).
            n_beams = beam_anc.shape[1]
            if n_beams:
                beam_ids = torch.stack(beam_cand, dim=1)  # [B, n_beams]
                match = parents[:, :, None] == beam_ids[:, None, :]
                parent_beam = torch.where(match.any(-1), match.float().argmax(-1), torch.full_like(parents, -1))
            else:
                parent_beam = torch.full_like(parents, -1)
            # Ancestor mask among beams for the new beams.
            new_total = n_beams + nb
            anc = torch.zeros(batch, new_total, new_total, dtype=torch.bool, device=device)
            anc[:, :n_beams, :n_beams] = beam_anc
            inherit = beam_anc.gather(1, parent_beam.clamp(min=0)[:, :, None].expand(-1, -1, n_beams)) if n_beams else \
                torch.zeros(batch, nb, 0, dtype=torch.bool, device=device)
            anc[:, n_beams:, :n_beams] = inherit & (parent_beam >= 0)[:, :, None]
            anc[:, n_beams:, n_beams:] = torch.eye(nb, dtype=torch.bool, device=device)
            beam_anc = anc
            # Features of the chosen candidates' parents (root feature or a beam's output).
            if n_beams:
                pf = beam_feats.gather(1, source.rows(parent_beam.clamp(min=0))[:, :, None].expand(-1, -1, beam_feats.shape[-1]))
                pf = torch.where(source.rows(parent_beam >= 0)[:, :, None], pf, feats_root[:, None, :])
            else:
                pf = feats_root[:, None, :].expand(-1, nb, -1)
            # Tree nodes here are: 0 = root (slot root_index), beams at slots root_index + 1 + j.
            full_anc = torch.zeros(batch, 1 + new_total, 1 + new_total, dtype=torch.bool, device=device)
            full_anc[:, :, 0] = True
            full_anc[:, 1:, 1:] = anc
            queries = (torch.arange(nb, device=device) + 1 + n_beams).expand(batch, -1)
            mask = tree_attention_mask(root_index, full_anc, kv_len, queries)
            depth_now = torch.cat(cand_depth, dim=1).gather(1, chosen)
            out, q = source.expand(pf, toks, root_index[:, None] + depth_now, root_index[:, None] + queries, mask)
            beam_feats = torch.cat([beam_feats, out], dim=1)
            beam_cand.extend(chosen.unbind(1))
            top = q.topk(kk, dim=-1)  # [B, nb, kk]
            parent_scores = scores.gather(1, chosen)
            level_start = scores.shape[1]
            level_size = nb * kk
            cand_tok.append(top.indices.reshape(batch, -1))
            cand_score.append((parent_scores[:, :, None] + top.values.clamp(min=1e-30).log()).reshape(batch, -1))
            cand_parent.append(chosen[:, :, None].expand(-1, -1, kk).reshape(batch, -1))
            cand_depth.append(torch.full((batch, level_size), d, dtype=torch.long, device=device))
        tokens_all = torch.cat(cand_tok, 1)
        scores_all = torch.cat(cand_score, 1)
        parents_all = torch.cat(cand_parent, 1)
        depth_all = torch.cat(cand_depth, 1)
        # Keep the best total-1 candidates. A child never outscores its parent (log q <= 0), and
        # ties are broken towards shallower (earlier) candidates, so the set is ancestor-closed.
        n_keep = min(self.total - 1, tokens_all.shape[1])
        order_key = scores_all - 1e-6 * torch.arange(tokens_all.shape[1], device=device)
        keep = order_key.topk(n_keep, dim=-1).indices
        # Node order: by depth, then by score (siblings tested most-likely first).
        sort_key = depth_all.gather(1, keep).float() * 1e4 - order_key.gather(1, keep).clamp(min=-1e3)
        keep = keep.gather(1, sort_key.argsort(dim=-1))
        position = torch.full_like(scores_all, -1, dtype=torch.long)
        position.scatter_(1, keep, torch.arange(1, n_keep + 1, device=device).expand(batch, -1))
        kept_parent = parents_all.gather(1, keep)
        node_parent = torch.where(kept_parent >= 0, position.gather(1, kept_parent.clamp(min=0)), torch.zeros_like(kept_parent))
        # A kept node whose parent was not kept cannot happen, but guard: mark it invalid.
        ok = node_parent >= 0
        node_parent = node_parent.clamp(min=0)
        parents = torch.cat([torch.full((batch, 1), -1, device=device, dtype=torch.long), node_parent], 1)
        tokens = torch.cat([roots[:, None], tokens_all.gather(1, keep)], 1)
        depth = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device), depth_all.gather(1, keep)], 1)
        valid = torch.cat([torch.ones(batch, 1, dtype=torch.bool, device=device), ok], 1)
        proposals = one_hot(tokens.reshape(-1), vocab, source.root_q.dtype).view(batch, -1, vocab)
        # A node has at most kk children (one expansion's top-kk), the root its kk candidates.
        return DraftTree(tokens, parents, depth, proposals, valid, ancestor_matrix(parents, self.depth),
                         children=children_table(parents, valid & (depth > 0), kk),
                         level_widths=(kk,) * self.depth, point_mass=True)


# ------------------------------------------------------------------------------------------
# Jacobi window (SJD / SCD)
# ------------------------------------------------------------------------------------------


class JacobiSource:
    """Speculative Jacobi decoding (arXiv 2410.01699): the draft is a window of ``window``
    future tokens, each drawn from the distribution the target gave for it in the previous
    iteration (uniform for fresh positions); verification is exact against those laws.

    ``coupled=True`` (SCD-style, arXiv 2510.24211): a redraw keeps the previous draft at its
    position with probability ``min(1, p_new/p_old)`` and otherwise samples
    ``norm(max(p_new - p_old, 0))`` — a maximal coupling, so the redraw still has law ``p_new``
    (exactness is untouched) while unchanged drafts survive.
    """

    def __init__(self, window: int = 16, coupled: bool = False):
        self.window, self.coupled = window, coupled
        self.max_nodes, self.max_depth = window + 1, window
        self.depth = window
        self.forwards = 0
        self._chain = StaticTree(TreeSpec.chain(window), "topk")

    def start(self, first_tokens, first_probs, first_hidden, streams: int, num_tokens: int, generator,
              greedy: bool) -> None:
        """Called once after the target's prefill; the first window is uniform random."""
        self.greedy = greedy
        batch, self.vocab = first_tokens.shape[0], first_probs.shape[-1]
        uniform = torch.full((batch, self.window, self.vocab), 1.0 / self.vocab, device=first_tokens.device)
        self.drafts = self._draw(uniform, generator)
        self.laws = self._as_proposal(uniform, self.drafts)

    def _draw(self, laws: torch.Tensor, generator) -> torch.Tensor:
        return sample_from(laws, generator, greedy=self.greedy)

    def _as_proposal(self, laws: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        # Greedy drafts are point masses: the proposal is the one-hot of the draft.
        if not self.greedy:
            return laws
        return one_hot(drafts.reshape(-1), self.vocab, laws.dtype).view_as(laws)

    def close(self) -> None:
        pass

    def propose(self, roots, root_index, generator, greedy: bool) -> DraftTree:
        batch, device = roots.shape[0], roots.device
        tokens = torch.cat([roots[:, None], self.drafts], dim=1)
        # The root is never tested; a one-hot row keeps it a distribution.
        proposals = torch.cat([one_hot(roots, self.vocab, self.laws.dtype)[:, None], self.laws], dim=1)
        n = self.window + 1
        tab = self._chain.tables(device)
        return DraftTree(tokens, tab["parents"].expand(batch, n), tab["depths"].expand(batch, n), proposals,
                         torch.ones(batch, n, dtype=torch.bool, device=device), tab["ancestors"].expand(batch, n, n),
                         children=tab["children"], level_widths=tab["level_widths"], point_mass=self.greedy)

    def update(self, committed, path, count, root_index, target_probs, target_hidden, generator=None) -> None:
        """New window after committing ``count = a + 1`` tokens: position ``j`` of the new window
        was predicted by chain node ``a + j`` (conditioned on the old, possibly rejected
        drafts); positions past the old window start uniform."""
        batch, L = self.drafts.shape
        device = self.drafts.device
        a = count - 1
        src = a[:, None] + 1 + torch.arange(L, device=device)  # chain node whose output predicts it
        have = src <= L
        new_laws = target_probs.gather(1, src.clamp(max=L)[:, :, None].expand(-1, -1, target_probs.shape[-1]))
        uniform = torch.full_like(new_laws, 1.0 / self.vocab)
        new_laws = torch.where(have[:, :, None], new_laws, uniform)
        fresh = self._draw(new_laws, generator)
        if self.coupled and not self.greedy:
            # The old draft at the same image position sits at window index a + 1 + j.
            old_idx = src + 1  # window index (1-based chain node) of the old draft at that position
            old_have = old_idx <= L
            old_tok = self.drafts.gather(1, (old_idx - 1).clamp(max=L - 1))
            old_law = self.laws.gather(1, (old_idx - 1).clamp(max=L - 1)[:, :, None].expand(-1, -1, self.vocab))
            p_new = new_laws.gather(2, old_tok[:, :, None]).squeeze(2)
            p_old = old_law.gather(2, old_tok[:, :, None]).squeeze(2).clamp(min=1e-30)
            keep = torch.rand(p_new.shape, generator=generator, device=device) < (p_new / p_old).clamp(max=1.0)
            residual = (new_laws - old_law).clamp(min=0)
            mass = residual.sum(-1, keepdim=True)
            residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), new_laws)
            redraw = sample_from(residual, generator)
            coupled = torch.where(keep, old_tok, redraw)
            fresh = torch.where(old_have & have, coupled, fresh)
        self.drafts = fresh
        self.laws = self._as_proposal(new_laws, fresh)
