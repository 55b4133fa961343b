"""The settings a tuning run tries: each method's knobs over the trees built for this machine.

Trees come from the probe (per-(depth, rank) acceptance, measured per rule with a wide or a deep
tree) and the cost curve (target and drafter forwards timed here): for each acceptance rule the
tree that commits the most tokens per second, the best chain and its neighbours, and a wider tree
in case the cost model is off. The knob grids are the ranges the papers and our benchmarks found useful (delta / k / lam
for LANTERN and LANTERN++, cool_delta for COOL-SD, group_p_gap and window for GSD, windows for the
Jacobi methods, dynamic-tree sizes for EAGLE-2, and under a quality budget the row lead of ZipAR and
PJD, whose rows in parallel no TV record certifies); ``compile`` is tried on the finalists only,
because compiling costs a fixed price per setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relaxspec import methods
from relaxspec.bench.config import MethodSpec, format_value
from relaxspec.drafting.trees import TreeSpec, best_tree_for_cost, expected_accept_length
from relaxspec.methods.rows import ALL_ROWS
from relaxspec.drafting.trees import build_tree

#: The acceptance rules the probe measures: exact; LANTERN at a middle relaxation, whose trees serve
#: the milder relaxed settings (``delta`` up to 0.3, LANTERN++, COOL-SD); and LANTERN at the grid's
#: strongest, whose trees serve ``delta`` 0.5 and 0.7. A tree is only as deep as the rates measured
#: for it, and a strong relaxation accepts nearly every level (LANTERN at ``delta`` 0.5 on the
#: embedded model: MAL 6.8 on a chain of ten), so trees built from a mild probe would stop it short.
PROBE_RULES = {"exact": {"method": "sd"}, "relaxed": {"method": "lantern", "delta": 0.2, "k": 64},
               "strong": {"method": "lantern", "delta": 0.5, "k": 64}}
#: The tree each rule is measured with: exact acceptance decays within a few levels, so its probe
#: is wide; relaxed acceptance goes deep, so theirs are deep (every level up to 10 tested whenever
#: the rank-0 spine reaches it).
PROBE_TREES = {"exact": "probe6x6", "relaxed": "probe10x4", "strong": "probe10x4"}
#: The tree of a ``probe.json`` entry that names none: every rule's before the trees were per rule.
LEGACY_PROBE_TREE = "probe6x6"


@dataclass
class Candidate:
    """One setting: a registry method name and the fields over its preset; ``tree``: the tree
    name it drafts with (``None`` when it has none)."""

    label: str
    method: str
    fields: dict = field(default_factory=dict)
    tree: str | None = None

    def options(self):
        return methods.resolve(self.method, self.fields)

    @property
    def relaxed(self) -> bool:
        """Whether its law may differ from the model's: a relaxed rule, or rows in parallel."""
        options = self.options()
        return bool(options.family.relaxed) or options.rows > 1

    @property
    def certified(self) -> bool:
        """Whether its TV record bounds its law's deviation: not for rows in parallel, whose record
        covers the acceptance only."""
        return self.options().rows <= 1

    def spec(self) -> MethodSpec:
        return MethodSpec(label=self.label, options={"method": self.method, **self.fields}, family=self.method)

    def compiled(self) -> "Candidate":
        return Candidate(f"{self.label}+compile", self.method, {**self.fields, "compile": True}, self.tree)

    def to_dict(self) -> dict:
        return {"label": self.label, "method": self.method, "fields": dict(self.fields), "tree": self.tree}

    @classmethod
    def from_dict(cls, data: dict) -> "Candidate":
        return cls(data["label"], data["method"], dict(data["fields"]), data.get("tree"))


def label_of(method: str, fields: dict, tree: str | None = None) -> str:
    hidden = {"draft", "tree"} | ({"dynamic_top_k", "depth", "total_tokens"} if str(tree).startswith("dynamic") else set())
    shown = {k: v for k, v in fields.items() if k not in hidden}
    parts = ([f"tree={tree}"] if tree else []) + [f"{k}={format_value(v)}" for k, v in shown.items()]
    return f"{method}[{','.join(parts)}]" if parts else method


