"""Rows in parallel: several image rows decoded at once, each with its own drafts (issue 31).

ZipAR (arXiv 2412.04062) and PJD (arXiv 2606.05703) stop painting strictly in raster order: row
``r + 1`` opens once row ``r`` has committed a lead of ``lead`` tokens, and every open row
advances in the same target forward. Here every open row is a **lane**: a row of the engine's
usual machinery (a draft source's tree, verification by any acceptance rule, a bonus token), and
the lanes of one image share its KV cache.

* ``lanes`` rows are open at most; lane ``l`` paints rows ``l, l + lanes, l + 2 lanes, ...``,
  row ``r`` opening once row ``r - 1`` has ``lead`` tokens (and its lane is free). A row stays
  ``lead`` tokens behind the row above until that one is complete (ZipAR's window: drafts may not
  overtake it), so every open row commits at least one token a step.
* Each step, lane ``l``'s tree (node 0 = the root, the token before the lane's next one; nodes in
  the lane's scratch slots past the image) goes through one target forward with every other
  lane's. A node sees the condition, every token whose keys are in the cache and that comes before
  it in raster order, and its own ancestors in its lane's tree: never another lane's drafts
  (the row-causal mask). Positions are grid positions, so LlamaGen's 2-D RoPE is the grid's.
* A newly opened row's first token is predicted as ZipAR predicts it: from the row above's
  latest token placed at the position before the row's first (the raster predecessor, the row
  above's last token, does not exist yet); that stand-in's keys are never cached.
* Accepted nodes' keys and values move from the scratch slots to their grid slots, which is where
  commits out of raster order land.

No parallel-row setting is the model's law, whatever the rule: a token of row ``r + 1`` is
conditioned on row ``r`` only up to where row ``r`` was when it was decided. The TV record covers
the acceptance only.
"""

from __future__ import annotations

import time
import torch

from relaxspec.acceptance import AcceptanceRule
from relaxspec.decoding.result import DecodeResult, add_counts, read_once, watched_seconds
from relaxspec.decoding.target import GuidedTarget
from relaxspec.compiling import compiled
from relaxspec.decoding.verify import verify_tree, walk_tree
from relaxspec.methods.grid import RowPlan, grid_side
from relaxspec.sampling import SamplingConfig, sample_from


