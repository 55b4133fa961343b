"""Static tree shapes: expected accepted length, the budgeted optimiser, and the cost-aware size
choice (``relaxspec build-tree``, including ``--budget auto`` on a real tiny model pair)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from relaxspec.bench.cost import ForwardCosts, measure_forward_costs
from relaxspec.models.weights import save_model
from relaxspec.cli import main
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.drafting.trees import TreeSpec, best_tree_for_cost, build_tree, expected_accept_length
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig

#: conditional acceptance rates [depth, rank], decreasing in rank (as build_tree assumes)
RATES = torch.tensor([[0.6, 0.3, 0.2], [0.5, 0.25, 0.1], [0.45, 0.2, 0.05]], dtype=torch.float64)


def walk_value(spec: TreeSpec, rates: torch.Tensor) -> float:
    """Expected accepted drafts by the tree walk itself: from a node, test children in rank
    order; the first accepted one is walked into (an independent reference implementation)."""
    children: dict[tuple, list[tuple]] = {}
    for path in spec.paths:
        children.setdefault(path[:-1], []).append(path)

    def from_node(node: tuple) -> float:
        value, reach = 0.0, 1.0
        for child in sorted(children.get(node, []), key=lambda p: p[-1]):
            rate = float(rates[len(child) - 1, child[-1]])
            value += reach * rate * (1.0 + from_node(child))
            reach *= 1.0 - rate
        return value

    return from_node(())


def all_trees(max_depth: int, max_rank: int, size: int):
    """Every valid tree of ``size`` nodes inside the (depth, rank) box."""
    candidates = [p for d in range(1, max_depth + 1) for p in itertools.product(range(max_rank), repeat=d)]
    for subset in itertools.combinations(candidates, size):
        try:
            yield TreeSpec.from_paths(subset)
        except RelaxspecError:
            continue


def test_expected_accept_length_is_the_walks_expectation() -> None:
    for paths in ([[0]], [[0], [1], [0, 0]], [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]):
        spec = TreeSpec.from_paths(paths)
        assert expected_accept_length(spec, RATES) == pytest.approx(walk_value(spec, RATES), rel=1e-12)
    chain = TreeSpec.chain(3)
    assert expected_accept_length(chain, RATES) == pytest.approx(0.6 + 0.6 * 0.5 + 0.6 * 0.5 * 0.45)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
def test_build_tree_is_optimal_for_its_budget(budget) -> None:
    best = max(walk_value(spec, RATES) for spec in all_trees(3, 3, budget))
    built = build_tree(RATES, budget)
    assert len(built.paths) == budget
    assert walk_value(built, RATES) == pytest.approx(best, rel=1e-12)


def test_best_tree_for_cost_maximises_tokens_per_second() -> None:
    def linear(per_node: float):
        return lambda spec: 1.0 + per_node * spec.num_nodes

    for per_node, expected_nodes in ((0.0, None), (10.0, 1)):
        spec, curve = best_tree_for_cost(RATES, linear(per_node), max_budget=9)
        assert [row["nodes"] for row in curve] == list(range(1, 10))
        best_row = max(curve, key=lambda row: row["tokens_per_second"])
        assert len(spec.paths) == best_row["nodes"]
        if per_node == 0.0:  # free nodes: the largest tree wins
            assert len(spec.paths) == 9
        else:  # nodes ten times the fixed cost: a single draft
            assert len(spec.paths) == expected_nodes
    # in between, the choice is the brute-force argmax of MAL / cost over budgets
    cost = linear(0.15)
    spec, curve = best_tree_for_cost(RATES, cost, max_budget=9)
    brute = max(range(1, 10), key=lambda n: (1 + walk_value(build_tree(RATES, n), RATES)) / cost(build_tree(RATES, n)))
    assert len(spec.paths) == brute and 1 < brute < 9
    for row in curve:
        tree = build_tree(RATES, row["nodes"])
        assert row["expected_mal"] == pytest.approx(1 + walk_value(tree, RATES))
        assert row["step_seconds"] == pytest.approx(cost(tree))
    with pytest.raises(RelaxspecError, match="max budget"):
        best_tree_for_cost(RATES, cost, max_budget=0)


def test_forward_costs_interpolate_and_price_a_step() -> None:
    costs = ForwardCosts(target={1: 10.0, 5: 14.0, 9: 22.0}, drafter={1: 2.0, 3: 3.0})
    assert costs.target_seconds(1) == 10.0 and costs.target_seconds(3) == 12.0 and costs.target_seconds(7) == 18.0
    assert costs.target_seconds(11) == 26.0  # past the last point: the last segment's slope
    assert costs.drafter_seconds(2) == 2.5 and costs.drafter_seconds(0) == 2.0
    # a chain of 3: target over 4 tokens, catch-up over <= 4 committed pairs, one drafter pass per
    # level with children (levels 1 and 2, one node each)
    assert costs.step_seconds(TreeSpec.chain(3)) == pytest.approx(13.0 + 3.5 + 2 * 2.0)
    # [[0], [1], [0, 0], [0, 1]]: two level-1 nodes, one of them has children
    tree = TreeSpec.from_paths([[0], [1], [0, 0], [0, 1]])
    assert costs.step_seconds(tree) == pytest.approx(costs.target_seconds(5) + costs.drafter_seconds(3) + 2.0)


def test_measure_forward_costs_on_a_tiny_pair(tiny_gpt) -> None:
    drafter = EagleDrafter.for_target(tiny_gpt).eval()
    costs = measure_forward_costs(tiny_gpt, drafter, sampling=SamplingConfig(cfg_scale=2.0),
                                  target_sizes=(1, 4, 8), drafter_sizes=(1, 2), reps=3, warmup=1)
    assert sorted(costs.target) == [1, 4, 8] and sorted(costs.drafter) == [1, 2]
    assert all(v > 0 for v in [*costs.target.values(), *costs.drafter.values()])
    assert tiny_gpt.layers[0].attention.kv_cache is None and drafter.layers[0].attention.kv_cache is None
    with pytest.raises(RelaxspecError, match="reps"):
        measure_forward_costs(tiny_gpt, reps=0)


def test_cli_build_tree_fixed_and_auto(tmp_path, tiny_ckpts, capsys) -> None:
    from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq

    entry = tiny_ckpts["c2i"]
    vq = load_vq(entry["vq"], entry["vq_json"])
    target = load_gpt(entry["gpt"], entry["gpt_json"], image_size=16, downsample=vq.config.downsample_factor)
    drafter_dir = save_model(EagleDrafter.for_target(target), tmp_path / "drafter", kind="drafter")
    run = tmp_path / "run"
    assert main(["generate", *entry["args"], "--drafter-ckpt", str(drafter_dir), "--method", "lantern++",
                 "--draft", "static", "--tree", "probe3x3", "--classes", "0,1,2,3", "--out", str(run),
                 "--no-progress", "--threads", "1"]) == 0
    stats = run / "stats.json"
    assert main(["build-tree", "--stats", str(stats), "--budget", "4", "--out", str(tmp_path / "four.json")]) == 0
    four = json.loads((tmp_path / "four.json").read_text())
    assert len(four["paths"]) == 4 and four["expected_mal"] >= 1.0
    capsys.readouterr()
    assert main(["build-tree", "--stats", str(stats), "--budget", "auto", "--max-budget", "6",
                 "--out", str(tmp_path / "auto.json")]) == 0
    table = capsys.readouterr().out
    assert "tokens/s" in table and "<-" in table
    chosen = json.loads((tmp_path / "auto.json").read_text())
    curve = chosen["curve"]
    assert 1 <= len(curve) <= 6 and chosen["costs"]["target_seconds"]
    best = max(curve, key=lambda row: row["tokens_per_second"])
    assert len(chosen["paths"]) == best["nodes"]
    assert TreeSpec.from_paths(chosen["paths"])  # loadable as --draft FILE
    assert main(["build-tree", "--stats", str(stats), "--budget", "many", "--out", str(tmp_path / "x.json")]) == 2


def test_resumed_generate_keeps_the_finished_batches_acceptance_counts(tmp_path, tiny_ckpts) -> None:
    """The counts build-tree reads cover every batch of a resumed run once: kept batches keep
    theirs, a redone batch replaces its own."""
    from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq

    entry = tiny_ckpts["c2i"]
    vq = load_vq(entry["vq"], entry["vq_json"])
    target = load_gpt(entry["gpt"], entry["gpt_json"], image_size=16, downsample=vq.config.downsample_factor)
    drafter_dir = save_model(EagleDrafter.for_target(target), tmp_path / "drafter", kind="drafter")
    argv = ["generate", *entry["args"], "--drafter-ckpt", str(drafter_dir), "--method", "sd", "--draft", "static",
            "--tree", "probe3x3", "--classes", "0,1,2,3", "--batch-size", "2", "--no-progress", "--threads", "1"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert main([*argv, "--out", str(whole)]) == 0
    assert main([*argv, "--out", str(resumed)]) == 0
    (resumed / "0003.png").unlink()  # batch 1 is redone, batch 0 is kept
    assert main([*argv, "--out", str(resumed)]) == 0
    counts = [json.loads((folder / "stats.json").read_text()) for folder in (whole, resumed)]
    assert counts[0]["acceptance_counts"]["tests"] and sorted(counts[0]["acceptance_counts_by_batch"]) == ["0", "1"]
    assert counts[1]["acceptance_counts"] == counts[0]["acceptance_counts"]
