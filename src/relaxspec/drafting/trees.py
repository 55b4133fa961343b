"""Static draft trees: shapes given as rank paths, shipped defaults, and the shape optimiser.

A tree is a list of paths of child ranks (REFERENCE §1.3): ``[0]`` is the root's first child,
``[0, 1]`` that child's second child, and so on. At run time the children of a node are its
drafter's top-r tokens (deterministic siblings) or r tokens drawn from its ``q`` without
replacement (sampled siblings), in rank order.

``build_tree`` chooses the shape that maximises the expected accepted length for a node budget
from measured per-depth, per-rank acceptance rates (the Sequoia / Medusa argument: with
position-wise rates, adding the node of largest marginal value is optimal because a node's value
never exceeds its parent's).
"""

from __future__ import annotations

import heapq
import re
import json
from dataclasses import dataclass
from functools import cached_property
from importlib import resources
from pathlib import Path

import torch

from relaxspec.errors import RelaxspecError

#: The most nodes (drafts) one step may verify: the papers' trees have 25-60, a GPU verifies a
#: few hundred at the cost of one; past this the step's tables grow by the square of the count
#: for nothing (``--depth 100000`` asked for tens of GB).
MAX_TREE_NODES = 1024


def check_tree_size(drafts: int, what: str) -> None:
    """Refuse, with one line, a draft structure of more than :data:`MAX_TREE_NODES` drafts."""
    if drafts > MAX_TREE_NODES:
        raise RelaxspecError(f"{what} drafts {drafts:,} tokens per step; a step verifies at most {MAX_TREE_NODES}")


@dataclass(frozen=True)
class TreeSpec:
    """A static tree. ``paths`` excludes the root; nodes are numbered root = 0, then the paths
    sorted by (depth, path), so parents precede children and siblings appear in rank order."""

    paths: tuple[tuple[int, ...], ...]

    @classmethod
    def from_paths(cls, paths) -> "TreeSpec":
        if hasattr(paths, "__len__"):
            check_tree_size(len(paths), "the tree")
        try:
            clean = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        except (TypeError, ValueError):
            raise RelaxspecError("a tree must be a list of paths of integer ranks, e.g. [[0], [1], [0, 0]]") from None
        if not clean:
            raise RelaxspecError("a tree needs at least one node")
        check_tree_size(len(clean), "the tree")
        present = set(clean)
        for path in clean:
            if not path or min(path) < 0:
                raise RelaxspecError(f"tree path {list(path)} must be non-empty with ranks >= 0")
            if len(path) > 1 and path[:-1] not in present:
                raise RelaxspecError(f"tree path {list(path)} has no parent {list(path[:-1])} in the tree")
            if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in present:
                raise RelaxspecError(f"tree path {list(path)}: rank {path[-1]} needs rank {path[-1] - 1} beside it")
        return cls(tuple(clean))

    @classmethod
    def chain(cls, length: int) -> "TreeSpec":
        if length < 1:
            raise RelaxspecError(f"a chain needs length >= 1, got {length}")
        check_tree_size(length, f"a chain of {length:,}")
        return cls.from_paths([[0] * d for d in range(1, length + 1)])

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @cached_property
    def _index(self) -> dict[tuple[int, ...], int]:
        return {(): 0, **{p: i + 1 for i, p in enumerate(self.paths)}}

    @cached_property
    def parents(self) -> torch.Tensor:
        """``[T]`` parent node of each node (-1 for the root)."""
        return torch.tensor([-1] + [self._index[p[:-1]] for p in self.paths])

    @cached_property
    def depths(self) -> torch.Tensor:
        return torch.tensor([0] + [len(p) for p in self.paths])

    @cached_property
    def ranks(self) -> torch.Tensor:
        return torch.tensor([0] + [p[-1] for p in self.paths])

    @cached_property
    def num_children(self) -> torch.Tensor:
        counts = torch.zeros(self.num_nodes, dtype=torch.long)
        for p in self.paths:
            counts[self._index[p[:-1]]] += 1
        return counts

    def level(self, d: int) -> torch.Tensor:
        """Node indices at depth ``d``."""
        return torch.nonzero(self.depths == d).flatten()

    def level_sizes(self) -> list[int]:
        return [int((self.depths == d).sum()) for d in range(1, self.depth + 1)]

    def to_json(self) -> str:
        return json.dumps([list(p) for p in self.paths])


