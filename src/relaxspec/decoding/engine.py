"""The speculative decoding loop: draft -> one target forward over the tree -> accept -> commit.

It composes three independent pieces and knows none of their internals:
a draft source (:class:`relaxspec.drafting.base.DraftSource`), an acceptance rule
(:mod:`relaxspec.acceptance`) and the tree walk (:func:`relaxspec.decoding.verify.verify_tree`).
Each row of the batch accepts its own length: row ``b`` has committed ``n[b]`` tokens, its root
(the last committed token, not yet in the target's cache) sits at slot ``C + n[b] - 1``, and its
tree node ``i`` at slot ``C + n[b] - 1 + i`` with RoPE position ``C + n[b] - 1 + depth(i)``.
After verification the accepted nodes' keys and values are copied down so the committed prefix
stays contiguous.

A step -- the source's drafts, the target's forward, the walk of every rule, the commit, the KV
move, the source's catch-up and the counters -- is one function of a :class:`RasterLoop`
(:func:`raster_step`) that updates the loop's tensors in place; with ``compile`` it runs as one
graph (issue 41, :mod:`relaxspec.decoding.loop`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from tqdm.auto import tqdm

from relaxspec.acceptance import AcceptanceRule
from relaxspec.caching import kept_buffer
from relaxspec.compiling import compiled
from relaxspec.decoding.loop import run_steps, step_runner
from relaxspec.decoding.result import DecodeResult, add_counts, read_once, watched_seconds
from relaxspec.decoding.target import GuidedTarget
from relaxspec.decoding.verify import verify_tree, walk_tests, walk_tree
from relaxspec.drafting.tree_tables import tree_attention_mask
from relaxspec.errors import RelaxspecError
from relaxspec.methods import BuildContext, MethodOptions
from relaxspec.noise import UNIFORMS, VERIFY, NoiseSlot, StepNoise
from relaxspec.sampling import SamplingConfig
from relaxspec.timing import Profiling


def build_parts(options: MethodOptions, context: BuildContext):
    """``(source, rule)``: what ``options``' method builds from ``context``."""
    return options.family.build(options, context)


@dataclass(eq=False)
class RasterLoop:
    """What one step of the raster engine reads and updates (:func:`raster_step`).

    The parts: the ``target``, the draft ``source``, the ``rule``, the step's random numbers
    ``noise`` (the walk's ``uniform_slot`` and ``clock_slot`` on it; ``None`` when greedy, or for a
    source of no fixed shape, whose walk draws from ``generator``) and the ``walk`` function. The
    state, updated in place by every step, ``[B, ...]``: ``tokens [B, N + W]`` (a scratch column
    past the image takes what a step does not commit), ``step_tv [B, N + W]``, ``n`` (tokens
    committed), ``steps`` (steps taken), ``lengths [B, N + 1]`` (tokens committed by each step),
    the sibling counts ``rank_tests`` / ``rank_accepts [levels, width]`` and ``done`` (the sum of
    ``n``, what the loop reads)."""

    target: GuidedTarget
    source: object
    rule: AcceptanceRule
    noise: StepNoise
    walk: Callable
    greedy: bool
    record_tv: bool
    num_tokens: int
    tokens: torch.Tensor
    step_tv: torch.Tensor
    n: torch.Tensor
    steps: torch.Tensor
    lengths: torch.Tensor
    rank_tests: torch.Tensor | None
    rank_accepts: torch.Tensor | None
    done: torch.Tensor
    offsets: torch.Tensor
    spill: torch.Tensor
    uniform_slot: NoiseSlot | None = None
    clock_slot: NoiseSlot | None = None
    generator: torch.Generator | None = None
    profiling: bool = False
    drafter_seconds: float = 0.0


