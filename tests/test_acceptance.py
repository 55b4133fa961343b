"""Acceptance rules against exact enumeration of the procedure they describe.

The judge for every closed form is the enumeration ``sum_x q(x) [alpha_x delta_x +
(1 - alpha_x) R_x]`` built only from ``accept_prob`` and ``residual``; for the exact rule that
enumeration must be the target itself (REFERENCE §1.1), which is what checks the residuals.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relaxspec.acceptance import (
    CoolRule,
    ExactRule,
    LanternRule,
    cached_neighbour_table,
    cool_weights,
    neighbour_table,
    one_hot,
)
from relaxspec.acceptance import lantern as lantern_module
from relaxspec.acceptance import neighbours as neighbours_module
from relaxspec.errors import RelaxspecError

V = 6
ATOL = 1e-6



# --------------------------------------------------------------------------- fixtures / helpers
def random_neighbours(vocab: int, seed: int = 0) -> torch.Tensor:
    """A random proximity order per code, self excluded: ``[vocab, vocab - 1]``."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for c in range(vocab):
        others = torch.tensor([i for i in range(vocab) if i != c])
        rows.append(others[torch.randperm(vocab - 1, generator=gen)])
    return torch.stack(rows)


def random_pairs(vocab: int = V, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target/proposal rows ``[B, vocab]`` covering the awkward cases: zeros in q, zeros in t,
    one-hot q, one-hot t, q == t, and generic rows."""
    gen = torch.Generator().manual_seed(seed)

    def simplex(n: int, zero_frac: float) -> torch.Tensor:
        x = torch.rand(n, vocab, generator=gen, dtype=torch.float64) ** 2
        x = x * (torch.rand(n, vocab, generator=gen) >= zero_frac)
        x[x.sum(1) == 0, 0] = 1.0
        return x / x.sum(1, keepdim=True)

    t = [simplex(8, 0.0), simplex(8, 0.4), simplex(6, 0.0), simplex(4, 0.0)]
    q = [simplex(8, 0.0), simplex(8, 0.0), simplex(6, 0.5), None]
    t_all = torch.cat(t)
    q_list = [q[0], q[1], q[2], t[3].clone()]  # last block: q == t
    q_all = torch.cat(q_list)
    # one-hot proposals and one-hot targets
    tok = torch.randint(0, vocab, (6,), generator=gen)
    t_extra = torch.cat([simplex(6, 0.3), one_hot(tok[:3], vocab, torch.float64), simplex(3, 0.0)])
    q_extra = torch.cat([one_hot(tok, vocab, torch.float64)[:6], simplex(3, 0.2), one_hot(tok[3:], vocab, torch.float64)])
    t_all = torch.cat([t_all, t_extra]).float()
    q_all = torch.cat([q_all, q_extra]).float()
    # renormalise in float32 so rows sum to 1 in the dtype the interface uses
    return t_all / t_all.sum(1, keepdim=True), q_all / q_all.sum(1, keepdim=True)


def enumerate_law(rule, target, proposal, depth) -> torch.Tensor:
    """``sum_x q(x) [alpha_x delta_x + (1 - alpha_x) R_x]`` from ``accept_prob`` and ``residual``."""
    batch, vocab = target.shape
    law = torch.zeros(batch, vocab, dtype=torch.float64)
    for x in range(vocab):
        token = torch.full((batch,), x, dtype=torch.long)
        alpha = rule.accept_prob(target, proposal, token, depth).double()
        res = rule.residual(target, proposal, token, depth).double()
        assert torch.isfinite(alpha).all() and torch.isfinite(res).all()
        assert torch.allclose(res.sum(1), torch.ones(batch, dtype=torch.float64), atol=1e-5)
        weight = proposal[:, x].double().unsqueeze(1)
        law += weight * (alpha.unsqueeze(1) * one_hot(token, vocab, torch.float64) + (1 - alpha.unsqueeze(1)) * res)
    return law


def reference_merge(t_row, nbrs, k, budget):
    """Pure-Python LANTERN prefix: (m, S_m) for one row (REFERENCE §1.2)."""
    total, m = 0.0, 0
    for j in range(k):
        if total + float(t_row[nbrs[j]]) > budget * (1 + 1e-6) + 1e-12:
            break
        total += float(t_row[nbrs[j]])
        m += 1
    return m, total


NBRS = random_neighbours(V, seed=3)


def depth_for(batch: int) -> torch.Tensor:
    return (torch.arange(batch) % 4 + 1).long()


RULES = {
    "exact": lambda: ExactRule(),
    "lantern-d0.15-k3-relaxed": lambda: LanternRule(NBRS, k=3, delta=0.15),
    "lantern-d0.4-k5-relaxed": lambda: LanternRule(NBRS, k=5, delta=0.4),
    "lantern-d1-k5-relaxed": lambda: LanternRule(NBRS, k=5, delta=1.0),
    "lantern-d0.3-k2-plain": lambda: LanternRule(NBRS, k=2, delta=0.3, residual="plain"),
    "lantern-d0.6-k5-plain": lambda: LanternRule(NBRS, k=5, delta=0.6, residual="plain"),
    "lantern-lam2-k3-relaxed": lambda: LanternRule(NBRS, k=3, lam=2.0),
    "lantern-lam5-k5-relaxed": lambda: LanternRule(NBRS, k=5, lam=5.0),
    "lantern-lam3-k4-plain": lambda: LanternRule(NBRS, k=4, lam=3.0, residual="plain"),
    "lantern-schedule-relaxed": lambda: LanternRule(NBRS, k=5, delta_schedule=[0.5, 0.2, 0.0]),
    "lantern-schedule-plain": lambda: LanternRule(NBRS, k=5, delta_schedule=[0.05, 0.3], residual="plain"),
    "cool-1.1-mean": lambda: CoolRule(delta=1.1),
    "cool-2-mean": lambda: CoolRule(delta=2.0),
    "cool-2-none": lambda: CoolRule(delta=2.0, normalisation="none"),
    "cool-weights": lambda: CoolRule(weights=[3.0, 1.0, 0.5]),
}


# --------------------------------------------------------------------------- (a) closed forms
@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("seed", [0, 1])
def test_one_step_law_matches_enumeration(name, seed):
    rule = RULES[name]()
    t, q = random_pairs(seed=seed)
    depth = depth_for(t.shape[0])
    expected = enumerate_law(rule, t, q, depth)
    law = rule.one_step_law(t, q, depth)
    assert law.shape == t.shape and law.dtype == t.dtype
    torch.testing.assert_close(law.double(), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(expected.sum(1), torch.ones(t.shape[0], dtype=torch.float64), atol=ATOL, rtol=0)


def test_float64_inputs_at_a_merge_boundary_keep_the_law_of_accept_and_residual():
    """Issue 45: LANTERN++ (lam 2) with float64 inputs where x's first two neighbours sum to its
    bound to the last bit: accept and residual (float64) merge both, the law was computed in
    float32 and merged one, 0.28 off. The law now computes in the inputs' dtype (float32 at least)."""
    rule = LanternRule(NBRS, k=3, lam=2.0)
    t = torch.tensor([[0.2830749590581557, 0.2811246665824132, 0.0019502924757425523, 0.11919060112022964,
                       0.08112893599678032, 0.23353054476667867]], dtype=torch.float64)
    q = one_hot(torch.tensor([0]), 6, torch.float64)
    depth = depth_for(1)
    law = rule.one_step_law(t, q, depth)
    assert law.dtype == torch.float64
    torch.testing.assert_close(law, enumerate_law(rule, t, q, depth), atol=1e-12, rtol=0)
    assert (rule.one_step_law(t.float(), q.float(), depth).double() - law).abs().max() > 0.1  # float32 differs here


@pytest.mark.parametrize("name", list(RULES))
def test_step_tv_matches_enumeration(name):
    """General rows: TV of the marginal law; one-hot rows: the fast path (law of that token)."""
    rule = RULES[name]()
    t, q = random_pairs(seed=5)
    depth = depth_for(t.shape[0])
    token = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(0)).squeeze(1)
    expected = 0.5 * (enumerate_law(rule, t, q, depth) - t.double()).abs().sum(1)
    torch.testing.assert_close(rule.step_tv(t, q, token, depth).double(), expected, atol=2 * ATOL, rtol=0)
    # A batch of point masses only: the fast path alone.
    point = one_hot(token, V)
    expected_point = 0.5 * (enumerate_law(rule, t, point, depth) - t.double()).abs().sum(1)
    torch.testing.assert_close(rule.step_tv(t, point, token, depth).double(), expected_point, atol=2 * ATOL, rtol=0)


