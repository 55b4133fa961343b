"""Exactness at temperature 0 and at the edges (REFERENCE §4).

Each reproducer of issue 9 is a test here: what a lossless rule returns at temperature 0 must be
the greedy AR token, a relaxed greedy rule must keep LANTERN's definition (boost ``p(x)`` to
``p~(x)``, accept iff it is then the argmax of the *parent's own* ``p``, ties to the lowest id),
no token of zero (relaxed) target probability is ever committed, the annealed LANTERN budget keeps
its mean, and the TV certificate is reported under names that say what it is.
"""

from __future__ import annotations


import pytest
import torch
from helpers.engine import verify_fields

from relaxspec.acceptance import CoolRule, ExactRule, LanternRule, cool_weights


def tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def one_level_tree(target: torch.Tensor, children: list[int], child_targets: torch.Tensor | None = None,
                   proposals: torch.Tensor | None = None) -> dict:
    """Root with ``children`` (drafted tokens) as siblings at depth 1, batch 1, point-mass drafts.
    ``child_targets [C, V]`` are the targets at the children (default: ``target`` again)."""
    vocab, n = target.shape[-1], len(children)
    child_targets = target.expand(n, vocab) if child_targets is None else child_targets
    tokens = torch.tensor([[0] + children])
    if proposals is None:
        proposals = torch.nn.functional.one_hot(tokens, vocab).float()
    return dict(target_probs=torch.cat([target.view(1, 1, vocab), child_targets.view(1, n, vocab)], 1),
                tokens=tokens, parents=torch.tensor([[-1] + [0] * n]), proposals=proposals,
                depth=torch.tensor([[0] + [1] * n]), valid=torch.ones(1, n + 1, dtype=torch.bool))


# --------------------------------------------------------------------------- reproducer 1
def test_cool_weight_below_one_is_greedy_ar():
    """COOL-SD with ``w < 1`` is lossless, so at temperature 0 the argmax draft is accepted and a
    correction is the argmax: ``w p(x)`` must never demote the argmax (it committed the runner-up)."""
    rule = CoolRule(weights=[0.7])
    assert rule.lossless
    p = tensor([[0.5, 0.4, 0.1]])
    assert rule.greedy_accept(p, torch.tensor([0]), 1).item()
    assert not rule.greedy_accept(p, torch.tensor([1]), 1).item()
    assert rule.greedy_correction(p, torch.tensor([1]), 1).item() == 0
    after = tensor([[0.1, 0.2, 0.7]])
    result = verify_fields(rule, **one_level_tree(p, [0], after), greedy=True)
    assert result.committed[0].tolist() == [0, 2]  # the draft, then the bonus argmax of the child
    result = verify_fields(rule, **one_level_tree(p, [1], after), greedy=True)
    assert result.committed[0].tolist() == [0, -1]  # rejected; the correction is p's argmax


