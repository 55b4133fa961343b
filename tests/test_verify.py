"""The tree-verification walk, checked at the level of output distributions.

The batch dimension is the sample dimension: ``B`` independent speculative steps over a small
hand-made "model" (target and drafter distributions that depend on the token prefix), and the
law of the committed tokens is compared with the model's law by a chi-square test.

Power (see test_chi_square_power): with ``B = 120000`` samples, ``alpha = 1e-3`` and up to
``V^2 = 25`` cells, any alternative at TV distance ``eps`` from the truth has non-centrality
``lambda = B * sum (p' - p)^2 / p >= B * (sum |p' - p|)^2 = 4 B eps^2`` (Cauchy-Schwarz), i.e.
``lambda >= 192`` for ``eps = 0.02``, which the test rejects with probability > 0.999.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.engine import verify_fields
from scipy import stats

from relaxspec.acceptance import CoolRule, ExactRule, LanternRule, neighbour_table, one_hot
from relaxspec.decoding.verify import VerifyResult, children_table
from relaxspec.drafting.siblings import sample_siblings, topk_siblings

V = 5
B = 120_000



ALPHA = 1e-3
MAX_LEN = 3


# --------------------------------------------------------------------------- the toy model
def _dist(prefix: tuple[int, ...], salt: int, zeros: bool) -> np.ndarray:
    code = sum((t + 1) * (V + 1) ** i for i, t in enumerate(prefix))
    rng = np.random.default_rng(1000 * salt + code)
    p = rng.dirichlet(np.full(V, 2.0)) + 0.03
    if zeros and code % 3 == 0:
        p[(code + salt) % V] = 0.0  # some prefixes forbid a token outright
    return p / p.sum()


def target_dist(prefix: tuple[int, ...]) -> np.ndarray:
    """The model: p(next | prefix), prefix-dependent, with zeros in some rows."""
    return _dist(prefix, salt=1, zeros=True)


def drafter_dist(prefix: tuple[int, ...]) -> np.ndarray:
    """A drafter close to, but not equal to, the model; some rows have a single nonzero entry
    (fewer than the number of siblings asked for) and some have zeros."""
    code = sum((t + 1) * (V + 1) ** i for i, t in enumerate(prefix))
    if code % 7 == 3:
        q = np.zeros(V)
        q[code % V] = 1.0
        return q
    q = 0.5 * target_dist(prefix) + 0.5 * _dist(prefix, salt=2, zeros=True)
    return q / q.sum()


def tables(fn) -> list[torch.Tensor]:
    """``tables(fn)[L][code]`` = ``fn(prefix)`` for every prefix of length ``L``; code in base V."""
    out = []
    for length in range(MAX_LEN + 1):
        rows = [fn(tuple(int(d) for d in np.unravel_index(c, (V,) * length))) if length else fn(())
                for c in range(V**length)]
        out.append(torch.tensor(np.array(rows), dtype=torch.float32))
    return out


P = tables(target_dist)
Q = tables(drafter_dist)


def prefix_code(*tokens: torch.Tensor) -> torch.Tensor:
    code = torch.zeros_like(tokens[0])
    for t in tokens:
        code = code * V + t
    return code


def draft(q_rows: torch.Tensor, n: int, mode: str, gen: torch.Generator):
    if mode == "sampled":
        return sample_siblings(q_rows, n, gen)
    return topk_siblings(q_rows, n)


def build_tree(shape: str, mode: str, gen: torch.Generator, batch: int = B):
    """Draft a batch of trees from the toy drafter and attach the model's target rows.

    ``"tree"``: root -> nodes 1, 2; node 1 -> nodes 3, 4.  ``"chain"``: root -> 1 -> 2 -> 3.
    ``"single"``: root -> 1.
    """
    root_q = Q[0].expand(batch, V)
    if shape == "tree":
        parents = [-1, 0, 0, 1, 1]
        depth = [0, 1, 1, 2, 2]
        tok01, prop01, val01 = draft(root_q, 2, mode, gen)
        tok34, prop34, val34 = draft(Q[1][tok01[:, 0]], 2, mode, gen)
        tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), tok01, tok34], 1)
        proposals = torch.cat([root_q.unsqueeze(1), prop01, prop34], 1)
        valid = torch.cat([torch.ones(batch, 1, dtype=torch.bool), val01, val34 & val01[:, :1]], 1)
        targets = torch.stack([
            P[0].expand(batch, V), P[1][tok01[:, 0]], P[1][tok01[:, 1]],
            P[2][prefix_code(tok01[:, 0], tok34[:, 0])], P[2][prefix_code(tok01[:, 0], tok34[:, 1])],
        ], 1)
    elif shape == "chain":
        parents = [-1, 0, 1, 2]
        depth = [0, 1, 2, 3]
        t1, p1, v1 = draft(root_q, 1, mode, gen)
        t2, p2, v2 = draft(Q[1][t1[:, 0]], 1, mode, gen)
        t3, p3, v3 = draft(Q[2][prefix_code(t1[:, 0], t2[:, 0])], 1, mode, gen)
        tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), t1, t2, t3], 1)
        proposals = torch.cat([root_q.unsqueeze(1), p1, p2, p3], 1)
        valid = torch.cat([torch.ones(batch, 1, dtype=torch.bool), v1, v2, v3], 1)
        targets = torch.stack([
            P[0].expand(batch, V), P[1][t1[:, 0]], P[2][prefix_code(t1[:, 0], t2[:, 0])],
            P[3][prefix_code(t1[:, 0], t2[:, 0], t3[:, 0])],
        ], 1)
    elif shape == "single":
        parents = [-1, 0]
        depth = [0, 1]
        t1, p1, v1 = draft(root_q, 1, mode, gen)
        tokens = torch.cat([torch.zeros(batch, 1, dtype=torch.long), t1], 1)
        proposals = torch.cat([root_q.unsqueeze(1), p1], 1)
        valid = torch.cat([torch.ones(batch, 1, dtype=torch.bool), v1], 1)
        targets = torch.stack([P[0].expand(batch, V), P[1][t1[:, 0]]], 1)
    else:  # pragma: no cover
        raise ValueError(shape)
    as_rows = lambda xs: torch.tensor(xs, dtype=torch.long).expand(batch, len(xs))  # noqa: E731
    return dict(target_probs=targets.contiguous(), tokens=tokens, parents=as_rows(parents),
                proposals=proposals.contiguous(), depth=as_rows(depth), valid=valid)


def first_two_tokens(result: VerifyResult, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The first two committed tokens; where the step committed only one (the bonus), the second
    is what the next step would produce, drawn from the model (already tested exact separately)."""
    y1 = result.committed[:, 0]
    y2 = result.committed[:, 1].clone()
    missing = result.num_accepted == 0
    y2[missing] = torch.multinomial(P[1][y1[missing]], 1, generator=gen).squeeze(1)
    return y1, y2