def raster_step(loop: RasterLoop) -> None:
    """One speculative step of every image: draft, one target forward over the trees, the walk,
    commit, KV compaction, the source's catch-up; every result lands in ``loop``'s tensors. A
    fixed sequence of ops on fixed shapes that reads nothing back: what ``compile`` compiles as
    one graph."""
    target, source, n_tok = loop.target, loop.source, loop.num_tokens
    n = loop.n
    active = n < n_tok
    root_index = n - 1
    roots = loop.tokens.gather(1, root_index[:, None]).squeeze(1)
    if loop.profiling:
        started = time.perf_counter()
    tree = source.propose(roots, root_index, loop.greedy)
    if loop.profiling:
        loop.drafter_seconds += time.perf_counter() - started
    nodes = tree.num_nodes
    # A step commits at most the tokens still missing, but every draft is tested, past the image
    # too, as official EAGLE and LANTERN test them: committing a prefix of the walk is exact, and
    # where two accepted paths run through the image's last token, greedy takes the longer one
    # (so a relaxed rule may accept a draft at the last token, whose bonus is then dropped).
    missing = n_tok - n
    base = target.cls + root_index
    slots = base[:, None] + loop.offsets[:nodes]
    # Nodes past the image are scored at the last image token's position (official LlamaGen code:
    # zero RoPE rows); they decide nothing committed but which equally long path wins.
    positions = (base[:, None] + tree.depth).clamp(max=target.cls + n_tok - 1)
    mask = tree_attention_mask(base, tree.ancestors, target.max_seq)
    probs, hidden = target.forward(tree.tokens, positions, slots, mask)
    noise = loop.noise
    result = verify_tree(loop.rule, probs, tree.tokens, tree.parents, tree.proposals, tree.depth, tree.valid,
                         greedy=loop.greedy, generator=loop.generator, record_tv=loop.record_tv,
                         children=tree.children, level_widths=tree.level_widths, point_mass=tree.point_mass,
                         check=False, walk=loop.walk,
                         uniforms=noise.read(loop.uniform_slot) if loop.uniform_slot is not None else None,
                         clocks=noise.read(loop.clock_slot) if loop.clock_slot is not None else None)
    count = torch.where(active, torch.minimum(result.num_accepted + 1, missing), torch.zeros_like(n))
    add_rank_counts(loop, result)
    # Commit: tokens n .. n + count - 1 of each row (the rest of the span goes to a scratch
    # column past the image).
    span = result.committed.shape[1]
    offsets = loop.offsets[:span]
    keep = offsets[None, :] < count[:, None]
    write_at = torch.where(keep, n[:, None] + offsets, loop.spill[:, :span])
    loop.tokens.scatter_(1, write_at, result.committed.clamp(min=0))
    loop.step_tv.scatter_(1, write_at, result.step_tv.to(loop.step_tv.dtype))
    # KV compaction: accepted node path[j] (j >= 1) moves from slot base + path[j] to
    # base + j; every other entry copies a slot onto itself.
    path = result.path[:, 1:]
    moving = (path >= 0) & (offsets[None, : path.shape[1]] < result.num_accepted[:, None]) & active[:, None]
    dst = base[:, None] + 1 + offsets[None, : path.shape[1]]
    target.move_cache(torch.where(moving, base[:, None] + path.clamp(min=0), dst), dst)
    if loop.profiling:
        started = time.perf_counter()
    # count is 0 for a finished image: it committed nothing
    source.update(result.committed, result.path, count, root_index, probs, hidden)
    if loop.profiling:
        loop.drafter_seconds += time.perf_counter() - started
    loop.lengths.scatter_(1, torch.where(active, loop.steps + 1, torch.full_like(n, n_tok))[:, None], count[:, None])
    loop.steps.add_(active.long())
    loop.n.add_(count)
    loop.done.copy_(loop.n.sum())


def add_rank_counts(loop, result) -> None:
    """Add a step's sibling counts ``[levels, width]`` to the loop's (in place, where the source's
    trees have a fixed shape; a source of no fixed shape grows its tables as they come, eagerly)."""
    if loop.rank_tests is not None and loop.rank_tests.shape == result.rank_tests.shape:
        loop.rank_tests.add_(result.rank_tests)
        loop.rank_accepts.add_(result.rank_accepts)
    else:
        loop.rank_tests = add_counts(loop.rank_tests, result.rank_tests)
        loop.rank_accepts = add_counts(loop.rank_accepts, result.rank_accepts)


