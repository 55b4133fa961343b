"""What ``relaxspec bench`` runs: named method specs, ``--methods`` lists and ``--sweep`` variants.

A :class:`MethodSpec` is a label plus a method or preset name of the registry
(:mod:`relaxspec.methods`), the model's own preset of that name, the fields set over them and any
:class:`~relaxspec.sampling.SamplingConfig` overrides: a name means in ``bench`` exactly what it
means in ``generate`` and the Python API on the same model. Without model presets the named specs
pair each relaxed rule with the exact method on the same draft structure, so a speed-up can be
read as "what the relaxation buys":

* ``eagle2`` (exact, EAGLE-2 dynamic tree) <-> ``lantern`` (LANTERN applies its additive budget to
  EAGLE-2's dynamic tree, arXiv 2410.03355);
* ``sd-static`` (exact, static ``naive_extend_57`` tree, sampled siblings: EAGLE-1 style) <->
  ``lantern++`` (multiplicative ``lam``, arXiv 2502.06352) and ``cool`` (COOL-SD, arXiv 2601.09212,
  which compares against EAGLE-1 and LANTERN++);
* ``sjd`` <-> ``scd``: the drafter-free Jacobi baselines (arXiv 2410.01699, 2510.24211).

A sweep ``NAME:FIELD=V1,V2,...`` runs ``NAME`` once per value *instead of* once with its default
(labels ``NAME[FIELD=V]``); sweeps of the same name multiply (``lantern[delta=0.1,k=10]``). All
variants of a name share its ``family``: the Pareto plot connects them.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from relaxspec import methods
from relaxspec.methods import MethodOptions
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig

#: The plain-AR baseline every speed-up is measured against.
BASELINE = "ar"

#: The named specs are the registry's presets (:mod:`relaxspec.methods`), so a name means in
#: ``bench`` what it means in ``generate``. What a plain ``relaxspec bench`` runs on a model with no presets of its own (the compiled
#: baseline is left out: its compilation costs minutes on a CPU; ask for it).
DEFAULT_METHODS = methods.bench_defaults()

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingConfig))


@dataclass
class MethodSpec:
    """One benchmarked method: ``label`` (unique in a run), ``options`` (``{"method": NAME}`` and
    the fields set over that name's preset: a sweep's values, ``--compile``), the model's own
    preset of that name (``preset``), sampling overrides, the named spec it derives from
    (``family``) and the swept values (``sweep``)."""

    label: str
    options: dict
    sampling: dict = field(default_factory=dict)
    family: str = ""
    sweep: dict = field(default_factory=dict)
    description: str = ""
    preset: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.family = self.family or self.label

    def method_options(self) -> MethodOptions:
        given = {k: v for k, v in self.options.items() if k != "method"}
        return methods.resolve(self.options["method"], given, {self.options["method"]: self.preset})

    def sampling_config(self, base: SamplingConfig) -> SamplingConfig:
        return dataclasses.replace(base, **self.sampling) if self.sampling else base

    @property
    def needs_drafter(self) -> bool:
        return self.method_options().needs_drafter

    def to_dict(self) -> dict:
        """Everything that identifies the method (the resolved options, not just what was typed)."""
        return {"label": self.label, "family": self.family, "sweep": dict(self.sweep),
                "options": self.method_options().to_dict(), "sampling": dict(self.sampling),
                "description": self.description}


def canonical_name(name: str) -> str:
    return methods.canonical(name)


def named_spec(name: str, model_presets: dict | None = None) -> MethodSpec:
    """The spec ``name`` means on a model with ``model_presets`` (preset name -> fields, e.g. the
    embedded model's tuned LANTERN): the same settings ``relaxspec generate --method NAME`` uses."""
    name = canonical_name(name)
    own = dict((model_presets or {}).get(name, {}))
    description = methods.presets()[name][1].description
    if own:
        description = f"{description}; this model's preset: " + ", ".join(f"{k}={v}" for k, v in own.items())
    return MethodSpec(label=name, options={"method": name}, family=name, description=description, preset=own)


def parse_methods(text: str | None, default: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """``"ar,sd-chain,lantern"`` -> canonical names (``None``: ``default``, or every named spec
    the registry benchmarks by default)."""
    if text is None:
        return [canonical_name(n) for n in default] if default else list(DEFAULT_METHODS)
    names = [canonical_name(item) for item in text.split(",") if item.strip()]
    if not names:
        raise RelaxspecError("--methods is empty")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise RelaxspecError(f"--methods lists {', '.join(repeated)} more than once")
    return names


def _convert(field_name: str, text: str):
    """Parse one sweep value with the type of the field it sets."""
    if field_name in SAMPLING_FIELDS:
        kind = str({f.name: f.type for f in dataclasses.fields(SamplingConfig)}[field_name])
    else:
        kind = methods.settings()[field_name].kind.__name__
    try:
        if "bool" in kind:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return lowered in ("true", "1", "yes")
        if "int" in kind:
            return int(text)
        if "float" in kind:
            return float(text)
        return text
    except ValueError:
        raise RelaxspecError(f"--sweep: {field_name}={text!r} is not a valid value "
                             f"({kind.replace(' | None', '')} expected)") from None


def parse_sweep(text: str) -> tuple[str, str, list]:
    """``"lantern:delta=0.05,0.1"`` -> ``("lantern", "delta", [0.05, 0.1])``."""
    name, sep, assignment = text.partition(":")
    field_name, eq, values = assignment.partition("=")
    if not sep or not eq or not name.strip() or not field_name.strip():
        raise RelaxspecError(f"--sweep {text!r}: expected NAME:FIELD=V1,V2,... (e.g. lantern:delta=0.05,0.1,0.2)")
    name, field_name = canonical_name(name), field_name.strip().replace("-", "_")
    if name == BASELINE:
        raise RelaxspecError(f"--sweep {text!r}: {BASELINE} is the speed-up baseline; it is not swept")
    if field_name == "method":
        raise RelaxspecError(f"--sweep {text!r}: sweep a method's settings, not its method (list methods in --methods)")
    if field_name not in methods.settings() and field_name not in SAMPLING_FIELDS:
        raise RelaxspecError(f"--sweep {text!r}: unknown field {field_name!r}; method fields: {', '.join(methods.settings())}; "
                             f"sampling fields: {', '.join(SAMPLING_FIELDS)}")
    items = [item.strip() for item in values.split(",") if item.strip()]
    if not items:
        raise RelaxspecError(f"--sweep {text!r}: no values after '='")
    parsed = [_convert(field_name, item) for item in items]
    if len(set(map(repr, parsed))) != len(parsed):
        raise RelaxspecError(f"--sweep {text!r}: a value is repeated")
    return name, field_name, parsed


def format_value(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def variant(base: MethodSpec, assignment: dict) -> MethodSpec:
    """``base`` with the swept fields set, validated (a bad combination raises with its label)."""
    options, sampling = dict(base.options), dict(base.sampling)
    for name, value in assignment.items():
        (sampling if name in SAMPLING_FIELDS else options)[name] = value
    label = f"{base.family}[{','.join(f'{k}={format_value(v)}' for k, v in assignment.items())}]"
    spec = MethodSpec(label=label, options=options, sampling=sampling, family=base.family, sweep=dict(assignment),
                      description=base.description, preset=dict(base.preset))
    check_spec(spec)
    return spec


def check_spec(spec: MethodSpec, base: SamplingConfig | None = None) -> None:
    """Raise a :class:`RelaxspecError` naming ``spec.label`` if its options or sampling are invalid."""
    try:
        spec.method_options()
        spec.sampling_config(base or SamplingConfig())
    except (RelaxspecError, TypeError) as err:  # TypeError: an unknown keyword in a hand-made spec
        raise RelaxspecError(f"{spec.label}: {err}") from None


def expand_methods(names: list[str] | None = None, sweeps: list[str] | None = None,
                   model_presets: dict | None = None) -> list[MethodSpec]:
    """The benchmarked methods, in order: ``names`` (default: every named spec), each swept name
    replaced by its variants (a swept name missing from ``names`` is appended). The baseline
    ``ar`` is always included (first, if it was not listed). ``model_presets``: the model's own
    presets, so each name means what ``generate --method NAME`` means on that model."""
    names = list(DEFAULT_METHODS) if names is None else [canonical_name(n) for n in names]
    grid: dict[str, dict[str, list]] = {}
    for text in sweeps or []:
        name, field_name, values = parse_sweep(text)
        fields = grid.setdefault(name, {})
        if field_name in fields:
            raise RelaxspecError(f"--sweep {text!r}: {name}:{field_name} is swept twice")
        fields[field_name] = values
    if BASELINE not in names:
        names.insert(0, BASELINE)
    names += [name for name in grid if name not in names]
    specs: list[MethodSpec] = []
    for name in names:
        base = named_spec(name, model_presets)
        if name not in grid:
            check_spec(base)
            specs.append(base)
            continue
        fields = grid[name]
        for values in itertools.product(*fields.values()):
            specs.append(variant(base, dict(zip(fields, values))))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise RelaxspecError(f"two methods share a label: {', '.join(sorted({l for l in labels if labels.count(l) > 1}))}")
    return specs


__all__ = [
    "BASELINE",
    "DEFAULT_METHODS",
    "MethodSpec",
    "canonical_name",
    "check_spec",
    "expand_methods",
    "format_value",
    "named_spec",
    "parse_methods",
    "parse_sweep",
    "variant",
]
