"""The raster schedule: draft -> one target forward over the tree -> accept -> commit, every
image at its own place in raster order.

A step composes three independent pieces and knows none of their internals: a draft source
(:class:`relaxspec.drafting.base.DraftSource`), an acceptance rule (:mod:`relaxspec.acceptance`)
and the tree walk (:func:`relaxspec.decoding.verify.verify_tree`). Each row of the batch accepts
its own length: row ``b`` has committed ``n[b]`` tokens, its root (the last committed token, not
yet in the target's cache) sits at slot ``C + n[b] - 1``, and its tree node ``i`` at slot
``C + n[b] - 1 + i`` with RoPE position ``C + n[b] - 1 + depth(i)``. After verification the
accepted nodes' keys and values are copied down so the committed prefix stays contiguous.

The step -- the source's drafts, the target's forward, the walk of every rule, the commit, the KV
move, the source's catch-up and the counters -- is :func:`raster_step`, one function of a
:class:`~relaxspec.decoding.steps.Loop` that updates its :class:`RasterState` in place; with
``compile`` it runs as one graph (issue 41, :mod:`relaxspec.decoding.loop`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from relaxspec.decoding.plan import Layout, Schedule, register
from relaxspec.decoding.steps import DraftState, Loop, drafted_result, kept_state, reserve_walk
from relaxspec.drafting.tree_tables import tree_attention_mask


@dataclass(eq=False)
class RasterState(DraftState):
    """The raster schedule's state, ``[B, ...]``: ``tokens`` and ``step_tv`` ``[B, N + W]`` (a
    scratch column past the image takes what a step does not commit), ``n`` (tokens committed),
    ``lengths [B, N + 1]`` (tokens committed by each step); and its constant tables: ``offsets
    [W]`` and the scratch column ``spill [B, W]``."""

    n: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    spill: torch.Tensor


def raster_step(loop: Loop) -> None:
    """One speculative step of every image: draft, one target forward over the trees, the walk,
    commit, KV compaction, the source's catch-up; every result lands in ``loop.state``. A fixed
    sequence of ops on fixed shapes that reads nothing back: what ``compile`` compiles as one
    graph."""
    parts, state, n_tok = loop.parts, loop.state, loop.num_tokens
    target, n = parts.target, state.n
    active = n < n_tok
    root_index = n - 1
    tree = parts.source.propose(state.tokens.gather(1, root_index[:, None]).squeeze(1), root_index, parts.greedy)
    # A step commits at most the tokens still missing, but every draft is tested, past the image
    # too, as official EAGLE and LANTERN test them: committing a prefix of the walk is exact, and
    # where two accepted paths run through the image's last token, greedy takes the longer one
    # (so a relaxed rule may accept a draft at the last token, whose bonus is then dropped).
    base = target.cls + root_index
    slots = base[:, None] + state.offsets[: tree.num_nodes]
    # Nodes past the image are scored at the last image token's position (official LlamaGen code:
    # zero RoPE rows); they decide nothing committed but which equally long path wins.
    positions = (base[:, None] + tree.depth).clamp(max=target.cls + n_tok - 1)
    probs, hidden = target.forward(tree.tokens, positions, slots, tree_attention_mask(base, tree.ancestors,
                                                                                      target.max_seq))
    if tree.longest_row:  # a walk that takes the longest accepted path tests no node past the image
        tree = replace(tree, valid=tree.valid & (tree.depth <= (n_tok - n)[:, None]))
    result = parts.verify(tree, probs)
    count = torch.where(active, torch.minimum(result.num_accepted + 1, n_tok - n), torch.zeros_like(n))
    state.add_rank_counts(result)
    _commit(state, result, count)
    # KV compaction: accepted node path[j] (j >= 1) moves from slot base + path[j] to
    # base + j; every other entry copies a slot onto itself.
    path = result.path[:, 1:]
    offsets = state.offsets[: path.shape[1]]
    moving = (path >= 0) & (offsets[None, :] < result.num_accepted[:, None]) & active[:, None]
    dst = base[:, None] + 1 + offsets[None, :]
    target.move_cache(torch.where(moving, base[:, None] + path.clamp(min=0), dst), dst)
    # count is 0 for a finished image: it committed nothing
    parts.source.update(result.committed, result.path, count, root_index, probs, hidden)
    state.lengths.scatter_(1, torch.where(active, state.steps + 1, torch.full_like(n, n_tok))[:, None], count[:, None])
    state.steps.add_(active.long())
    state.n.add_(count)
    state.done.copy_(state.n.sum())


def _commit(state: RasterState, result, count: torch.Tensor) -> None:
    """Tokens ``n .. n + count - 1`` of each row and their TV records (the rest of the span goes
    to the scratch column past the image)."""
    span = result.committed.shape[1]
    offsets = state.offsets[:span]
    keep = offsets[None, :] < count[:, None]
    write_at = torch.where(keep, state.n[:, None] + offsets, state.spill[:, :span])
    state.tokens.scatter_(1, write_at, result.committed.clamp(min=0))
    state.step_tv.scatter_(1, write_at, result.step_tv.to(state.step_tv.dtype))


@register
@dataclass(frozen=True)
class Raster(Schedule):
    """Every image in raster order, one speculative step at a time (no settings)."""

    name = "raster"
    step = staticmethod(raster_step)

    def reserve(self, noise, layout: Layout, batch: int, vocab: int, greedy: bool):
        return reserve_walk(noise, layout.source, batch, vocab, greedy)

    def state(self, model, layout: Layout, target, first: torch.Tensor) -> RasterState:
        """The state, kept with the model across decodes of one shape, set to a decode's start:
        token 0 committed in every image."""
        source, n_tok = layout.source, target.num_tokens
        batch, device, width = first.shape[0], first.device, source.max_nodes  # most tokens a step commits
        kept = kept_state(model, "raster", device)
        return RasterState(
            **DraftState.start(kept, first, source, n_tok + width), n=kept("n", (batch,)).fill_(1),
            lengths=kept("lengths", (batch, n_tok + 1)),
            offsets=kept("offsets", (width,)).copy_(torch.arange(width, device=device)),
            spill=kept("spill", (batch, width)).fill_(n_tok + width - 1))  # a scratch column

    def progress(self, state: RasterState, num_tokens: int):
        return state.tokens[:, :num_tokens], state.n

    def read_out(self, loop: Loop):
        return (*loop.state.read_out(loop), loop.state.lengths)

    def result(self, host, loop: Loop) -> dict:
        *drafted, lengths = host
        steps = drafted[1]
        accept_lengths = [[1] + row[1 : count + 1] for row, count in zip(lengths.tolist(), steps.tolist())]
        return drafted_result(loop, drafted, accept_lengths)


__all__ = ["Raster", "RasterState", "raster_step"]
