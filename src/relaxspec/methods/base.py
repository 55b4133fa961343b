"""What a decoding method is to the rest of relaxspec: a :class:`Method` with typed
:class:`Setting` s (which are also its command-line flags), the draft structures it accepts, how
it builds its ``(draft source, acceptance rule)`` pair, and its named :class:`Preset` s.

One file per method family (``methods/ar.py``, ``exact.py``, ``lantern.py``, ...) declares its
methods; ``methods/registry.py`` lists the files. ``generate``, ``bench``, the Python API and a
model's shipped presets all read that one registry, so a method name means one thing everywhere.

The draft structures are shared by every method that drafts:

* ``chain`` (``depth`` drafts), ``static`` (a shipped ``tree`` or a JSON tree file given as the
  draft itself; ``siblings`` sampled or top-k) and ``dynamic`` (EAGLE-2: ``dynamic_top_k``,
  ``depth``, ``total_tokens``) draft with the EAGLE drafter;
* ``jacobi`` is the drafter-free window of ``window`` future tokens (SJD, arXiv 2410.01699).
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from functools import cached_property
from typing import Any, ClassVar

from relaxspec.acceptance import ExactRule
from relaxspec.decoding import AR, DecodePlan, Raster, Schedule
from relaxspec.drafting.dynamic_tree import DynamicTree
from relaxspec.drafting.eagle_source import EagleSource
from relaxspec.drafting.jacobi import JacobiSource
from relaxspec.drafting.static_tree import StaticTree
from relaxspec.drafting.trees import TreeSpec, load_tree
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_finite
from relaxspec.methods.grid import grid_side, row_plan

#: Draft structures that use the EAGLE drafter, and the drafter-free one.
EAGLE_DRAFTS = ("chain", "static", "dynamic")
JACOBI = "jacobi"
#: The settings each draft structure reads; a JSON tree file given as ``draft`` reads ``siblings``.
STRUCTURE_FIELDS = {"chain": ("depth", "siblings"), "static": ("tree", "siblings"),
                    "dynamic": ("depth", "dynamic_top_k", "total_tokens"), JACOBI: ("window",)}


@dataclass(frozen=True)
class Setting:
    """One typed setting of a method, and its command-line flag.

    ``kind``: int, float, str or bool; ``default``: its value when neither a preset nor the user
    sets it (``None``: the method chooses in :meth:`Method.resolve`); ``choices``: the values a
    string may take; ``flag``: the command-line spelling (default ``--name-with-dashes``); a
    bool setting is a switch that turns on (``--anneal``) or, with ``off_switch``, off
    (``--no-tv-record`` sets ``record_tv`` to False).
    """

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple | None = None
    flag: str | None = None
    off_switch: bool = False
    minimum: float | None = None  # ints and floats: the smallest valid value

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def check(self, value) -> None:
        """Raise a one-line :class:`RelaxspecError` if ``value`` is not valid for this setting
        (its type: an int is a valid float, a bool is not a number)."""
        if value is None:
            return
        kinds = {float: (int, float), int: (int,), bool: (bool,), str: (str,)}.get(self.kind, (self.kind,))
        if not isinstance(value, kinds) or (self.kind is not bool and isinstance(value, bool)):
            raise RelaxspecError(f"{self.name} must be {'a' if self.kind is not int else 'an'} {self.kind.__name__}, "
                                 f"got {value!r}")
        if self.kind is float:
            check_finite(self.name, value)
        if self.choices is not None and value not in self.choices:
            raise RelaxspecError(f"{self.name} must be one of {', '.join(map(repr, self.choices))}, got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise RelaxspecError(f"{self.name} must be >= {self.minimum:g}, got {value}")


# The settings every method shares (draft structures, compilation, the TV record).
DRAFT = Setting("draft", str, None, f"{' | '.join(EAGLE_DRAFTS)} | {JACOBI} | a JSON static tree file "
                                     "(default: the method's own)")
DEPTH = Setting("depth", int, None, "chain length / dynamic-tree depth (default 4 for a chain, 5 for EAGLE-2's tree)",
                minimum=1)
TREE = Setting("tree", str, "naive_extend_57", "name of a shipped static tree (default naive_extend_57, official LANTERN++'s)")
SIBLINGS = Setting("siblings", str, "sampled", "static trees: sibling drafts sampled from q without replacement, "
                                               "or the top-k", choices=("sampled", "topk"))
DYNAMIC_TOP_K = Setting("dynamic_top_k", int, 10, "EAGLE-2 dynamic tree: children per beam (default 10)", minimum=1)
TOTAL_TOKENS = Setting("total_tokens", int, 59, "EAGLE-2 dynamic tree: nodes per step (default 59)", minimum=1)
WINDOW = Setting("window", int, 16, "Jacobi window: future tokens drafted per step (default 16)", minimum=1)
COMPILE = Setting("compile", bool, False, "compile every decoding step as one graph (torch.compile; CUDA graphs on a "
                                          "GPU): the first batch pays the compilation, later ones run faster")
PROFILE = Setting("profile", bool, False, "time the target's and the drafter's forwards apart from the engine (each "
                                          "forward its own graph: slower steps; for finding where the time goes)")
RECORD_TV = Setting("record_tv", bool, True, "relaxed methods: skip the per-token TV record (faster; no TV "
                                             "certificate)", flag="--no-tv-record", off_switch=True)
ROWS = Setting("rows", int, 1, "image rows painted at once (2-D decoding, as ZipAR and PJD): 1 = raster order; more "
                               "changes what a token is conditioned on, so no setting above 1 is the model's law",
               minimum=1)
ROW_LEAD = Setting("row_lead", int, None, "with --rows above 1: tokens a row has before the row below opens (default "
                                          "a third of the row, ZipAR's 8 of 24; pjd: a fifth, PJD's 6 of 32)",
                   minimum=1)
SHARED_SETTINGS = (DRAFT, DEPTH, TREE, SIBLINGS, DYNAMIC_TOP_K, TOTAL_TOKENS, WINDOW, COMPILE, PROFILE, RECORD_TV, ROWS,
                   ROW_LEAD)


def settings_dataclass(name: str, settings: tuple[Setting, ...]) -> type:
    """A small dataclass of ``settings`` (each field typed and defaulted as its :class:`Setting`
    says): the record one group of settings is kept in."""
    return make_dataclass(name, [(s.name, s.kind | None, field(default=s.default)) for s in settings])


#: The settings every method shares (draft structures, compilation, the TV record, rows).
SharedSettings = settings_dataclass("SharedSettings", SHARED_SETTINGS)


@dataclass(frozen=True)
class Preset:
    """A named setting of a method: ``fields`` over the method's defaults.

    ``bench``: run by a plain ``relaxspec bench`` on a model without presets of its own.
    ``fixed``: fields the name implies, which the user may not change (``--method eagle2`` is
    the dynamic tree); ``refuse``: field -> why the name cannot take it. ``spellings``: other
    names accepted for it.
    """

    fields: dict
    description: str
    bench: bool = True
    fixed: tuple[str, ...] = ()
    refuse: dict = field(default_factory=dict)
    spellings: tuple[str, ...] = ()


@dataclass
class BuildContext:
    """Everything a method may read to build its parts (:meth:`Method.build`). A rule or source
    that needs a new input adds a field here, not a keyword threaded through every caller.

    ``target``: the :class:`~relaxspec.models.base.TargetModel` (GSD reads its token embeddings);
    ``tokenizer``: its image tokenizer (LANTERN's codebook neighbours); ``drafter``: the EAGLE
    drafter or ``None``; ``sampling``: the :class:`~relaxspec.sampling.SamplingConfig` drafts are
    drawn under."""

    target: object = None
    tokenizer: object = None
    drafter: object = None
    sampling: object = None


class Method:
    """A decoding method: subclass it in a family file and list the file in the registry.

    Class attributes: ``name``; ``summary`` (one line, for help texts); ``settings`` (its own
    settings beyond :data:`SHARED_SETTINGS`); ``drafts`` (the draft structures it accepts, the
    first being its default; ``()`` for plain AR); ``relaxed`` (its output law may differ from
    the model's: it reads ``record_tv``); ``exclusive`` (pairs of settings that are
    alternatives: setting one in a later layer drops the other from earlier ones); ``presets``.
    """

    name: ClassVar[str]
    summary: ClassVar[str]
    settings: ClassVar[tuple[Setting, ...]] = ()
    drafts: ClassVar[tuple[str, ...]] = EAGLE_DRAFTS
    relaxed: ClassVar[bool] = False
    exclusive: ClassVar[dict[str, tuple[str, ...]]] = {}
    presets: ClassVar[dict[str, Preset]] = {}
    rows_only: ClassVar[bool] = False  # drafts nothing, decodes rows in parallel (ZipAR)

    @cached_property
    def settings_type(self) -> type:
        """The dataclass of this method's own settings (``LanternSettings``: ``k``, ``delta``, ...)."""
        return settings_dataclass(f"{type(self).__name__}Settings", self.settings)

    def prefix_below(self, options) -> bool:
        """Whether an open row below the top one commits its accepted drafts only (PJD's code),
        not also a bonus or residual token."""
        return False

    def default_row_lead(self, grid: int) -> int:
        """Tokens a row has before the row below opens, on a grid ``grid`` tokens wide, when
        ``row_lead`` is not given: a third of the row (ZipAR's 8 of 24)."""
        return max(1, -(-grid // 3))

    # ---------------------------------------------------------------- settings
    def resolve(self, options) -> None:
        """Fill the settings left to the method (``None``) and validate; ``options`` is the
        :class:`~relaxspec.methods.options.MethodOptions` being built. Override and call this."""
        if not self.drafts:
            return
        if options.draft is None:
            options.draft = self.drafts[0]
        draft = options.draft
        if draft not in STRUCTURE_FIELDS and not ("static" in self.drafts and str(draft).endswith(".json")):
            raise RelaxspecError(f"--draft {draft!r} is not a draft of --method {self.name}; it drafts with "
                                 f"{' / '.join(self.drafts)}" + (" or a JSON tree file" if "static" in self.drafts
                                                                 else ""))
        if draft in STRUCTURE_FIELDS and draft not in self.drafts:
            raise RelaxspecError(f"--method {self.name} does not draft with --draft {draft}; it drafts with "
                                 f"{' / '.join(self.drafts)}")
        if options.depth is None:
            options.depth = 5 if draft == "dynamic" else 4

    def used(self, options) -> set[str]:
        """The settings this method reads with ``options`` (its own ones; the draft structure's
        and the shared ones are added by :meth:`used_fields`). Override for conditional ones."""
        return {s.name for s in self.settings}

    def used_fields(self, options) -> frozenset[str]:
        used = {"method", "compile"} | self.used(options)
        if options.profile:  # (off is the default every record has always meant: no record says it)
            used.add("profile")
        if self.drafts:
            if len(self.drafts) > 1:
                used.add("draft")
            used |= set(STRUCTURE_FIELDS.get(options.draft, ("siblings",)))
        if self.relaxed:
            used.add("record_tv")
        if self.takes_rows and options.rows > 1:  # (rows 1 is raster order: no record says it)
            used |= {"rows", "row_lead", "record_tv"}
        return frozenset(used)

    @property
    def takes_rows(self) -> bool:
        """Whether ``--rows`` means something to this method (every method that drafts, and ZipAR)."""
        return bool(self.drafts) or self.rows_only

    def where(self, options) -> str:
        """How the user named this method and structure, for messages: ``--method sd --draft chain``."""
        return f"--method {self.name}" + (f" --draft {options.draft}" if len(self.drafts) > 1 else "")

    # ---------------------------------------------------------------- building
    def check_fits(self, options, context: BuildContext) -> None:
        """Refuse, with one line, sizes past what the model can use, before anything is allocated:
        a draft deeper, or a Jacobi window wider, than the image has tokens. (Draft trees are
        bounded on their own: :data:`relaxspec.drafting.trees.MAX_TREE_NODES`.) Override to add a
        method's own bounds, and call this."""
        config = getattr(context.target, "config", None)
        tokens = getattr(config, "block_size", None)
        if options.rows > 1:
            self._check_rows(options, context)
        if tokens is None or not self.drafts:
            return
        size = f"{tokens} token" + ("s" if tokens != 1 else "")
        if options.draft == JACOBI and options.window > tokens:
            raise RelaxspecError(f"--window {options.window:,} is wider than this model's images ({size}): at most "
                                 f"{tokens}")
        if options.draft in ("chain", "dynamic") and options.depth > tokens:
            raise RelaxspecError(f"--depth {options.depth:,} is deeper than this model's images ({size}): at most "
                                 f"{tokens}")
        if options.draft != JACOBI:
            draft_structure(options)  # a tree's own bounds (nothing is allocated)

    def use_effective(self, options, context: BuildContext) -> None:
        """Settings past what the model can use, set to what it uses (:meth:`MethodOptions.use`,
        with a note): more open rows than the grid and the lead can keep open. Override to add a
        method's own, and call this."""
        if options.rows > 1 and context.target is not None:
            plan, grid = row_plan(options, context.target), grid_side(context.target)
            most = min(grid, -(-grid // plan.lead) + 1)  # a row stays the lead behind the row above
            if options.rows > most:
                options.use("rows", most, f"--rows {options.rows:,}: at a lead of {plan.lead} this model's "
                                          f"{grid}-row grid keeps at most {most} rows open; {most} are used")

    def _check_rows(self, options, context: BuildContext) -> None:
        """Rows in parallel: a model with a square grid, a lead within the row, and drafts that every
        row can have (a Jacobi window, any tree of the EAGLE drafter, or none)."""
        if context.target is not None:
            row_plan(options, context.target)

    def needs_drafter(self, options) -> bool:
        return options.draft in EAGLE_DRAFTS or str(options.draft).endswith(".json")

    def schedule(self, options, model) -> Schedule:
        """How this method's steps cover the image on ``model``: plain AR for a method that drafts
        nothing in raster order, rows in parallel with ``rows`` above 1, else raster order."""
        if not self.drafts and not self.rows_only:
            return AR()
        return row_plan(options, model) if options.rows > 1 else Raster()

    def plan(self, options, context: BuildContext, source=None, rule=None) -> DecodePlan:
        """The :class:`~relaxspec.decoding.DecodePlan` of ``options`` on ``context``: the schedule
        and the parts (:meth:`build`; ``source`` / ``rule`` given are used as they are, and when
        both are, sizes were checked where they were built)."""
        schedule = self.schedule(options, context.target)
        flags = dict(compile=options.compile, profile=options.profile)
        if not schedule.drafts:
            return DecodePlan(schedule, label=self.name, **flags)
        if source is None or rule is None:
            self.check_fits(options, context)
        source, rule = self.parts(options, context, source, rule)
        return DecodePlan(schedule, source, rule, record_tv=options.record_tv,
                          label="rows" if options.rows > 1 else self.name, **flags)

    def build(self, options, context: BuildContext):
        """``(draft source, acceptance rule)`` for ``options``, from what ``context`` holds, its
        sizes checked first."""
        self.check_fits(options, context)
        return self.parts(options, context)

    def parts(self, options, context: BuildContext, source=None, rule=None):
        """:meth:`build` without the check (for sizes checked already,
        :meth:`relaxspec.pipelines.ImagePipeline.prepare`): the one place a method's parts are
        built; a ``source`` or ``rule`` given is kept (the rule's horizon is the source's depth)."""
        source = source or self.source(options, context)
        return source, rule or self.rule(options, context, horizon=source.max_depth)

    def source(self, options, context: BuildContext):
        """The draft source (:class:`relaxspec.drafting.base.DraftSource`) ``options`` describe."""
        return draft_source(self, options, context.drafter, context.sampling)

    def rule(self, options, context: BuildContext, horizon: int = 5):
        """The acceptance rule (:class:`relaxspec.acceptance.AcceptanceRule`); ``horizon``: the
        deepest draft the source proposes."""
        return ExactRule()


def draft_source(method: Method, options, drafter, sampling, coupled: bool = False):
    """The shared draft structures: an EAGLE source over a chain / static / dynamic tree, or the
    Jacobi window (``coupled``: SCD's maximally coupled redraws)."""
    if options.draft == JACOBI:
        return JacobiSource(options.window, coupled=coupled)
    if drafter is None:
        raise RelaxspecError(f"method {method.name!r} needs a trained drafter (--drafter-ckpt)")
    return EagleSource(drafter, draft_structure(options), sampling)


def draft_structure(options):
    """The EAGLE draft structure ``options`` describe: EAGLE-2's dynamic tree, or a static tree (a
    chain, a shipped tree or a JSON tree file), each checked against its size bounds."""
    if options.draft == "dynamic":
        return DynamicTree(options.dynamic_top_k, options.depth, options.total_tokens)
    spec = TreeSpec.chain(options.depth) if options.draft == "chain" else load_tree(
        options.tree if options.draft == "static" else options.draft)
    return StaticTree(spec, options.siblings)