def chi_square_pvalue(samples: torch.Tensor, probs: np.ndarray) -> float:
    """Goodness of fit of integer ``samples`` to ``probs``; an outcome of probability zero makes
    the p-value 0 (the data are impossible under ``probs``)."""
    counts = np.bincount(samples.numpy(), minlength=len(probs)).astype(float)
    assert counts.sum() == len(samples)
    impossible = probs <= 1e-12
    if counts[impossible].sum() > 0:
        return 0.0
    expected = probs[~impossible] / probs[~impossible].sum() * counts.sum()
    assert expected.min() > 5, "cells too small for the chi-square approximation"
    return float(stats.chisquare(counts[~impossible], expected).pvalue)


def joint_model_law() -> np.ndarray:
    """``p(y1) p(y2 | y1)`` flattened to ``V^2`` cells (index ``y1 * V + y2``)."""
    p1 = P[0][0].double().numpy()
    return (p1[:, None] * P[1].double().numpy()).reshape(-1)


# --------------------------------------------------------------------------- power of the test
def test_chi_square_power():
    """Any law at TV 0.02 from the truth is detected with probability > 0.999 (lambda >= 4 B eps^2)."""
    for cells in (V, V * V):
        df = cells - 1
        critical = stats.chi2.isf(ALPHA, df)
        power = stats.ncx2.sf(critical, df, 4 * B * 0.02**2)
        assert power > 0.999


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("shape", ["tree", "chain"])
@pytest.mark.parametrize("mode", ["sampled", "topk"])
def test_exact_rule_preserves_the_model_law(shape, mode):
    gen = torch.Generator().manual_seed({"tree": 1, "chain": 2}[shape] * 10 + (mode == "topk"))
    tree = build_tree(shape, mode, gen)
    result = verify_fields(ExactRule(), **tree, generator=gen)
    assert torch.all(result.step_tv == 0)
    # structural sanity of the result
    assert result.path.shape == (B, {"tree": 3, "chain": 4}[shape])
    assert torch.all(result.path[:, 0] == 0)
    assert torch.all((result.path >= 0).sum(1) == result.num_accepted + 1)
    assert torch.all(result.committed[torch.arange(B), result.num_accepted] == result.next_token)
    assert result.num_accepted.float().mean() > 0.3  # the drafter is good enough to exercise depth

    assert chi_square_pvalue(result.committed[:, 0], P[0][0].double().numpy()) > ALPHA
    y1, y2 = first_two_tokens(result, gen)
    assert chi_square_pvalue(y1 * V + y2, joint_model_law()) > ALPHA


