"""What one speculative step costs on *this* machine, and the tree size that pays off.

A static tree of ``n`` drafted nodes costs one target forward over ``n + 1`` tokens (on both CFG
streams) plus one drafter forward per level. On a GPU the target forward is nearly flat in ``n``
up to a few dozen tokens, so wide trees (EAGLE's 25, LANTERN++'s 57 nodes) are free; on a CPU
every extra token costs a visible fraction of a forward, and the tree that maximises tokens per
*second* is much smaller than the one that maximises tokens per *forward*. This module measures
the two forward costs for a given model pair and device so that
:func:`relaxspec.drafting.trees.best_tree_for_cost` can pick the size (``relaxspec build-tree
--budget auto``).

Measured: the median wall time of ``reps`` forwards after ``warmup`` untimed ones, in the model's
own dtype and on its device, inside a KV cache holding half an image of context. The sizes are
timed round-robin (one forward of each size per round), so drift of a shared machine hits every
size alike instead of whichever happened to run during a busy spell. Not measured:
the engine's own per-step work (sampling, tree walk, cache moves), which the bench reports as the
"engine" share; it is nearly the same for every tree size and so hardly moves the choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from relaxspec.decoding.target import GuidedTarget
from relaxspec.drafting.trees import TreeSpec
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig


@dataclass
class ForwardCosts:
    """Median seconds of one target forward over ``T`` tokens (``target[T]``) and of one drafter
    forward over ``M`` tokens (``drafter[M]``), both CFG streams; linear in between."""

    target: dict[int, float]
    drafter: dict[int, float] = field(default_factory=dict)
    device: str = "cpu"
    threads: int | None = None

    @staticmethod
    def _interpolate(table: dict[int, float], size: int) -> float:
        if not table:
            return 0.0
        sizes = sorted(table)
        if size <= sizes[0]:
            return table[sizes[0]]
        for lo, hi in zip(sizes, sizes[1:]):
            if size <= hi:
                return table[lo] + (table[hi] - table[lo]) * (size - lo) / (hi - lo)
        lo, hi = sizes[-2:] if len(sizes) > 1 else (sizes[0], sizes[0])
        slope = (table[hi] - table[lo]) / (hi - lo) if hi > lo else 0.0
        return table[hi] + slope * (size - hi)  # past the last measurement: extend the last segment

    def target_seconds(self, tokens: int) -> float:
        return self._interpolate(self.target, tokens)

    def drafter_seconds(self, tokens: int) -> float:
        return self._interpolate(self.drafter, tokens)

    def step_seconds(self, spec: TreeSpec) -> float:
        """One step of a static tree: the target over root + nodes, the drafter once per level
        (the catch-up forward that yields the root's law, then every level with children)."""
        expanding = [int(((spec.depths == d) & (spec.num_children > 0)).sum()) for d in range(1, spec.depth)]
        return (self.target_seconds(spec.num_nodes) + self.drafter_seconds(spec.depth + 1)
                + sum(self.drafter_seconds(m) for m in expanding))

    def to_dict(self) -> dict:
        return {"target_seconds": {str(k): v for k, v in self.target.items()},
                "drafter_seconds": {str(k): v for k, v in self.drafter.items()},
                "device": self.device, "threads": self.threads}


def _round_robin_medians(calls: dict, reps: int, warmup: int, device: torch.device) -> dict:
    """``{key: fn}`` -> ``{key: median seconds}``, timing one call of each per round."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times = {key: [] for key in calls}
    for _ in range(reps):
        for key, fn in calls.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[key].append(time.perf_counter() - start)
    return {key: sorted(values)[len(values) // 2] for key, values in times.items()}


@torch.no_grad()
def measure_forward_costs(target_model, drafter=None, *, sampling: SamplingConfig | None = None,
                          target_sizes=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64), drafter_sizes=(1, 2, 4, 8, 16),
                          reps: int = 21, warmup: int = 2, cond: torch.Tensor | None = None,
                          cond_mask: torch.Tensor | None = None, compile: bool = False) -> ForwardCosts:
    """Time the target (and drafter) forwards of one image (both CFG streams unless ``sampling``
    turns CFG off) for the given token counts. ``cond [1, ...]`` (and ``cond_mask``): the image's
    condition, needed for a text-to-image target (default: class 0). ``compile``: the target's
    step compiled, as ``--compile`` runs it (CUDA graphs on a GPU; each size is its own graph,
    compiled in the warm-up)."""
    if reps < 1 or warmup < 0:
        raise RelaxspecError(f"reps must be >= 1 and warmup >= 0, got {reps}, {warmup}")
    sampling = sampling or SamplingConfig(cfg_scale=4.0)
    config = target_model.config
    device = target_model.device
    if cond is None:
        if config.model_type != "c2i":
            raise RelaxspecError("a text-to-image target's forward costs need its condition (cond=...)")
        cond = torch.zeros(1, dtype=torch.long, device=device)
    context = config.block_size // 2  # a KV cache half full: the average step of an image
    largest = max(target_sizes)
    fused = None if drafter is None else drafter.config.fused_layers  # the target's forward as a fused drafter's
    target = GuidedTarget(target_model, cond, sampling, scratch=largest, cond_mask=cond_mask, compile=compile,
                          grow=False, capture=fused)
    def target_call(size: int):
        first = target.cls + context
        slots = torch.arange(first, first + size, device=device)[None]
        positions = slots.clamp(max=target.cls + config.block_size - 1)
        tokens = torch.zeros(1, size, dtype=torch.long, device=device)
        return lambda: target.forward(tokens, positions, slots)

    try:
        target.prefill()
        costs = _round_robin_medians({size: target_call(size) for size in sorted(set(int(s) for s in target_sizes))},
                                     reps, warmup, device)
    finally:
        target_model.clear_caches()  # a measurement leaves no cache behind
    drafted = {}
    if drafter is not None:
        rows = target.streams
        drafter.setup_caches(rows, config.block_size + max(drafter_sizes) + 1)
        def drafter_call(size: int):
            slots = torch.arange(context, context + size, device=device)[None].expand(rows, -1)
            positions = slots.clamp(max=config.block_size - 1)
            feats = torch.zeros(rows, size, config.dim, device=device, dtype=drafter.fc.weight.dtype)
            tokens = torch.zeros(rows, size, dtype=torch.long, device=device)
            return lambda: drafter(feats, tokens, positions, cache_slots=slots)

        try:
            drafted = _round_robin_medians({size: drafter_call(size) for size in sorted(set(int(s) for s in drafter_sizes))},
                                           reps, warmup, device)
        finally:
            drafter.clear_caches()
    return ForwardCosts(costs, drafted, device=str(device), threads=torch.get_num_threads())
