"""Acceptance rules: exact (arXiv 2211.17192), LANTERN / LANTERN++ (arXiv 2410.03355,
2502.06352) and COOL-SD (arXiv 2601.09212), all with the interface of :class:`AcceptanceRule`.

>>> rule = build_rule("cool", delta=2.0)
>>> rule = build_rule("lantern", neighbours=table, k=1000, delta=0.1)
"""

from __future__ import annotations

import inspect

from relaxspec.acceptance.base import AcceptanceRule, one_hot
from relaxspec.acceptance.cool import CoolRule, cool_weights
from relaxspec.acceptance.exact import ExactRule
from relaxspec.acceptance.lantern import LanternRule
from relaxspec.acceptance.neighbours import cached_neighbour_table, neighbour_table
from relaxspec.errors import RelaxspecError

RULES: dict[str, type[AcceptanceRule]] = {"exact": ExactRule, "lantern": LanternRule, "cool": CoolRule}


def build_rule(name: str, **kwargs) -> AcceptanceRule:
    """Construct the rule called ``name`` ("exact", "lantern", "cool") from keyword options."""
    key = str(name).strip().lower()
    if key not in RULES:
        raise RelaxspecError(f"Unknown acceptance rule {name!r}; choose one of {', '.join(RULES)}.")
    cls = RULES[key]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise RelaxspecError(
            f"Acceptance rule {key!r} has no option(s) {', '.join(unknown)}; "
            f"its options are: {', '.join(accepted) or 'none'}."
        )
    try:
        return cls(**kwargs)
    except TypeError as err:  # a missing required option, e.g. lantern without neighbours
        raise RelaxspecError(f"Acceptance rule {key!r}: {err}.") from err


__all__ = [
    "AcceptanceRule",
    "CoolRule",
    "ExactRule",
    "LanternRule",
    "RULES",
    "build_rule",
    "cached_neighbour_table",
    "cool_weights",
    "neighbour_table",
    "one_hot",
]
