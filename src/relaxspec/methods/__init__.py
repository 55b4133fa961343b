"""Decoding methods: one file per family declares its settings (which are also its command-line
flags), the draft structures it accepts, how it builds its (draft source, acceptance rule) and its
named presets; :mod:`relaxspec.methods.registry` lists the families. ``generate``, ``bench``, the
Python API and a model's shipped presets all resolve a method name here, so it means one thing
everywhere.

>>> resolve("lantern", {"delta": 0.2}).describe()          # doctest: +SKIP
'lantern draft=dynamic depth=5 dynamic_top_k=10 total_tokens=59 record_tv=True k=1000 delta=0.2 ...'
"""

from __future__ import annotations

from relaxspec.methods.base import BuildContext, Method, Preset, Setting
from relaxspec.methods.options import MethodOptions
from relaxspec.methods.registry import bench_defaults, canonical, lookup, methods, names, presets, settings


def resolve(name: str, given: dict | None = None, model_presets: dict | None = None) -> MethodOptions:
    """The settings ``name`` means on a model: the registry's preset, then the model's own preset
    of that name (``model_presets``: preset name -> fields, e.g. the embedded model's tuned
    LANTERN), then ``given`` (what the user set). A given setting the method does not read is
    an error naming it."""
    given = dict(given or {})
    key = canonical(name)
    options = MethodOptions.from_layers(key, [dict((model_presets or {}).get(key, {})), given])
    options.check_given(given)
    return options


def build_rule(options: MethodOptions, tokenizer=None, *, horizon: int = 5, target=None):
    """The acceptance rule ``options`` decode with (its family builds it, as the engine does), for
    tests and tools that walk trees by hand. ``tokenizer``: the image tokenizer (LANTERN's
    neighbours come from its codebook)."""
    return options.family.rule(options, BuildContext(target=target, tokenizer=tokenizer), horizon=horizon)


__all__ = ["BuildContext", "build_rule", "Method", "MethodOptions", "Preset", "Setting", "bench_defaults", "canonical", "lookup", "methods",
           "names", "presets", "resolve", "settings"]
