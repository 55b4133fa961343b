"""The drafter's distillation maths (relaxspec.training.drafter.maths) against closed forms built
by hand: the one-position pairing, the per-depth attention mask, the chain's tokens per step, the
decoding law and the loss. No model runs here: tensors in, tensors out."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from relaxspec.sampling import SamplingConfig, process_logits
from relaxspec.training.drafter.maths import (
    chain_mal,
    drafter_inputs,
    drafter_loss,
    drafter_targets,
    guided_log_law,
    unrolled_mask,
)

LAW_LOSSES = ("ce", "kl", "tv", "kl+tv")
#: CFG, a temperature and both filters: every step of the decoding law is exercised.
FILTERED = SamplingConfig(cfg_scale=3.0, temperature=0.7, top_k=4, top_p=0.9)


# --------------------------------------------------------------------------- the pairing
def numbered(rows: int, n: int, dim: int) -> torch.Tensor:
    """``[rows, n, dim]`` whose entry ``[r, j, c]`` is ``1000 r + 10 j + c``: any shift shows."""
    r, j, c = torch.meshgrid(torch.arange(rows), torch.arange(n), torch.arange(dim), indexing="ij")
    return (1000 * r + 10 * j + c).double()


def test_pair_j_is_the_feature_that_predicted_token_j_and_that_token():
    rows, n, dim = 3, 6, 4
    features = numbered(rows, n, dim)
    tokens = torch.arange(rows * n).reshape(rows, n) * 7
    in_features, in_tokens, positions = drafter_inputs(features, tokens)
    assert in_features.shape == (rows, n - 1, dim) and in_tokens.shape == (rows, n - 1)
    for j in range(n - 1):
        assert torch.equal(in_features[:, j], features[:, j])
        assert torch.equal(in_tokens[:, j], tokens[:, j])
    # RoPE positions: image-token index j, the same in every row
    assert torch.equal(positions, torch.arange(n - 1).expand(rows, n - 1))


def test_pair_j_must_predict_the_feature_and_logits_of_token_j_plus_one():
    rows, n, dim, vocab = 3, 6, 4, 5
    features, logits = numbered(rows, n, dim), numbered(rows, n, vocab) + 0.5
    next_features, next_logits = drafter_targets(features, logits)
    assert next_features.shape == (rows, n - 1, dim) and next_logits.shape == (rows, n - 1, vocab)
    for j in range(n - 1):
        assert torch.equal(next_features[:, j], features[:, j + 1])
        assert torch.equal(next_logits[:, j], logits[:, j + 1])


def test_inputs_and_targets_are_one_position_apart():
    """Input j and target j are the pass's rows j and j + 1: exactly one apart, not zero, not two."""
    rows, n, dim = 2, 7, 3
    features = numbered(rows, n, dim)
    in_features, _, _ = drafter_inputs(features, torch.zeros(rows, n, dtype=torch.long))
    next_features, _ = drafter_targets(features, features)
    assert torch.equal(next_features[:, :-1], in_features[:, 1:])
    assert torch.equal(next_features - in_features, torch.full_like(in_features, 10.0))  # 10 per position


# --------------------------------------------------------------------------- the depth mask
def reference_mask(count: int, depths: int) -> torch.Tensor:
    """The docstring's rule, one query at a time: level ``k``'s query at pair ``i`` is the ``k``-th
    draft after committed token ``j = i - k + 1``; it sees level 1 at pairs ``<= j`` and level
    ``m`` (``2 <= m <= k``) only at pair ``j + m - 1``."""
    size = depths * count
    mask = torch.zeros(size, size, dtype=torch.bool)
    for k, i in itertools.product(range(1, depths + 1), range(count)):
        query, j = (k - 1) * count + i, i - k + 1
        for p in range(count):
            if p <= j:
                mask[query, p] = True  # level 1: the target's features up to the committed token
        for m in range(2, k + 1):
            p = j + m - 1
            if 0 <= p < count:
                mask[query, (m - 1) * count + p] = True  # the drafts of its own chain
    return mask


