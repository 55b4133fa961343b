"""Rows in parallel: several image rows decoded at once, each with its own drafts (issue 31).

ZipAR (arXiv 2412.04062) and PJD (arXiv 2606.05703) stop painting strictly in raster order: row
``r + 1`` opens once row ``r`` has committed a lead of ``lead`` tokens, and every open row
advances in the same target forward. Here every open row is a **lane**: a row of the engine's
usual machinery (a draft source's tree, verification by any acceptance rule, a bonus token), and
the lanes of one image share its KV cache.

* ``lanes`` rows are open at most; lane ``l`` paints rows ``l, l + lanes, l + 2 lanes, ...``.
  As official LlamaGen-ZipAR schedules them, row 1 opens once row 0 is complete and row ``r + 1``
  once row ``r`` has ``lead`` tokens (and its lane is free); on a target whose rows end with a
  forced token (Emu3, Lumina-mGPT: ``row_end_companions``) row 1 opens at the lead too, as
  Lumina-mGPT-ZipAR opens it. A row stays ``lead`` tokens behind
  the row above until that one is complete (ZipAR's window: drafts may not overtake it), so every
  open row commits at least one token a step.
* Each step, lane ``l``'s tree (node 0 = the root, the lane's latest token; nodes in the lane's
  scratch slots past the image) goes through one target forward with every other lane's and with
  the *tail*: the last token of a row finished the step before, forwarded at its grid slot so
  that its keys are kept, as the official code forwards it again. Positions are grid positions,
  so LlamaGen's 2-D RoPE is the grid's.
* What a node sees (the row-causal mask), as in the official code, causal by grid position over
  the keys written: the condition, every kept key earlier in raster order, this forward's tail
  and other lanes' roots earlier in raster order (the row above's current input), and its own
  ancestors in its lane's tree; never another lane's drafts.
* A newly opened row's first token, while the row above is open, is predicted as LlamaGen-ZipAR
  predicts it: from an auxiliary token, the latest token of the row two above, at the slot before
  the row (the row above's last). Its keys stay there, seen by the rows below, until the row
  above's last token replaces them. Once the row above is complete its real last token is the root.
  On a row-end target the first token is predicted as Lumina-mGPT-ZipAR predicts it, from the real
  end of line after the row above: the row-end companion of a root nobody sees (its keys go to a
  parking slot of the row above), whose keys every later row sees from then on, as the official
  code keeps them (the row above's last token, forwarded later, does not replace them).
* Accepted nodes' keys and values move from the scratch slots to their grid slots, which is where
  commits out of raster order land.

Without drafts, greedy, this is official LlamaGen-ZipAR token for token (``tests/test_rows.py``,
golden tokens of its code on the embedded model) but for one thing the official code does and this
does not: its mask, causal by cache slot, also lets a lower row attend the never-written slots of
the rows above as zero keys. On row-end targets it is the rules of Lumina-mGPT-ZipAR's code. No parallel-row setting is the model's law, whatever the rule
(:data:`relaxspec.methods.grid.ROWS_SEEN`); the TV record covers the acceptance only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from relaxspec.caching import kept_copy
from relaxspec.decoding.driver import drive
from relaxspec.decoding.plan import DecodePlan, Layout, Schedule, register
from relaxspec.decoding.result import DecodeResult
from relaxspec.decoding.row_ends import row_ends
from relaxspec.decoding.steps import DraftState, Loop, drafted_result, kept_state, reserve_walk
from relaxspec.drafting.base import DraftTree
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig


def grid_side(model) -> int | None:
    """The side of ``model``'s square token grid, ``None`` when its image is not one."""
    config = model.config
    side = getattr(config, "grid_size", None)
    if not isinstance(side, int) or side * side != config.block_size:
        return None
    return side


