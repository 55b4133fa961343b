"""The one list of method families. Adding a method: write ``methods/<family>.py`` (its
:class:`~relaxspec.methods.base.Method` subclasses in a ``METHODS`` tuple) and add the file's
name here."""

from __future__ import annotations

import importlib
from functools import cache

from relaxspec.errors import RelaxspecError
from relaxspec.methods.base import SHARED_SETTINGS, Method, Preset, Setting

FAMILIES = ("ar", "exact", "lantern", "cool", "jacobi", "gsd", "rows")


@cache
def methods() -> dict[str, Method]:
    """Method name -> :class:`Method`, in registry order."""
    found: dict[str, Method] = {}
    for family in FAMILIES:
        for method in importlib.import_module(f"relaxspec.methods.{family}").METHODS:
            if method.name in found:
                raise RelaxspecError(f"two methods are called {method.name!r}")
            found[method.name] = method
    return found


@cache
def settings() -> dict[str, Setting]:
    """Every setting of every method (a setting two methods share is one :class:`Setting`)."""
    found = {s.name: s for s in SHARED_SETTINGS}
    for method in methods().values():
        for setting in method.settings:
            if found.setdefault(setting.name, setting) != setting:
                raise RelaxspecError(f"two different settings are called {setting.name!r}")
    return found


@cache
def presets() -> dict[str, tuple[Method, Preset]]:
    """Preset name -> (its method, the preset), in registry order; a method's own name is always
    one (its defaults, when the method declares no preset of that name)."""
    found: dict[str, tuple[Method, Preset]] = {}
    for method in methods().values():
        own = method.presets.get(method.name, Preset({}, method.summary))
        for name, preset in {method.name: own, **method.presets}.items():
            if name in found:
                raise RelaxspecError(f"two presets are called {name!r}")
            found[name] = (method, preset)
    return found


@cache
def spellings() -> dict[str, str]:
    """Other accepted spellings -> preset name."""
    return {other: name for name, (_, preset) in presets().items() for other in preset.spellings}


def canonical(name: str) -> str:
    """A method or preset name as the registry spells it; a one-line error for an unknown one."""
    key = str(name).strip().lower()
    key = spellings().get(key, key)
    if key not in presets():
        raise RelaxspecError(f"unknown method {name!r}; choose one of {', '.join(presets())}")
    return key


def lookup(name: str) -> tuple[Method, str, Preset]:
    """``name`` -> (its method, the canonical preset name, the preset)."""
    key = canonical(name)
    method, preset = presets()[key]
    return method, key, preset


def names() -> tuple[str, ...]:
    """What ``--method`` accepts: every method and preset name, and their other spellings."""
    return tuple(presets()) + tuple(spellings())


def bench_defaults() -> tuple[str, ...]:
    """The presets a plain ``relaxspec bench`` runs on a model with no presets of its own."""
    return tuple(name for name, (_, preset) in presets().items() if preset.bench)
