"""The typed, validated settings of one decoding method: :class:`MethodOptions`."""

from __future__ import annotations

from dataclasses import asdict

from relaxspec.errors import RelaxspecError
from relaxspec.drafting.trees import load_tree
from relaxspec.methods import registry
from relaxspec.methods.base import SHARED_SETTINGS, STRUCTURE_FIELDS, BuildContext, SharedSettings


class MethodOptions:
    """A method and every setting it can be told: the settings every method shares
    (:attr:`shared`, a :class:`~relaxspec.methods.base.SharedSettings`) and the method's own
    (:attr:`own`, the small dataclass its family declares, :attr:`Method.settings_type`), each
    read and set as an attribute (``options.delta``); another method's setting is refused at
    construction. ``MethodOptions.settings()`` lists every method's.

    ``MethodOptions("lantern", delta=0.2)``: ``method`` is a method or preset name (``"ar"``,
    ``"sd"``, ``"eagle2"``, ``"lantern"``, ``"lantern++"``, ``"cool"``, ``"sjd"``, ``"scd"``, ...);
    the preset's fields come first, then the given ones. Settings left ``None`` are chosen by the
    method (``draft``: its own structure; ``depth``: 4 for a chain, 5 for a dynamic tree;
    LANTERN's ``delta`` / ``lam`` / ``k``), and everything is validated. After construction
    ``method`` is the method's name (``"lantern"`` for ``"lantern++"``) and every setting is an
    attribute (``options.delta``). Use :func:`relaxspec.methods.resolve` to put a model's own
    presets in between and refuse settings the method would ignore.

    ``MethodOptions(name)`` is the registry's (the paper's) setting of ``name``, not a model's own
    tuned preset of it: ``--method lantern`` on the embedded model is its LANTERN (delta 0.5, 64
    neighbours, a chain of six), ``MethodOptions("lantern")`` LANTERN on EAGLE-2's tree with
    delta 0.1 and k 1000. For the model's, ask its pipeline: ``open_pipeline(...).method("lantern")``
    (what ``relaxspec.generate`` and every command use).
    """

    def __init__(self, method: str = "ar", **fields):
        self._build(method, [fields])

    @classmethod
    def from_layers(cls, name: str, layers: list[dict]) -> "MethodOptions":
        """``name``'s registry preset, then each layer in order (e.g. a model's preset, then what
        the user gave); a setting of a later layer replaces the earlier value, and also drops
        the alternative it excludes (LANTERN's ``lam`` drops a preset's ``delta``)."""
        options = cls.__new__(cls)
        options._build(name, layers)
        return options

    def _build(self, name: str, layers: list[dict]) -> None:
        method, key, preset = registry.lookup(name)
        known = registry.settings()
        values = {s.name: s.default for s in (*SHARED_SETTINGS, *method.settings)}  # what this method has
        foreign: list[str] = []  # another method's settings: refused once the method's own are resolved
        for layer in [preset.fields, *layers]:
            unknown = sorted(set(layer) - set(known) - {"method"})
            if unknown:
                raise RelaxspecError(f"unknown method setting {unknown[0]!r}; settings: {', '.join(known)}")
            if layer is not preset.fields:
                self._check_preset(method, key, preset, layer)
            for field, value in layer.items():
                if field == "method":
                    continue
                if field not in values:
                    foreign.append(field)
                    continue
                values[field] = value
                for other in method.exclusive.get(field, ()):
                    if other not in layer:
                        values[other] = known[other].default
        for field, value in values.items():
            known[field].check(value)
        # the fields of the last layer (what the user gave): a value a run cannot use is noted then
        self._hold(method, values, (), frozenset(layers[-1]) - {"method"} if layers else frozenset())
        method.resolve(self)
        if foreign:
            field = sorted(foreign)[0]
            owners = [m.name for m in registry.methods().values() if any(s.name == field for s in m.settings)]
            raise RelaxspecError(f"{known[field].cli_flag} is not used by {method.where(self)} (it is a setting of "
                                 f"--method {' / '.join(owners)})")

    @staticmethod
    def _check_preset(method, key: str, preset, layer: dict) -> None:
        for field, value in layer.items():
            if field in preset.refuse:
                raise RelaxspecError(preset.refuse[field])
            if field in preset.fixed and value != preset.fields[field]:
                setting = registry.settings()[field]
                if setting.kind is bool:
                    raise RelaxspecError(f"--method {key} means {setting.name}={preset.fields[field]}; "
                                         f"use --method {method.name}")
                # The way to say it otherwise: the family, the other value, and what else the
                # name implies beyond its draft structure (LANTERN++'s multiplicative lam).
                structural = {"draft", *(f for fields in STRUCTURE_FIELDS.values() for f in fields)}
                rest = "".join(f" {registry.settings()[f].cli_flag} {v}" for f, v in preset.fields.items()
                               if f not in structural and f != field)
                raise RelaxspecError(f"--method {key} means {setting.cli_flag} {preset.fields[field]}; for another "
                                     f"value use --method {method.name} {setting.cli_flag} {value}{rest}")

    # ------------------------------------------------------------------ attribute access
    def _holder(self, name: str):
        """The settings record holding ``name``: the shared one or the method's own."""
        for part in ("shared", "own"):
            holder = self.__dict__.get(part)
            if holder is not None and name in holder.__dataclass_fields__:
                return holder
        method = self.__dict__.get("method")
        raise AttributeError(f"MethodOptions has no setting {name!r}" + (f" for --method {method}" if method else ""))

    def __getattr__(self, name: str):
        return getattr(self._holder(name), name)

    def __setattr__(self, name: str, value) -> None:
        holder = self._holder(name)
        registry.settings()[name].check(value)
        setattr(holder, name, value)

    @property
    def _values(self) -> dict:
        """Every setting of this method, shared ones first, in the registry's order."""
        merged = {**asdict(self.shared), **asdict(self.own)}
        return {name: merged[name] for name in registry.settings() if name in merged}

    def _hold(self, family, values: dict, notes: tuple, given: frozenset) -> None:
        """Keep ``values`` in the shared settings' record and ``family``'s own (the one place the
        records are made: construction, copies and unpickling)."""
        object.__setattr__(self, "shared", SharedSettings(**{s.name: values[s.name] for s in SHARED_SETTINGS}))
        object.__setattr__(self, "own", family.settings_type(**{s.name: values[s.name] for s in family.settings}))
        for name, value in (("method", family.name), ("family", family), ("notes", notes), ("given", given)):
            object.__setattr__(self, name, value)

    def __reduce__(self):
        """Pickled as its method, settings, notes and given fields (the settings dataclasses are
        made per method at run time, so they are rebuilt rather than pickled by name)."""
        return _restored, (self.method, self._values, self.notes, self.given)

    def __copy__(self) -> "MethodOptions":
        return _restored(self.method, self._values, self.notes, self.given)

    def use(self, field: str, value, note: str) -> None:
        """Where the user gave ``field`` past what the run can use on its model, set it to what it
        uses (``value``), so that the run records that, with ``note`` (one line saying why) kept in
        :attr:`notes` for the run to print. A preset's or the paper's value stays as it is named
        (zipar's "every row"; LANTERN's k = 1000 on a small codebook): the engine caps it alike."""
        if field in self.given:
            setattr(self, field, value)
            object.__setattr__(self, "notes", (*self.notes, note))

    def __eq__(self, other) -> bool:
        return isinstance(other, MethodOptions) and (self.method, self._values) == (other.method, other._values)

    def __repr__(self) -> str:
        return f"MethodOptions({self.describe()})"

    @staticmethod
    def settings():
        """Every setting a method can have: name -> :class:`~relaxspec.methods.base.Setting`."""
        return registry.settings()

    # ------------------------------------------------------------------ what is used
    def used_fields(self) -> frozenset[str]:
        """The settings this method (with its draft structure) actually reads."""
        return self.family.used_fields(self)

    def check_given(self, given) -> None:
        """Refuse a setting this method would silently ignore: ``given`` names the fields the
        user set (``--tree`` without ``--draft static``, ``--lam`` with ``ar``, ...)."""
        unused = sorted(set(given) - self.used_fields() - {"method"} - ({"rows"} if self.family.takes_rows else set()))
        if unused:
            users = [d for d, fields in STRUCTURE_FIELDS.items() if unused[0] in fields and d in self.family.drafts]
            hint = f" (it belongs to --draft {' / '.join(users)})" if users and len(self.family.drafts) > 1 else ""
            if unused[0] == "row_lead" and self.family.takes_rows and self.rows < 2:
                hint = " without --rows: it sets rows in parallel (add --rows R, R >= 2)"
            flag = registry.settings()[unused[0]].cli_flag
            raise RelaxspecError(f"{flag} is not used by {self.family.where(self)}{hint}")

    def plan(self, *, target=None, tokenizer=None, drafter=None, sampling=None, source=None, rule=None):
        """The :class:`~relaxspec.decoding.DecodePlan` these settings decode with on ``target``
        (:meth:`Method.plan`; what :func:`relaxspec.decoding.decode` asks for)."""
        return self.family.plan(self, BuildContext(target=target, tokenizer=tokenizer, drafter=drafter,
                                                   sampling=sampling), source, rule)

    def schedule(self, model):
        """How these settings' steps cover the image on ``model`` (:meth:`Method.schedule`)."""
        return self.family.schedule(self, model)

    @property
    def needs_drafter(self) -> bool:
        return self.family.needs_drafter(self)

    def to_dict(self) -> dict:
        """The settings this method reads (:meth:`used_fields`), and only those: what stats.json
        and bench records say was used."""
        used = self.used_fields()
        return {"method": self.method, **{name: value for name, value in self._values.items() if name in used}}

    def describe(self) -> str:
        """One line: the method and every setting it reads, e.g. ``lantern draft=static
        tree=emoji-lantern (a chain of 6) ...``; a named or file tree says its shape."""
        fields = self.to_dict()
        words = [self.method]
        for key, value in fields.items():
            if key == "method":
                continue
            word = f"{key}={value}"
            if key == "tree" and fields.get("draft") == "static" or key == "draft" and str(value).endswith(".json"):
                word += f" ({tree_shape(str(value))})"
            words.append(word)
        return " ".join(words)


def _restored(method: str, values: dict, notes: tuple, given: frozenset) -> MethodOptions:
    """A :class:`MethodOptions` from what :meth:`MethodOptions.__reduce__` kept (no check: these
    settings were checked when they were made)."""
    options = MethodOptions.__new__(MethodOptions)
    options._hold(registry.methods()[method], values, notes, given)
    return options


def tree_shape(name: str) -> str:
    """A static tree's shape in words (``a chain of 6``, ``25 nodes, depth 5``), or ``?`` when
    it cannot be read."""
    try:
        spec = load_tree(name)
    except RelaxspecError:
        return "?"
    drafts = spec.num_nodes - 1
    return f"a chain of {drafts}" if spec.depth == drafts else f"{drafts} nodes, depth {spec.depth}"
