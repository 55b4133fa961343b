"""GSD (grouped speculative decoding, arXiv 2508.07747): the group construction against a
brute-force reading of the published code, the one-step law by enumeration against its closed
form, the TV record, greedy semantics, and decoding with the Jacobi window and the EAGLE drafter."""

from __future__ import annotations

import pytest
import torch

from relaxspec import methods
from relaxspec.acceptance.base import one_hot
from relaxspec.acceptance.gsd import GroupRule
from relaxspec.decoding import decode
from relaxspec.decoding.ar import generate_ar
from relaxspec.sampling import SamplingConfig
from helpers.engine import fake_vq, markov_pair

V = 9


def simplex(rows: int, vocab: int, seed: int, zeros: float = 0.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(rows, vocab, generator=gen, dtype=torch.float64) ** 3
    x[torch.rand(rows, vocab, generator=gen) < zeros] = 0.0
    x[:, 0] += 1e-3  # no empty row
    return (x / x.sum(1, keepdim=True)).float()


def embeddings(seed: int = 0) -> torch.Tensor:
    """Nine codes in three tight clusters (squared distances ~0.02 inside, >= 2 across)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
    return centres.repeat_interleave(3, 0) + 0.05 * torch.randn(V, 2, generator=gen)


def reference_group(p: list[float], e: torch.Tensor, x: int, ranks: int, p_gap: float, distance: float) -> list[int]:
    """The published construction, written out: the ascending (stable) ranking of ``p``, the slice
    of ``ranks`` positions below and ``ranks - 1`` above ``x`` (cut at the ends), the probability
    and squared-distance filters, ``x`` always kept."""
    order = sorted(range(len(p)), key=lambda y: (p[y], y))
    r = order.index(x)
    window = order[max(r - ranks, 0): r + ranks]
    return [y for y in window if y == x or (abs(p[y] - p[x]) < p_gap and float(((e[y] - e[x]) ** 2).sum()) < distance)]


def reference_law(p: torch.Tensor, q: torch.Tensor, e: torch.Tensor, ranks: int, p_gap: float,
                  distance: float) -> torch.Tensor:
    """``out(y) = q(y) a(y) + beta r(y)`` (REFERENCE §1.5), row by row in float64."""
    out = torch.zeros(p.shape, dtype=torch.float64)
    for b in range(p.shape[0]):
        pb, qb = p[b].double(), q[b].double()
        accept = torch.zeros(V, dtype=torch.float64)
        for x in range(V):
            group = reference_group(pb.tolist(), e, x, ranks, p_gap, distance)
            big_p, big_q = float(pb[group].sum()), float(qb[group].sum())
            accept[x] = 0.0 if pb[x] == 0 else (min(1.0, big_p / big_q) if big_q > 0 else 1.0)
        residual = (pb - qb).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else pb
        out[b] = qb * accept + (1 - (qb * accept).sum()) * residual
    return out


SETTINGS = [(7, 0.15, 0.5), (2, 1.0, 0.5), (3, 0.05, 10.0), (7, 1.0, 10.0)]


@pytest.mark.parametrize("ranks, p_gap, distance", SETTINGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_one_step_law_matches_the_closed_form_by_enumeration(ranks, p_gap, distance, seed):
    e = embeddings(seed)
    rule = GroupRule(e, ranks, p_gap, distance)
    p, q = simplex(6, V, seed, zeros=0.2), simplex(6, V, seed + 10)
    expected = reference_law(p, q, e, ranks, p_gap, distance)
    # Enumerating the draft through the rule's own test and residual gives the same law ...
    enumerated = torch.zeros_like(expected)
    for x in range(V):
        token = torch.full((6,), x, dtype=torch.long)
        alpha = rule.accept_prob(p, q, token, 1).double()[:, None]
        enumerated += q[:, x, None].double() * (alpha * one_hot(token, V, torch.float64)
                                                + (1 - alpha) * rule.residual(p, q, token, 1).double())
    torch.testing.assert_close(enumerated, expected, atol=1e-5, rtol=0)
    # ... and so does its closed form, which the TV record uses.
    torch.testing.assert_close(rule.one_step_law(p, q, 1).double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(expected.sum(1), torch.ones(6, dtype=torch.float64), atol=1e-6, rtol=0)
    tv = 0.5 * (expected - p.double()).abs().sum(1)
    torch.testing.assert_close(rule.step_tv(p, q, torch.zeros(6, dtype=torch.long), 1).double(), tv, atol=1e-5, rtol=0)


def test_the_worked_example_is_lossy():
    """p = (.5, .3, .2), q = (.2, .5, .3), groups {0, 1}, {0, 1}, {2}: a = (1, 1, 2/3), the
    residual is all on 0, and the output law is (.3, .5, .2), not p."""
    e = torch.tensor([[0.0, 0.0], [0.1, 0.0], [5.0, 0.0]])
    rule = GroupRule(e, ranks=7, p_gap=1.0, distance=0.5)
    p, q = torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([[0.2, 0.5, 0.3]])
    alphas = [float(rule.accept_prob(p, q, torch.tensor([x]), 1)) for x in range(3)]
    assert alphas == pytest.approx([1.0, 1.0, 2 / 3])
    torch.testing.assert_close(rule.one_step_law(p, q, 1), torch.tensor([[0.3, 0.5, 0.2]]))
    assert not rule.lossless


def test_groups_follow_the_published_construction():
    e = embeddings(3)
    p = simplex(4, V, 7)
    for ranks, p_gap, distance in SETTINGS:
        rule = GroupRule(e, ranks, p_gap, distance)
        order, rank = rule._ranking(p)
        tokens = torch.arange(V).expand(4, V)
        candidates, keep = rule._groups(p, order, rank, tokens)
        for b in range(4):
            for x in range(V):
                got = sorted(set(candidates[b, x][keep[b, x]].tolist()))
                assert got == sorted(reference_group(p[b].tolist(), e, x, ranks, p_gap, distance))


def test_a_new_table_at_a_reused_address_gets_its_own_closeness_table():
    """Issue 20: the table cache was keyed by the tensor's address (and version, shape, dtype), so
    a new embedding tensor at a freed one's address read the old table. Two tensors over one numpy
    buffer force the reuse: same address, shape, dtype and version (numpy writes bump no torch
    version counter), different vectors."""
    import gc

    import numpy as np

    buffer = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32) * 0.05
    first = torch.from_numpy(buffer)
    assert int(GroupRule(first, distance=0.5).close_table("cpu").sum()) == 64 * 64  # all close
    del first
    gc.collect()
    buffer *= 20 * 20  # 20x the scale: only each code itself stays within the distance
    second = torch.from_numpy(buffer)
    rule = GroupRule(second, distance=0.5)
    assert int(rule.close_table("cpu").sum()) == 64
    # A rule over the same live owner shares its table; another owner of the same vectors does not.
    model = torch.nn.Embedding(64, 8)
    with torch.no_grad():
        model.weight.copy_(second)
    shared = GroupRule(model.weight[:64], distance=0.5)
    assert GroupRule(model.weight[:64], distance=0.5).close_table("cpu") is shared.close_table("cpu")
    assert GroupRule(model.weight[:64], distance=0.5, owner=torch.nn.Module()).close_table("cpu") is not shared.close_table("cpu")
    # Weights changed in place (training) bump the version: a new table.
    with torch.no_grad():
        model.weight.mul_(0.0)
    assert int(GroupRule(model.weight[:64], distance=0.5).close_table("cpu").sum()) == 64 * 64


@pytest.mark.parametrize("ranks, p_gap, distance", [(0, 1.0, 10.0), (7, 0.0, 10.0), (7, 1.0, 0.0)])
def test_a_group_of_one_is_the_exact_rule(ranks, p_gap, distance):
    rule = GroupRule(embeddings(), ranks, p_gap, distance)
    p, q = simplex(5, V, 2, zeros=0.3), simplex(5, V, 3)
    assert rule.lossless
    torch.testing.assert_close(rule.one_step_law(p, q, 1), p, atol=1e-6, rtol=0)


def test_a_token_the_target_gives_no_mass_is_never_accepted():
    """REFERENCE §4 (the published code would accept it for its neighbours' mass)."""
    e = torch.zeros(V, 2)  # every code is every other's neighbour
    rule = GroupRule(e, ranks=7, p_gap=1.0, distance=1.0)
    p = torch.tensor([[0.0] + [1 / 8] * 8])
    q = torch.full((1, V), 1 / V)
    assert float(rule.accept_prob(p, q, torch.tensor([0]), 1)) == 0.0
    # Token 1's window (ranks 0..7 of the ascending order) holds 0 .. 7: P = 7/8, Q = 8/9.
    assert float(rule.accept_prob(p, q, torch.tensor([1]), 1)) == pytest.approx((7 / 8) / (8 / 9))
    assert float(rule.one_step_law(p, q, 1)[0, 0]) == 0.0


def test_greedy_boosts_the_draft_to_its_group_mass():
    e = embeddings(0)
    rule = GroupRule(e, ranks=7, p_gap=1.0, distance=0.5)
    p = torch.tensor([[0.30, 0.05, 0.05, 0.35, 0.0, 0.0, 0.25, 0.0, 0.0]])
    # 0's group is {0, 1, 2} (one cluster): 0.40 beats 3's 0.35; 6's group {6} does not.
    assert bool(rule.greedy_accept(p, torch.tensor([0]), 1)) and not bool(rule.greedy_accept(p, torch.tensor([6]), 1))
    assert bool(rule.greedy_accept(p, torch.tensor([3]), 1))  # the argmax is never rejected
    assert int(rule.greedy_correction(p)) == 3


@pytest.fixture(scope="module")
def markov():
    return markov_pair()


@pytest.mark.parametrize("draft", ["jacobi", "chain", "static"])
def test_gsd_decodes_with_the_jacobi_window_and_the_drafter(markov, draft, monkeypatch, tmp_path):
    model, drafter = markov
    cond = torch.arange(4)
    given = {"draft": draft, **({"window": 6} if draft == "jacobi" else {}), **({"tree": "eagle25"} if draft == "static" else {})}
    # Greedy with a group of one is greedy AR, token for token, on every structure.
    greedy = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    exact = methods.resolve("gsd", {**given, "group_p_gap": 0.0})
    ar = generate_ar(model, cond, greedy).tokens
    result = decode(model, cond, greedy, exact, drafter=drafter, vq=fake_vq(model.config.vocab_size))
    assert torch.equal(result.tokens, ar) and float(result.step_tv.sum()) == 0.0
    # Sampling with real groups: every row finishes, and the TV record is kept.
    sampling = SamplingConfig(cfg_scale=4.0, top_k=20)
    relaxed = methods.resolve("gsd", {**given, "group_p_gap": 1.0, "group_distance": 1e9})
    result = decode(model, cond, sampling, relaxed, drafter=drafter, generator=torch.Generator().manual_seed(0))
    assert [sum(a) for a in result.accept_lengths] == [model.config.block_size] * 4
    assert result.tv_recorded and float(result.step_tv.sum()) > 0.0
    assert relaxed.needs_drafter == (draft != "jacobi")


def test_gsd_reads_the_codebook_when_asked(markov):
    model, _ = markov
    vq = fake_vq(model.config.vocab_size)
    options = methods.resolve("gsd", {"group_latent": "codebook", "window": 4})
    _, rule = options.family.build(options, methods.BuildContext(target=model, tokenizer=vq))
    assert torch.equal(rule.embeddings, vq.codebook.float())
    options = methods.resolve("gsd")
    _, rule = options.family.build(options, methods.BuildContext(target=model))  # a rule's input: one field
    assert rule.embeddings.shape == (model.config.vocab_size, model.config.dim)


@pytest.mark.slow
def test_gsd_from_the_command_line(tmp_path):
    """``relaxspec generate --method gsd`` on the embedded model: drafter-free, its settings and
    only those recorded, a TV record kept."""
    import json

    from relaxspec.cli import main

    out = tmp_path / "gsd"
    assert main(["generate", "--method", "gsd", "--window", "4", "--group-ranks", "3", "--classes", "heart,time",
                 "--out", str(out), "--no-progress"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["settings"]["method"] == {"method": "gsd", "draft": "jacobi", "window": 4, "compile": False,
                                           "record_tv": True, "group_ranks": 3, "group_p_gap": 0.15,
                                           "group_distance": 0.5, "group_latent": "embedding"}
    assert stats["settings"]["drafter_ckpt"] is None and stats["totals"]["mean_accepted_length"] > 1.0
    assert stats["totals"]["tv_sum_mean"] > 0.0
    from relaxspec import embedded

    assert main(["generate", "--method", "gsd", "--drafter-ckpt", str(embedded.path("drafter")), "--classes", "heart",
                 "--out", str(tmp_path / "no")]) == 2  # a drafter GSD's Jacobi window would not read


@pytest.mark.slow
def test_gsd_compiled_gives_the_eager_tokens(markov, monkeypatch):
    """The tree walk with GSD's rule inside compiles (fullgraph) and decodes what eager decoding
    decodes, sampled and greedy, with its grouping on. (dynamo traces it and aot_eager runs it: the
    inductor backend's own kernels are tested on other methods, tests/test_fast_engine.py, at ~20 s
    of compiling a graph on this CPU.)"""
    import relaxspec.compiling

    monkeypatch.setattr(relaxspec.compiling, "BACKEND", "aot_eager")
    model, drafter = markov
    cond = torch.arange(2)
    for sampling in (SamplingConfig(cfg_scale=4.0, top_k=20), SamplingConfig(cfg_scale=4.0, temperature=0.0)):
        runs = [decode(model, cond, sampling, methods.resolve("gsd", {"window": 4, "group_p_gap": 1.0,
                                                                      "group_distance": 1e9, "compile": compile}),
                       generator=torch.Generator().manual_seed(3)).tokens for compile in (False, True)]
        assert torch.equal(*runs)