def candidate_trees(rates, step_seconds, ar_seconds: float, max_nodes: int = 48) -> list[tuple[str, TreeSpec, dict]]:
    """``(name, tree, facts)`` for one rule's rates: the tree with the most expected tokens per
    second, the best chain and the chains one shorter and longer, and the best tree of about
    twice the winner's size (facts: nodes, depth, expected MAL, estimated speed-up over AR from
    the forwards alone; ``ar_seconds``: one AR step, a target forward over one token)."""
    best, curve = best_tree_for_cost(rates, step_seconds, max_nodes)
    ar_rate = 1.0 / ar_seconds
    chosen: dict[tuple, tuple[str, TreeSpec]] = {}
    if best is not None:
        is_chain = best.paths == TreeSpec.chain(best.depth).paths
        chosen[best.paths] = (f"chain{best.depth}" if is_chain else f"best{len(best.paths)}", best)

    def chain_rate(depth: int) -> float:
        spec = TreeSpec.chain(depth)
        return (1.0 + expected_accept_length(spec, rates)) / step_seconds(spec)

    depth_cap = max(1, int(rates.shape[0]))  # as deep as the probe measured
    top = max(range(1, depth_cap + 1), key=chain_rate)
    for depth in (top, top - 1, top + 1):
        if 1 <= depth <= depth_cap:
            spec = TreeSpec.chain(depth)
            chosen.setdefault(spec.paths, (f"chain{depth}", spec))
    if best is not None and curve:
        wide = [row for row in curve if row["nodes"] >= 2 * len(best.paths)]
        if wide:
            row = max(wide, key=lambda r: r["tokens_per_second"])

            spec = build_tree(rates, row["nodes"])
            chosen.setdefault(spec.paths, (f"wide{row['nodes']}", spec))
    trees = []
    for name, spec in chosen.values():
        mal = 1.0 + expected_accept_length(spec, rates)
        rate = mal / step_seconds(spec)
        trees.append((name, spec, {"nodes": len(spec.paths), "depth": spec.depth, "expected_mal": mal,
                                   "estimated_speedup": rate / ar_rate if ar_rate else None}))
    trees.sort(key=lambda item: -(item[2]["estimated_speedup"] or 0))
    return trees


def build_candidates(budget, trees: dict[str, list[dict]], has_drafter: bool) -> list[Candidate]:
    """Every setting a run with ``budget`` tries. ``trees[rule]``: ``{"name", "path"}`` per tree,
    best first (``rule``: ``exact`` / ``relaxed``)."""
    found: list[Candidate] = []

    def add(method: str, fields: dict, tree: str | None = None) -> None:
        label = label_of(method, fields, tree)
        if all(c.label != label for c in found):
            found.append(Candidate(label, method, fields, tree))

    if has_drafter:
        for tree in trees.get("exact", []):
            add("sd", {"draft": tree["path"]}, tree["name"])
        for top_k, depth, total in ((10, 5, 59), (4, 4, 16)):
            add("sd", {"draft": "dynamic", "dynamic_top_k": top_k, "depth": depth, "total_tokens": total},
                f"dynamic{total}")
    for window in (8, 16):
        add("sjd", {"window": window})
    add("scd", {"window": 16})
    add("sjd-pac", {})  # the paper's: 63 drafts a forward, cut to the image
    add("sjd-pac", {"window": 31})
    if not budget.relaxed_allowed:
        return found
    relaxed = trees.get("relaxed", [])
    strong = trees.get("strong") or relaxed
    if has_drafter:
        for tree in relaxed:
            for delta in (0.1, 0.2, 0.3):
                add("lantern", {"draft": tree["path"], "k": 64, "delta": delta}, tree["name"])
        for tree in strong:
            for delta in (0.5, 0.7):
                add("lantern", {"draft": tree["path"], "k": 64, "delta": delta}, tree["name"])
        for tree in relaxed[:1]:
            for k in (16, 256):
                add("lantern", {"draft": tree["path"], "k": k, "delta": 0.3}, tree["name"])
        for tree in relaxed[:2]:
            for lam in (2.0, 5.0, 10.0):
                add("lantern", {"draft": tree["path"], "lam": lam}, tree["name"])
            for cool_delta in (1.1, 2.0, 4.0, 8.0):
                add("cool", {"draft": tree["path"], "cool_delta": cool_delta}, tree["name"])
    for window in (8, 16):
        for gap in (0.15, 0.3):
            add("gsd", {"window": window, "group_p_gap": gap})
    if budget.kind == "quality":  # rows in parallel have no TV certificate: only quality can admit them
        for lead in (1, 2, 3):
            add("zipar", {"row_lead": lead})
        for window in (2, 4):
            add("pjd", {"window": window, "row_lead": 2})
        if has_drafter:  # LANTERN's best tree for every open row (every row the lead lets open)
            for tree in relaxed[:1]:
                for lead in (2, 3):
                    add("lantern", {"draft": tree["path"], "k": 64, "delta": 0.3, "rows": ALL_ROWS, "row_lead": lead},
                        tree["name"])
    return found


__all__ = ["Candidate", "LEGACY_PROBE_TREE", "PROBE_RULES", "PROBE_TREES", "build_candidates", "candidate_trees",
           "label_of"]