def test_lantern_law_large_vocab_and_chunking(monkeypatch):
    """O(V k) closed form on a wider vocabulary, with the chunk loop forced to many chunks."""
    vocab, k = 40, 12
    nbrs = random_neighbours(vocab, seed=11)
    gen = torch.Generator().manual_seed(2)
    t = torch.rand(7, vocab, generator=gen) ** 3
    t[:, :5] = 0
    t = t / t.sum(1, keepdim=True)
    q = torch.rand(7, vocab, generator=gen) ** 3
    q[:, 30:] = 0
    q = q / q.sum(1, keepdim=True)
    for kwargs in ({"delta": 0.1}, {"lam": 3.0}, {"delta": 0.1, "residual": "plain"}):
        rule = LanternRule(nbrs, k=k, **kwargs)
        expected = enumerate_law(rule, t, q, 1)
        full = rule.one_step_law(t, q, 1)
        monkeypatch.setattr(lantern_module, "LAW_CHUNK_ELEMENTS", 7 * k * 3)
        chunked = rule.one_step_law(t, q, 1)
        monkeypatch.undo()
        torch.testing.assert_close(full.double(), expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(chunked, full, atol=1e-7, rtol=0)


# --------------------------------------------------------------------------- (b), (c) exactness
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_rule_is_lossless(seed):
    rule = ExactRule()
    t, q = random_pairs(seed=seed)
    depth = depth_for(t.shape[0])
    torch.testing.assert_close(enumerate_law(rule, t, q, depth), t.double(), atol=ATOL, rtol=0)
    torch.testing.assert_close(rule.one_step_law(t, q, depth), t)
    assert rule.lossless
    assert torch.all(rule.step_tv(t, q, torch.zeros(t.shape[0], dtype=torch.long), depth) == 0)


def test_exact_point_mass_residual_zeroes_token():
    """One-hot draft: test U <= t(x), else zero x and renormalise (REFERENCE §1.1)."""
    t = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    x = torch.tensor([2])
    rule = ExactRule()
    assert rule.accept_prob(t, one_hot(x, 4), x, 1).item() == pytest.approx(0.3)
    torch.testing.assert_close(rule.residual(t, one_hot(x, 4), x, 1), torch.tensor([[1 / 7, 2 / 7, 0.0, 4 / 7]]))


@pytest.mark.parametrize(
    "relaxed",
    [
        lambda: LanternRule(NBRS, k=5, delta=0.0),
        lambda: LanternRule(NBRS, k=5, delta=0.0, residual="plain"),
        lambda: LanternRule(NBRS, k=5, lam=1.0),
        lambda: LanternRule(NBRS, k=0, delta=0.7),
        lambda: LanternRule(NBRS, k=5, delta_schedule=[0.0]),
        lambda: CoolRule(weights=[1.0]),
        lambda: CoolRule(delta=1.0, nu=0.0),
    ],
)
def test_zero_relaxation_reduces_to_exact(relaxed):
    rule, exact = relaxed(), ExactRule()
    assert rule.lossless
    t, q = random_pairs(seed=4)
    depth = depth_for(t.shape[0])
    torch.testing.assert_close(rule.one_step_law(t, q, depth), t, atol=ATOL, rtol=0)
    torch.testing.assert_close(enumerate_law(rule, t, q, depth), t.double(), atol=ATOL, rtol=0)
    for x in range(V):
        token = torch.full((t.shape[0],), x, dtype=torch.long)
        torch.testing.assert_close(rule.accept_prob(t, q, token, depth), exact.accept_prob(t, q, token, depth))
        torch.testing.assert_close(rule.residual(t, q, token, depth), exact.residual(t, q, token, depth), atol=1e-7, rtol=0)
        assert torch.equal(rule.greedy_accept(t, token, depth), exact.greedy_accept(t, token, depth))


# --------------------------------------------------------------------------- (d), (e) LANTERN
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("delta", [0.05, 0.2, 0.5])
def test_lantern_point_mass_tv_is_merged_mass(seed, delta):
    t, _ = random_pairs(seed=seed)
    batch = t.shape[0]
    rule = LanternRule(NBRS, k=4, delta=delta)
    for x in range(V):
        token = torch.full((batch,), x, dtype=torch.long)
        tv = rule.step_tv(t, one_hot(token, V), token, 1)
        relaxed = rule.relaxed_prob(t, token, 1)
        for b in range(batch):
            # Nothing merges onto a token outside the target's support (B = 0 there).
            m, moved = reference_merge(t[b], NBRS[x], 4, delta if t[b, x] > 0 else 0.0)
            assert tv[b].item() == pytest.approx(moved, abs=1e-6)
            assert relaxed[b].item() == pytest.approx(t[b, x].item() + moved, abs=1e-6)
            # The one-hot relaxed residual zeroes x and exactly the m merged neighbours.
            res = rule.residual(t[b : b + 1], one_hot(token[b : b + 1], V), token[b : b + 1], 1)[0]
            if relaxed[b] < 1 - 1e-6:
                zeroed = {x, *NBRS[x][:m].tolist()}
                for y in range(V):
                    if y in zeroed:
                        assert res[y] == 0
                    else:
                        assert res[y].item() == pytest.approx(t[b, y].item() / (1 - relaxed[b].item()), rel=1e-3, abs=1e-6)
        assert torch.all(tv <= delta * (1 + 1e-6))


@pytest.mark.parametrize("lam", [1.5, 3.0, 10.0])
def test_lantern_multiplicative_bound(lam):
    t, _ = random_pairs(seed=7)
    rule = LanternRule(NBRS, k=5, lam=lam)
    for x in range(V):
        token = torch.full((t.shape[0],), x, dtype=torch.long)
        relaxed = rule.relaxed_prob(t, token, 1)
        assert torch.all(relaxed <= lam * t[:, x] * (1 + 1e-6) + 1e-12)
        for b in range(t.shape[0]):
            _, moved = reference_merge(t[b], NBRS[x], 5, (lam - 1) * float(t[b, x]))
            assert relaxed[b].item() == pytest.approx(float(t[b, x]) + moved, abs=1e-6)


def test_lantern_prefix_never_skips_a_heavy_neighbour():
    nbrs = torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    t = torch.tensor([[0.1, 0.5, 0.1, 0.3]])
    x = torch.tensor([0])
    rule = LanternRule(nbrs, k=3, delta=0.3)  # heavy n1 = 0.5 > 0.3: m = 0 even though n2 = 0.1 fits
    assert rule.relaxed_prob(t, x, 1).item() == pytest.approx(0.1)
    assert rule.step_tv(t, one_hot(x, 4), x, 1).item() == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(rule.residual(t, one_hot(x, 4), x, 1), torch.tensor([[0.0, 5 / 9, 1 / 9, 3 / 9]]))
    # Budget exactly at a prefix sum (float32 0.1 + 0.2 vs 0.3) merges it.
    t2 = torch.tensor([[0.4, 0.1, 0.2, 0.3]])
    assert LanternRule(nbrs, k=3, delta=0.3).relaxed_prob(t2, x, 1).item() == pytest.approx(0.7)


def test_lantern_zero_probability_neighbours():
    nbrs = torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    t = torch.tensor([[0.3, 0.0, 0.2, 0.5]])
    x = torch.tensor([0])
    rule = LanternRule(nbrs, k=3, delta=0.25)  # the zero neighbour does not stop the prefix
    assert rule.relaxed_prob(t, x, 1).item() == pytest.approx(0.5)
    torch.testing.assert_close(rule.relaxed_target(t, x, 1), torch.tensor([[0.5, 0.0, 0.0, 0.5]]))
    torch.testing.assert_close(rule.residual(t, one_hot(x, 4), x, 1), torch.tensor([[0.0, 0.0, 0.0, 1.0]]))
    # multiplicative with t(x) = 0: budget 0, only zero-mass neighbours merge, p~(x) = 0
    t0 = torch.tensor([[0.0, 0.0, 0.6, 0.4]])
    mult = LanternRule(nbrs, k=3, lam=10.0)
    assert mult.relaxed_prob(t0, x, 1).item() == 0.0
    assert mult.accept_prob(t0, one_hot(x, 4), x, 1).item() == 0.0
    torch.testing.assert_close(mult.residual(t0, one_hot(x, 4), x, 1), t0)


@pytest.mark.parametrize("name", [name for name in RULES if name != "exact"])
@pytest.mark.parametrize("seed", [0, 1])
def test_relaxed_laws_keep_the_targets_support(name, seed):
    """Issue 20: a relaxed rule never commits a token the target's processed law gives no mass
    (top-k, top-p): the enumerated law, built only from accept_prob and residual, is 0 there, for
    sampled drafts and point masses alike; so is ``p~``."""
    rule = RULES[name]()
    t, q = random_pairs(seed=seed)
    depth = depth_for(t.shape[0])
    outside = t == 0
    assert outside.any()
    for proposal in (q, one_hot(torch.multinomial(q, 1, generator=torch.Generator().manual_seed(seed))[:, 0], V)):
        law = enumerate_law(rule, t, proposal, depth)
        assert float(law[outside].abs().max()) < 1e-7
        torch.testing.assert_close(rule.one_step_law(t, proposal, depth).double(), law, atol=ATOL, rtol=0)
    for x in range(V):
        token = torch.full((t.shape[0],), x, dtype=torch.long)
        relaxed = rule.relaxed_prob(t, token, depth)
        assert (relaxed[outside[:, x]] == 0).all()


def test_lantern_additive_budget_merges_nothing_onto_a_token_outside_the_support():
    """The official code's p~(x) = p(x) + S_m would give x = 0 mass 0.3 here (its neighbours'),
    accepting a token the user's top-k removed; within the support it is unchanged."""
    nbrs = torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    t = torch.tensor([[0.0, 0.3, 0.3, 0.4]])
    x = torch.tensor([0])
    for rule in (LanternRule(nbrs, k=3, delta=0.5), LanternRule(nbrs, k=3, delta_schedule=[0.5])):
        assert rule.relaxed_prob(t, x, 1).item() == 0.0
        assert rule.accept_prob(t, one_hot(x, 4), x, 1).item() == 0.0
        torch.testing.assert_close(rule.one_step_law(t, one_hot(x, 4), 1), t)  # rejected: the residual is t
        assert rule.step_tv(t, one_hot(x, 4), x, 1).item() == pytest.approx(0.0, abs=1e-7)
    full = torch.tensor([[0.1, 0.3, 0.2, 0.4]])  # full support: the official relaxation, p(x) + S_m
    assert LanternRule(nbrs, k=3, delta=0.5).relaxed_prob(full, x, 1).item() == pytest.approx(0.1 + 0.3 + 0.2)


def test_lantern_schedule_uses_depth_and_last_value():
    nbrs = torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    t = torch.tensor([[0.3, 0.1, 0.2, 0.4]]).expand(4, 4)
    x = torch.zeros(4, dtype=torch.long)
    rule = LanternRule(nbrs, k=3, delta_schedule=[0.35, 0.15, 0.0])
    relaxed = rule.relaxed_prob(t, x, torch.tensor([1, 2, 3, 9]))
    torch.testing.assert_close(relaxed, torch.tensor([0.6, 0.4, 0.3, 0.3]))


def test_lantern_plain_residual_ignores_merge():
    t, q = random_pairs(seed=9)
    rule = LanternRule(NBRS, k=5, delta=0.5, residual="plain")
    token = torch.zeros(t.shape[0], dtype=torch.long)
    torch.testing.assert_close(rule.residual(t, q, token, 1), ExactRule().residual(t, q, token, 1))


# --------------------------------------------------------------------------- (f) COOL-SD
def test_cool_weights_schedule():
    w = cool_weights(1.1, 0.7, "mean", 5)
    assert sum(w) / 5 == pytest.approx(1.1)
    assert all(a > b for a, b in zip(w, w[1:]))
    assert w[-1] < 1.0  # mean normalisation pushes late positions below 1 (lossless there)
    none = cool_weights(2.0, 0.7, "none", 3)
    assert none == pytest.approx(tuple(2.0 * math.exp(-0.7 * i) for i in (1, 2, 3)))
    rule = CoolRule(delta=2.0, horizon=4)
    torch.testing.assert_close(rule.weight(torch.tensor([1, 4, 7, 0])), torch.tensor(
        [rule.weights[0], rule.weights[3], rule.weights[3], rule.weights[0]], dtype=torch.float64))
    assert not rule.lossless and CoolRule(weights=[1.0, 0.5]).lossless


@pytest.mark.parametrize("w", [0.2, 0.5, 0.9, 1.0])
def test_cool_w_below_one_is_lossless(w):
    t, q = random_pairs(seed=3)
    rule = CoolRule(weights=[w])
    torch.testing.assert_close(rule.one_step_law(t, q, 1), t, atol=ATOL, rtol=0)
    torch.testing.assert_close(enumerate_law(rule, t, q, 1), t.double(), atol=ATOL, rtol=0)
    token = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(1)).squeeze(1)
    assert torch.all(rule.step_tv(t, q, token, 1) < 1e-6)


