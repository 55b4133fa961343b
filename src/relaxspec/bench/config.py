"""What ``relaxspec bench`` runs: named method specs, ``--methods`` lists and ``--sweep`` variants.

A :class:`MethodSpec` is a label plus the :class:`~relaxspec.decoding.options.MethodOptions`
keyword arguments (and any :class:`~relaxspec.sampling.SamplingConfig` overrides) that make the
method. The named specs pair each relaxed rule with the exact method on the same draft structure,
so a speed-up can be read as "what the relaxation buys":

* ``eagle2`` (exact, EAGLE-2 dynamic tree) <-> ``lantern`` (LANTERN applies its additive budget to
  EAGLE-2's dynamic tree, arXiv 2410.03355);
* ``sd-static`` (exact, static ``lantern57`` tree, sampled siblings: EAGLE-1 style) <->
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

from relaxspec.decoding.options import MethodOptions
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig

#: The plain-AR baseline every speed-up is measured against.
BASELINE = "ar"

#: name -> (MethodOptions kwargs, one-line description).
METHOD_SPECS: dict[str, tuple[dict, str]] = {
    "ar": (dict(method="ar"), "plain autoregressive sampling (the baseline, MAL 1.0)"),
    "ar-compiled": (dict(method="ar", compile=True),
                    "plain AR with its step compiled (CUDA graphs on a GPU): the baseline a method must beat"),
    "sd-chain": (dict(method="sd", draft="chain", depth=4), "exact speculative decoding, EAGLE drafter, chain of 4"),
    "sd-static": (dict(method="sd", draft="static", tree="lantern57", siblings="sampled"),
                  "exact speculative decoding, static 57-node tree, sampled siblings (EAGLE-1 style)"),
    "eagle2": (dict(method="sd", draft="dynamic", dynamic_top_k=10, depth=5, total_tokens=59),
               "exact speculative decoding, EAGLE-2 dynamic tree (top-k 10, depth 5, 59 nodes)"),
    # k is left to MethodOptions' defaults (1000 with delta, 10 with lam), as in the official code.
    "lantern": (dict(method="lantern", draft="dynamic", dynamic_top_k=10, depth=5, total_tokens=59, delta=0.1),
                "LANTERN: additive budget delta=0.1 over k=1000 latent neighbours, on EAGLE-2's dynamic tree"),
    "lantern++": (dict(method="lantern++", tree="lantern57", siblings="sampled", lam=5.0),
                  "LANTERN++: multiplicative lam=5 over k=10 neighbours, static 57-node tree"),
    "cool": (dict(method="cool", draft="static", tree="lantern57", siblings="sampled", cool_delta=1.1),
             "COOL-SD: annealed w_i = delta exp(-nu i - mu), delta=1.1, static 57-node tree"),
    "sjd": (dict(method="sjd", window=16), "speculative Jacobi decoding, window 16, no drafter"),
    "scd": (dict(method="scd", window=16), "SJD with maximally coupled redraws (SCD-style), window 16, no drafter"),
}
#: Other names for the same specs.
SPEC_ALIASES = {"sd-dynamic": "eagle2", "eagle-2": "eagle2", "cool-sd": "cool", "lanternpp": "lantern++"}
#: Every named spec but the compiled baseline (its compilation costs minutes on a CPU): ask for it.
DEFAULT_METHODS = tuple(name for name in METHOD_SPECS if name != "ar-compiled")

SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingConfig))
OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(MethodOptions) if f.name != "method")
#: LANTERN's two bounds are alternatives: sweeping one drops the other from the base spec.
EXCLUSIVE = {"delta": "lam", "lam": "delta"}


@dataclass
class MethodSpec:
    """One benchmarked method: ``label`` (unique in a run), the ``MethodOptions`` kwargs, sampling
    overrides, the named spec it derives from (``family``) and the swept values (``sweep``)."""

    label: str
    options: dict
    sampling: dict = field(default_factory=dict)
    family: str = ""
    sweep: dict = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        self.family = self.family or self.label

    def method_options(self) -> MethodOptions:
        options = MethodOptions(**self.options)
        options.check_given(self.options)
        return options

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
    name = name.strip().lower()
    name = SPEC_ALIASES.get(name, name)
    if name not in METHOD_SPECS:
        raise RelaxspecError(f"unknown method {name!r}; choose from {', '.join(METHOD_SPECS)}"
                             f" (aliases: {', '.join(SPEC_ALIASES)})")
    return name


def named_spec(name: str) -> MethodSpec:
    name = canonical_name(name)
    options, description = METHOD_SPECS[name]
    return MethodSpec(label=name, options=dict(options), family=name, description=description)


def parse_methods(text: str | None) -> list[str]:
    """``"ar,sd-chain,lantern"`` -> canonical names (``None``: every named spec)."""
    if text is None:
        return list(DEFAULT_METHODS)
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
        kind = {f.name: f.type for f in dataclasses.fields(SamplingConfig)}[field_name]
    else:
        kind = {f.name: f.type for f in dataclasses.fields(MethodOptions)}[field_name]
    kind = str(kind)
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
    if field_name not in OPTION_FIELDS and field_name not in SAMPLING_FIELDS:
        raise RelaxspecError(f"--sweep {text!r}: unknown field {field_name!r}; method fields: {', '.join(OPTION_FIELDS)}; "
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
        target = sampling if name in SAMPLING_FIELDS else options
        target[name] = value
        if name in EXCLUSIVE and EXCLUSIVE[name] not in assignment:
            options.pop(EXCLUSIVE[name], None)
    label = f"{base.family}[{','.join(f'{k}={format_value(v)}' for k, v in assignment.items())}]"
    spec = MethodSpec(label=label, options=options, sampling=sampling, family=base.family, sweep=dict(assignment),
                      description=base.description)
    check_spec(spec)
    return spec


def check_spec(spec: MethodSpec, base: SamplingConfig | None = None) -> None:
    """Raise a :class:`RelaxspecError` naming ``spec.label`` if its options or sampling are invalid."""
    try:
        options = spec.method_options()
        spec.sampling_config(base or SamplingConfig())
        # MethodOptions checks these ranges only when k is left to its default; a swept k must
        # not let an out-of-range budget through.
        if options.delta is not None and not 0 <= options.delta <= 1:
            raise RelaxspecError(f"--delta is an additive TV budget in [0, 1], got {options.delta}")
        if options.lam is not None and options.lam < 1:
            raise RelaxspecError(f"--lam is a multiplicative bound >= 1, got {options.lam}")
    except RelaxspecError as err:
        raise RelaxspecError(f"{spec.label}: {err}") from None
    except TypeError as err:  # an unknown keyword in a hand-made spec
        raise RelaxspecError(f"{spec.label}: {err}") from None


def expand_methods(names: list[str] | None = None, sweeps: list[str] | None = None) -> list[MethodSpec]:
    """The benchmarked methods, in order: ``names`` (default: every named spec), each swept name
    replaced by its variants (a swept name missing from ``names`` is appended). The baseline
    ``ar`` is always included (first, if it was not listed)."""
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
        base = named_spec(name)
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


def describe_methods() -> str:
    """For ``--help``: one line per named spec."""
    return "; ".join(f"{name}: {description}" for name, (_, description) in METHOD_SPECS.items())


__all__ = [
    "BASELINE",
    "DEFAULT_METHODS",
    "METHOD_SPECS",
    "SPEC_ALIASES",
    "MethodSpec",
    "canonical_name",
    "check_spec",
    "describe_methods",
    "expand_methods",
    "format_value",
    "named_spec",
    "parse_methods",
    "parse_sweep",
    "variant",
]