def rank_count_shape(level_widths: tuple[int, ...] | None) -> tuple[int, int] | None:
    """The walk's ``[levels, width]`` sibling-count tables for trees of ``level_widths`` (``None``:
    unknown until the first tree)."""
    if level_widths is None:
        return None
    return max(len(level_widths), 1), max(level_widths, default=1)


def walk_noise(noise: StepNoise, source, batch: int, vocab: int, greedy: bool):
    """Reserve the walk's numbers on ``noise`` (its :data:`~relaxspec.noise.VERIFY` phase: the
    acceptance uniforms, then the bonus clocks): ``(uniform_slot, clock_slot)``, ``(None, None)``
    when greedy or for a source of no fixed shape."""
    if greedy or source.level_widths is None:
        return None, None
    return (noise.reserve((walk_tests(source.level_widths), batch), UNIFORMS, VERIFY),
            noise.reserve((batch, vocab), phase=VERIFY))


def check_compilable(source, compile: bool) -> None:
    """One line for a source that cannot be part of a compiled step."""
    if compile and source.level_widths is None:
        raise RelaxspecError(f"the draft source {type(source).__name__} declares no fixed tree shape "
                             "(level_widths): its steps cannot be compiled; decode it without compile")


@torch.no_grad()
def generate_speculative(model, cond, sampling: SamplingConfig, options: MethodOptions, *, generator=None,
                         drafter=None, vq=None, cond_mask=None, progress: bool = False, rule: AcceptanceRule | None = None,
                         source=None, on_step=None) -> DecodeResult:
    """Generate ``[B, N]`` tokens speculatively. ``rule`` / ``source`` override what ``options``
    would build (the Python API composes them freely). ``options.record_tv=False`` skips the TV
    record of relaxed rules (``step_tv`` is then zero); ``options.compile`` runs every step as
    one compiled graph; ``options.profile`` times the target's and the drafter's forwards apart
    from the engine (each compiled on its own graph with ``compile``; slower: for diagnosis).

    Every step makes the same sequence of ops on tensors of fixed shapes and reads one number
    back, how many tokens are done, without blocking the device (one step late on a GPU,
    :mod:`relaxspec.decoding.loop`); counters, accept lengths and rank statistics stay on the
    device until the decode ends. ``on_step(tokens, done)``, if given, is called after the first
    token and after every step with the token buffer ``[B, N]`` (on the device; positions at or
    past ``done[b]`` are not yet committed) and the committed counts ``done [B]`` (on the device):
    views of the decode's own buffers, valid during the call (what ``relaxspec demo`` draws
    from; its time counts in ``seconds``)."""
    start = time.perf_counter()
    compile, record_tv, profile = options.compile, options.record_tv, options.profile
    context = BuildContext(target=model, tokenizer=vq, drafter=drafter, sampling=sampling)
    if source is None or rule is None:  # built here: checked here (prebuilt parts were checked where built:
        # Method.build, or ImagePipeline.prepare)
        options.family.check_fits(options, context)
    source = source or options.family.source(options, context)  # what build_parts builds, either part given
    rule = rule or options.family.rule(options, context, horizon=source.max_depth)
    greedy = sampling.greedy
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask, scratch=source.max_nodes,
                          compile=compile and profile, compile_prefill=compile, timed=profile)
    batch, n_tok, device = target.batch, target.num_tokens, target.device
    width = source.max_nodes  # most tokens one step can commit: depth + 1 <= nodes
    rule.prepare(device, owner=model)  # its numbers kept with the model: one address across decodes
    bar = tqdm(total=batch * n_tok, desc=options.method, disable=not progress, leave=False)
    try:
        first, probs0, hidden0 = target.start(source.caption_rows, generator)
        noise = StepNoise(device, owner=model)
        started = time.perf_counter()
        source.start(first, probs0, hidden0[:, -1:], target.streams, n_tok, generator, greedy,
                     condition_hidden=hidden0, condition_tokens=target.condition_tokens, noise=noise,
                     compile=compile, profiling=Profiling(compile) if profile else None)
        start_seconds = time.perf_counter() - started  # the draft source's time before the first step
        check_compilable(source, compile)
        uniform_slot, clock_slot = walk_noise(noise, source, batch, probs0.shape[-1], greedy)
        noise.allocate()
        loop = _raster_loop(model, target, source, rule, noise, first, n_tok, width, greedy,
                            record_tv and not rule.lossless, uniform_slot, clock_slot, generator, compile, profile)
        loop.drafter_seconds = start_seconds
        bar.update(batch)
        tokens_view = loop.tokens[:, :n_tok]
        if on_step is not None:
            on_step(tokens_view, loop.n)
        step = step_runner(raster_step, loop, device, (model, *source.models), compile=compile, profile=profile)
        run_steps(step, noise, generator, loop.done, batch * n_tok, start=batch, bar=bar,
                  on_step=None if on_step is None else (lambda: on_step(tokens_view, loop.n)))
    finally:
        bar.close()
        target.close()
        source.close()
    if loop.rank_tests is None:  # a one-token image from a source of no fixed shape: no step was taken
        loop.rank_tests = loop.rank_accepts = torch.zeros(max(source.max_depth, 1), 1, dtype=torch.long, device=device)
    # The results are read once, after the loop, in one copy.
    tokens_h, steps_h, lengths_h, tv_h, tests_h, accepts_h = read_once(
        tokens_view, loop.steps, loop.lengths, loop.step_tv[:, :n_tok], loop.rank_tests, loop.rank_accepts)
    step_counts, per_step = steps_h.tolist(), lengths_h.tolist()
    accept_lengths = [[1] + row[1 : count + 1] for row, count in zip(per_step, step_counts)]
    return DecodeResult(tokens=tokens_h, target_forwards=steps_h + 1,
                        drafter_forwards=steps_h * source.forwards_per_step, step_tv=tv_h,
                        accept_lengths=accept_lengths, seconds=time.perf_counter() - start,
                        drafter_seconds=loop.drafter_seconds if profile else None,
                        target_forward_seconds=target.watch.seconds if profile else None,
                        drafter_forward_seconds=watched_seconds(source) if profile else None,
                        rank_tests=tests_h, rank_accepts=accepts_h, tv_recorded=record_tv or rule.lossless)


