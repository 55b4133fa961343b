"""The speculative decoding loop: draft -> one target forward over the tree -> accept -> commit.

It composes three independent pieces and knows none of their internals:
a draft source (:class:`relaxspec.drafting.base.DraftSource`), an acceptance rule
(:mod:`relaxspec.acceptance`) and the tree walk (:func:`relaxspec.decoding.verify.verify_tree`).
Each row of the batch accepts its own length: row ``b`` has committed ``n[b]`` tokens, its root
(the last committed token, not yet in the target's cache) sits at slot ``C + n[b] - 1``, and its
tree node ``i`` at slot ``C + n[b] - 1 + i`` with RoPE position ``C + n[b] - 1 + depth(i)``.
After verification the accepted nodes' keys and values are copied down so the committed prefix
stays contiguous.
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from relaxspec.acceptance import AcceptanceRule
from relaxspec.compiling import compiled
from relaxspec.decoding.result import DecodeResult, add_counts, read_once, watched_seconds
from relaxspec.decoding.target import GuidedTarget
from relaxspec.decoding.verify import verify_tree, walk_tree
from relaxspec.drafting.tree_tables import tree_attention_mask
from relaxspec.methods import BuildContext, MethodOptions
from relaxspec.sampling import SamplingConfig, sample_from


def build_parts(options: MethodOptions, context: BuildContext):
    """``(source, rule)``: what ``options``' method builds from ``context``."""
    return options.family.build(options, context)