@pytest.mark.parametrize("count, depths", [(c, d) for c in range(1, 6) for d in range(1, 5)])
def test_unrolled_mask_is_the_per_depth_chain_rule(count, depths):
    assert torch.equal(unrolled_mask(count, depths), reference_mask(count, depths))


def test_one_depth_is_the_causal_mask_and_no_query_is_blind():
    assert torch.equal(unrolled_mask(5, 1), torch.ones(5, 5, dtype=torch.bool).tril())
    mask = unrolled_mask(4, 3)
    assert mask.diagonal().all()  # every query sees itself: no row is all -inf in attention
    # level 3 at pair 3 (committed token 1): level 1 at pairs 0, 1; level 2 at pair 2; itself
    assert mask[2 * 4 + 3].nonzero().flatten().tolist() == [0, 1, 4 + 2, 8 + 3]


# --------------------------------------------------------------------------- chain MAL
def test_chain_mal_closed_forms():
    cases = [([0.5, 0.4, 0.2], 1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.2),
             ([0.0, 0.0, 0.0], 1.0),  # nothing accepted: the target's own token only
             ([1.0, 1.0, 1.0, 1.0], 5.0),  # every draft accepted: four drafts + the bonus token
             ([0.9, 0.0, 1.0], 1.9)]  # a rejection at depth 2 ends the chain
    for accept, expected in cases:
        assert chain_mal(torch.tensor(accept, dtype=torch.float64)).item() == pytest.approx(expected, abs=1e-12)


def test_chain_mal_is_the_mean_accepted_length_of_independent_depths():
    """Enumerate every accept pattern of depths accepted independently at ``rates``: the mean
    number of tokens per step (1 + the leading run of accepts) is ``chain_mal(rates)``."""
    rates = [0.8, 0.6, 0.3, 0.9]
    mean_length = 0.0
    for pattern in itertools.product((0, 1), repeat=len(rates)):
        probability = math.prod(r if a else 1 - r for r, a in zip(rates, pattern))
        leading = next((d for d, a in enumerate(pattern) if not a), len(pattern))
        mean_length += probability * (1 + leading)
    assert chain_mal(torch.tensor(rates, dtype=torch.float64)).item() == pytest.approx(mean_length, abs=1e-12)


def test_chain_mal_of_mean_rates_is_not_the_mean_length_of_correlated_patterns():
    """What "treats the depths' mean rates as independent" means: two steps, one accepting only
    depth 1 and one only depth 2, have mean rates (0.5, 0.5) and chain_mal 1.75, while their mean
    accepted length is 1.5."""
    patterns = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mean_length = 1 + sum(next((d for d, a in enumerate(p.tolist()) if not a), 2) for p in patterns) / len(patterns)
    assert mean_length == 1.5
    assert chain_mal(patterns.mean(dim=0)).item() == pytest.approx(1.75)


# --------------------------------------------------------------------------- the decoding law
COND = [2.0, 1.0, 0.5, -1.0, 0.0]
NULL = [1.0, 1.5, 0.0, 0.5, -0.5]


def log_softmax_by_hand(values: list[float]) -> list[float]:
    top = max(values)
    log_total = top + math.log(sum(math.exp(v - top) for v in values))
    return [v - log_total for v in values]


