"""Acceptance rules: exact (arXiv 2211.17192), LANTERN / LANTERN++ (arXiv 2410.03355,
2502.06352) and COOL-SD (arXiv 2601.09212), all with the interface of :class:`AcceptanceRule`. A method family builds its rule from its settings
(:mod:`relaxspec.methods`; ``relaxspec.methods.build_rule(options, tokenizer)``); the rules are
also built directly:

>>> rule = CoolRule(delta=2.0)                              # doctest: +SKIP
>>> rule = LanternRule(table, k=1000, delta=0.1)            # doctest: +SKIP
"""

from __future__ import annotations

from relaxspec.acceptance.base import AcceptanceRule, one_hot
from relaxspec.acceptance.cool import CoolRule, cool_weights
from relaxspec.acceptance.exact import ExactRule
from relaxspec.acceptance.lantern import LanternRule
from relaxspec.acceptance.neighbours import cached_neighbour_table, neighbour_table

__all__ = [
    "AcceptanceRule",
    "CoolRule",
    "ExactRule",
    "LanternRule",
    "cached_neighbour_table",
    "cool_weights",
    "neighbour_table",
    "one_hot",
]