@torch.no_grad()
def generate_rows(model, cond, sampling: SamplingConfig, *, source, rule: AcceptanceRule, plan: RowPlan,
                  generator: torch.Generator | None = None, cond_mask=None, record_tv: bool = True,
                  compile: bool = False, on_step=None) -> DecodeResult:
    """Generate ``[B, N]`` tokens with ``plan.lanes`` rows open at once; ``source`` drafts for
    every lane (a source of ``B * lanes`` rows, lane ``l`` of image ``b`` being row ``b * lanes +
    l``; a source whose state is one per image, as a drafter's cache, gives its own view of the
    lanes by ``source.for_lanes(lanes, grid)``), ``rule`` accepts. Every step is one target
    forward and one read of the device; ``compile`` runs the target's step and the tree walk
    compiled (their shapes are static).
    ``on_step(tokens, committed)``: called after every step with the buffer ``[B, N]`` and which
    of its tokens are committed ``[B, N]`` (bool: commits land out of raster order here)."""
    start = time.perf_counter()
    grid = grid_side(model)
    plan.check(grid)
    # a row stays ``lead`` tokens behind the row above (ZipAR's window), so at most about
    # grid / lead rows are ever open: lanes past that would only pad every forward
    lanes, lead, greedy = min(plan.lanes, grid, -(-grid // plan.lead) + 1), plan.lead, sampling.greedy
    if hasattr(source, "for_lanes"):  # a source with one state per image (a drafter's cache) keeps its lanes apart
        source = source.for_lanes(lanes, grid)
    nodes = source.max_nodes
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask, scratch=lanes * nodes, compile=compile)
    walk = compiled(walk_tree, target.device) if compile else None
    batch, n_tok, cls, device = target.batch, target.num_tokens, target.cls, target.device
    virtual = batch * lanes
    rule.prepare(device)

    tokens = torch.zeros(batch, n_tok + 1, dtype=torch.long, device=device)  # column n_tok: a spill
    step_tv = torch.zeros(batch, n_tok + 1, device=device)
    step_sizes = torch.ones(batch, n_tok + 1, dtype=torch.long, device=device)  # per token: its step's commits
    committed_mask = torch.zeros(batch, n_tok + 1, dtype=torch.bool, device=device) if on_step is not None else None
    fill = torch.zeros(batch, grid + 1, dtype=torch.long, device=device)  # tokens committed per row (+ a spill row)
    cached = torch.zeros(batch, target.max_seq, dtype=torch.bool, device=device)  # keys in the cache
    cached[:, :cls] = True
    lane_row = torch.arange(lanes, device=device).expand(batch, lanes).clone()  # the row each lane paints next
    steps = torch.zeros(batch, dtype=torch.long, device=device)
    counts_per_step: list[torch.Tensor] = []
    rank_tests = rank_accepts = None

    raster_of_slot = torch.full((target.max_seq,), -1, dtype=torch.long, device=device)
    raster_of_slot[cls : cls + n_tok] = torch.arange(n_tok, device=device)
    node_ids = torch.arange(nodes, device=device)
    lane_ids = torch.arange(lanes, device=device)
    scratch = cls + n_tok + lane_ids[:, None] * nodes + node_ids[None, :]  # [L, T] each lane's slots
    offsets = torch.arange(nodes + 1, device=device)  # a step commits at most a path and its bonus

    probs0, hidden0 = target.prefill()
    tokens[:, 0] = sample_from(probs0, generator, greedy)
    fill[:, 0] = 1
    if on_step is not None:
        committed_mask[:, 0] = True
        on_step(tokens[:, :n_tok], committed_mask[:, :n_tok])
    source.start(tokens[:, 0].repeat_interleave(lanes), probs0.repeat_interleave(lanes, 0),
                 _lanes(hidden0[:, -1:], lanes), target.streams, n_tok, generator, greedy,
                 condition_hidden=hidden0, condition_tokens=target.condition_tokens)
    drafter_seconds = 0.0
    try:
        while True:
            row = lane_row.clamp(max=grid)  # [B, L]; grid = finished
            f = fill.gather(1, row)
            above = torch.where(row == 0, grid, fill.gather(1, (row - 1).clamp(min=0)))  # the row above's tokens
            opened = (above >= lead) | (above == grid)
            active = (row < grid) & opened & (f < grid)
            k = row.clamp(max=grid - 1) * grid + f.clamp(max=grid - 1)  # raster index of the lane's next token
            # the root: the lane's last token, or (a row's first step) the row above's latest
            stand_in = f == 0
            root_at = torch.where(stand_in, (row - 1).clamp(min=0) * grid + (above - 1).clamp(min=0), k - 1)
            roots = tokens.gather(1, root_at.clamp(min=0)).reshape(virtual)
            root_index = (k - 1).reshape(virtual)
            t0 = time.perf_counter()
            tree = source.propose(roots, root_index, generator, greedy)
            drafter_seconds += time.perf_counter() - t0
            depth = tree.depth.view(batch, lanes, nodes)
            # drafts a step may commit: within the row, and ``lead`` behind the row above until it is complete
            room = torch.where(above >= grid, grid - 1 - f, torch.minimum(grid - 1 - f, above - lead - f))[:, :, None]
            valid = tree.valid.view(batch, lanes, nodes) & (depth <= room) & active[:, :, None]
            raster = (k - 1)[:, :, None] + depth  # each node's token's raster index
            positions = cls + raster.clamp(max=n_tok - 1)
            slots = scratch.expand(batch, lanes, nodes)
            mask = row_causal_mask(cached, raster_of_slot, raster, tree.ancestors.view(batch, lanes, nodes, nodes),
                               scratch, cls, n_tok)
            probs, hidden = target.forward(tree.tokens.view(batch, lanes * nodes), positions.reshape(batch, -1),
                                           slots.reshape(batch, -1), mask)
            result = verify_tree(rule, probs.view(virtual, nodes, -1), tree.tokens, tree.parents, tree.proposals,
                                 tree.depth, valid.view(virtual, nodes), greedy=greedy, generator=generator,
                                 record_tv=record_tv and not rule.lossless, children=tree.children,
                                 level_widths=tree.level_widths, point_mass=tree.point_mass, check=False, walk=walk)
            accepted = result.num_accepted.view(batch, lanes)
            count = torch.where(active, accepted + 1, torch.zeros_like(accepted))
            rank_tests = add_counts(rank_tests, result.rank_tests)
            rank_accepts = add_counts(rank_accepts, result.rank_accepts)
            # commit: raster k .. k + count - 1 of each lane (the rest to the spill column)
            span = result.committed.shape[1]
            keep = offsets[None, None, :span] < count[:, :, None]
            write_at = torch.where(keep, k[:, :, None] + offsets[:span], n_tok)
            tokens.scatter_(1, write_at.view(batch, -1), result.committed.clamp(min=0).view(batch, -1))
            step_tv.scatter_(1, write_at.view(batch, -1), result.step_tv.to(step_tv.dtype).view(batch, -1))
            # keys: the root (its own token, not a stand-in) and the accepted nodes move to their grid slots
            # (a stand-in root is the token before the row only once the row above is complete, and a
            # token already cached keeps the keys it has); other entries copy a lane's own scratch
            # slot onto itself, so no two entries write one slot
            path = result.path.view(batch, lanes, span)
            moving = (path >= 0) & (offsets[:span] < (accepted + 1)[:, :, None]) & active[:, :, None]
            root_slot = cls + (k - 1).clamp(min=0)
            moving[:, :, 0] &= (~stand_in | (above == grid)) & ~cached.gather(1, root_slot)
            source_slot = scratch.expand(batch, -1, -1).gather(2, path.clamp(min=0))
            grid_slot = cls + (k - 1)[:, :, None] + offsets[:span]
            idle = scratch[None, :, :span].expand(batch, -1, -1) if span <= nodes else \
                scratch[None, :, -1:].expand(batch, lanes, span)
            src = torch.where(moving, source_slot, idle)
            dst = torch.where(moving, grid_slot, idle)
            target.move_cache(src.view(batch, -1), dst.view(batch, -1))
            cached.scatter_(1, dst.view(batch, -1), moving.view(batch, -1))  # idle entries: scratch, never cached
            t0 = time.perf_counter()
            source.update(result.committed, result.path, count.view(-1), root_index, probs.view(virtual, nodes, -1),
                          _lanes_hidden(hidden, lanes, nodes), generator)
            drafter_seconds += time.perf_counter() - t0
            fill.scatter_add_(1, row, count)
            fill[:, grid] = 0
            lane_row = torch.where(active & (fill.gather(1, row) >= grid), lane_row + lanes, lane_row)
            committed_now = count.sum(1)
            counts_per_step.append(committed_now)
            step_sizes.scatter_(1, write_at.view(batch, -1), committed_now[:, None].expand(-1, lanes * span))
            if on_step is not None:
                committed_mask.scatter_(1, write_at.view(batch, -1), True)
                committed_mask[:, n_tok] = False
                on_step(tokens[:, :n_tok], committed_mask[:, :n_tok])
            steps += (committed_now > 0).long()
            if int(fill[:, :grid].sum()) >= batch * n_tok:  # the step's one read of the device
                break
    finally:
        target.close()
        source.close()
    if rank_tests is None:
        rank_tests = rank_accepts = torch.zeros(max(source.max_depth, 1), 1, dtype=torch.long, device=device)
    tokens_h, steps_h, per_step_h, tv_h, tests_h, accepts_h, sizes_h = read_once(
        tokens[:, :n_tok], steps, torch.stack(counts_per_step, 1), step_tv[:, :n_tok], rank_tests, rank_accepts,
        step_sizes[:, :n_tok])
    accept_lengths = [[1] + [count for count in image if count > 0] for image in per_step_h.tolist()]
    return DecodeResult(tokens=tokens_h, target_forwards=steps_h + 1,
                        drafter_forwards=torch.full((batch,), source.forwards, dtype=torch.long),
                        step_tv=tv_h, accept_lengths=accept_lengths,
                        seconds=time.perf_counter() - start, drafter_seconds=drafter_seconds,
                        target_forward_seconds=target.watch.seconds, drafter_forward_seconds=watched_seconds(source),
                        rank_tests=tests_h, rank_accepts=accepts_h,
                        tv_recorded=record_tv or rule.lossless, rows=lanes, row_lead=lead, token_step_sizes=sizes_h)


def row_causal_mask(cached: torch.Tensor, raster_of_slot: torch.Tensor, raster: torch.Tensor, ancestors: torch.Tensor,
                scratch: torch.Tensor, cls: int, n_tok: int) -> torch.Tensor:
    """``[B, L * T, max_seq]``: lane ``l``'s node ``i`` (its token at raster index ``raster[b, l, i]``)
    may attend the condition, every cached image key earlier in raster order, and its ancestors
    (itself included) among its own lane's scratch slots."""
    batch, lanes, nodes = raster.shape
    max_seq = cached.shape[1]
    earlier = raster_of_slot[None, None, None, :] < raster[:, :, :, None]  # [B, L, T, S]
    seen = cached[:, None, None, :] & (earlier | (raster_of_slot < 0)[None, None, None, :])
    seen[..., cls + n_tok :] = False
    own = torch.zeros(batch, lanes, nodes, max_seq, dtype=torch.bool, device=cached.device)
    index = scratch[None, :, None, :].expand(batch, lanes, nodes, nodes)
    own.scatter_(3, index, ancestors)
    return (seen | own).view(batch, lanes * nodes, max_seq)


def _lanes(hidden: torch.Tensor, lanes: int) -> torch.Tensor:
    """``[S*B, ...]`` -> ``[S*B*L, ...]``: each image's rows repeated for its lanes (stream-major)."""
    return hidden.repeat_interleave(lanes, 0)


def _lanes_hidden(hidden: torch.Tensor, lanes: int, nodes: int) -> torch.Tensor:
    """``[S*B, L*T, d]`` -> ``[S*B*L, T, d]`` (stream-major, lane ``l`` of image ``b`` at ``b * L + l``)."""
    rows, _, dim = hidden.shape
    return hidden.reshape(rows, lanes, nodes, dim).reshape(rows * lanes, nodes, dim)


__all__ = ["generate_rows", "row_causal_mask"]