def test_wrong_residual_is_detected(monkeypatch):
    """The same machinery rejects a walk whose residual forgets to subtract the proposal."""
    monkeypatch.setattr(ExactRule, "residual", lambda self, target, proposal, token, depth=1: target.clone())
    gen = torch.Generator().manual_seed(3)
    result = verify_fields(ExactRule(), **build_tree("tree", "sampled", gen), generator=gen)
    assert chi_square_pvalue(result.committed[:, 0], P[0][0].double().numpy()) < ALPHA


# --------------------------------------------------------------------------- relaxed rules
def _lantern_rules():
    codebook = torch.randn(V, 3, generator=torch.Generator().manual_seed(0))
    table = neighbour_table(codebook, V - 1, "raw")
    return {
        "lantern-delta-relaxed": LanternRule(table, k=3, delta=0.4),
        "lantern-delta-plain": LanternRule(table, k=3, delta=0.4, residual="plain"),
        "lantern-lam": LanternRule(table, k=4, lam=3.0),
        "cool": CoolRule(weights=[2.5]),
    }


RELAXED = _lantern_rules()


@pytest.mark.parametrize("name", list(RELAXED))
@pytest.mark.parametrize("mode", ["sampled", "topk"])
def test_relaxed_rule_one_level_gives_one_step_law(name, mode):
    rule = RELAXED[name]
    gen = torch.Generator().manual_seed(5 + (mode == "topk"))
    tree = build_tree("single", mode, gen)
    result = verify_fields(rule, **tree, generator=gen)
    target = P[0][:1]
    proposal = tree["proposals"][:1, 1]
    law = rule.one_step_law(target, proposal, 1)[0].double().numpy()
    assert 0.5 * np.abs(law - target[0].double().numpy()).sum() > 0.02  # the relaxation is visible
    assert chi_square_pvalue(result.committed[:, 0], law) > ALPHA
    # ... and the exact law is rejected: the chi-square test sees the relaxation
    assert chi_square_pvalue(result.committed[:, 0], target[0].double().numpy()) < ALPHA


@pytest.mark.parametrize("name", list(RELAXED))
def test_relaxed_rule_two_siblings(name):
    """Two sampled siblings: law = sum_x1 q(x1) [a delta_x1 + (1 - a) one_step_law(R_x1, q_2)]."""
    rule = RELAXED[name]
    gen = torch.Generator().manual_seed(8)
    tree = build_tree("tree", "sampled", gen)
    result = verify_fields(rule, **tree, generator=gen)
    target, q = P[0][:1].double(), Q[0][:1].double()
    law = torch.zeros(1, V, dtype=torch.float64)
    for x in range(V):
        if q[0, x] == 0:
            continue
        tok = torch.tensor([x])
        alpha = rule.accept_prob(target, q, tok, 1)
        residual = rule.residual(target, q, tok, 1)
        q2 = q.clone()
        q2[0, x] = 0
        q2 = q2 / q2.sum()
        law += q[0, x] * (alpha * one_hot(tok, V, torch.float64) + (1 - alpha) * rule.one_step_law(residual, q2, 2))
    assert chi_square_pvalue(result.committed[:, 0], law[0].numpy()) > ALPHA