@torch.no_grad()
def generate_speculative(model, cond, sampling: SamplingConfig, options: MethodOptions, *, generator=None,
                         drafter=None, vq=None, cond_mask=None, progress: bool = False, rule: AcceptanceRule | None = None,
                         source=None, on_step=None) -> DecodeResult:
    """Generate ``[B, N]`` tokens speculatively. ``rule`` / ``source`` override what ``options``
    would build (the Python API composes them freely). ``options.record_tv=False`` skips the TV
    record of relaxed rules (``step_tv`` is then zero); ``options.compile`` runs the target's
    and the drafter's steps and the tree walk compiled.

    Every step makes the same sequence of ops on tensors of fixed shapes and reads the device
    once, for whether every row has finished and how many tokens are done; counters, accept
    lengths and rank statistics stay on the device until the decode ends. ``on_step(tokens,
    done)``, if given, is called after the first token and after every step with the token buffer
    ``[B, N]`` (on the device; positions at or past ``done[b]`` are not yet committed) and the
    committed counts ``done [B]`` (what ``relaxspec demo`` draws from; its time counts in
    ``seconds``)."""
    start = time.perf_counter()
    compile, record_tv = options.compile, options.record_tv
    context = BuildContext(target=model, tokenizer=vq, drafter=drafter, sampling=sampling, compile=compile)
    options.family.check_fits(options, context)
    source = source or options.family.source(options, context)  # what build_parts builds, either part given
    rule = rule or options.family.rule(options, context, horizon=source.max_depth)
    greedy = sampling.greedy
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask, scratch=source.max_nodes, compile=compile)
    batch, n_tok, cls, device = target.batch, target.num_tokens, target.cls, target.device
    width = source.max_nodes  # most tokens one step can commit: depth + 1 <= nodes
    tokens = torch.zeros(batch, n_tok + width, dtype=torch.long, device=device)
    step_tv = torch.zeros(batch, n_tok + width, device=device)
    n = torch.ones(batch, dtype=torch.long, device=device)
    steps = torch.zeros(batch, dtype=torch.long, device=device)  # speculative steps each row took
    drafter_forwards = torch.zeros(batch, dtype=torch.long, device=device)
    lengths = torch.zeros(batch, n_tok + 1, dtype=torch.long, device=device)  # tokens committed per step
    rank_tests = rank_accepts = None
    rows = torch.arange(batch, device=device)
    spill = torch.full((batch, width), n_tok + width - 1, dtype=torch.long, device=device)  # a scratch column
    offsets = torch.arange(width, device=device)
    walk = compiled(walk_tree, device) if compile else None
    rule.prepare(device)
    drafter_seconds, done = 0.0, batch
    bar = tqdm(total=batch * n_tok, desc=options.method, disable=not progress, leave=False)
    try:
        probs0, hidden0 = target.prefill()
        tokens[:, 0] = sample_from(probs0, generator, greedy)
        bar.update(batch)
        if on_step is not None:
            on_step(tokens[:, :n_tok], n)
        t0 = time.perf_counter()
        source.start(tokens[:, 0], probs0, hidden0[:, -1:], target.streams, n_tok, generator, greedy,
                     condition_hidden=hidden0, condition_tokens=target.condition_tokens)
        drafter_seconds += time.perf_counter() - t0
        before = source.forwards
        while done < batch * n_tok:
            active = n < n_tok
            root_index = n - 1
            t0 = time.perf_counter()
            tree = source.propose(tokens[rows, root_index], root_index, generator, greedy)
            drafter_seconds += time.perf_counter() - t0
            nodes = tree.num_nodes
            # A step may commit at most the tokens still missing: drafts deeper than that are
            # never tested (stopping early is exact: the bonus then comes from p itself).
            valid = tree.valid & (tree.depth <= (n_tok - n - 1)[:, None])
            base = cls + root_index
            slots = base[:, None] + offsets[:nodes]
            # Nodes past the image (never tested) still need a valid RoPE row.
            positions = (base[:, None] + tree.depth).clamp(max=cls + n_tok - 1)
            mask = tree_attention_mask(base, tree.ancestors, target.max_seq)
            probs, hidden = target.forward(tree.tokens, positions, slots, mask)
            result = verify_tree(rule, probs, tree.tokens, tree.parents, tree.proposals, tree.depth, valid,
                                 greedy=greedy, generator=generator, record_tv=record_tv and not rule.lossless,
                                 children=tree.children, level_widths=tree.level_widths, point_mass=tree.point_mass,
                                 check=False, walk=walk)
            count = torch.where(active, result.num_accepted + 1, torch.zeros_like(n))
            rank_tests = add_counts(rank_tests, result.rank_tests)
            rank_accepts = add_counts(rank_accepts, result.rank_accepts)
            # Commit: tokens n .. n + count - 1 of each row (the rest of the span goes to a
            # scratch column past the image).
            span = result.committed.shape[1]
            keep = offsets[None, :span] < count[:, None]
            write_at = torch.where(keep, n[:, None] + offsets[:span], spill[:, :span])
            tokens.scatter_(1, write_at, result.committed.clamp(min=0))
            step_tv.scatter_(1, write_at, result.step_tv.to(step_tv.dtype))
            # KV compaction: accepted node path[j] (j >= 1) moves from slot base + path[j] to
            # base + j; every other entry copies a slot onto itself.
            path = result.path[:, 1:]
            moving = (path >= 0) & (offsets[None, : path.shape[1]] < result.num_accepted[:, None]) & active[:, None]
            dst = base[:, None] + 1 + offsets[None, : path.shape[1]]
            target.move_cache(torch.where(moving, base[:, None] + path.clamp(min=0), dst), dst)
            t0 = time.perf_counter()
            # count is 0 for a finished image: it committed nothing
            source.update(result.committed, result.path, count, root_index, probs, hidden, generator)
            drafter_seconds += time.perf_counter() - t0
            drafter_forwards += active.long() * (source.forwards - before)
            before = source.forwards
            lengths.scatter_(1, torch.where(active, steps + 1, torch.full_like(steps, n_tok))[:, None], count[:, None])
            steps += active.long()
            n = n + count
            now = int(n.clamp(max=n_tok).sum())  # the step's one read from the device
            bar.update(now - done)
            done = now
            if on_step is not None:
                on_step(tokens[:, :n_tok], n.clamp(max=n_tok))
    finally:
        bar.close()
        target.close()
        source.close()
    if rank_tests is None:  # a one-token image: no step was taken
        rank_tests = rank_accepts = torch.zeros(max(source.max_depth, 1), 1, dtype=torch.long, device=device)
    # The results are read once, after the loop, in one copy.
    tokens_h, steps_h, lengths_h, drafter_h, tv_h, tests_h, accepts_h = read_once(
        tokens[:, :n_tok], steps, lengths, drafter_forwards, step_tv[:, :n_tok], rank_tests, rank_accepts)
    step_counts, per_step = steps_h.tolist(), lengths_h.tolist()
    accept_lengths = [[1] + row[1 : count + 1] for row, count in zip(per_step, step_counts)]
    return DecodeResult(tokens=tokens_h, target_forwards=steps_h + 1, drafter_forwards=drafter_h,
                        step_tv=tv_h, accept_lengths=accept_lengths,
                        seconds=time.perf_counter() - start, drafter_seconds=drafter_seconds,
                        target_forward_seconds=target.watch.seconds, drafter_forward_seconds=watched_seconds(source),
                        rank_tests=tests_h, rank_accepts=accepts_h, tv_recorded=record_tv or rule.lossless)