def test_cool_plain_residual_would_be_biased_below_one():
    """Why G* exists: with w < 1 the exact residual norm(max(t - q, 0)) loses mass."""
    t, q = random_pairs(seed=3)
    rule = CoolRule(weights=[0.5])
    accepted = torch.minimum(q.double(), 0.5 * t.double())
    plain = (t - q).clamp(min=0).double()
    plain = plain / plain.sum(1, keepdim=True).clamp(min=1e-30)
    biased = accepted + (1 - accepted.sum(1, keepdim=True)) * plain
    assert (biased - t.double()).abs().sum(1).max() > 0.05
    torch.testing.assert_close(rule.one_step_law(t, q, 1).double(), t.double(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("w", [1.1, 2.0, 5.0])
def test_cool_tv_above_one(w):
    t, q = random_pairs(seed=6)
    rule = CoolRule(weights=[w])
    token = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(1)).squeeze(1)
    is_point = q.max(1).values >= 1 - 1e-6
    expected = (torch.minimum(q.double(), w * t.double()) - t.double()).clamp(min=0).sum(1)
    tv = rule.step_tv(t, q, token, 1).double()
    torch.testing.assert_close(tv[~is_point], expected[~is_point], atol=ATOL, rtol=0)
    # G* equals the exact residual for w >= 1
    torch.testing.assert_close(rule.residual(t, q, token, 1), ExactRule().residual(t, q, token, 1), atol=1e-7, rtol=0)


# --------------------------------------------------------------------------- (g) greedy
def test_greedy_accept_rules():
    t = torch.tensor([[0.30, 0.33, 0.07, 0.30]])
    x0, x1 = torch.tensor([0]), torch.tensor([1])
    exact = ExactRule()
    assert not exact.greedy_accept(t, x0, 1).item() and exact.greedy_accept(t, x1, 1).item()
    assert exact.greedy_correction(t, x0, 1).item() == 1
    # ties go to the lowest index, like argmax in plain greedy decoding
    tie = torch.tensor([[0.4, 0.4, 0.2]])
    assert exact.greedy_accept(tie, torch.tensor([0]), 1).item()
    assert not exact.greedy_accept(tie, torch.tensor([1]), 1).item()

    nbrs = torch.tensor([[2, 3, 1], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    assert not LanternRule(nbrs, k=3, delta=0.05).greedy_accept(t, x0, 1).item()
    assert LanternRule(nbrs, k=3, delta=0.1).greedy_accept(t, x0, 1).item()  # 0.30 + 0.07 > 0.33
    # merging the argmax itself into x: p~(x) = .30 + .33 beats every code's own p
    nbrs_top = torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])
    rule = LanternRule(nbrs_top, k=3, delta=0.35)
    assert rule.greedy_accept(t, x0, 1).item()
    # rejected greedy draft: correction is the argmax of the relaxed residual (x and A_x removed)
    rule_small = LanternRule(nbrs, k=3, delta=0.05)
    assert rule_small.greedy_correction(t, x0, 1).item() == 1

    cool = CoolRule(weights=[1.2])
    assert cool.greedy_accept(t, x0, 1).item()  # 1.2 * 0.30 = 0.36 >= 0.33
    assert not CoolRule(weights=[1.05]).greedy_accept(t, x0, 1).item()
    # w < 1 is a lossless position: the argmax is accepted (it used to be demoted to 0.5 * 0.33,
    # committing the runner-up -- issue 9), and a non-argmax draft is rejected
    assert CoolRule(weights=[0.5]).greedy_accept(t, x1, 1).item()
    assert not CoolRule(weights=[0.5]).greedy_accept(t, x0, 1).item()


# --------------------------------------------------------------------------- (h) neighbours
def brute_force_neighbours(codebook: torch.Tensor, k: int, geometry: str) -> np.ndarray:
    vecs = codebook.double().numpy()
    if geometry == "normalised":
        vecs = vecs / np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
    out = []
    for c in range(len(vecs)):
        dist = np.sqrt(((vecs - vecs[c]) ** 2).sum(1))
        order = sorted((i for i in range(len(vecs)) if i != c), key=lambda i: (dist[i], i))
        out.append(order[:k])
    return np.array(out, dtype=np.int64).reshape(len(vecs), k)


@pytest.mark.parametrize("geometry", ["raw", "normalised"])
def test_neighbour_table_brute_force(geometry, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    smooth = torch.randn(37, 4, generator=gen)
    # Small-integer codes have many exact distance ties (and duplicate codes), testing the
    # id tie-break and the full-sort fallback at the candidate boundary.
    ties = torch.randint(-2, 3, (41, 2), generator=gen).float()
    ties[ties.abs().sum(1) == 0] = 1.0  # keep the normalised geometry well defined
    monkeypatch.setattr(neighbours_module, "CHUNK_ELEMENTS", 200)  # several chunks
    for book in (smooth, ties):
        for k in (0, 1, 5, book.shape[0] - 1):
            table = neighbour_table(book, k, geometry)
            assert table.dtype == torch.long and table.shape == (book.shape[0], k)
            np.testing.assert_array_equal(table.numpy(), brute_force_neighbours(book, k, geometry))


def test_neighbour_geometries_differ():
    book = torch.tensor([[1.0, 0.0], [10.0, 0.0], [0.0, 1.5]])
    assert neighbour_table(book, 1, "raw")[0].item() == 2
    assert neighbour_table(book, 1, "normalised")[0].item() == 1


def test_cached_neighbour_table_round_trip(tmp_path, monkeypatch):
    book = torch.randn(30, 3, generator=torch.Generator().manual_seed(1))
    wide = cached_neighbour_table(book, 8, "raw", tmp_path)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and "k8" in files[0].name
    torch.testing.assert_close(wide, neighbour_table(book, 8, "raw"))

    def fail(*args, **kwargs):
        raise AssertionError("the cached table should have been reused")

    monkeypatch.setattr(neighbours_module, "neighbour_table", fail)
    torch.testing.assert_close(cached_neighbour_table(book, 8, "raw", tmp_path), wide)
    torch.testing.assert_close(cached_neighbour_table(book, 3, "raw", tmp_path), wide[:, :3])
    with pytest.raises(AssertionError):  # other geometry / codebook / wider k: not in the cache
        cached_neighbour_table(book, 3, "normalised", tmp_path)
    with pytest.raises(AssertionError):
        cached_neighbour_table(book + 1e-3, 3, "raw", tmp_path)
    with pytest.raises(AssertionError):
        cached_neighbour_table(book, 9, "raw", tmp_path)
    monkeypatch.undo()
    cached_neighbour_table(book, 4, "normalised", tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    assert not list(tmp_path.glob("*.tmp"))


# --------------------------------------------------------------------------- (i) configs
@pytest.mark.parametrize(
    "make",
    [
        lambda: LanternRule(NBRS, k=6, delta=0.1),
        lambda: LanternRule(NBRS, k=-1, delta=0.1),
        lambda: LanternRule(NBRS, k=3),
        lambda: LanternRule(NBRS, k=3, delta=0.1, lam=2.0),
        lambda: LanternRule(NBRS, k=3, delta=0.1, delta_schedule=[0.1]),
        lambda: LanternRule(NBRS, k=3, delta=1.5),
        lambda: LanternRule(NBRS, k=3, delta=-0.1),
        lambda: LanternRule(NBRS, k=3, lam=0.5),
        lambda: LanternRule(NBRS, k=3, delta_schedule=[]),
        lambda: LanternRule(NBRS, k=3, delta_schedule=[0.1, 2.0]),
        lambda: LanternRule(NBRS, k=3, delta=0.1, residual="zeroed"),
        lambda: LanternRule(NBRS.float(), k=3, delta=0.1),
        lambda: LanternRule(torch.arange(6).view(6, 1), k=1, delta=0.1),  # contains self
        lambda: LanternRule(torch.tensor([[1, 1], [0, 0]]), k=2, delta=0.1),  # repeated code
        lambda: LanternRule(torch.tensor([[1, 2], [0, 1]]), k=2, delta=0.1),  # out of range
        lambda: CoolRule(),
        lambda: CoolRule(delta=0.0),
        lambda: CoolRule(delta=1.1, weights=[1.0]),
        lambda: CoolRule(delta=1.1, normalisation="max"),
        lambda: CoolRule(delta=1.1, horizon=0),
        lambda: CoolRule(delta=1.1, nu=-1.0),
        lambda: CoolRule(weights=[1.0, -2.0]),
        lambda: neighbour_table(torch.randn(5, 2), 5),
        lambda: neighbour_table(torch.randn(5, 2), 2, "cosine"),
    ],
)
def test_bad_configs_raise(make):
    with pytest.raises(RelaxspecError):
        make()