def test_step_tv_record_matches_rule():
    """Per committed token, step_tv is the sum of rule.step_tv over the tests that decided it."""
    rule = RELAXED["lantern-delta-relaxed"]
    batch = 400
    gen = torch.Generator().manual_seed(9)
    tree = build_tree("tree", "sampled", gen, batch=batch)
    tree["proposals"][: batch // 2, 3] = one_hot(tree["tokens"][: batch // 2, 3], V)  # mix in point masses
    result = verify_fields(rule, **tree, generator=gen)
    tp, tok, prop, val, dep = (tree[k] for k in ("target_probs", "tokens", "proposals", "valid", "depth"))
    children = {0: [1, 2], 1: [3, 4], 2: [], 3: [], 4: []}
    for b in range(batch):
        path = [int(n) for n in result.path[b] if n >= 0]
        expected = torch.zeros(result.step_tv.shape[1], dtype=torch.float64)
        n_tests = 0
        for level, node in enumerate(path):
            target = tp[b : b + 1, node]
            chosen = path[level + 1] if level + 1 < len(path) else None
            for child in children[node]:
                if not val[b, child]:
                    continue
                x, q, d = tok[b : b + 1, child], prop[b : b + 1, child], dep[b : b + 1, child]
                expected[level] += rule.step_tv(target, q, x, d).double().item()
                n_tests += 1
                if child == chosen:
                    break
                target = rule.residual(target, q, x, d)
        torch.testing.assert_close(result.step_tv[b].double(), expected, atol=1e-6, rtol=0)
        assert result.tests[b].item() == n_tests
    assert result.step_tv.sum() > 0


# --------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("mode", ["sampled", "topk"])
@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_greedy_follows_argmax(mode, shape):
    batch = 3000
    gen = torch.Generator().manual_seed(10)
    tree = build_tree(shape, mode, gen, batch=batch)
    result = verify_fields(ExactRule(), **tree, greedy=True, generator=gen)
    g1 = int(P[0][0].argmax())
    g2 = int(P[1][g1].argmax())
    g3 = int(P[2][g1 * V + g2].argmax())
    g4 = int(P[3][(g1 * V + g2) * V + g3].argmax())
    greedy = torch.tensor([g1, g2, g3, g4])
    kids = children_table(tree["parents"], tree["valid"] & (torch.arange(tree["tokens"].shape[1]) > 0))
    for b in range(batch):
        n = int(result.num_accepted[b])
        assert torch.equal(result.committed[b, : n + 1], greedy[: n + 1])
        # every accepted node carries the greedy token, and the walk stopped only because no
        # valid child of the last accepted node carried the next greedy token
        last = int(result.path[b, n])
        options = [int(tree["tokens"][b, c]) for c in kids[b, last] if c >= 0]
        assert int(greedy[n]) not in options
    assert result.num_accepted.float().mean() > 0.2
    # greedy is deterministic: no randomness used
    again = verify_fields(ExactRule(), **tree, greedy=True, generator=torch.Generator().manual_seed(99))
    assert torch.equal(again.committed, result.committed)


def test_invalid_siblings_are_never_tested():
    q = torch.tensor([[0.0, 1.0, 0.0]])
    tokens, proposals, valid = sample_siblings(q, 3, torch.Generator().manual_seed(0))
    assert tokens[0, 0] == 1 and valid.tolist() == [[True, False, False]]
    torch.testing.assert_close(proposals[0, 0], q[0])
    target = torch.tensor([[0.2, 0.3, 0.5]])
    tree = dict(
        target_probs=torch.stack([target, target, target, target], 1),
        tokens=torch.cat([torch.zeros(1, 1, dtype=torch.long), tokens], 1),
        parents=torch.tensor([[-1, 0, 0, 0]]),
        proposals=torch.cat([target.unsqueeze(1), proposals], 1),
        depth=torch.tensor([[0, 1, 1, 1]]),
        valid=torch.cat([torch.ones(1, 1, dtype=torch.bool), valid], 1),
    )
    result = verify_fields(ExactRule(), **tree, generator=torch.Generator().manual_seed(0))
    assert result.tests.item() == 1


def test_sample_siblings_law():
    """Without replacement: P(first = a, second = b) = q(a) q(b) / (1 - q(a))."""
    q = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    tokens, proposals, valid = sample_siblings(q.expand(60_000, 4), 2, torch.Generator().manual_seed(0))
    assert valid.all() and torch.all(tokens[:, 0] != tokens[:, 1])
    expected = np.zeros(16)
    for a in range(3):
        for b in range(3):
            if a != b:
                expected[a * 4 + b] = q[0, a] * q[0, b] / (1 - q[0, a])
    assert chi_square_pvalue(tokens[:, 0] * 4 + tokens[:, 1], expected) > ALPHA
    rows = proposals[:, 1]
    manual = q.expand(60_000, 4).scatter(1, tokens[:, :1], 0.0)
    torch.testing.assert_close(rows, manual / manual.sum(1, keepdim=True))
    top_tokens, top_props, top_valid = topk_siblings(q, 5)
    assert top_tokens[0, :3].tolist() == [0, 1, 2] and top_valid[0].tolist() == [True, True, True, False, False]
    torch.testing.assert_close(top_props[0, 1], torch.tensor([0.0, 1.0, 0.0, 0.0]))