def _raster_loop(model, target, source, rule, noise, first, n_tok, width, greedy, record_tv, uniform_slot, clock_slot,
                 generator, compile, profile) -> RasterLoop:
    """The loop's tensors, kept with the model across decodes of one shape (a compiled step finds
    them where they were), set to a decode's start: token 0 committed in every image."""
    batch, device = first.shape[0], first.device

    def kept(name, shape, dtype=torch.long):
        return kept_buffer(model, f"raster.{name}", shape, dtype, device).zero_()

    tokens = kept("tokens", (batch, n_tok + width))
    tokens[:, 0] = first
    counts = rank_count_shape(source.level_widths)
    walk = compiled(walk_tree, device) if compile and profile else walk_tree
    return RasterLoop(
        target=target, source=source, rule=rule, noise=noise, walk=walk, greedy=greedy, record_tv=record_tv,
        num_tokens=n_tok, tokens=tokens, step_tv=kept("step_tv", (batch, n_tok + width), torch.float32),
        n=kept("n", (batch,)).fill_(1), steps=kept("steps", (batch,)), lengths=kept("lengths", (batch, n_tok + 1)),
        rank_tests=None if counts is None else kept("rank_tests", counts),
        rank_accepts=None if counts is None else kept("rank_accepts", counts),
        done=kept("done", ()).fill_(batch),
        offsets=kept("offsets", (width,)).copy_(torch.arange(width, device=device)),
        spill=kept("spill", (batch, width)).fill_(n_tok + width - 1),  # a scratch column
        uniform_slot=uniform_slot, clock_slot=clock_slot, generator=generator, profiling=profile)
