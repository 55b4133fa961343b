"""EAGLE-2's dynamic draft tree (arXiv 2406.16858) for an EAGLE drafter."""

from __future__ import annotations

import torch

from relaxspec.acceptance.base import one_hot
from relaxspec.drafting.base import DraftTree, FeatureDrafter
from relaxspec.drafting.tree_tables import ancestor_matrix, children_table
from relaxspec.drafting.trees import check_tree_size
from relaxspec.errors import RelaxspecError


def best_candidates(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The indices ``[B, count]`` of the ``count`` best of candidates ``scores [B, M]`` (cumulative
    log-probabilities, candidates numbered level by level), best first, as official EAGLE-2's
    selection (one top-k over the scores) keeps them: near ties are decided by the scores alone.
    A child never outscores its parent (log q <= 0); where they tie exactly (q = 1) the earlier
    candidate -- the shallower -- goes first (a stable sort; top-k leaves the order of equal scores
    open), so the kept set is ancestor-closed."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :count]


class DynamicTree:
    """EAGLE-2's dynamic tree (arXiv 2406.16858): at each of ``depth`` levels expand the
    ``top_k`` children of the ``top_k`` best nodes by cumulative drafter log-probability, then keep
    the ``total_tokens - 1`` best nodes overall. Siblings are deterministic (one-hot proposals)."""

    def __init__(self, top_k: int = 10, depth: int = 5, total_tokens: int = 59):
        # Every size is bounded before anything is allocated: the candidate pool and the
        # drafter's slots grow with depth x top_k, the verification tables with total_tokens^2.
        check_tree_size(total_tokens, f"EAGLE-2's tree of --total-tokens {total_tokens:,}")
        if top_k > total_tokens:
            raise RelaxspecError(f"--dynamic-top-k {top_k:,} is more children per beam than the tree keeps nodes "
                                 f"(--total-tokens {total_tokens}): at most {total_tokens}")
        if depth > total_tokens:
            raise RelaxspecError(f"--depth {depth:,} is deeper than the tree keeps nodes (--total-tokens "
                                 f"{total_tokens}): at most {total_tokens}")
        check_tree_size((depth - 1) * top_k + 1, f"EAGLE-2's expansion (--depth {depth} x --dynamic-top-k {top_k})")
        self.top_k, self.depth, self.total = top_k, depth, total_tokens
        # Every tree has this many nodes (static shapes: rows in parallel lay their trees side by
        # side): the root and the best total - 1 candidates, or every candidate when the expansion
        # yields fewer (top_k at depth 1, top_k^2 under each later level's top_k beams).
        self.max_nodes = min(total_tokens, 1 + top_k + (depth - 1) * top_k * top_k)
        # The drafter writes every expanded beam (top_k per level below the root) to its own slot.
        self.drafter_slots = max(total_tokens, (depth - 1) * top_k + 1)
        self.expansions = depth - 1  # one drafter forward per level below the root's

    def level_widths(self, vocab: int) -> tuple[int, ...]:
        return (min(self.top_k, vocab),) * self.depth

    def prepare(self, device: torch.device) -> None:
        """Nothing to build ahead: every table is made by the draft itself."""

    def reserve(self, noise, rows: int, vocab: int, greedy: bool) -> list:
        """The tree is deterministic (top-k beams): nothing to draw."""
        return []

    def draft(self, source: FeatureDrafter, roots, root_index, greedy: bool, clocks: list) -> DraftTree:
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
            # Tree nodes here are: 0 = the root, beam j = node 1 + j; the source says where each
            # node's pair goes in the drafter cache and what it sees (its ancestors, the pairs before).
            full_anc = torch.zeros(batch, 1 + new_total, 1 + new_total, dtype=torch.bool, device=device)
            full_anc[:, :, 0] = True
            full_anc[:, 1:, 1:] = anc
            slots, mask = source.node_inputs(root_index, full_anc, torch.arange(nb, device=device) + 1 + n_beams)
            depth_now = torch.cat(cand_depth, dim=1).gather(1, chosen)
            out, q = source.expand(pf, toks, root_index[:, None] + depth_now, slots, mask)
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
        n_keep = min(self.total - 1, tokens_all.shape[1])
        keep = best_candidates(scores_all, n_keep)
        # Node order: the candidates' own, as EAGLE-2 numbers its tree: by depth, then by the
        # expanded beam (best first), then by rank under it (siblings tested most-likely first).
        # Greedy LANTERN takes the first longest path in this order, as the official code does.
        keep = keep.sort(dim=-1).values
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
        missing = self.max_nodes - tokens.shape[1]
        if missing > 0:  # a vocabulary smaller than top_k: fewer candidates; invalid nodes keep the size
            pad = torch.zeros(batch, missing, dtype=torch.long, device=device)
            tokens, parents = torch.cat([tokens, pad], 1), torch.cat([parents, pad], 1)
            depth = torch.cat([depth, pad + 1], 1)
            valid = torch.cat([valid, pad.bool()], 1)
        proposals = one_hot(tokens.reshape(-1), vocab, source.root_q.dtype).view(batch, -1, vocab)
        # A node has at most kk children (one expansion's top-kk), the root its kk candidates.
        return DraftTree(tokens, parents, depth, proposals, valid, ancestor_matrix(parents, self.depth),
                         children=children_table(parents, valid & (depth > 0), kk),
                         level_widths=(kk,) * self.depth, point_mass=True)