@dataclass(eq=False)
class RowTables:
    """What rows in parallel read and never change, per shape: ``grid`` tokens a row, ``lanes``
    rows open at most, ``nodes`` per lane's tree, ``cls`` condition slots; ``raster_of_slot
    [max_seq]`` (a slot's raster index, -1 off the image), ``scratch [L, T]`` (each lane's node
    slots), ``offsets [T + 1]``, ``row_ends [grid]`` (the rows' last tokens' grid slots),
    ``slot_ids [max_seq]``, the ``spare`` and first ``parking`` slot, the row-end strategy ``ends``
    (:mod:`relaxspec.decoding.row_ends`) and its tables."""

    grid: int
    lanes: int
    nodes: int
    cls: int
    spare: int
    parking: int
    ends: object
    raster_of_slot: torch.Tensor
    scratch: torch.Tensor
    offsets: torch.Tensor
    row_ends: torch.Tensor
    slot_ids: torch.Tensor
    row_end_raster: torch.Tensor | None = None
    lane_eye: torch.Tensor | None = None


@dataclass(eq=False)
class RowsState(DraftState):
    """The state of rows in parallel, updated in place: ``tokens``, ``step_tv``, ``step_sizes`` and
    ``committed`` ``[B, N + 1]`` (the token, its record, how many tokens its step committed, whether
    it is committed; column ``N`` a spill), ``fill [B, grid + 1]`` (tokens committed per row, and a
    spill row), ``cached [B, max_seq]`` (slots whose keys are seen, real or auxiliary), ``real [B,
    max_seq]`` (slots holding their own token's keys), ``lane_row [B, lanes]`` (the row each lane
    paints next), ``per_step [B, N + 2]`` (tokens each step committed), ``iteration [1]``;
    ``row_end_kept`` on a row-end target; and the shape's ``tables``."""

    step_sizes: torch.Tensor
    committed: torch.Tensor
    fill: torch.Tensor
    cached: torch.Tensor
    real: torch.Tensor
    lane_row: torch.Tensor
    per_step: torch.Tensor
    iteration: torch.Tensor
    tables: RowTables
    row_end_kept: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        tables = [getattr(self.tables, f.name) for f in fields(RowTables)]
        return super().tensors() + [t for t in tables if isinstance(t, torch.Tensor)]


@dataclass(eq=False)
class OpenLanes:
    """This step's lanes, ``[B, L]``: the ``row`` each paints (``grid`` = finished), its ``fill``,
    the row ``above``'s, whether the lane is ``active``, the raster index ``next_at`` of its next
    token, whether its root is a ``stand_in`` (a new row's first step while the row above is open)
    and, on a row-end target, ``hidden_root`` (a root nothing sees); and the roots ``[B * L]`` and
    their raster indices ``root_index [B * L]``."""

    row: torch.Tensor
    fill: torch.Tensor
    above: torch.Tensor
    active: torch.Tensor
    next_at: torch.Tensor
    stand_in: torch.Tensor
    hidden_root: torch.Tensor
    roots: torch.Tensor
    root_index: torch.Tensor


@dataclass(eq=False)
class Tail:
    """The last token of a row finished the step before, forwarded at its grid slot (its keys are
    real from then on) unless a lane's root is that token this step: its ``row``, raster index
    ``at``, whether it goes (``on``), its ``slot`` (the spare slot when not) and ``hot [B,
    max_seq]`` (that slot)."""

    row: torch.Tensor
    at: torch.Tensor
    on: torch.Tensor
    slot: torch.Tensor
    hot: torch.Tensor


