"""The typed, validated settings of a decoding method (what ``relaxspec generate`` exposes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from relaxspec.errors import RelaxspecError

METHODS = ("ar", "sd", "lantern", "cool", "sjd", "scd")
#: Shorthands: LANTERN++ = LANTERN's multiplicative rule on a static tree (arXiv 2502.06352);
#: EAGLE-2 = exact speculative decoding on a dynamic tree (arXiv 2406.16858).
ALIASES = {"lantern++": dict(method="lantern", draft="static"), "eagle2": dict(method="sd", draft="dynamic")}
DRAFTS = ("chain", "static", "dynamic")
DRAFTER_METHODS = ("sd", "lantern", "cool")
#: Command-line spelling of fields whose flag is not ``--field-name``.
FLAGS = {"record_tv": "--no-tv-record"}
#: The fields each draft structure reads; a JSON tree file given as ``draft`` reads ``siblings``.
STRUCTURE_FIELDS = {"chain": ("depth", "siblings"), "static": ("tree", "siblings"),
                    "dynamic": ("depth", "dynamic_top_k", "total_tokens")}


@dataclass
class MethodOptions:
    """Everything a decoding method can be told.

    method: ar | sd | lantern | cool | sjd | scd.
    draft: chain | static | dynamic | a path to a JSON static tree (list of rank paths).
    depth: chain length and dynamic-tree depth; tree: name of a shipped static tree.
    siblings: "sampled" (drawn from q without replacement) or "topk" (deterministic).
    dynamic_top_k / total_tokens: EAGLE-2 dynamic tree shape.
    k / delta / lam / residual / geometry: LANTERN (additive budget ``delta`` or multiplicative
    ``lam``, never both). cool_delta / nu / normalisation: COOL-SD's schedule.
    window: SJD / SCD Jacobi window length.
    anneal: LANTERN with COOL-SD's annealing — the additive budget at draft depth i is
    ``delta * exp(-nu * i - mu)`` (same ``nu`` / normalisation as COOL-SD), so early positions
    relax more than late ones at the same mean budget.
    compile: run the model steps and the tree walk compiled (``torch.compile``, CUDA graphs on
    a GPU; :mod:`relaxspec.compiling`): the first decode of each shape pays the compilation.
    record_tv: keep the per-token TV record of relaxed rules (``--no-tv-record`` turns it off;
    ``step_tv`` is then zero and no certificate is reported).
    """

    method: str = "ar"
    draft: str | None = None  # None: the method's default (chain; static for lantern++, dynamic for eagle2)
    depth: int | None = None  # None: 4 for a chain, 5 levels for EAGLE-2's dynamic tree (LANTERN's setting)
    tree: str = "lantern57"
    siblings: str = "sampled"
    dynamic_top_k: int = 10
    total_tokens: int = 59
    k: int | None = None  # None: 1000 (LANTERN's default), 10 for LANTERN++'s multiplicative rule
    delta: float | None = None
    lam: float | None = None
    residual: str = "relaxed"
    geometry: str = "raw"
    cool_delta: float = 1.1
    nu: float = 0.7
    normalisation: str = "mean"
    window: int = 16
    anneal: bool = False
    compile: bool = False
    record_tv: bool = True

    def __post_init__(self) -> None:
        if self.method in ALIASES:
            alias, implied = self.method, ALIASES[self.method]
            if self.draft is not None and self.draft != implied["draft"]:
                raise RelaxspecError(f"--method {alias} means --draft {implied['draft']}; for another structure use "
                                     f"--method {implied['method']} --draft {self.draft}")
            self.method, self.draft = implied["method"], implied["draft"]
            if alias == "lantern++" and self.delta is not None:
                raise RelaxspecError("--method lantern++ is the multiplicative rule (--lam); for an additive budget "
                                     "use --method lantern --draft static --delta D")
        if self.draft is None:
            self.draft = "chain"
        if self.depth is None:
            self.depth = 5 if self.draft == "dynamic" else 4
        self.validate()

    def validate(self) -> None:
        if self.method not in METHODS:
            raise RelaxspecError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS + tuple(ALIASES))}")
        if self.siblings not in ("sampled", "topk"):
            raise RelaxspecError(f"siblings must be 'sampled' or 'topk', got {self.siblings!r}")
        for name in ("depth", "dynamic_top_k", "total_tokens", "window"):
            if int(getattr(self, name)) < 1:
                raise RelaxspecError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.k is not None and self.k < 1:
            raise RelaxspecError(f"k (latent neighbours) must be >= 1, got {self.k} (k = 0 relaxes nothing: "
                                 "use --method sd for exact decoding)")
        if self.method == "lantern":
            if self.delta is not None and self.lam is not None:
                raise RelaxspecError("give LANTERN either --delta (additive budget) or --lam (multiplicative, LANTERN++), not both")
            if self.delta is None and self.lam is None:
                # Defaults of the official code: LANTERN++'s run script uses (k, lam) = (10, 5) on a
                # static tree; LANTERN's CLI default is (k, delta) = (1000, 0.1).
                if self.draft == "static":
                    self.lam = 5.0
                else:
                    self.delta = 0.1
            if self.delta is not None and not 0 <= self.delta <= 1:
                raise RelaxspecError(f"--delta is an additive TV budget in [0, 1], got {self.delta}")
            if self.lam is not None and self.lam < 1:
                raise RelaxspecError(f"--lam is a multiplicative bound >= 1, got {self.lam}")
        if self.k is None:
            self.k = 10 if self.method == "lantern" and self.lam is not None else 1000
        if self.anneal and (self.method != "lantern" or self.delta is None):
            raise RelaxspecError("--anneal applies to LANTERN's additive budget: use it with --method lantern --delta D")
        if self.residual not in ("relaxed", "plain"):
            raise RelaxspecError(f"residual must be 'relaxed' or 'plain', got {self.residual!r}")
        if self.geometry not in ("raw", "normalised"):
            raise RelaxspecError(f"geometry must be 'raw' or 'normalised', got {self.geometry!r}")
        if self.cool_delta <= 0:
            raise RelaxspecError(f"COOL-SD delta must be > 0, got {self.cool_delta}")
        if self.normalisation not in ("mean", "none"):
            raise RelaxspecError(f"normalisation must be 'mean' or 'none', got {self.normalisation!r}")

    def used_fields(self) -> frozenset[str]:
        """The fields this method (with its draft structure) actually reads."""
        used = {"method", "compile"}
        if self.method in ("sjd", "scd"):
            return frozenset(used | {"window"})
        if self.method == "ar":
            return frozenset(used)
        used |= {"draft", *STRUCTURE_FIELDS.get(self.draft, ("siblings",))}
        if self.method == "lantern":
            used |= {"k", "residual", "geometry", "anneal", "record_tv", "delta" if self.delta is not None else "lam"}
            if self.anneal:
                used |= {"nu", "normalisation"}
        elif self.method == "cool":
            used |= {"cool_delta", "nu", "normalisation", "record_tv"}
        return frozenset(used)

    def check_given(self, given) -> None:
        """Refuse a setting this method would silently ignore: ``given`` names the fields the
        user set (``--tree`` without ``--draft static``, ``--lam`` with ``ar``, ...)."""
        unused = sorted(set(given) - self.used_fields())
        if unused:
            where = f"--method {self.method}" + ("" if self.method in ("ar", "sjd", "scd") else f" --draft {self.draft}")
            users = [d for d, fields in STRUCTURE_FIELDS.items() if unused[0] in fields]
            hint = f" (it belongs to --draft {' / '.join(users)})" if users and self.method in DRAFTER_METHODS else ""
            flag = FLAGS.get(unused[0], "--" + unused[0].replace("_", "-"))
            raise RelaxspecError(f"{flag} is not used by {where}{hint}")

    @property
    def needs_drafter(self) -> bool:
        return self.method in DRAFTER_METHODS

    def to_dict(self) -> dict:
        """The settings this method reads (:meth:`used_fields`), and only those: what stats.json
        and bench records say was used."""
        used = self.used_fields()
        return {name: value for name, value in asdict(self).items() if name in used}

    def describe(self) -> str:
        """One line: the method and every setting it reads, e.g. ``lantern draft=static ...``."""
        return " ".join([self.method] + [f"{k}={v}" for k, v in self.to_dict().items() if k != "method"])
