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

import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from relaxspec.acceptance import AcceptanceRule
from relaxspec.caching import kept_buffer, kept_copy
from relaxspec.compiling import compiled
from relaxspec.decoding.engine import add_rank_counts, check_compilable, rank_count_shape, walk_noise
from relaxspec.decoding.loop import run_steps, step_runner
from relaxspec.decoding.result import DecodeResult, read_once, watched_seconds
from relaxspec.decoding.target import GuidedTarget
from relaxspec.decoding.verify import verify_tree, walk_tree
from relaxspec.methods.grid import RowPlan, grid_side
from relaxspec.noise import NoiseSlot, StepNoise
from relaxspec.sampling import SamplingConfig
from relaxspec.timing import Profiling


@dataclass(eq=False)
class RowsLoop:
    """What one step of rows in parallel reads and updates (:func:`rows_step`).

    The parts as :class:`relaxspec.decoding.engine.RasterLoop`'s; ``grid`` tokens a row, ``lanes``
    rows open at most, a row opening once the row above has ``lead``. The state, updated in place:
    ``tokens``, ``step_tv``, ``step_sizes`` and ``committed`` ``[B, N + 1]`` (the token, its record,
    how many tokens its step committed, whether it is committed; column ``N`` a spill),
    ``fill [B, grid + 1]`` (tokens committed per row, and a spill row), ``cached [B, max_seq]``
    (slots holding keys), ``lane_row [B, lanes]`` (the row each lane paints next), ``steps [B]``,
    ``per_step [B, N + 2]`` (tokens each step committed), ``iteration [1]``, the sibling counts
    and ``done`` (tokens committed in all)."""

    target: GuidedTarget
    source: object
    rule: AcceptanceRule
    noise: StepNoise
    walk: Callable
    greedy: bool
    record_tv: bool
    grid: int
    lanes: int
    lead: int
    tokens: torch.Tensor
    step_tv: torch.Tensor
    step_sizes: torch.Tensor
    committed: torch.Tensor
    fill: torch.Tensor
    cached: torch.Tensor
    lane_row: torch.Tensor
    steps: torch.Tensor
    per_step: torch.Tensor
    iteration: torch.Tensor
    rank_tests: torch.Tensor | None
    rank_accepts: torch.Tensor | None
    done: torch.Tensor
    raster_of_slot: torch.Tensor
    scratch: torch.Tensor
    offsets: torch.Tensor
    real: torch.Tensor
    row_ends: torch.Tensor
    slot_ids: torch.Tensor
    spare: int
    companions: bool = False
    prefix_below: bool = False
    row_end_kept: torch.Tensor | None = None
    row_end_raster: torch.Tensor | None = None
    parking: int = 0
    lane_eye: torch.Tensor | None = None
    uniform_slot: NoiseSlot | None = None
    clock_slot: NoiseSlot | None = None
    generator: torch.Generator | None = None
    profiling: bool = False
    drafter_seconds: float = 0.0