def rows_step(loop: Loop) -> None:
    """One step of every open row of every image: each lane's tree, one target forward over all of
    them and the tail, the walk, the commits out of raster order, the keys moved to their grid
    slots, the source's catch-up. A fixed sequence of ops that reads nothing back: what
    ``compile`` compiles as one graph."""
    parts, state, schedule = loop.parts, loop.state, loop.schedule
    tables = state.tables
    lanes = open_lanes(state, schedule.lead)
    tail = tail_of(state, lanes)
    tree = parts.source.propose(lanes.roots, lanes.root_index, parts.greedy)
    tokens, positions, slots, mask, companions, valid = forward_inputs(state, lanes, tail, tree, schedule.lead)
    probs, hidden = parts.target.forward(tokens, positions, slots, mask, companions)
    count_nodes = tables.lanes * tables.nodes
    probs, hidden = probs[:, :count_nodes], hidden[:, :count_nodes]
    keep_tail(state, tail)
    virtual = lanes.roots.shape[0]
    probs = probs.reshape(virtual, tables.nodes, -1)
    result = parts.verify(DraftTree(tree.tokens, tree.parents, tree.depth, tree.proposals, valid.view(virtual, -1),
                                    tree.ancestors, children=tree.children, level_widths=tree.level_widths,
                                    point_mass=tree.point_mass), probs)
    count, write_at = commit(state, lanes, result, schedule.prefix_below)
    move_keys(parts.target, state, lanes, result)
    parts.source.update(result.committed, result.path, count.view(-1), lanes.root_index, probs,
                        _lanes_hidden(hidden, tables.lanes, tables.nodes))
    advance(state, lanes, count, write_at)


def open_lanes(state: RowsState, lead: int) -> OpenLanes:
    """Which lanes paint this step and from which root. Row ``r + 1`` opens once row ``r`` has
    ``lead`` tokens (LlamaGen-ZipAR opens row 1 only once row 0 is complete: its new rows start
    from a token of the row two above; Lumina-mGPT-ZipAR at the lead). The root is the lane's last
    token; a row's first step while the row above is open: at the slot before the row, the latest
    token of the row two above (LlamaGen-ZipAR's auxiliary token), or on a row-end target a token
    nothing sees (its row-end companion is the root: the real end of line before the row, as
    Lumina-mGPT-ZipAR feeds it; the row above's latest token here)."""
    tables, fill = state.tables, state.fill
    grid, ends = tables.grid, tables.ends
    row = state.lane_row.clamp(max=grid)  # [B, L]; grid = finished
    filled = fill.gather(1, row)
    above = torch.where(row == 0, grid, fill.gather(1, (row - 1).clamp(min=0)))  # the row above's tokens
    opened = (above == grid) | ((above >= lead) & (row >= ends.first_row_at_lead))
    active = (row < grid) & opened & (filled < grid)
    next_at = row.clamp(max=grid - 1) * grid + filled.clamp(max=grid - 1)  # raster index of the lane's next token
    stand_in = (filled == 0) & (above < grid)
    stand_row = ends.stand_row(row).clamp(min=0)
    root_at = torch.where(stand_in, stand_row * grid + (fill.gather(1, stand_row) - 1).clamp(min=0), next_at - 1)
    return OpenLanes(row, filled, above, active, next_at, stand_in, stand_in & ends.hides_root,
                     state.tokens.gather(1, root_at.clamp(min=0)).reshape(-1), (next_at - 1).reshape(-1))


