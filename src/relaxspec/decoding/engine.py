"""The speculative decoding loop: draft -> one target forward over the tree -> accept -> commit.

It composes three independent pieces and knows none of their internals:
a draft source (:mod:`relaxspec.drafting.sources`), an acceptance rule
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

from relaxspec.acceptance import AcceptanceRule, CoolRule, ExactRule, LanternRule, cached_neighbour_table, cool_weights
from relaxspec.decoding.options import MethodOptions
from relaxspec.decoding.result import DecodeResult
from relaxspec.decoding.target import GuidedTarget
from relaxspec.decoding.verify import verify_tree
from relaxspec.drafting.sources import DynamicTree, EagleSource, JacobiSource, StaticTree, tree_attention_mask
from relaxspec.drafting.trees import TreeSpec, load_tree
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig, sample_from


def neighbour_cache_dir():
    from pathlib import Path
    import os

    return Path(os.environ.get("RELAXSPEC_CACHE", Path.home() / ".cache" / "relaxspec")) / "neighbours"


def build_source(options: MethodOptions, drafter, sampling: SamplingConfig):
    """The draft source an options object describes."""
    if options.method in ("sjd", "scd"):
        return JacobiSource(options.window, coupled=options.method == "scd")
    if drafter is None:
        raise RelaxspecError(f"method {options.method!r} needs a trained drafter (--drafter-ckpt)")
    if options.draft == "dynamic":
        structure = DynamicTree(options.dynamic_top_k, options.depth, options.total_tokens)
    else:
        spec = TreeSpec.chain(options.depth) if options.draft == "chain" else load_tree(
            options.tree if options.draft == "static" else options.draft)
        structure = StaticTree(spec, options.siblings)
    return EagleSource(drafter, structure, sampling)


def build_rule(options: MethodOptions, vq=None, horizon: int = 5) -> AcceptanceRule:
    """The acceptance rule an options object describes (LANTERN needs the VQ codebook)."""
    if options.method == "lantern":
        if vq is None:
            raise RelaxspecError("LANTERN needs the VQ tokenizer (its codebook defines the latent neighbours)")
        codebook = vq.raw_codebook if options.geometry == "raw" else vq.codebook
        k = min(options.k, codebook.shape[0] - 1)
        table = cached_neighbour_table(codebook.detach().float().cpu(), k, options.geometry, neighbour_cache_dir())
        if options.anneal:
            # Budgets are TV masses (<= 1): capped, with the mean kept at delta (docs/METHODS.md).
            schedule = cool_weights(options.delta, options.nu, options.normalisation, horizon, cap=1.0)
            return LanternRule(table, k, delta_schedule=schedule, residual=options.residual)
        return LanternRule(table, k, delta=options.delta, lam=options.lam, residual=options.residual)
    if options.method == "cool":
        return CoolRule(delta=options.cool_delta, nu=options.nu, normalisation=options.normalisation, horizon=horizon)
    return ExactRule()


@torch.no_grad()
def generate_speculative(model, cond, sampling: SamplingConfig, options: MethodOptions, *, generator=None,
                         drafter=None, vq=None, cond_mask=None, progress: bool = False, rule: AcceptanceRule | None = None,
                         source=None, record_tv: bool = True) -> DecodeResult:
    """Generate ``[B, N]`` tokens speculatively. ``rule`` / ``source`` override what ``options``
    would build (the Python API composes them freely)."""
    start = time.perf_counter()
    source = source or build_source(options, drafter, sampling)
    rule = rule or build_rule(options, vq, horizon=source.max_depth)
    greedy = sampling.greedy
    target = GuidedTarget(model, cond, sampling, cond_mask=cond_mask, scratch=source.max_nodes)
    batch, n_tok, cls, device = target.batch, target.num_tokens, target.cls, target.device
    width = source.max_nodes  # most tokens one step can commit: depth + 1 <= nodes
    tokens = torch.zeros(batch, n_tok + width, dtype=torch.long, device=device)
    step_tv = torch.zeros(batch, n_tok + width, device=device)
    n = torch.ones(batch, dtype=torch.long, device=device)
    forwards = torch.ones(batch, dtype=torch.long)
    drafter_forwards = torch.zeros(batch, dtype=torch.long)
    accept_lengths: list[list[int]] = [[1] for _ in range(batch)]
    drafter_seconds = 0.0
    rank_tests = torch.zeros(source.max_depth, 1, dtype=torch.long)
    rank_accepts = torch.zeros_like(rank_tests)
    rows = torch.arange(batch, device=device)
    bar = tqdm(total=batch * n_tok, desc=options.method, disable=not progress, leave=False)
    try:
        probs0, hidden0 = target.prefill()
        tokens[:, 0] = sample_from(probs0, generator, greedy)
        bar.update(batch)
        t0 = time.perf_counter()
        source.start(tokens[:, 0], probs0, hidden0, target.streams, n_tok, generator, greedy)
        drafter_seconds += time.perf_counter() - t0
        before = source.forwards
        while bool((n < n_tok).any()):
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
            slots = base[:, None] + torch.arange(nodes, device=device)
            # Nodes past the image (never tested) still need a valid RoPE row.
            positions = (base[:, None] + tree.depth).clamp(max=cls + n_tok - 1)
            kv_len = int(base.max()) + nodes
            mask = tree_attention_mask(base, tree.ancestors, kv_len)
            probs, hidden = target.forward(tree.tokens, positions, slots, mask, kv_len)
            result = verify_tree(rule, probs, tree.tokens, tree.parents, tree.proposals, tree.depth, valid,
                                 greedy=greedy, generator=generator, record_tv=record_tv and not rule.lossless)
            count = torch.where(active, result.num_accepted + 1, torch.zeros_like(n))
            rank_tests, rank_accepts = _accumulate(rank_tests, rank_accepts, result.rank_tests, result.rank_accepts)
            # Commit: tokens n .. n + count - 1 of each row.
            span = result.committed.shape[1]
            offsets = torch.arange(span, device=device)
            keep = offsets[None, :] < count[:, None]
            write_at = torch.where(keep, n[:, None] + offsets, torch.full_like(keep, n_tok + width - 1, dtype=torch.long))
            tokens.scatter_(1, write_at, torch.where(keep, result.committed.clamp(min=0), tokens.gather(1, write_at)))
            step_tv.scatter_(1, write_at, torch.where(keep, result.step_tv.to(step_tv.dtype), step_tv.gather(1, write_at)))
            # KV compaction: accepted node path[j] (j >= 1) moves from slot base + path[j] to base + j.
            path = result.path[:, 1:]
            moving = (path >= 0) & (offsets[None, : path.shape[1]] < result.num_accepted[:, None]) & active[:, None]
            dst = base[:, None] + 1 + offsets[None, : path.shape[1]]
            src = torch.where(moving, base[:, None] + path.clamp(min=0), dst)
            if bool(moving.any()):
                target.move_cache(src, dst)
            t0 = time.perf_counter()
            source.update(result.committed, result.path, torch.where(active, count, torch.ones_like(count)), root_index,
                          probs, hidden, generator)
            drafter_seconds += time.perf_counter() - t0
            steps = source.forwards - before
            before = source.forwards
            forwards += active.cpu().long()
            drafter_forwards += active.cpu().long() * steps
            for b in torch.nonzero(active).flatten().tolist():
                accept_lengths[b].append(int(count[b]))
            n = n + count
            bar.update(int(count.sum()))
    finally:
        bar.close()
        target.close()
        source.close()
    return DecodeResult(tokens=tokens[:, :n_tok].cpu(), target_forwards=forwards, drafter_forwards=drafter_forwards,
                        step_tv=step_tv[:, :n_tok].cpu(), accept_lengths=accept_lengths,
                        seconds=time.perf_counter() - start, drafter_seconds=drafter_seconds,
                        target_forward_seconds=target.watch.seconds, drafter_forward_seconds=_watched(source),
                        rank_tests=rank_tests, rank_accepts=rank_accepts)


def _accumulate(total_tests, total_accepts, tests, accepts):
    """Add one step's ``[depth, rank]`` counts into running totals, growing them as needed."""
    tests, accepts = tests.cpu(), accepts.cpu()
    rows = max(total_tests.shape[0], tests.shape[0])
    cols = max(total_tests.shape[1], tests.shape[1])
    grown_t = torch.zeros(rows, cols, dtype=torch.long)
    grown_a = torch.zeros_like(grown_t)
    for dst, parts in ((grown_t, (total_tests, tests)), (grown_a, (total_accepts, accepts))):
        for part in parts:
            dst[: part.shape[0], : part.shape[1]] += part
    return grown_t, grown_a


def _watched(source) -> float:
    """Seconds a draft source spent in model forwards (a user-written source may not time them)."""
    watch = getattr(source, "watch", None)
    return float(watch.seconds) if watch is not None else 0.0
