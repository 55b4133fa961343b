"""Exact laws of draws without replacement and of one test, for the tests that enumerate a
procedure's law."""

from __future__ import annotations


def plackett_luce(first_chance, q, count):
    """Ordered tuples: the first token from ``first_chance``, the rest from ``q`` without the earlier
    ones -> ``[(tokens, probability)]``; a tuple ends early where ``q`` has nothing left (as the
    engine's invalid siblings)."""
    if count == 0:
        return [((), 1.0)]
    out = [((y,), first_chance[y]) for y in range(len(q)) if first_chance[y] > 0]
    for _ in range(count - 1):
        grown = []
        for toks, pr in out:
            left = q.copy()
            left[list(toks)] = 0.0
            if left.sum() == 0:
                grown.append((toks, pr))
                continue
            grown += [(toks + (y,), pr * left[y] / left.sum()) for y in range(len(q)) if left[y] > 0]
        out = grown
    return out


def passes(t, q, x) -> float:
    """The chance ``t(x) > q(x) * u`` (u uniform) holds: ``min(1, t/q)``; where ``q(x)`` is 0 (a
    sibling equal to an earlier one), whether ``t(x) > 0``."""
    return min(1.0, t[x] / q[x]) if q[x] > 0 else float(t[x] > 0)
