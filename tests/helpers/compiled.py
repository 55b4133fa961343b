"""Reading what inductor generates: the buffers a compiled graph allocates (issue 51: a copy of
a KV cache shows as an allocation of its size)."""

from __future__ import annotations

import re

import torch


def allocations(code: str) -> list[int]:
    """The element counts of the buffers a piece of inductor's generated code allocates."""
    found = re.finditer(r"empty_strided_\w+\(\(([\d, ]*)\)", code)
    return [eval("*".join(part for part in match.group(1).split(",") if part.strip()) or "1") for match in found]


def generated_code(fn, *args, **kwargs) -> tuple[object, list[str]]:
    """``fn(*args, **kwargs)`` and the code inductor generated for the graphs compiled meanwhile
    (its graph cache off, so the code is generated here even where an earlier run cached it)."""
    from torch._inductor.utils import run_and_get_code

    with torch._inductor.config.patch(fx_graph_cache=False):
        return run_and_get_code(fn, *args, **kwargs)


def largest_allocation(codes: list[str]) -> int:
    """The largest buffer (elements) any of ``codes`` allocates (0 for none)."""
    return max((size for code in codes for size in allocations(code)), default=0)
