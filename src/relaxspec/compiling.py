"""``torch.compile`` for the decoding hot path, in one place.

The functions compiled are the model steps (the target's single-token and tree-verification
forwards with their logits processing, the drafter's step): ``fullgraph=True`` so a graph break
is an error, ``dynamic=False`` so every tensor shape is a constant of its graph (the engine keeps
shapes static: one graph per shape, compiled on first use and reused for every later step and
image). On CUDA the graphs are captured as CUDA graphs (``mode="reduce-overhead"``): a step then
costs one graph launch instead of hundreds of kernel launches.
"""

from __future__ import annotations

from typing import Callable

import torch

#: Distinct shapes one decode may compile (prefill, AR step, tree forward, a drafter graph per
#: tree level, for each batch size in use); dynamo's default of 8 would fall back to eager.
RECOMPILE_LIMIT = 64

_compiled: dict[tuple[Callable, str], Callable] = {}


def compiled(fn: Callable, device: torch.device) -> Callable:
    """``fn`` compiled for ``device`` (once per process; later calls reuse the same graphs).

    On CUDA each call marks a new CUDA-graph step and returns tensors cloned out of the graph's
    static memory, so an output stays valid after the next replay."""
    key = (fn, torch.device(device).type)
    if key not in _compiled:
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        if key[1] == "cuda":
            graph = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")

            def run(*args, **kwargs):
                torch.compiler.cudagraph_mark_step_begin()
                out = graph(*args, **kwargs)
                return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

            _compiled[key] = run
        else:
            _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _compiled[key]