def test_guided_log_law_is_the_guided_tempered_log_softmax():
    scale, temperature = 3.0, 0.7
    guided = [u + scale * (c - u) for c, u in zip(COND, NULL)]
    expected = log_softmax_by_hand([g / temperature for g in guided])
    logits = torch.tensor([COND, NULL], dtype=torch.float64)
    law = guided_log_law(logits, SamplingConfig(cfg_scale=scale, temperature=temperature))
    assert law.shape == (1, 5) and law.dtype == torch.float32
    assert law[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_guided_log_law_without_cfg_keeps_every_row():
    logits = torch.tensor([COND, NULL])
    law = guided_log_law(logits, SamplingConfig(cfg_scale=1.0, temperature=2.0))
    assert law.shape == (2, 5)
    for row, values in zip(law, (COND, NULL)):
        assert row.tolist() == pytest.approx(log_softmax_by_hand([v / 2.0 for v in values]), abs=1e-6)


def test_guided_log_law_is_taken_before_the_filters():
    """Its docstring's "before its filters": top-k / top-p leave it unchanged (drafter_loss's KL
    renormalises it on the target's filtered support instead)."""
    logits = torch.tensor([COND, NULL])
    plain = guided_log_law(logits, SamplingConfig(cfg_scale=3.0, temperature=0.7))
    filtered = guided_log_law(logits, SamplingConfig(cfg_scale=3.0, temperature=0.7, top_k=2, top_p=0.5))
    assert torch.equal(plain, filtered)


# --------------------------------------------------------------------------- the loss
def streams(batch: int, count: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    """Raw logits ``[2 * batch, count, vocab]`` (``[cond; null]`` rows)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2 * batch, count, vocab, generator=generator, dtype=torch.float64) * scale


def exact_prediction(next_features: torch.Tensor, next_logits: torch.Tensor, depths: int):
    """Predictions equal to the targets at every depth: ``[R, D, T, ...]``."""
    return (next_features[:, None].expand(-1, depths, -1, -1).clone(),
            next_logits[:, None].expand(-1, depths, -1, -1).clone())


def valid_mean(values: torch.Tensor) -> torch.Tensor:
    """``values [rows, D, T]`` -> ``[D]``: depth ``d`` (0-based) averages pairs ``i >= d``."""
    return torch.stack([values[:, d, d:].mean() for d in range(values.shape[1])])


@pytest.mark.parametrize("law_loss", LAW_LOSSES)
def test_the_loss_is_zero_when_the_drafter_is_the_target(law_loss):
    batch, depths, count, dim, vocab = 2, 3, 5, 4, 7
    next_logits = streams(batch, count, vocab, seed=1)
    next_features = torch.randn(2 * batch, count, dim, generator=torch.Generator().manual_seed(2),
                                dtype=torch.float64)
    pred_features, pred_logits = exact_prediction(next_features, next_logits, depths)
    result = drafter_loss(pred_features, pred_logits, next_features, next_logits, law_loss=law_loss,
                          sampling=FILTERED, ce_weight=0.1, distill_weight=1.0)
    assert result["feature_loss"].item() == 0.0
    assert result["accept"].tolist() == pytest.approx([1.0] * depths, abs=1e-6)
    assert result["top1"].tolist() == [1.0] * depths and result["accuracy"].item() == 1.0
    assert result["chain_mal"].item() == pytest.approx(1 + depths, abs=1e-5)
    if law_loss == "ce":
        # EAGLE's cross-entropy floors at the raw law's entropy, per stream, averaged like the loss
        probs = next_logits.softmax(dim=-1)
        entropy = -(probs * probs.log()).sum(dim=-1)  # [R, T]
        expected = valid_mean(entropy[:, None].expand(-1, depths, -1)).mean()
        assert result["ce"].item() == pytest.approx(expected.item(), abs=1e-6)
        assert result["loss"].item() == pytest.approx(0.1 * expected.item(), abs=1e-6)
    else:
        for term in law_loss.split("+"):
            assert result[term].item() == pytest.approx(0.0, abs=1e-6)
        assert result["loss"].item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("law_loss", LAW_LOSSES)
def test_the_loss_is_positive_when_the_drafter_is_not_the_target(law_loss):
    batch, depths, count, dim, vocab = 2, 2, 4, 3, 7
    next_logits = streams(batch, count, vocab, seed=3)
    next_features = torch.zeros(2 * batch, count, dim, dtype=torch.float64)
    pred_features, pred_logits = exact_prediction(next_features, next_logits, depths)
    exact = drafter_loss(pred_features, pred_logits, next_features, next_logits, law_loss=law_loss,
                         sampling=FILTERED, feature_weight=0.0)
    wrong_logits = pred_logits + streams(batch, depths * count, vocab, seed=4).reshape_as(pred_logits)
    wrong = drafter_loss(pred_features, wrong_logits, next_features, next_logits, law_loss=law_loss,
                         sampling=FILTERED, feature_weight=0.0)
    for term in ("ce",) if law_loss == "ce" else law_loss.split("+"):
        assert wrong[term].item() > exact[term].item() + 1e-3  # ce: Gibbs, the entropy is its minimum
    assert wrong["loss"].item() > exact["loss"].item() + 1e-3
    assert (wrong["accept"] < 1 - 1e-3).all()
    moved = drafter_loss(pred_features + 0.5, pred_logits, next_features, next_logits, law_loss=law_loss,
                         sampling=FILTERED)
    assert moved["feature_loss"].item() == pytest.approx(0.5 * 0.5**2)  # SmoothL1 below 1: x^2 / 2


def test_feature_loss_is_smooth_l1_per_element():
    next_features = torch.zeros(2, 3, 4, dtype=torch.float64)
    next_logits = torch.zeros(2, 3, 5, dtype=torch.float64)
    for shift, expected in ((0.5, 0.125), (2.0, 1.5), (-3.0, 2.5)):
        result = drafter_loss(next_features[:, None] + shift, next_logits[:, None], next_features, next_logits)
        assert result["feature_loss"].item() == pytest.approx(expected)


def test_kl_and_tv_by_hand_on_the_filtered_guided_laws():
    """The terms on a 5-token vocabulary, by hand: ``p`` is the target's guided, tempered law kept
    on its top-k / top-p support and renormalised; ``q`` the drafter's law filtered the same way
    on its own support; KL compares ``p`` with the drafter's guided law renormalised on ``p``'s
    support; TV is half the L1 distance of ``p`` and ``q``."""
    scale, temperature, top_k, top_p = 3.0, 1.5, 3, 0.8
    sampling = SamplingConfig(cfg_scale=scale, temperature=temperature, top_k=top_k, top_p=top_p)
    target = torch.tensor([[COND], [NULL]], dtype=torch.float64)  # [2, T=1, V=5]
    drafter = torch.tensor([[[0.5, 2.0, 1.0, 0.0, -1.0]], [[0.0, 1.0, 1.0, 0.5, 0.0]]], dtype=torch.float64)

    def filtered_law(cond: list[float], null: list[float]) -> tuple[list[float], list[float], set[int]]:
        guided = [(u + scale * (c - u)) / temperature for c, u in zip(cond, null)]
        law = [math.exp(v) for v in log_softmax_by_hand(guided)]
        order = sorted(range(5), key=lambda x: -law[x])
        top = order[:top_k]  # (no ties here)
        mass = sum(law[x] for x in top)
        kept, total = [], 0.0
        for x in top:  # top-p on the top-k law: keep tokens until the kept mass passes top_p
            kept.append(x)
            total += law[x] / mass
            if total > top_p:
                break
        support = set(kept)
        norm = sum(law[x] for x in support)
        return [law[x] / norm if x in support else 0.0 for x in range(5)], law, support

    p, _, support = filtered_law(COND, NULL)
    q, q_guided, _ = filtered_law(drafter[0, 0].tolist(), drafter[1, 0].tolist())
    q_on_p = sum(q_guided[x] for x in support)
    kl = sum(p[x] * math.log(p[x] / (q_guided[x] / q_on_p)) for x in support)
    tv = 0.5 * sum(abs(a - b) for a, b in zip(p, q))
    assert support == {0, 2}  # top-k drops tokens 1 and 3, top-p token 4
    assert q[1] > 0 and p[1] == 0  # and the drafter keeps a token the target dropped

    features = torch.zeros(2, 1, 1, dtype=torch.float64)
    result = drafter_loss(features[:, None], drafter[:, None], features, target, law_loss="kl+tv",
                          sampling=sampling, feature_weight=0.0, distill_weight=2.0)
    assert result["kl"].item() == pytest.approx(kl, abs=1e-6)
    assert result["tv"].item() == pytest.approx(tv, abs=1e-6)
    assert result["loss"].item() == pytest.approx(2.0 * (kl + tv), abs=1e-5)
    assert result["accept"].tolist() == pytest.approx([1 - tv], abs=1e-6)


def test_per_depth_means_count_only_pairs_with_a_chain():
    """Depth ``d`` counts pairs ``i >= d - 1``: garbage where no chain exists changes nothing."""
    batch, depths, count, dim, vocab = 2, 3, 5, 4, 6
    generator = torch.Generator().manual_seed(5)
    next_logits = streams(batch, count, vocab, seed=6)
    next_features = torch.randn(2 * batch, count, dim, generator=generator, dtype=torch.float64)
    pred_features = torch.randn(2 * batch, depths, count, dim, generator=generator, dtype=torch.float64)
    pred_logits = streams(batch, depths * count, vocab, seed=7).reshape(2 * batch, depths, count, vocab)
    spoiled_features, spoiled_logits = pred_features.clone(), pred_logits.clone()
    for d in range(1, depths):
        spoiled_features[:, d, :d] = 1e3
        spoiled_logits[:, d, :d] = torch.linspace(-50, 50, vocab, dtype=torch.float64)
    for law_loss in LAW_LOSSES:
        clean = drafter_loss(pred_features, pred_logits, next_features, next_logits, law_loss=law_loss,
                             sampling=FILTERED)
        spoiled = drafter_loss(spoiled_features, spoiled_logits, next_features, next_logits, law_loss=law_loss,
                               sampling=FILTERED)
        for name in clean:
            assert torch.allclose(clean[name], spoiled[name], atol=1e-6), (law_loss, name)
    # and accept at depth d is the mean 1 - TV over those pairs, by hand
    p, q = process_logits(next_logits, FILTERED)[:, None], process_logits(pred_logits, FILTERED)
    tv = 0.5 * (p - q).abs().sum(dim=-1)
    assert clean["accept"].tolist() == pytest.approx(valid_mean(1 - tv).tolist(), abs=1e-6)


def test_only_the_trained_depths_enter_the_loss_but_every_depth_is_measured():
    batch, depths, count, dim, vocab = 1, 3, 4, 2, 5
    next_logits = streams(batch, count, vocab, seed=8)
    next_features = torch.zeros(2 * batch, count, dim, dtype=torch.float64)
    pred_features, pred_logits = exact_prediction(next_features, next_logits, depths)
    off, off_features = pred_logits.clone(), pred_features.clone()
    off[:, 2] += streams(batch, count, vocab, seed=9)  # depth 3 only
    off_features[:, 2] += 1.0
    for law_loss in LAW_LOSSES:
        exact, exact_all = (drafter_loss(pred_features, pred_logits, next_features, next_logits, law_loss=law_loss,
                                         sampling=FILTERED, train_depths=train_depths) for train_depths in (2, None))
        trained = drafter_loss(off_features, off, next_features, next_logits, law_loss=law_loss,
                               sampling=FILTERED, train_depths=2)
        assert trained["loss"].item() == pytest.approx(exact["loss"].item(), abs=1e-9), law_loss
        assert trained["accept"][:2].tolist() == pytest.approx(exact["accept"][:2].tolist(), abs=1e-9)
        assert trained["accept"][2].item() < 1 - 1e-3
        counted = drafter_loss(off_features, off, next_features, next_logits, law_loss=law_loss,
                               sampling=FILTERED)
        assert counted["loss"].item() > exact_all["loss"].item() + 1e-4, law_loss