#: EAGLE-1's default tree (25 nodes, 4/8/8/3/2 per level).
EAGLE25 = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
           [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
           [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]


def probe_tree(depth: int, ranks: int) -> TreeSpec:
    """A tree for *measuring* rates: a rank-0 spine of ``depth`` levels with ``ranks`` siblings
    at every level, so each (depth, rank) is tested whenever the spine reaches it."""
    if depth < 1 or ranks < 1:
        raise RelaxspecError("a probe tree needs depth >= 1 and ranks >= 1")
    check_tree_size(depth * ranks, f"probe{depth}x{ranks}")
    return TreeSpec.from_paths([[0] * d + [r] for d in range(depth) for r in range(ranks)])


def shipped_trees() -> dict[str, list[str]]:
    return {"eagle25": "EAGLE-1 default, 25 nodes", "chainN": "a chain of N drafts",
            "probeDxR": "measuring tree: D levels x R siblings", **{
        f.name[: -len(".json")]: "shipped" for f in resources.files("relaxspec").joinpath("trees").iterdir()
        if f.name.endswith(".json")
    }}


def load_tree(name_or_path: str) -> TreeSpec:
    """A shipped tree by name ("eagle25", "naive_extend_57", ...), ``chainN``, or a JSON file of paths."""
    if name_or_path == "eagle25":
        return TreeSpec.from_paths(EAGLE25)
    if name_or_path.startswith("chain") and name_or_path[5:].isdigit():
        return TreeSpec.chain(int(name_or_path[5:]))
    probe = re.fullmatch(r"probe(\d+)x(\d+)", name_or_path)
    if probe:
        return probe_tree(int(probe.group(1)), int(probe.group(2)))
    shipped = resources.files("relaxspec").joinpath("trees", f"{name_or_path}.json")
    path = Path(name_or_path)
    if shipped.is_file():
        text = shipped.read_text()
    elif path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise RelaxspecError(f"{path}: cannot read ({err.strerror})") from None
        except UnicodeDecodeError:
            raise RelaxspecError(f"{path}: not JSON (not UTF-8 text)") from None
    else:
        raise RelaxspecError(f"unknown tree {name_or_path!r}: not a shipped tree ({', '.join(shipped_trees())}), chainN, or a file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise RelaxspecError(f"{name_or_path}: not JSON ({err})") from None
    except RecursionError:
        raise RelaxspecError(f"{name_or_path}: not a tree (nested too deeply)") from None
    if isinstance(data, dict):
        data = data.get("paths")
    if not isinstance(data, list):
        raise RelaxspecError(f"{name_or_path}: expected a JSON list of rank paths (or {{\"paths\": [...]}})")
    return TreeSpec.from_paths(data)


def expected_accept_length(spec: TreeSpec, rates: torch.Tensor) -> float:
    """Expected drafted tokens accepted per step under position-wise rates ``rates [depth, rank]``
    (probability that the rank-r sibling at depth d is accepted given its elder siblings were
    rejected and its parent accepted). Add 1 for the bonus token to get MAL."""
    value = {(): 1.0}
    total = 0.0
    for path in spec.paths:
        d, r = len(path) - 1, path[-1]
        rate = lambda j: float(rates[min(d, rates.shape[0] - 1), j]) if j < rates.shape[1] else 0.0  # noqa: E731
        reach = value[path[:-1]]
        for j in range(r):
            reach *= 1.0 - rate(j)
        value[path] = reach * rate(r)
        total += value[path]
    return total


def build_tree(rates, budget: int, max_depth: int | None = None, max_children: int | None = None) -> TreeSpec:
    """The static tree of ``budget`` drafted nodes with the largest expected accepted length.

    ``rates [depth, rank]``: measured conditional acceptance rates (see
    :func:`expected_accept_length`). Greedy by marginal value, which is optimal here because
    every node's value is at most its parent's and at most its elder sibling's when rates do
    not increase with rank; we sort each depth's rates downwards to make that hold.
    """
    rates = torch.as_tensor(rates, dtype=torch.float64)
    if rates.dim() != 2 or rates.numel() == 0:
        raise RelaxspecError("acceptance rates must be a [depth, rank] table")
    if not ((rates >= 0) & (rates <= 1)).all():
        raise RelaxspecError("acceptance rates must lie in [0, 1]")
    if budget < 1:
        raise RelaxspecError(f"node budget must be >= 1, got {budget}")
    rates = rates.sort(dim=1, descending=True).values
    depth_cap = max_depth or rates.shape[0]
    child_cap = min(max_children or rates.shape[1], rates.shape[1])

    def value_of(parent_value: float, d: int, r: int) -> float:
        reach = parent_value
        for j in range(r):
            reach *= 1.0 - float(rates[d, j])
        return reach * float(rates[d, r])

    chosen: list[tuple[int, ...]] = []
    values = {(): 1.0}
    heap = [(-value_of(1.0, 0, 0), (0,))]
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        values[path] = -neg
        d, r = len(path) - 1, path[-1]
        if r + 1 < child_cap:  # the next sibling
            heapq.heappush(heap, (-value_of(values[path[:-1]], d, r + 1), path[:-1] + (r + 1,)))
        if len(path) < depth_cap:  # the first child
            heapq.heappush(heap, (-value_of(-neg, min(d + 1, rates.shape[0] - 1), 0), path + (0,)))
    return TreeSpec.from_paths(chosen)


def best_tree_for_cost(rates, step_seconds, max_budget: int = 64, max_depth: int | None = None,
                       max_children: int | None = None) -> tuple[TreeSpec, list[dict]]:
    """The tree that commits the most tokens per *second*, not per forward.

    For every budget ``n = 1 .. max_budget`` the best ``n``-node tree (:func:`build_tree`) has an
    expected MAL (bonus included) and a step cost ``step_seconds(spec)`` (e.g.
    :meth:`relaxspec.bench.cost.ForwardCosts.step_seconds`); the winner maximises MAL / cost.
    Returns it and one row per budget: ``nodes, depth, expected_mal, step_seconds,
    tokens_per_second``."""
    if max_budget < 1:
        raise RelaxspecError(f"max budget must be >= 1, got {max_budget}")
    rows, best, best_rate = [], None, -1.0
    ranked = torch.as_tensor(rates, dtype=torch.float64).sort(dim=1, descending=True).values  # as build_tree sees them
    for budget in range(1, max_budget + 1):
        spec = build_tree(rates, budget, max_depth, max_children)
        if len(spec.paths) < budget:  # the rates allow no larger tree
            break
        mal = 1.0 + expected_accept_length(spec, ranked)
        seconds = float(step_seconds(spec))
        if seconds <= 0:
            raise RelaxspecError("step_seconds must be positive")
        rate = mal / seconds
        rows.append({"nodes": budget, "depth": spec.depth, "expected_mal": mal, "step_seconds": seconds,
                     "tokens_per_second": rate})
        if rate > best_rate:
            best, best_rate = spec, rate
    return best, rows