def rows_step(loop: RowsLoop) -> None:
    """One step of every open row of every image: each lane's tree, one target forward over all of
    them and the last token of a row finished the step before, the walk, the commits out of raster
    order, the keys moved to their grid slots, the source's catch-up. A fixed sequence of ops that
    reads nothing back: what ``compile`` compiles as one graph."""
    target, source, grid, lanes, lead = loop.target, loop.source, loop.grid, loop.lanes, loop.lead
    tokens, fill, cached, real = loop.tokens, loop.fill, loop.cached, loop.real
    batch, n_tok, cls = tokens.shape[0], grid * grid, target.cls
    nodes, virtual = source.max_nodes, tokens.shape[0] * lanes
    row = loop.lane_row.clamp(max=grid)  # [B, L]; grid = finished
    f = fill.gather(1, row)
    above = torch.where(row == 0, grid, fill.gather(1, (row - 1).clamp(min=0)))  # the row above's tokens
    # row r + 1 opens once row r has ``lead`` tokens; LlamaGen-ZipAR opens row 1 only once row 0 is
    # complete (its new rows start from a token of the row two above), Lumina-mGPT-ZipAR at the lead
    opened = (above == grid) | ((above >= lead) & (row >= (0 if loop.companions else 2)))
    active = (row < grid) & opened & (f < grid)
    k = row.clamp(max=grid - 1) * grid + f.clamp(max=grid - 1)  # raster index of the lane's next token
    # the root: the lane's last token; a row's first step while the row above is open: at the slot
    # before the row, the latest token of the row two above (LlamaGen-ZipAR's auxiliary token), or
    # on a row-end target a token nothing sees (its row-end companion is the root: the real end
    # of line before the row, as Lumina-mGPT-ZipAR feeds it; the row above's latest token here)
    stand_in = (f == 0) & (above < grid)
    hidden_root = stand_in & loop.companions
    stand_row = (row - 1 if loop.companions else row - 2).clamp(min=0)
    root_at = torch.where(stand_in, stand_row * grid + (fill.gather(1, stand_row) - 1).clamp(min=0), k - 1)
    roots = tokens.gather(1, root_at.clamp(min=0)).reshape(virtual)
    root_index = (k - 1).reshape(virtual)
    # the tail: the last token of a row finished the step before, forwarded at its grid slot (its
    # keys are real from now on), unless a lane's root is that token this step
    ends = loop.row_ends  # [grid] grid slots of the rows' last tokens
    pending = (fill[:, :grid] == grid) & ~real[:, ends]
    # the first pending row (a min, not an argmax: inductor's CPU argmax of an all-false row gave -1)
    tail_row = torch.where(pending, (ends - cls) // grid, grid).amin(1).clamp(max=grid - 1)
    tail_at = tail_row * grid + grid - 1
    tail_on = pending.any(1) & ~(active & ~stand_in & (f == 0) & (k - 1 == tail_at[:, None])).any(1)
    tail_slot = torch.where(tail_on, cls + tail_at, loop.spare)
    if loop.profiling:
        started = time.perf_counter()
    tree = source.propose(roots, root_index, loop.greedy)
    if loop.profiling:
        loop.drafter_seconds += time.perf_counter() - started
    depth = tree.depth.view(batch, lanes, nodes)
    # drafts a step may commit: within the row, and ``lead`` behind the row above until it is complete
    room = torch.where(above >= grid, grid - 1 - f, torch.minimum(grid - 1 - f, above - lead - f))[:, :, None]
    valid = tree.valid.view(batch, lanes, nodes) & (depth <= room) & active[:, :, None]
    raster = (k - 1)[:, :, None] + depth  # each node's token's raster index
    positions = torch.cat([cls + raster.clamp(max=n_tok - 1).reshape(batch, -1), (cls + tail_at)[:, None]], 1)
    slots = torch.cat([loop.scratch.expand(batch, lanes, nodes).reshape(batch, -1), tail_slot[:, None]], 1)
    mask = row_causal_mask(cached, loop.raster_of_slot, raster, tree.ancestors.view(batch, lanes, nodes, nodes),
                           loop.scratch, cls, n_tok).view(batch, lanes, nodes, -1)
    # every forwarded token the official code writes before attending: the tail at its grid slot and
    # the other lanes' roots; a node sees those earlier in raster order (other lanes' drafts: never)
    root_seen = active[:, None, None, :] & ((k - 1)[:, None, None, :] < raster[..., None])  # [B, L, T, L]
    mask[..., loop.scratch[:, 0]] |= root_seen
    mask[..., loop.scratch[:, 0]] &= ~hidden_root[:, None, None, :]
    tail_hot = loop.slot_ids[None, :] == tail_slot[:, None]  # [B, S]
    mask |= (tail_on[:, None, None] & (tail_at[:, None, None] < raster))[..., None] & tail_hot[:, None, None, :]
    tail_mask = cached & ((loop.raster_of_slot < tail_at[:, None]) | (loop.raster_of_slot < 0))
    tail_mask[:, cls + n_tok :] = False
    tail_mask |= tail_hot
    mask = torch.cat([mask.view(batch, lanes * nodes, -1), tail_mask[:, None, :]], 1)
    companions = None
    if loop.companions:  # the row ends kept, each seen from the next row on; a row's first root's by its own lane
        companions = loop.row_end_kept[:, None, None, :] & (loop.row_end_raster < raster[..., None])
        companions[..., loop.scratch[:, 0]] |= (f == 0)[:, None, None, :] & loop.lane_eye[None, :, None, :]
        tail_companions = loop.row_end_kept & (loop.row_end_raster < tail_at[:, None])
        companions = torch.cat([companions.view(batch, lanes * nodes, -1), tail_companions[:, None, :]], 1)
    tree_tokens = tree.tokens.view(batch, lanes * nodes)
    probs, hidden = target.forward(torch.cat([tree_tokens, tokens.gather(1, tail_at[:, None])], 1), positions, slots,
                                   mask, companions)
    probs, hidden = probs[:, : lanes * nodes], hidden[:, : lanes * nodes]
    written = tail_hot & tail_on[:, None]
    real |= written
    cached |= written
    if loop.companions:  # the tail's row end, unless the row below kept one when it opened
        parked = loop.row_end_kept.gather(1, (loop.parking + tail_row)[:, None])
        loop.row_end_kept |= written & ~parked
    noise = loop.noise
    result = verify_tree(loop.rule, probs.reshape(virtual, nodes, -1), tree.tokens, tree.parents, tree.proposals,
                         tree.depth, valid.view(virtual, nodes), greedy=loop.greedy, generator=loop.generator,
                         record_tv=loop.record_tv, children=tree.children, level_widths=tree.level_widths,
                         point_mass=tree.point_mass, check=False, walk=loop.walk,
                         uniforms=noise.read(loop.uniform_slot) if loop.uniform_slot is not None else None,
                         clocks=noise.read(loop.clock_slot) if loop.clock_slot is not None else None)
    accepted = result.num_accepted.view(batch, lanes)
    if loop.prefix_below:  # a row below the top open one commits its accepted drafts only (PJD's code)
        top = row == torch.where(active, row, grid).min(1, keepdim=True).values
        count = torch.where(active, accepted + top.long(), torch.zeros_like(accepted))
    else:
        count = torch.where(active, accepted + 1, torch.zeros_like(accepted))
    add_rank_counts(loop, result)
    # commit: raster k .. k + count - 1 of each lane (the rest to the spill column)
    span = result.committed.shape[1]
    offsets = loop.offsets[:span]
    keep = offsets[None, None, :] < count[:, :, None]
    write_at = torch.where(keep, k[:, :, None] + offsets, n_tok).view(batch, -1)
    tokens.scatter_(1, write_at, result.committed.clamp(min=0).view(batch, -1))
    loop.step_tv.scatter_(1, write_at, result.step_tv.to(loop.step_tv.dtype).view(batch, -1))
    # keys: the root and the accepted nodes move to their grid slots (a root whose slot already
    # holds its real keys keeps them; an auxiliary root's keys stay at the slot before its row,
    # seen by the rows below until the row above's last token replaces them); other entries copy a
    # lane's own scratch slot onto itself, so no two entries write one slot
    path = result.path.view(batch, lanes, span)
    moving = (path >= 0) & (offsets < (accepted + 1)[:, :, None]) & active[:, :, None]
    root_slot = cls + (k - 1).clamp(min=0)
    moving[:, :, 0] &= ~real.gather(1, root_slot)
    source_slot = loop.scratch.expand(batch, -1, -1).gather(2, path.clamp(min=0))
    grid_slot = cls + (k - 1)[:, :, None] + offsets
    idle = loop.scratch[None, :, :span].expand(batch, -1, -1) if span <= nodes else \
        loop.scratch[None, :, -1:].expand(batch, lanes, span)
    if loop.companions:  # a hidden root's keys go to the parking slot of the row above: its row end is kept there
        grid_slot[:, :, 0] = torch.where(hidden_root, loop.parking + (row - 1).clamp(min=0), grid_slot[:, :, 0])
    src = torch.where(moving, source_slot, idle)
    dst = torch.where(moving, grid_slot, idle)
    target.move_cache(src.view(batch, -1), dst.view(batch, -1))
    is_real = moving.clone()
    is_real[:, :, 0] &= ~stand_in
    seen_now = moving.clone()
    seen_now[:, :, 0] &= ~hidden_root
    cached.scatter_(1, dst.view(batch, -1), seen_now.view(batch, -1) | cached.gather(1, dst.view(batch, -1)))
    real.scatter_(1, dst.view(batch, -1), is_real.view(batch, -1) | real.gather(1, dst.view(batch, -1)))
    if loop.companions:  # row ends kept: a hidden root's (parked), a token's landing at a row end unless one is parked
        row_of = ((dst - cls).clamp(min=0, max=n_tok - 1) // grid).view(batch, -1)
        at_end = ((dst - cls) % grid == grid - 1).view(batch, -1) & (dst < cls + n_tok).view(batch, -1)
        parked = loop.row_end_kept.gather(1, loop.parking + row_of)
        keep_end = moving.view(batch, -1) & ((at_end & ~parked) | (dst >= loop.parking).view(batch, -1))
        loop.row_end_kept.scatter_(1, dst.view(batch, -1), keep_end | loop.row_end_kept.gather(1, dst.view(batch, -1)))
    if loop.profiling:
        started = time.perf_counter()
    source.update(result.committed, result.path, count.view(-1), root_index, probs.reshape(virtual, nodes, -1),
                  _lanes_hidden(hidden, lanes, nodes))
    if loop.profiling:
        loop.drafter_seconds += time.perf_counter() - started
    fill.scatter_add_(1, row, count)
    fill[:, grid] = 0
    loop.lane_row.copy_(torch.where(active & (fill.gather(1, row) >= grid), loop.lane_row + lanes, loop.lane_row))
    committed_now = count.sum(1)
    width = loop.per_step.shape[1]
    loop.per_step.scatter_(1, loop.iteration.clamp(max=width - 1).expand(batch)[:, None], committed_now[:, None])
    loop.iteration.add_(1)
    loop.step_sizes.scatter_(1, write_at, committed_now[:, None].expand(-1, lanes * span))
    loop.committed.scatter_(1, write_at, True)
    loop.committed[:, n_tok] = False
    loop.steps.add_((committed_now > 0).long())
    loop.done.copy_(fill[:, :grid].sum())


@torch.no_grad()
def generate_rows(model, cond, sampling: SamplingConfig, *, source, rule: AcceptanceRule, plan: RowPlan,
                  generator: torch.Generator | None = None, cond_mask=None, record_tv: bool = True,
                  compile: bool = False, profile: bool = False, progress: bool = False, on_step=None) -> DecodeResult:
    """Generate ``[B, N]`` tokens with ``plan.lanes`` rows open at once; ``source`` drafts for
    every lane (a source of ``B * lanes`` rows, lane ``l`` of image ``b`` being row ``b * lanes +
    l``; a source whose state is one per image, as a drafter's cache, gives its own view of the
    lanes by ``source.for_lanes(lanes, grid)``), ``rule`` accepts. Every step is one target
    forward and one lagged read of how many tokens are done (:mod:`relaxspec.decoding.loop`);
    ``compile`` runs every step as one compiled graph (their shapes are static), ``profile``
    times the forwards apart.
    ``on_step(tokens, committed)``: called after every step with the buffer ``[B, N]`` and which
    of its tokens are committed ``[B, N]`` (bool: commits land out of raster order here): views
    of the decode's own buffers, valid during the call."""
    start = time.perf_counter()
    grid = grid_side(model)
    lanes, scratch, source = rows_layout(model, plan, source)
    lead, greedy = plan.lead, sampling.greedy
    nodes = source.max_nodes
    companions = bool(getattr(model, "row_end_companions", False))  # a target whose row ends are forced tokens
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask, scratch=scratch,
                          compile=compile and profile, compile_prefill=compile, timed=profile)
    batch, n_tok, device = target.batch, target.num_tokens, target.device
    virtual = batch * lanes
    rule.prepare(device, owner=model)  # its numbers kept with the model: one address across decodes
    bar = tqdm(total=batch * n_tok, desc="rows", disable=not progress, leave=False)
    try:
        first, probs0, hidden0 = target.start(source.caption_rows, generator)
        noise = StepNoise(device, owner=model)
        started = time.perf_counter()
        # every lane's first pair, kept at one address: what the source's first (compiled) forward reads
        lane_first, lane_probs, lane_hidden = (kept_copy(model, f"rows.start.{name}", value) for name, value in (
            ("first", first.repeat_interleave(lanes)), ("probs", probs0.repeat_interleave(lanes, 0)),
            ("hidden", _lanes(hidden0[:, -1:], lanes))))
        source.start(lane_first, lane_probs, lane_hidden, target.streams, n_tok, generator, greedy,
                     condition_hidden=hidden0, condition_tokens=target.condition_tokens, noise=noise,
                     compile=compile, profiling=Profiling(compile) if profile else None)
        start_seconds = time.perf_counter() - started  # the draft source's time before the first step
        check_compilable(source, compile)
        uniform_slot, clock_slot = walk_noise(noise, source, virtual, probs0.shape[-1], greedy)
        noise.allocate()
        loop = _rows_loop(model, target, source, rule, noise, first, grid, lanes, lead, greedy, companions,
                          plan.prefix_below, record_tv and not rule.lossless, uniform_slot, clock_slot, generator,
                          compile, profile)
        loop.drafter_seconds = start_seconds
        bar.update(batch)
        tokens_view, committed_view = loop.tokens[:, :n_tok], loop.committed[:, :n_tok]
        if on_step is not None:
            on_step(tokens_view, committed_view)
        step = step_runner(rows_step, loop, device, (model, *source.models), compile=compile, profile=profile)
        run_steps(step, noise, generator, loop.done, batch * n_tok, start=batch, bar=bar,
                  on_step=None if on_step is None else (lambda: on_step(tokens_view, committed_view)))
    finally:
        bar.close()
        target.close()
        source.close()
    if loop.rank_tests is None:
        loop.rank_tests = loop.rank_accepts = torch.zeros(max(source.max_depth, 1), 1, dtype=torch.long, device=device)
    tokens_h, steps_h, per_step_h, tv_h, tests_h, accepts_h, sizes_h = read_once(
        tokens_view, loop.steps, loop.per_step, loop.step_tv[:, :n_tok], loop.rank_tests, loop.rank_accepts,
        loop.step_sizes[:, :n_tok])
    accept_lengths = [[1] + [count for count in image if count > 0] for image in per_step_h.tolist()]
    return DecodeResult(tokens=tokens_h, target_forwards=steps_h + 1,
                        drafter_forwards=steps_h * source.forwards_per_step, step_tv=tv_h, accept_lengths=accept_lengths,
                        seconds=time.perf_counter() - start,
                        drafter_seconds=loop.drafter_seconds if profile else None,
                        target_forward_seconds=target.watch.seconds if profile else None,
                        drafter_forward_seconds=watched_seconds(source) if profile else None,
                        rank_tests=tests_h, rank_accepts=accepts_h,
                        tv_recorded=record_tv or rule.lossless, rows=lanes, row_lead=lead, token_step_sizes=sizes_h)


def rows_layout(model, plan: RowPlan, source) -> tuple[int, int, object]:
    """``(lanes, scratch, source)`` of rows in parallel on ``model`` by ``plan``: the rows open at
    once, the target's cache slots past the image (each lane's draft nodes, a parking slot per row
    on a row-end target, a spare slot) and the source the lanes draft with (a source whose state
    is one per image gives its view of the lanes, ``source.for_lanes``)."""
    grid = grid_side(model)
    plan.check(grid)
    # a row stays ``lead`` tokens behind the row above (ZipAR's window), so at most about
    # grid / lead rows are ever open: lanes past that would only pad every forward
    lanes = min(plan.lanes, grid, -(-grid // plan.lead) + 1)
    if hasattr(source, "for_lanes"):  # a source with one state per image (a drafter's cache) keeps its lanes apart
        source = source.for_lanes(lanes, grid)
    companions = bool(getattr(model, "row_end_companions", False))  # a target whose row ends are forced tokens
    return lanes, lanes * source.max_nodes + (grid if companions else 0) + 1, source


def _rows_loop(model, target, source, rule, noise, first, grid, lanes, lead, greedy, companions, prefix_below,
               record_tv, uniform_slot, clock_slot, generator, compile, profile) -> RowsLoop:
    """The loop's tensors, kept with the model across decodes of one shape, set to a decode's
    start: token 0 committed in every image, every lane on its first row. On a row-end target
    (``companions``) also: which slots' row-end companions are kept (``row_end_kept``), the raster
    index each one follows, and a parking slot per row past the scratch slots, where the row end
    a new row started from is kept before the row above is complete."""
    batch, device, cls, n_tok = first.shape[0], first.device, target.cls, grid * grid
    nodes = source.max_nodes

    def kept(name, shape, dtype=torch.long):
        return kept_buffer(model, f"rows.{name}", shape, dtype, device).zero_()

    tokens = kept("tokens", (batch, n_tok + 1))  # column n_tok: a spill
    tokens[:, 0] = first
    committed = kept("committed", (batch, n_tok + 1), torch.bool)
    committed[:, 0] = True
    fill = kept("fill", (batch, grid + 1))  # tokens committed per row (+ a spill row)
    fill[:, 0] = 1
    cached = kept("cached", (batch, target.max_seq), torch.bool)  # slots whose keys are seen (real or auxiliary)
    cached[:, :cls] = True
    real = kept("real", (batch, target.max_seq), torch.bool)  # slots holding their own token's keys
    real[:, :cls] = True
    lane_row = kept("lane_row", (batch, lanes))
    lane_row.copy_(torch.arange(lanes, device=device).expand(batch, lanes))  # the row each lane paints next
    raster_of_slot = kept("raster_of_slot", (target.max_seq,)).fill_(-1)
    raster_of_slot[cls : cls + n_tok] = torch.arange(n_tok, device=device)
    lane_ids, node_ids = torch.arange(lanes, device=device), torch.arange(nodes, device=device)
    counts = rank_count_shape(source.level_widths)
    return RowsLoop(
        target=target, source=source, rule=rule, noise=noise,
        walk=compiled(walk_tree, device) if compile and profile else walk_tree, greedy=greedy, record_tv=record_tv,
        grid=grid, lanes=lanes, lead=lead, tokens=tokens, step_tv=kept("step_tv", (batch, n_tok + 1), torch.float32),
        step_sizes=kept("step_sizes", (batch, n_tok + 1)).fill_(1), committed=committed, fill=fill, cached=cached,
        lane_row=lane_row, steps=kept("steps", (batch,)), per_step=kept("per_step", (batch, n_tok + 2)),
        iteration=kept("iteration", (1,)),
        rank_tests=None if counts is None else kept("rank_tests", counts),
        rank_accepts=None if counts is None else kept("rank_accepts", counts),
        done=kept("done", ()).fill_(batch), raster_of_slot=raster_of_slot, real=real,
        row_ends=kept_copy(model, "rows.row_ends", cls + torch.arange(grid, device=device) * grid + grid - 1),
        slot_ids=kept_copy(model, "rows.slot_ids", torch.arange(target.max_seq, device=device)),
        spare=target.max_seq - 1, companions=companions, prefix_below=prefix_below, parking=cls + n_tok + lanes * nodes,
        row_end_kept=kept("row_end_kept", (batch, target.max_seq), torch.bool) if companions else None,
        row_end_raster=kept_copy(model, "rows.row_end_raster", _row_end_raster(target.max_seq, cls, grid, lanes * nodes).to(device))
        if companions else None,
        lane_eye=kept_copy(model, "rows.lane_eye", torch.eye(lanes, dtype=torch.bool, device=device)) if companions else None,
        scratch=kept_copy(model, "rows.scratch", cls + n_tok + lane_ids[:, None] * nodes + node_ids[None, :]),  # [L, T]
        offsets=kept_copy(model, "rows.offsets", torch.arange(nodes + 1, device=device)),  # a path and its bonus
        uniform_slot=uniform_slot, clock_slot=clock_slot, generator=generator, profiling=profile)


def _row_end_raster(max_seq: int, cls: int, grid: int, scratch: int) -> torch.Tensor:
    """``[max_seq]``: the raster index a slot's row-end companion follows (a grid slot's own, a
    parking slot's row's last; ``grid * grid`` elsewhere: never seen)."""
    n_tok = grid * grid
    raster = torch.full((max_seq,), n_tok, dtype=torch.long)
    raster[cls : cls + n_tok] = torch.arange(n_tok)
    raster[cls + n_tok + scratch : cls + n_tok + scratch + grid] = torch.arange(grid) * grid + grid - 1
    return raster


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