# --------------------------------------------------------------------------- reproducer 2
def test_greedy_siblings_are_tested_against_the_parents_own_p():
    """LANTERN's definition: every greedy sibling is compared with the parent's ``p``, not with a
    residual left by earlier rejections (which here merged a different neighbour set)."""
    p = tensor([[0.335, 0.30, 0.285, 0.06, 0.02]])
    nbrs = torch.tensor([[1, 2, 3, 4], [0, 2, 3, 4], [1, 3, 0, 4], [0, 1, 2, 4], [0, 1, 2, 3]])
    rule = LanternRule(nbrs, k=4, delta=0.1)
    child = tensor([[0.0, 0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    result = verify_fields(rule, **one_level_tree(p, [1, 2], child), greedy=True)
    assert result.committed[0].tolist() == [0, -1]
    assert result.num_accepted.item() == 0 and result.tests.item() == 2


# --------------------------------------------------------------------------- reproducer 3
def test_greedy_ties_go_to_the_lowest_index():
    """``p = [.5, .25, .125, .125]``, draft 3 merges neighbours 1 and 2: ``p~(3) = .5`` ties with
    ``p(0)``, and the tie goes to the lower id, as ``argmax`` (and plain greedy decoding) decides
    it. The merged neighbours keep their own ``p`` in the comparison (they are not zeroed)."""
    p = tensor([[0.5, 0.25, 0.125, 0.125]])
    nbrs = torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [1, 2, 0]])
    rule = LanternRule(nbrs, k=3, delta=0.375)
    assert rule.relaxed_prob(p, torch.tensor([3]), 1).item() == 0.5
    assert not rule.greedy_accept(p, torch.tensor([3]), 1).item()
    # ... while a strictly larger relaxed probability wins, and a tie with a *higher* id too
    assert LanternRule(nbrs, k=3, delta=0.9).greedy_accept(p, torch.tensor([3]), 1).item()  # .125 + .875
    # p~(1) = .3 + .2 (neighbours 0 and the empty 2) = .5 ties p(3): the lower id, 1, wins
    p2 = tensor([[0.2, 0.3, 0.0, 0.5]])
    assert LanternRule(nbrs, k=3, delta=0.2).greedy_accept(p2, torch.tensor([1]), 1).item()
    assert not LanternRule(nbrs, k=3, delta=0.19).greedy_accept(p2, torch.tensor([1]), 1).item()


# --------------------------------------------------------------------------- reproducer 4
@pytest.mark.parametrize("rule", [ExactRule(), CoolRule(weights=[3.0]),
                                  LanternRule(torch.tensor([[1, 2], [0, 2], [0, 1]]), k=2, delta=0.0)],
                         ids=["exact", "cool", "lantern-delta0"])
def test_a_draft_of_zero_relaxed_probability_is_never_accepted(rule):
    """``q(x) = 0`` and ``p(x) = 0`` (only a user-written source can draft it): never accepted."""
    p = q = tensor([[0.0, 0.5, 0.5]])
    x = torch.tensor([0])
    assert rule.relaxed_prob(p, x, 1).item() == 0.0
    assert rule.accept_prob(p, q, x, 1).item() == 0.0
    assert not rule.greedy_accept(p, x, 1).item()
    gen = torch.Generator().manual_seed(0)
    tree = one_level_tree(p, [0], proposals=q.view(1, 1, 3).expand(1, 2, 3).clone())
    batched = {key: value.expand(200, *value.shape[1:]).contiguous() for key, value in tree.items()}
    result = verify_fields(rule, **batched, generator=gen)
    assert result.num_accepted.sum().item() == 0
    assert bool((result.committed[:, 0] != 0).all())  # the residual never holds token 0 either
    # a draft the proposal gave no mass but the target does is still accepted (enumerating
    # callers weight it by q(x) = 0; the ratio would be infinite)
    assert rule.accept_prob(p, tensor([[1.0, 0.0, 0.0]]), torch.tensor([1]), 1).item() == 1.0


# --------------------------------------------------------------------------- reproducer 5
@pytest.mark.parametrize("delta", [0.0, 0.1, 0.3, 0.385, 0.4, 0.5, 0.7, 0.9, 1.0])
@pytest.mark.parametrize("horizon", [1, 3, 5])
def test_capped_schedule_keeps_its_mean(delta, horizon):
    """``cool_weights(delta, cap=1)``: every weight <= 1, still annealed (non-increasing), mean
    exactly ``delta`` (a plain ``min(1, w)`` fell to a mean of 0.44 at delta 0.5)."""
    weights = cool_weights(delta, horizon=horizon, cap=1.0)
    assert len(weights) == horizon
    assert sum(weights) / horizon == pytest.approx(delta, abs=1e-12)
    assert all(0.0 <= w <= 1.0 for w in weights)
    assert all(a >= b - 1e-15 for a, b in zip(weights, weights[1:]))
    plain = cool_weights(delta, horizon=horizon)
    if max(plain) <= 1.0:  # nothing to clip: the schedule is the uncapped one
        assert weights == pytest.approx(plain, abs=1e-15)
    else:
        assert weights[0] == 1.0
    # the docs/API.md use: an annealed LANTERN budget for delta above 0.385
    LanternRule(torch.tensor([[1], [0]]), k=1, delta_schedule=weights)


def test_capped_schedule_rejects_a_mean_above_the_cap():
    from relaxspec.errors import RelaxspecError

    with pytest.raises(RelaxspecError, match="cap"):
        cool_weights(1.5, cap=1.0)
    # without normalisation the weights are only clipped (no mean is promised)
    assert cool_weights(3.0, normalisation="none", horizon=2, cap=1.0) == pytest.approx((1.0, 3.0 * 2.718281828459045 ** -1.4))


def test_anneal_option_builds_the_capped_schedule(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from relaxspec.methods import MethodOptions
    from relaxspec.methods import build_rule

    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    codebook = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    vq = SimpleNamespace(raw_codebook=codebook, codebook=codebook)
    rule = build_rule(MethodOptions("lantern", delta=0.5, anneal=True, k=8), vq, horizon=4)
    assert sum(rule.delta_schedule) / 4 == pytest.approx(0.5)
    assert max(rule.delta_schedule) <= 1.0


# --------------------------------------------------------------------------- reproducer 6
def test_certificate_names_say_what_they_are():
    """Per image ``tv_sum`` is the hybrid-argument sum (may exceed 1) and ``tv_per_token`` its
    mean per token; no capped per-image figure is reported (issue 20); the run's certificate caps
    the *mean* sum. Old records (a ``tv_bound`` alone, or next to ``tv_sum``) still read."""
    from relaxspec.decoding.result import DecodeResult, certified_tv, record_tv_sum

    step_tv = torch.tensor([[0.0, 0.5, 0.75, 0.25], [0.0, 0.1, 0.0, 0.1]])
    result = DecodeResult(tokens=torch.zeros(2, 4, dtype=torch.long), target_forwards=torch.tensor([3, 3]),
                          drafter_forwards=torch.zeros(2), step_tv=step_tv)
    assert result.tv_sum.tolist() == pytest.approx([1.5, 0.2])
    assert not hasattr(result, "tv_bound")
    assert result.tv_per_token.tolist() == pytest.approx([0.375, 0.05])
    assert result.tv_record(0) == pytest.approx({"tv_sum": 1.5, "tv_per_token": 0.375})
    assert certified_tv(result.tv_sum) == pytest.approx(0.85)  # min(1, mean sum), not mean min(1, sum) = 0.6
    assert certified_tv([3.0, 0.0]) == 1.0 and certified_tv([]) == 0.0
    assert record_tv_sum({"tv_sum": 2.0, "tv_bound": 1.0}) == 2.0
    assert record_tv_sum({"tv_bound": 2.0}) == 2.0  # records written before the rename


def test_greedy_tv_record_counts_departures_from_greedy_ar():
    """At temperature 0 the record is exact: 1 for a committed draft that is not its node's
    argmax, 0 otherwise (the bonus / correction is the argmax), so ``min(1, tv_sum)`` is the TV
    distance (0 or 1) between the image and the greedy AR image."""
    p = tensor([[0.40, 0.35, 0.25]])
    nbrs = torch.tensor([[1, 2], [2, 0], [1, 0]])
    rule = LanternRule(nbrs, k=2, delta=0.3)  # p~(1) = .35 + .25 beats .40: a departure
    child = tensor([[0.2, 0.3, 0.5], [0.2, 0.3, 0.5]])
    result = verify_fields(rule, **one_level_tree(p, [1], child[:1]), greedy=True)
    assert result.committed[0].tolist() == [1, 2] and result.step_tv[0].tolist() == [1.0, 0.0]
    result = verify_fields(rule, **one_level_tree(p, [0], child[:1]), greedy=True)  # the argmax itself
    assert result.committed[0].tolist() == [0, 2] and result.step_tv[0].tolist() == [0.0, 0.0]
    result = verify_fields(rule, **one_level_tree(p, [1], child[:1]), greedy=True, record_tv=False)
    assert result.step_tv.abs().sum() == 0


# --------------------------------------------------------------------------- greedy by definition
def reference_relaxed_prob(spec: tuple, p: list[float], x: int, depth: int, nbrs: list[list[int]]) -> float:
    """``p~(x)`` from scratch (REFERENCE §1.2, §1.4): LANTERN's neighbour prefix or COOL's weight;
    nothing is merged onto a token outside the target's support (issue 20)."""
    kind, value, k = spec
    if kind == "exact" or p[x] == 0:
        return p[x] if kind != "cool" else 0.0
    if kind == "cool":
        return value[min(depth, len(value)) - 1] * p[x]
    if kind == "delta":
        budget = value
    elif kind == "lam":
        budget = (value - 1.0) * p[x]
    else:  # an additive budget per depth
        budget = value[min(depth, len(value)) - 1]
    total = 0.0
    for n in nbrs[x][:k]:
        if total + p[n] > budget * (1 + 1e-7):
            break
        total += p[n]
    return p[x] + total


def first_argmax(scores: list[float]) -> int:
    best = max(scores)
    return next(i for i, s in enumerate(scores) if s == best)


def reference_greedy_walk(spec, node_targets, tokens, parents, depths, nbrs):
    """LANTERN's greedy definition, as its official code applies it: every child is accepted iff its
    boosted score ``max(p(x), p~(x))`` is the first argmax of its parent's own ``p``; each
    root-to-leaf path, in leaf order, counts its accepted prefix, and the first longest is
    committed, then the argmax of its last accepted node's ``p``. Returns (committed tokens,
    departures)."""
    def accepted(child):
        p, x = node_targets[parents[child]], tokens[child]
        scores = list(p)
        scores[x] = max(p[x], reference_relaxed_prob(spec, p, x, depths[child], nbrs))
        return first_argmax(scores) == x

    def path_to(node):
        path = []
        while node > 0:
            path, node = [node] + path, parents[node]
        return path

    leaves = [n for n in range(len(tokens)) if not any(parents[c] == n for c in range(1, len(tokens)))]
    best = []
    for leaf in leaves:  # in node order: the first longest wins
        prefix = []
        for node in path_to(leaf):
            if not accepted(node):
                break
            prefix.append(node)
        if len(prefix) > len(best):
            best = prefix
    committed = [tokens[n] for n in best]
    departures = [float(tokens[n] != first_argmax(node_targets[parents[n]])) for n in best]
    return committed + [first_argmax(node_targets[best[-1] if best else 0])], departures + [0.0]


GREEDY_SPECS = {
    "exact": ("exact", None, 0),
    "lantern-delta0.1-k3": ("delta", 0.1, 3),
    "lantern-delta0.35-k5": ("delta", 0.35, 5),
    "lantern++-lam3-k4": ("lam", 3.0, 4),
    "lantern-schedule-k5": ("schedule", (0.4, 0.1, 0.0), 5),
    "cool-weights": ("cool", (1.5, 0.75, 1.25), 0),
}
TREES = {  # parents (node 0 = root) and depths
    "three-siblings": ([-1, 0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 2, 2, 2]),
    "deep": ([-1, 0, 0, 1, 1, 3, 3, 5], [0, 1, 1, 2, 2, 3, 3, 4]),
}


def sixteenths(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random distributions ``[*shape]`` over the last dimension whose entries are multiples of
    1/16 (16 unit masses dropped at random), so sums and ties are exact in float32."""
    drops = torch.randint(0, shape[-1], (*shape[:-1], 16), generator=gen)
    return torch.nn.functional.one_hot(drops, shape[-1]).sum(-2).float() / 16


def build_greedy_rule(spec, nbrs: torch.Tensor):
    kind, value, k = spec
    if kind == "exact":
        return ExactRule()
    if kind == "cool":
        return CoolRule(weights=value)
    keyword = {"delta": "delta", "lam": "lam", "schedule": "delta_schedule"}[kind]
    return LanternRule(nbrs, k=k, **{keyword: value})


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("name", list(GREEDY_SPECS))
def test_greedy_walk_matches_the_definition(name, tree):
    """Batched ``verify_tree(greedy=True)`` against the node-by-node definition on 600 random
    trees with siblings: coarse probabilities (multiples of 1/16, exact in binary: many exact ties
    and zeros), drafts that repeat among siblings, every rule (binary-exact COOL weights). Committed tokens, departures (the TV record) and the
    number of tests must agree row for row."""
    vocab, batch = 6, 600
    parents, depths = TREES[tree]
    nodes = len(parents)
    gen = torch.Generator().manual_seed(len(name) * 31 + nodes)
    nbrs = torch.stack([torch.tensor([i for i in torch.randperm(vocab, generator=gen).tolist() if i != c])
                        for c in range(vocab)])
    targets = sixteenths(gen, batch, nodes, vocab)
    tokens = torch.randint(0, vocab, (batch, nodes), generator=gen)
    # half the rows draft each node's parent's argmax somewhere, so acceptance is common
    argmax_parent = targets.argmax(-1).gather(1, torch.tensor(parents).clamp(min=0).expand(batch, -1))
    tokens = torch.where(torch.rand(batch, nodes, generator=gen) < 0.4, argmax_parent, tokens)
    spec = GREEDY_SPECS[name]
    rule = build_greedy_rule(spec, nbrs)
    result = verify_fields(rule, targets, tokens, torch.tensor(parents).expand(batch, -1),
                         torch.nn.functional.one_hot(tokens, vocab).float(), torch.tensor(depths).expand(batch, -1),
                         torch.ones(batch, nodes, dtype=torch.bool), greedy=True)
    nbr_lists = nbrs.tolist()
    departures_seen = 0
    for b in range(batch):
        committed, departures = reference_greedy_walk(spec, targets[b].tolist(), tokens[b].tolist(), parents, depths,
                                                      nbr_lists)
        n = int(result.num_accepted[b])
        assert result.committed[b, : n + 1].tolist() == committed, f"row {b}"
        assert result.step_tv[b, : n + 1].tolist() == departures, f"row {b}"
        departures_seen += sum(departures)
    assert result.num_accepted.float().mean() > 0.5  # the walk goes deep enough to mean something
    assert (departures_seen > 0) == (not rule.lossless)


@pytest.mark.parametrize("name", list(GREEDY_SPECS))
def test_greedy_argmax_is_never_rejected_and_corrections_are_the_argmax(name):
    """For every rule: the argmax draft is accepted, the correction is the argmax, and a lossless
    rule accepts nothing else."""
    gen = torch.Generator().manual_seed(7)
    vocab = 6
    nbrs = torch.stack([torch.tensor([i for i in torch.randperm(vocab, generator=gen).tolist() if i != c])
                        for c in range(vocab)])
    rule = build_greedy_rule(GREEDY_SPECS[name], nbrs)
    p = sixteenths(gen, 500, vocab)
    depth = torch.randint(1, 5, (500,), generator=gen)
    top = p.argmax(1)
    assert rule.greedy_accept(p, top, depth).all()
    assert torch.equal(rule.greedy_correction(p, top, depth), top)
    if rule.lossless:
        for x in range(vocab):
            token = torch.full((500,), x)
            assert torch.equal(rule.greedy_accept(p, token, depth), top == x)