def tail_of(state: RowsState, lanes: OpenLanes) -> Tail:
    """The first row finished but whose last token's keys are not yet real."""
    tables = state.tables
    grid, cls, ends = tables.grid, tables.cls, tables.row_ends
    pending = (state.fill[:, :grid] == grid) & ~state.real[:, ends]
    # the first pending row (a min, not an argmax: inductor's CPU argmax of an all-false row gave -1)
    row = torch.where(pending, (ends - cls) // grid, grid).amin(1).clamp(max=grid - 1)
    at = row * grid + grid - 1
    rooted = lanes.active & ~lanes.stand_in & (lanes.fill == 0) & (lanes.next_at - 1 == at[:, None])
    on = pending.any(1) & ~rooted.any(1)
    slot = torch.where(on, cls + at, tables.spare)
    return Tail(row, at, on, slot, tables.slot_ids[None, :] == slot[:, None])


def forward_inputs(state: RowsState, lanes: OpenLanes, tail: Tail, tree, lead: int):
    """``(tokens, positions, slots, mask, companions, valid)`` of the forward: every lane's tree
    ``[B, L * T]`` at grid positions in its scratch slots, then the tail; ``valid [B, L, T]``, the
    drafts a step may commit: within the row, and ``lead`` behind the row above until it is
    complete."""
    tables = state.tables
    batch, grid, cls, n_tok = state.tokens.shape[0], tables.grid, tables.cls, tables.grid * tables.grid
    depth = tree.depth.reshape(batch, tables.lanes, tables.nodes)
    filled, above = lanes.fill, lanes.above
    room = torch.where(above >= grid, grid - 1 - filled, torch.minimum(grid - 1 - filled, above - lead - filled))
    valid = tree.valid.reshape(depth.shape) & (depth <= room[:, :, None]) & lanes.active[:, :, None]
    raster = (lanes.next_at - 1)[:, :, None] + depth  # each node's token's raster index
    positions = torch.cat([cls + raster.clamp(max=n_tok - 1).reshape(batch, -1), (cls + tail.at)[:, None]], 1)
    slots = torch.cat([tables.scratch.expand(depth.shape).reshape(batch, -1), tail.slot[:, None]], 1)
    tokens = torch.cat([tree.tokens.reshape(batch, -1), state.tokens.gather(1, tail.at[:, None])], 1)
    mask = forward_mask(state, lanes, tail, raster, tree.ancestors.reshape(*depth.shape, tables.nodes))
    return tokens, positions, slots, mask, tables.ends.forward_mask(state, lanes, raster, tail), valid


def forward_mask(state: RowsState, lanes: OpenLanes, tail: Tail, raster: torch.Tensor,
                 ancestors: torch.Tensor) -> torch.Tensor:
    """``[B, L * T + 1, max_seq]``: the row-causal mask (:func:`row_causal_mask`), and every
    forwarded token the official code writes before attending: the tail at its grid slot and the
    other lanes' roots; a node sees those earlier in raster order (other lanes' drafts: never)."""
    tables = state.tables
    batch, lanes_n, nodes = raster.shape
    cls, n_tok, first = tables.cls, tables.grid * tables.grid, tables.scratch[:, 0]
    mask = row_causal_mask(state.cached, tables.raster_of_slot, raster, ancestors, tables.scratch, cls,
                           n_tok).view(batch, lanes_n, nodes, -1)
    mask[..., first] |= lanes.active[:, None, None, :] & ((lanes.next_at - 1)[:, None, None, :] < raster[..., None])
    mask[..., first] &= ~lanes.hidden_root[:, None, None, :]
    mask |= (tail.on[:, None, None] & (tail.at[:, None, None] < raster))[..., None] & tail.hot[:, None, None, :]
    tail_mask = state.cached & ((tables.raster_of_slot < tail.at[:, None]) | (tables.raster_of_slot < 0))
    tail_mask[:, cls + n_tok :] = False
    tail_mask |= tail.hot
    return torch.cat([mask.view(batch, lanes_n * nodes, -1), tail_mask[:, None, :]], 1)


def keep_tail(state: RowsState, tail: Tail) -> None:
    """The tail's keys are written at its grid slot: real and seen from now on."""
    written = tail.hot & tail.on[:, None]
    state.real |= written
    state.cached |= written
    state.tables.ends.tail_written(state, written, tail.row)


def commit(state: RowsState, lanes: OpenLanes, result, prefix_below: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Raster ``next_at .. next_at + count - 1`` of each lane (the rest to the spill column), with
    their TV records: ``(count [B, L], write_at [B, L * W])``. With ``prefix_below`` a row below the
    top open one commits its accepted drafts only (PJD's code)."""
    batch, n_tok = state.tokens.shape[0], state.tables.grid ** 2
    accepted = result.num_accepted.view(batch, -1)
    if prefix_below:
        top = lanes.row == torch.where(lanes.active, lanes.row, state.tables.grid).min(1, keepdim=True).values
        count = torch.where(lanes.active, accepted + top.long(), torch.zeros_like(accepted))
    else:
        count = torch.where(lanes.active, accepted + 1, torch.zeros_like(accepted))
    state.add_rank_counts(result)
    offsets = state.tables.offsets[: result.committed.shape[1]]
    keep = offsets[None, None, :] < count[:, :, None]
    write_at = torch.where(keep, lanes.next_at[:, :, None] + offsets, n_tok).view(batch, -1)
    state.tokens.scatter_(1, write_at, result.committed.clamp(min=0).view(batch, -1))
    state.step_tv.scatter_(1, write_at, result.step_tv.to(state.step_tv.dtype).view(batch, -1))
    return count, write_at


def move_keys(target, state: RowsState, lanes: OpenLanes, result) -> None:
    """The root and the accepted nodes' keys move to their grid slots (a root whose slot already
    holds its real keys keeps them; an auxiliary root's keys stay at the slot before its row, seen
    by the rows below until the row above's last token replaces them); other entries copy a lane's
    own scratch slot onto itself, so no two entries write one slot."""
    tables = state.tables
    batch, span, cls, nodes = state.tokens.shape[0], result.path.shape[1], tables.cls, tables.nodes
    offsets = tables.offsets[:span]
    path = result.path.view(batch, tables.lanes, span)
    moving = (path >= 0) & (offsets < (result.num_accepted.view(batch, -1) + 1)[:, :, None]) & lanes.active[:, :, None]
    moving[:, :, 0] &= ~state.real.gather(1, cls + (lanes.next_at - 1).clamp(min=0))
    source_slot = tables.scratch.expand(batch, -1, -1).gather(2, path.clamp(min=0))
    grid_slot = cls + (lanes.next_at - 1)[:, :, None] + offsets
    idle = tables.scratch[None, :, :span].expand(batch, -1, -1) if span <= nodes else \
        tables.scratch[None, :, -1:].expand(batch, tables.lanes, span)
    tables.ends.land_roots(grid_slot, lanes, tables)
    src, dst = torch.where(moving, source_slot, idle), torch.where(moving, grid_slot, idle)
    target.move_cache(src.view(batch, -1), dst.view(batch, -1))
    is_real, seen_now = moving.clone(), moving.clone()
    is_real[:, :, 0] &= ~lanes.stand_in
    seen_now[:, :, 0] &= ~lanes.hidden_root
    flat = dst.view(batch, -1)
    state.cached.scatter_(1, flat, seen_now.view(batch, -1) | state.cached.gather(1, flat))
    state.real.scatter_(1, flat, is_real.view(batch, -1) | state.real.gather(1, flat))
    tables.ends.after_move(state, moving, dst)


def advance(state: RowsState, lanes: OpenLanes, count: torch.Tensor, write_at: torch.Tensor) -> None:
    """Rows' fill, lanes moving to their next row, and the step's counters."""
    tables = state.tables
    batch, grid, n_tok = state.tokens.shape[0], tables.grid, tables.grid ** 2
    fill = state.fill
    fill.scatter_add_(1, lanes.row, count)
    fill[:, grid] = 0
    finished = lanes.active & (fill.gather(1, lanes.row) >= grid)
    state.lane_row.copy_(torch.where(finished, state.lane_row + tables.lanes, state.lane_row))
    committed_now = count.sum(1)
    width = state.per_step.shape[1]
    state.per_step.scatter_(1, state.iteration.clamp(max=width - 1).expand(batch)[:, None], committed_now[:, None])
    state.iteration.add_(1)
    state.step_sizes.scatter_(1, write_at, committed_now[:, None].expand(-1, write_at.shape[1]))
    state.committed.scatter_(1, write_at, True)
    state.committed[:, n_tok] = False
    state.steps.add_((committed_now > 0).long())
    state.done.copy_(fill[:, :grid].sum())


@register
@dataclass(frozen=True)
class Rows(Schedule):
    """Rows in parallel: ``lanes`` rows open at once at most (more than the grid has: all of
    them); a row opens once the row above has ``lead`` tokens; ``prefix_below``: an open row below
    the top one commits its accepted drafts only (PJD's code), not also a bonus or residual token."""

    name = "rows"
    step = staticmethod(rows_step)
    lanes: int = 2
    lead: int = 1
    prefix_below: bool = False

    def check(self, grid: int | None) -> None:
        """One line for settings the model's grid cannot take (``grid``: its side, ``None`` without one)."""
        if grid is None:
            raise RelaxspecError("rows in parallel need a model whose image tokens lie on a square grid")
        if self.lanes < 1:
            raise RelaxspecError(f"rows must be at least 1, got {self.lanes}")
        if not 1 <= self.lead <= grid:
            raise RelaxspecError(f"row lead must lie in [1, {grid}] (the grid is {grid} tokens wide), got {self.lead}")

    def layout(self, model, source) -> Layout:
        """The rows open at once, the target's cache slots past the image (each lane's draft
        nodes, a parking slot per row on a row-end target, a spare slot) and the source the lanes
        draft with (a source whose state is one per image gives its view of the lanes,
        ``source.for_lanes``)."""
        grid = grid_side(model)
        self.check(grid)
        # a row stays ``lead`` tokens behind the row above (ZipAR's window), so at most about
        # grid / lead rows are ever open: lanes past that would only pad every forward
        lanes = min(self.lanes, grid, -(-grid // self.lead) + 1)
        if hasattr(source, "for_lanes"):  # a source with one state per image (a drafter's cache) keeps its lanes apart
            source = source.for_lanes(lanes, grid)
        return Layout(source, lanes * source.max_nodes + row_ends(model, grid).extra_slots + 1, lanes)

    def start_source(self, model, layout: Layout, first, probs, hidden, start) -> None:
        """Every lane's first pair, kept at one address: what the source's first (compiled) forward reads."""
        lanes = layout.lanes
        start(*(kept_copy(model, f"rows.start.{name}", value) for name, value in (
            ("first", first.repeat_interleave(lanes)), ("probs", probs.repeat_interleave(lanes, 0)),
            ("hidden", hidden[:, -1:].repeat_interleave(lanes, 0)))))

    def reserve(self, noise, layout: Layout, batch: int, vocab: int, greedy: bool):
        return reserve_walk(noise, layout.source, batch * layout.lanes, vocab, greedy)

    def state(self, model, layout: Layout, target, first: torch.Tensor) -> RowsState:
        """The state, kept with the model across decodes of one shape, set to a decode's start:
        token 0 committed in every image, every lane on its first row."""
        tables = _tables(model, layout, target)
        batch, device, n_tok, cls = first.shape[0], first.device, target.num_tokens, target.cls
        kept = kept_state(model, "rows", device)
        state = RowsState(
            **DraftState.start(kept, first, layout.source, n_tok + 1),  # column n_tok: a spill
            step_sizes=kept("step_sizes", (batch, n_tok + 1)).fill_(1),
            committed=kept("committed", (batch, n_tok + 1), torch.bool), fill=kept("fill", (batch, tables.grid + 1)),
            cached=kept("cached", (batch, target.max_seq), torch.bool),
            real=kept("real", (batch, target.max_seq), torch.bool), lane_row=kept("lane_row", (batch, tables.lanes)),
            per_step=kept("per_step", (batch, n_tok + 2)), iteration=kept("iteration", (1,)), tables=tables,
            **tables.ends.state(kept, target))
        state.committed[:, 0] = True
        state.fill[:, 0] = 1
        state.cached[:, :cls] = True
        state.real[:, :cls] = True
        state.lane_row.copy_(torch.arange(tables.lanes, device=device).expand(batch, -1))
        return state

    def progress(self, state: RowsState, num_tokens: int):
        return state.tokens[:, :num_tokens], state.committed[:, :num_tokens]

    def read_out(self, loop: Loop):
        state = loop.state
        return (*state.read_out(loop), state.per_step, state.step_sizes[:, : loop.num_tokens])

    def result(self, host, loop: Loop) -> dict:
        *drafted, per_step, sizes = host
        accept_lengths = [[1] + [count for count in image if count > 0] for image in per_step.tolist()]
        return dict(drafted_result(loop, drafted, accept_lengths), rows=loop.state.tables.lanes, row_lead=self.lead,
                    token_step_sizes=sizes)


def _tables(model, layout: Layout, target) -> RowTables:
    """The shape's constant tables, kept with the model."""
    grid, lanes, nodes, cls = grid_side(model), layout.lanes, layout.source.max_nodes, target.cls
    device, n_tok, max_seq = target.device, grid * grid, target.max_seq
    ends = row_ends(model, grid)
    raster_of_slot = torch.full((max_seq,), -1, dtype=torch.long, device=device)
    raster_of_slot[cls : cls + n_tok] = torch.arange(n_tok, device=device)
    lane_ids, node_ids = torch.arange(lanes, device=device), torch.arange(nodes, device=device)

    def kept(name, value):
        return kept_copy(model, f"rows.{name}", value)

    return RowTables(
        grid=grid, lanes=lanes, nodes=nodes, cls=cls, spare=max_seq - 1, parking=cls + n_tok + lanes * nodes,
        ends=ends, raster_of_slot=kept("raster_of_slot", raster_of_slot),
        scratch=kept("scratch", cls + n_tok + lane_ids[:, None] * nodes + node_ids[None, :]),  # [L, T]
        offsets=kept("offsets", torch.arange(nodes + 1, device=device)),  # a path and its bonus
        row_ends=kept("row_ends", cls + torch.arange(grid, device=device) * grid + grid - 1),
        slot_ids=kept("slot_ids", torch.arange(max_seq, device=device)),
        **ends.tables(kept, target, grid, lanes, nodes))


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


def _lanes_hidden(hidden: torch.Tensor, lanes: int, nodes: int) -> torch.Tensor:
    """``[S*B, L*T, d]`` -> ``[S*B*L, T, d]`` (stream-major, lane ``l`` of image ``b`` at ``b * L + l``)."""
    rows, _, dim = hidden.shape
    return hidden.reshape(rows, lanes, nodes, dim).reshape(rows * lanes, nodes, dim)


@torch.no_grad()
def generate_rows(model, cond, sampling: SamplingConfig, *, source, rule, plan: Rows,
                  generator: torch.Generator | None = None, cond_mask=None, record_tv: bool = True,
                  compile: bool = False, profile: bool = False, progress: bool = False, on_step=None) -> DecodeResult:
    """Generate ``[B, N]`` tokens with ``plan.lanes`` rows open at once (the :class:`Rows`
    schedule ``plan``); ``source`` drafts for every lane (a source of ``B * lanes`` rows, lane
    ``l`` of image ``b`` being row ``b * lanes + l``; a source whose state is one per image, as a
    drafter's cache, gives its own view of the lanes by ``source.for_lanes(lanes, grid)``), ``rule``
    accepts. ``on_step(tokens, committed)``: called after every step with the buffer ``[B, N]`` and
    which of its tokens are committed ``[B, N]`` (bool: commits land out of raster order here)."""
    return drive(model, cond, sampling, DecodePlan(plan, source, rule, compile=compile, profile=profile,
                                                   record_tv=record_tv, label="rows"),
                 generator=generator, cond_mask=cond_mask, progress=progress, on_step=on_step)


__all__ = ["OpenLanes", "Rows", "RowsState", "RowTables", "Tail", "generate_rows", "grid_side", "row_causal_mask",
           "rows_step"]
