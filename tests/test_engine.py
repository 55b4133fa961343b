"""The speculative engine, end to end, against the plain autoregressive law.

The batch dimension is the sample dimension. On a tiny random LlamaGen-style target
(vocabulary ``V = 4``, a 2x2 grid, so ``V**4 = 256`` whole images) the exact law of every image
is enumerated with teacher forcing (:meth:`Transformer.forward_train` + the same
:func:`relaxspec.sampling.process_logits` the engine uses), and ``N = 100000`` images drawn by
each speculative method are compared with it by a chi-square test at ``alpha = 1e-3``.

Power. Cells whose expected count is below 5 are pooled. For any alternative law at total
variation ``eps`` from the truth, Cauchy-Schwarz gives the non-centrality
``lambda = N * sum (p' - p)^2 / p >= N * (sum |p' - p|)^2 = 4 N eps^2`` (pooling only cells with
``p < 5e-5`` changes ``eps`` negligibly), i.e. ``lambda >= 160`` for ``eps = 0.02``;
:func:`chi_square_pvalue` asserts that the test rejects such an alternative with probability
> 0.9 for the number of cells it actually used, and :func:`test_whole_image_chi_square_has_power`
shows it rejecting a method that is *not* lossless (LANTERN with a large budget).

A 4-token image lets the first step test drafts down to depth 2 only (deeper nodes exist but
are invalid); depth is exercised by the greedy tests: token-for-token equality with
:func:`generate_ar` on a 4x4 grid with a "good" drafter (a target that is nearly a Markov chain
over tokens and a drafter that computes that chain), so rows of a batch accept different lengths.

Also here: the law of token 1 under relaxed rules (LANTERN, COOL-SD) against
``rule.one_step_law`` and the engine's TV record; batched sampling smoke tests. (KV compaction,
option validation, the drafter cache and the seams: tests/test_engine_parts.py.)
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import torch
from scipy import stats

from relaxspec.acceptance import CoolRule, ExactRule, LanternRule, neighbour_table
from relaxspec.decoding import DecodeResult, decode
from relaxspec.methods import MethodOptions
from relaxspec.decoding.ar import generate_ar
from helpers.draws import passes, plackett_luce
from helpers.engine import SMALL_TREE, fake_vq, markov_pair, tiny_drafter, tiny_target
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.drafting.dynamic_tree import DynamicTree
from relaxspec.drafting.eagle_source import EagleSource
from relaxspec.drafting.jacobi import JacobiSource
from relaxspec.drafting.static_tree import StaticTree
from relaxspec.drafting.trees import EAGLE25, TreeSpec, load_tree
from relaxspec.models.llamagen.gpt import Transformer
from relaxspec.sampling import SamplingConfig, process_logits

ALPHA = 1e-3
N_SAMPLES = 100_000
CHUNK = 25_000  # images per engine call
CLASS = 1



# --------------------------------------------------------------------------- models
# --------------------------------------------------------------------------- exact laws
def guided_probs(model: Transformer, cls: int, tokens: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Teacher-forced processed distributions ``[S, N, V]`` (row k = law of token k)."""
    cond = torch.full((tokens.shape[0],), cls, dtype=torch.long)
    with torch.no_grad():
        logits = model.forward_train(cond, tokens)
        if sampling.use_cfg:
            logits = torch.cat([logits, model.forward_train(model.null_condition(cond), tokens)])
    return process_logits(logits, sampling).double()


def exact_image_law(model: Transformer, cls: int, sampling: SamplingConfig) -> torch.Tensor:
    """Law of all ``V**N`` images ``[V**N]`` (float64); image index = tokens read base V, first
    token most significant (the order of ``torch.cartesian_prod``)."""
    vocab, n_tok = model.config.vocab_size, model.config.block_size
    images = torch.cartesian_prod(*[torch.arange(vocab)] * n_tok)
    probs = guided_probs(model, cls, images, sampling)
    law = probs.gather(2, images[:, :, None]).squeeze(2).prod(dim=1)
    assert abs(float(law.sum()) - 1.0) < 1e-6
    return law


def image_index(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    weights = vocab ** torch.arange(tokens.shape[1] - 1, -1, -1)
    return (tokens.long() * weights).sum(dim=1)


def chi_square_pvalue(counts: np.ndarray, law: np.ndarray, min_expected: float = 5.0,
                      eps: float = 0.02) -> float:
    """Chi-square goodness of fit of ``counts`` to ``law`` with cells of expected count < 5
    pooled. Impossible cells (law 0) must be empty. Also asserts the test's power against any
    alternative at TV ``eps``: non-centrality ``>= 4 n eps^2`` (see the module docstring)."""
    counts = np.asarray(counts, dtype=np.float64)
    law = np.asarray(law, dtype=np.float64)
    n = counts.sum()
    impossible = law <= 0
    assert counts[impossible].sum() == 0, f"{int(counts[impossible].sum())} samples in cells of probability 0"
    expected = law * n
    order = np.argsort(expected)
    small = expected < min_expected
    obs, exp = list(counts[~small]), list(expected[~small])
    pooled_obs, pooled_exp = counts[small].sum(), expected[small].sum()
    if small.any():
        if pooled_exp < min_expected:  # fold the smallest big cell into the pool too
            big = next(i for i in order if not small[i])
            k = list(np.nonzero(~small)[0]).index(big)
            pooled_obs += obs.pop(k)
            pooled_exp += exp.pop(k)
        obs.append(pooled_obs)
        exp.append(pooled_exp)
    obs, exp = np.array(obs), np.array(exp)
    exp = exp * (obs.sum() / exp.sum())
    df = len(obs) - 1
    critical = stats.chi2.ppf(1 - ALPHA, df)
    power = stats.ncx2.sf(critical, df, 4 * n * eps**2)
    assert power > 0.9, f"chi-square test too weak: power {power:.3f} at TV {eps} with {df} dof"
    return float(stats.chisquare(obs, exp).pvalue)


def sample_images(run, n: int = N_SAMPLES, chunk: int = CHUNK, seed: int = 0) -> tuple[torch.Tensor, list[DecodeResult]]:
    """``run(batch, generator) -> DecodeResult`` called ``n / chunk`` times -> tokens ``[n, N]``."""
    results = []
    for i in range(n // chunk):
        generator = torch.Generator().manual_seed(10_000 * seed + i)
        results.append(run(chunk, generator))
    return torch.cat([r.tokens for r in results]), results


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny():
    model = tiny_target()
    return model, tiny_drafter(model)


# --------------------------------------------------------------------------- 1. exactness
EAGLE25_DEPTH2 = [list(p) for p in EAGLE25 if len(p) <= 2]

EXACT_CASES = {
    # name: (options, cfg scale, top-k, rule override). CFG doubles the cost of every forward, so
    # the trees run without it here; tree forwards with CFG are checked by test_greedy_matches_ar.
    # In a 4-token image the first step can test drafts up to depth 2 (the last token is the
    # bonus at best), the next ones depth 1: deeper nodes exist but are never valid.
    "sd-chain3-cfg2": (dict(method="sd", draft="chain", depth=3), 2.0, 0, None),
    # The part of EAGLE-1's tree a 4-token image can test (4 + 8 nodes); top-k 3 leaves the
    # root's 4th sampled sibling without support: an invalid placeholder node.
    "sd-eagle25depth2-sampled-cfg1-topk3": (dict(method="sd", draft="static", tree=EAGLE25_DEPTH2, siblings="sampled"), 1.0, 3, None),
    "sd-smalltree-topk-cfg1-topk3": (dict(method="sd", draft="static", tree=SMALL_TREE, siblings="topk"), 1.0, 3, None),
    "eagle2-dynamic-cfg1": (dict(method="eagle2", dynamic_top_k=3, total_tokens=8, depth=3), 1.0, 0, None),
    "sjd-cfg1-topk3": (dict(method="sjd", window=3), 1.0, 3, None),
    # SCD's coupled redraw must reuse the old draft of the *same* image position (an untested
    # one); coupling with the rejected draft one position earlier gave p = 4e-62 here.
    "scd-cfg2": (dict(method="scd", window=3), 2.0, 0, None),
    # SJD-PAC's siblings at both positions a 4-token image tests (width 2, depth 3: 2 + 4 drafts)
    "sjd-pac-cfg2-topk3": (dict(method="sjd-pac", window=6, tree_width=2, tree_depth=3), 2.0, 3, None),
    # COOL-SD with every weight <= 1 and the optimal residual G* is lossless (the w < 1 branch).
    "cool-w-at-most-1-chain3-cfg1-topk3": (dict(method="sd", draft="chain", depth=3), 1.0, 3, CoolRule(weights=(1.0, 0.6, 0.3))),
}


def run_case(model, drafter, options: dict, sampling: SamplingConfig, rule=None, tmp_path=None):
    options = dict(options)
    tree = options.get("tree")
    if isinstance(tree, list):  # a JSON static tree given as a file (the CLI's --draft path)
        path = tmp_path / "tree.json"
        path.write_text(json.dumps(tree))
        options["draft"] = str(path)
        options.pop("tree")
    opts = MethodOptions(**options)

    def cond_of(batch: int) -> torch.Tensor:
        return torch.full((batch,), CLASS, dtype=torch.long)

    if rule is None:
        return lambda batch, gen: decode(model, cond_of(batch), sampling, opts, generator=gen, drafter=drafter)
    return lambda batch, gen: decode(model, cond_of(batch), sampling, opts, generator=gen,
                                     drafter=drafter, rule=rule)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXACT_CASES))
def test_whole_image_law_is_exact(tiny, name, tmp_path):
    model, drafter = tiny
    options, cfg, top_k, rule = EXACT_CASES[name]
    sampling = SamplingConfig(cfg_scale=cfg, temperature=1.0, top_k=top_k)
    law = exact_image_law(model, CLASS, sampling)
    tokens, results = sample_images(run_case(model, drafter, options, sampling, rule, tmp_path))
    counts = torch.bincount(image_index(tokens, 4), minlength=law.numel()).numpy()
    pvalue = chi_square_pvalue(counts, law.numpy())
    assert pvalue > ALPHA, f"{name}: speculative images do not follow the AR law (p = {pvalue:.2e})"
    for r in results:
        # Lossless methods certify zero TV; the engine still did speculative work.
        assert float(r.step_tv.abs().max()) == 0.0 and float(r.tv_sum.abs().max()) == 0.0
        assert int(r.target_forwards.max()) <= 4
    mal = torch.cat([r.mean_accepted_length for r in results]).mean()
    assert mal > 1.05, f"{name}: MAL {mal:.3f}, the drafts are never accepted (a weak test)"


@pytest.mark.slow
def test_whole_image_chi_square_has_power(tiny, monkeypatch, tmp_path):
    """The same machinery rejects LANTERN with a large additive budget (not lossless)."""
    model, drafter = tiny
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    sampling = SamplingConfig(cfg_scale=1.0)
    options = MethodOptions(method="lantern", draft="chain", depth=3, k=3, delta=0.3)
    law = exact_image_law(model, CLASS, sampling)
    vq = fake_vq(4)
    tokens, results = sample_images(
        lambda batch, gen: decode(model, torch.full((batch,), CLASS), sampling, options, generator=gen,
                                  drafter=drafter, vq=vq))
    counts = torch.bincount(image_index(tokens, 4), minlength=law.numel()).numpy()
    assert chi_square_pvalue(counts, law.numpy()) < 1e-12
    assert torch.cat([r.tv_sum for r in results]).mean() > 0.01


# --------------------------------------------------------------------------- 4. relaxed laws
def first_step_laws(model: Transformer, drafter: EagleDrafter, cls: int, sampling: SamplingConfig):
    """For every value ``v`` of image token 0: ``p0 [V]`` (law of token 0), ``p1 [V, V]`` (target law
    of token 1 given token 0 = v) and ``q1 [V, V]`` (the drafter's processed law at that root),
    computed without the engine's caches: teacher forcing for the target, and one cache-free
    drafter call on (target feature that predicted token 0, token 0) at image position 0."""
    vocab = model.config.vocab_size
    roots = torch.arange(vocab)
    images = torch.stack([roots, *[torch.zeros_like(roots)] * (model.config.block_size - 1)], dim=1)
    probs = guided_probs(model, cls, images, sampling)  # [V, N, V]
    cond = torch.full((vocab,), cls, dtype=torch.long)
    if sampling.use_cfg:
        cond = torch.cat([cond, model.null_condition(cond)])
    streams = cond.shape[0] // vocab
    with torch.no_grad():
        _, hidden = model(cond=cond, return_hidden=True)
        feature = hidden[:, -1:]  # [S*V, 1, dim]: the state that predicted token 0
        tokens = roots.repeat(streams)[:, None]
        _, logits = drafter(feature, tokens, torch.zeros_like(tokens))
    q1 = process_logits(logits[:, 0], sampling).double()
    return probs[0, 0], probs[:, 1], q1


RELAXED_CASES = {
    # name: (options, cfg, expected rule built independently of the engine's build_rule)
    "lantern-delta0.3-relaxed-cfg2": (dict(method="lantern", draft="chain", depth=1, k=3, delta=0.3, residual="relaxed"), 2.0,
                                      lambda table: LanternRule(table, 3, delta=0.3, residual="relaxed")),
    "lantern-delta0.3-plain-cfg1": (dict(method="lantern", draft="chain", depth=1, k=3, delta=0.3, residual="plain"), 1.0,
                                    lambda table: LanternRule(table, 3, delta=0.3, residual="plain")),
    # The schedule's horizon is the chain depth: token 1 is tested at depth 1 with
    # w_1 = 2 e^-0.7 / mean(e^-0.7, e^-1.4, e^-2.1) = 3.44.
    "cool-delta2-chain3-cfg2": (dict(method="cool", draft="chain", depth=3, cool_delta=2.0), 2.0,
                                lambda table: CoolRule(delta=2.0, horizon=3)),
    "lantern-delta0-cfg1": (dict(method="lantern", draft="chain", depth=1, k=3, delta=0.0), 1.0,
                            lambda table: LanternRule(table, 3, delta=0.0)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RELAXED_CASES))
def test_relaxed_first_token_law_matches_one_step_law(tiny, name, monkeypatch, tmp_path):
    """Token 1 is always decided by one test at depth 1 of the first step, so its law given
    token 0 must be ``rule.one_step_law(p1, q1, 1)``; the engine's TV record for it must be
    ``rule.step_tv`` (0 for exact rules) and ``tv_sum`` the sum of the records."""
    model, drafter = tiny
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))  # LANTERN's neighbour-table cache
    options, cfg, make_rule = RELAXED_CASES[name]
    sampling = SamplingConfig(cfg_scale=cfg)
    vq = fake_vq(4)
    rule = make_rule(neighbour_table(vq.raw_codebook, 3))
    p0, p1, q1 = first_step_laws(model, drafter, CLASS, sampling)
    depth1 = torch.ones(4, dtype=torch.long)
    law1 = rule.one_step_law(p1, q1, depth1).double()
    expected = (p0[:, None] * law1).flatten().numpy()
    exact = (p0[:, None] * p1).flatten().numpy()
    tv1 = rule.step_tv(p1.float(), q1.float(), p1.argmax(1), depth1).double()

    opts = MethodOptions(**options)
    tokens, results = sample_images(
        lambda batch, gen: decode(model, torch.full((batch,), CLASS), sampling, opts, generator=gen,
                                  drafter=drafter, vq=vq))
    counts = torch.bincount(tokens[:, 0] * 4 + tokens[:, 1], minlength=16).numpy()
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > ALPHA, f"{name}: token 1 does not follow rule.one_step_law (p = {pvalue:.2e})"

    step_tv = torch.cat([r.step_tv for r in results]).double()
    tv_sum = torch.cat([r.tv_sum for r in results]).double()
    assert torch.allclose(tv_sum, step_tv.sum(dim=1), atol=1e-6)
    assert float(step_tv[:, 0].abs().max()) == 0.0  # token 0 comes from the prefill, untested
    assert torch.allclose(step_tv[:, 1], tv1[tokens[:, 0]], atol=1e-5), "TV record of token 1 != rule.step_tv"
    if rule.lossless:
        assert float(step_tv.abs().max()) == 0.0
        assert np.allclose(expected, exact, atol=1e-6)
    else:
        assert float(tv1.min()) > 1e-3 and float(tv_sum.mean()) > 1e-3
        # The relaxed law is far enough from the exact one for this test to tell them apart.
        assert chi_square_pvalue(counts, exact) < 1e-6


# --------------------------------------------------------------------------- 4b. Jacobi window laws
def jacobi_decode_law(model: Transformer, cls: int, sampling: SamplingConfig, window: int, coupled: bool,
                      width: int = 1, branched: int = 0, official: bool = False) -> dict:
    """Exact law ``{(image, tokens committed per step): probability}`` of SJD (``coupled=False``),
    SCD, or SJD-PAC (``width`` siblings at the first ``branched`` positions: the proactive tree) on
    the tiny model, enumerated from the procedure's definition (REFERENCE §1.5), not from the
    engine.

    The first window is drawn uniformly. The walk tests a position's siblings in order, each
    against the current residual of the teacher-forced target of the accepted prefix: sibling
    ``k`` of law ``q`` with siblings ``0..k-1`` removed and renormalised (``q_k``) is accepted with
    ``min(1, t(x)/q_k(x))``, and on rejection ``t`` becomes ``norm(max(t - q_k, 0))``; when every
    sibling fails the step ends with a draw from ``t``. Every node of the first ``branched - 1``
    positions is the parent of the next position's siblings (one set a position); past the tree
    only the first siblings' path goes on (the chain of ``window`` positions). After committing
    ``a + 1`` tokens, window position ``j`` is drawn from the target's output at old chain node
    ``a + 1 + j`` (conditioned on the old chain drafts, accepted or not; uniform past the old
    window; in a tree, see below) and, for SCD and SJD-PAC, maximally coupled with the old chain
    draft of the same image position; a tree position's other siblings are the next draws from its
    law without replacement. In a tree the law of position ``j`` is the output of the node at depth
    ``a + 1 + j`` below the last accepted node along first siblings, where the tree has one (the
    chain's node at that depth otherwise). Drafts at positions that can never be tested (the last
    token is always a bonus) are not enumerated.

    ``official``: SJD-PAC's code's procedure instead (docs/METHODS.md): a tree position's siblings
    are its residual's draws without replacement (its ``torch.multinomial(res_p, K)``: the first
    of them replaced by the old draft where that is kept), still verified as draws from the new law
    without replacement; every node is tested on its own against its parent's target less the
    siblings before it, and the longest accepted path is committed (the first in rank order of
    equal ones), the bonus drawn from its end's target less all its children."""
    vocab, n_tok = model.config.vocab_size, model.config.block_size
    images = torch.cartesian_prod(*[torch.arange(vocab)] * n_tok)
    probs = guided_probs(model, cls, images, sampling).numpy()
    target_of = {tuple(image[:k]): rows[k] for image, rows in zip(images.tolist(), probs) for k in range(n_tok)}
    uniform = np.full(vocab, 1.0 / vocab)
    law: dict = {}
    last_tested = n_tok - 1 if official else n_tok - 2  # the last image token's draft: only the official walk

    def residual(p, q):
        mass = np.maximum(p - q, 0.0)
        return mass / mass.sum() if mass.sum() > 0 else p

    def removed(q, tokens):  # q with ``tokens`` removed, renormalised
        rest = q.copy()
        rest[list(tokens)] = 0.0
        return rest / rest.sum()

    def siblings(first_chance, q, count):
        """Ordered ``count``-tuples (first, then draws from ``q`` without the earlier ones), with
        their probabilities: ``[(tokens, probability)]``."""
        out = [((y,), first_chance[y]) for y in range(vocab) if first_chance[y] > 0]
        for _ in range(count - 1):
            out = [(toks + (y,), pr * removed(q, toks)[y]) for toks, pr in out for y in range(vocab)
                   if removed(q, toks)[y] > 0]
        return out

    def longest_walk(committed, drafts, laws):
        """The official choice: every node's pass chance, each pattern of passes, its longest path
        (a draft of the image's last token is tested too, its bonus dropped: the engine tests no
        node past the image in a longest-row walk, so which path wins is the image's alone)."""
        usable = min(window, n_tok - len(committed))
        nodes = []  # (ranks, token, pass chance); and each node's target less all its children

        def grow(i, ranks, accepted):
            target = target_of.get(tuple(committed + accepted), uniform)  # (a whole image: no bonus)
            if i == usable or (i >= branched and any(ranks)):
                return target
            t, toks = target, drafts[i] if i < branched else drafts[i][:1]
            for k, x in enumerate(toks):
                q = removed(laws[i], toks[:k]) if k else laws[i]
                nodes.append((ranks + (k,), x, passes(t, q, x)))
                exhausted[ranks + (k,)] = grow(i + 1, ranks + (k,), accepted + [x])
                t = residual(t, q)
            return t

        exhausted: dict = {}
        exhausted[()] = grow(0, (), [])
        outcomes = []
        for flags in itertools.product((False, True), repeat=len(nodes)):
            chance = float(np.prod([c if f else 1 - c for (_, _, c), f in zip(nodes, flags)]))
            if chance == 0:
                continue
            passed = {ranks for (ranks, _, _), f in zip(nodes, flags) if f}
            paths = [r for r in passed if all(r[:d] in passed for d in range(1, len(r)))]
            best = min(paths, key=lambda r: (-len(r), r), default=())
            accepted = [x for ranks, x, _ in nodes if ranks == best[:len(ranks)] and ranks]
            end = exhausted[best]
            if len(committed) + len(accepted) == n_tok:  # the image's last token accepted: no bonus
                outcomes.append((chance, accepted, None, not any(best)))
                continue
            outcomes.extend((chance * end[b], accepted, b, not any(best)) for b in range(vocab) if end[b] > 0)
        return outcomes

    def walk(committed, drafts, laws):
        if official:
            return longest_walk(committed, drafts, laws)
        usable = min(window, n_tok - len(committed) - 1)
        outcomes = []

        def step(i, prob, accepted, on_chain):
            target = target_of[tuple(committed + accepted)]
            if i == usable or (i >= branched and not on_chain):  # a leaf: the bonus
                outcomes.extend((prob * target[b], accepted, b, on_chain) for b in range(vocab) if target[b] > 0)
                return
            t, toks = target, drafts[i] if i < branched else drafts[i][:1]
            for k, x in enumerate(toks):
                q = removed(laws[i], toks[:k])
                alpha = min(1.0, t[x] / q[x])
                if alpha > 0:
                    step(i + 1, prob * alpha, accepted + [x], on_chain and k == 0)
                if alpha == 1:
                    return
                prob *= 1 - alpha
                t = residual(t, q)
            outcomes.extend((prob * t[b], accepted, b, on_chain) for b in range(vocab) if t[b] > 0)

        step(0, 1.0, [], True)
        return outcomes

    def count_of(j):
        return width if j < branched else 1

    def decode_from(prob, committed, options, lengths):
        for combo in itertools.product(*options):
            drafts, laws = [c[0] for c in combo], [c[1] for c in combo]
            weight = prob * float(np.prod([c[2] for c in combo]))
            chain = [d[0] for d in drafts]
            for p_walk, accepted, bonus, on_chain in walk(committed, drafts, laws):
                now = committed + accepted + ([] if bonus is None else [bonus])
                steps = lengths + (len(now) - len(committed),)
                if len(now) == n_tok:
                    key = (tuple(now), steps)
                    law[key] = law.get(key, 0.0) + weight * p_walk
                    continue
                a, following = len(accepted), []
                for j in range(window):
                    if len(now) + j > last_tested:  # never tested
                        following.append([((0,) * count_of(j), uniform, 1.0)])
                        continue
                    src, old = a + 1 + j, a + 2 + j
                    # below the accepted path along first siblings where the tree has that node
                    below = src <= branched or on_chain
                    seen = accepted + chain[a:src] if below else chain[:src]
                    new_law = target_of[tuple(committed + seen)] if src <= window else uniform
                    if coupled and old <= window:
                        x_old, q_old = chain[old - 1], laws[old - 1]
                        keep = min(1.0, new_law[x_old] / max(q_old[x_old], 1e-30))
                        rest = residual(new_law, q_old)
                        chance = [keep * (y == x_old) + (1 - keep) * rest[y] for y in range(vocab)]
                        if official and count_of(j) > 1:  # the residual's draws, the first kept or not
                            drawn = plackett_luce(rest, rest, count_of(j))
                            tuples: dict = {}
                            for toks, pr in drawn:
                                for first, share in ((x_old, keep), (toks[0], 1 - keep)):
                                    key = (first,) + toks[1:]
                                    tuples[key] = tuples.get(key, 0.0) + pr * share
                            following.append([(toks, new_law, pr) for toks, pr in tuples.items() if pr > 0])
                            continue
                    else:
                        chance = list(new_law)
                    following.append([(toks, new_law, pr) for toks, pr in siblings(chance, new_law, count_of(j))])
                decode_from(weight * p_walk, now, following, steps)

    first = target_of[()]
    for t0 in range(vocab):
        if first[t0] > 0:
            fresh = [[(toks, uniform, pr) for toks, pr in siblings(uniform, uniform, count_of(j))]
                     if 1 + j <= last_tested else [((0,) * count_of(j), uniform, 1.0)] for j in range(window)]
            decode_from(float(first[t0]), [t0], fresh, ())
    return law


# name: (coupled, cfg, top-k, options); SJD-PAC's window counts its tree's drafts (2 + 4 with width 2
# and depth 3: a chain of 2, both positions branched; 3 + 1 with width 3 and depth 2).
JACOBI_LAW_CASES = {"sjd-cfg1-topk3": (False, 1.0, 3, dict(method="sjd", window=2)),
                    "scd-cfg2": (True, 2.0, 0, dict(method="scd", window=2)),
                    "sjd-pac-width2-depth3-cfg1": (True, 1.0, 0, dict(method="sjd-pac", window=6, tree_width=2,
                                                                      tree_depth=3)),
                    "sjd-pac-width3-depth2-cfg2-topk3": (True, 2.0, 3, dict(method="sjd-pac", window=4, tree_width=3,
                                                                            tree_depth=2)),
                    "sjd-pac-official-width2-depth3-cfg1": (True, 1.0, 0, dict(method="sjd-pac", window=6, tree_width=2,
                                                                               tree_depth=3, sjd_pac_rules="official")),
                    "sjd-pac-official-width3-depth2-cfg2": (True, 2.0, 0, dict(method="sjd-pac", window=4, tree_width=3,
                                                                               tree_depth=2, sjd_pac_rules="official"))}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(JACOBI_LAW_CASES))
def test_jacobi_window_law_by_enumeration(tiny, name):
    """SJD / SCD / SJD-PAC's law of (image, accept length of every step): the enumeration's image
    marginal is the model's law to float32 precision (the procedure is lossless), and 100000
    engine decodes follow the whole joint law (chi-square, power > 0.9 at TV 0.02), accept lengths
    included, which the image-law test of EXACT_CASES does not see.

    On a 4-token image the coupling cannot change this law: a kept old draft only helps when the
    next new position is tested in the same step (its law was conditioned on that old draft),
    which needs two testable window positions after a step, i.e. at least 5 tokens. So SJD and
    SCD share one law here (checked); what the SCD case checks is that coupled redraws keep it.
    SJD-PAC's siblings do change it: their accept lengths are longer than SJD's (checked). The
    official SJD-PAC procedure (``--sjd-pac-rules official``) is enumerated as its code runs it
    and is not the model's law (checked: its image law's TV from the model's)."""
    model, _ = tiny
    coupled, cfg, top_k, given = JACOBI_LAW_CASES[name]
    options = MethodOptions(**given)
    sampling = SamplingConfig(cfg_scale=cfg, top_k=top_k)
    source = options.plan(target=model).source
    window, width, branched = source.chain, source.width, source.branched
    official = not source.lossless
    law = jacobi_decode_law(model, CLASS, sampling, window, coupled, width, branched, official)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-6)  # rows are float32 softmaxes
    image_law = exact_image_law(model, CLASS, sampling).numpy()
    marginal = np.zeros_like(image_law)
    for (image, _), prob in law.items():
        marginal[int(image_index(torch.tensor([image]), 4))] += prob
    if official:  # the official code's procedure is not the model's law (the image TVs: 0.0152 and 0.0012)
        assert 0.5 * np.abs(marginal - image_law).sum() > 1e-3
        exact = jacobi_decode_law(model, CLASS, sampling, window, coupled, width, branched)
        assert 0.5 * sum(abs(law.get(k, 0.0) - exact.get(k, 0.0)) for k in set(law) | set(exact)) > 0.015
    else:
        np.testing.assert_allclose(marginal, image_law, atol=1e-7, rtol=0)
    other = jacobi_decode_law(model, CLASS, sampling, window, not coupled)
    keys = sorted(set(law) | set(other))
    distance = 0.5 * sum(abs(law.get(k, 0.0) - other.get(k, 0.0)) for k in keys)
    if width == 1:
        assert distance < 1e-6
    else:
        steps = lambda joint: sum(prob * len(lengths) for (_, lengths), prob in joint.items())  # noqa: E731
        assert distance > 0.02 and steps(law) < steps(other) - 0.05, (distance, steps(law), steps(other))

    tokens, results = sample_images(
        lambda batch, gen: decode(model, torch.full((batch,), CLASS), sampling, options, generator=gen))
    assert all(r.tv_recorded is not official for r in results)  # no record claims a law it does not have
    lengths = [tuple(a[1:]) for r in results for a in r.accept_lengths]
    cell = {key: i for i, key in enumerate(keys)}
    counts = np.zeros(len(keys) + 1)  # the last cell: outcomes the enumeration calls impossible
    for image, steps in zip(tokens.tolist(), lengths):
        counts[cell.get((tuple(image), steps), len(keys))] += 1
    expected = np.array([law.get(k, 0.0) for k in keys] + [0.0])
    pvalue = chi_square_pvalue(counts, expected)
    assert pvalue > ALPHA, f"{name}: engine's (image, accept lengths) do not follow the enumeration (p = {pvalue:.2e})"


# --------------------------------------------------------------------------- 2. greedy == AR
@pytest.fixture(scope="module")
def markov():
    return markov_pair()


@pytest.fixture(scope="module")
def greedy_ar(markov):
    """Plain greedy AR tokens for 5 images (one per class), per CFG scale."""
    model, _ = markov
    cond = torch.arange(5)
    return {cfg: generate_ar(model, cond, SamplingConfig(cfg_scale=cfg, temperature=0.0)).tokens for cfg in (1.0, 4.0)}


GREEDY_CASES = {
    "sd-chain4": dict(method="sd", draft="chain", depth=4),
    "sd-eagle25-sampled": dict(method="sd", draft="static", tree="eagle25", siblings="sampled"),
    "sd-eagle25-topk": dict(method="sd", draft="static", tree="eagle25", siblings="topk"),
    "sd-lantern57-sampled": dict(method="sd", draft="static", tree="lantern57", siblings="sampled"),
    "sd-lantern57-topk": dict(method="sd", draft="static", tree="lantern57", siblings="topk"),
    "eagle2-dynamic": dict(method="eagle2"),  # EAGLE-2 defaults: top-k 10, 59 tokens, depth 4
    # More expansion beams ((depth - 1) * top_k = 50) than kept nodes: the drafter needs a slot
    # per beam (this crashed with "size of tensor a (27) must match ... (52)" before the fix).
    "eagle2-deep-small-budget": dict(method="eagle2", dynamic_top_k=10, total_tokens=10, depth=6),
    "sjd": dict(method="sjd", window=6),
    "scd": dict(method="scd", window=6),
    "sjd-pac": dict(method="sjd-pac"),  # the paper's: 63 drafts, width 3, depth 3, cut to the 16 tokens
    "sjd-pac-width2": dict(method="sjd-pac", window=8, tree_width=2, tree_depth=3),
    "sjd-pac-official": dict(method="sjd-pac", sjd_pac_rules="official"),  # greedy: the exact rules' walk
    # A zero budget is the exact rule: greedy LANTERN must then be greedy AR too.
    "lantern-delta0-chain4": dict(method="lantern", draft="chain", depth=4, k=8, delta=0.0),
}


@pytest.mark.parametrize("cfg", [1.0, 4.0])
@pytest.mark.parametrize("name", list(GREEDY_CASES))
def test_greedy_matches_ar(markov, greedy_ar, name, cfg, monkeypatch, tmp_path):
    model, drafter = markov
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    # profile mode (the forwards timed apart: the time split below) decodes the same tokens
    options = MethodOptions(**GREEDY_CASES[name], profile=True)
    result = decode(model, torch.arange(5), SamplingConfig(cfg_scale=cfg, temperature=0.0), options,
                    drafter=drafter, vq=fake_vq(model.config.vocab_size))
    expected = greedy_ar[cfg]
    assert torch.equal(result.tokens, expected), (
        f"{name} cfg {cfg}: first mismatch per row "
        f"{[(int(torch.nonzero(r != e)[0]) if bool((r != e).any()) else None) for r, e in zip(result.tokens, expected)]}")
    lengths = result.accept_lengths
    assert [sum(a) for a in lengths] == [16] * 5
    assert [len(a) for a in lengths] == result.target_forwards.tolist()
    assert float(result.step_tv.abs().max()) == 0.0
    # the time split is consistent: forwards are timed inside the decode, the drafter's inside its source
    assert 0 < result.target_forward_seconds < result.seconds
    assert 0 <= result.drafter_forward_seconds <= result.drafter_seconds
    assert result.overhead_seconds == pytest.approx(
        result.seconds - result.target_forward_seconds - result.drafter_forward_seconds)
    assert (result.drafter_forward_seconds > 0) == options.needs_drafter
    if options.needs_drafter:
        # The steps really speculate, and rows of the batch accept different lengths.
        assert max(max(a) for a in lengths) >= 3
        assert len({tuple(a) for a in lengths}) > 1
        assert float(result.mean_accepted_length.mean()) > 1.5


# Every rule that reports ``lossless`` x every draft structure x batch 1 and 3 x cfg 1 and 4: the
# greedy AR tokens exactly (issue 9). The rules are built here, independently of the CLI options.
LOSSLESS_RULES = {
    "exact": lambda table, depth: ExactRule(),
    "lantern-delta0": lambda table, depth: LanternRule(table, 8, delta=0.0),
    "lantern++-lam1": lambda table, depth: LanternRule(table, 8, lam=1.0),
    # --cool-delta 0.3: every weight of the mean-normalised schedule is below 1 (w_1 = 0.78 at
    # depth 5), the branch that committed the runner-up before.
    "cool-delta0.3": lambda table, depth: CoolRule(delta=0.3, horizon=depth),
}
DRAFT_STRUCTURES = {
    "chain": lambda drafter, sampling: EagleSource(drafter, StaticTree(TreeSpec.chain(5)), sampling),
    "static-sampled": lambda drafter, sampling: EagleSource(drafter, StaticTree(load_tree("eagle25"), "sampled"), sampling),
    "static-topk": lambda drafter, sampling: EagleSource(drafter, StaticTree(load_tree("eagle25"), "topk"), sampling),
    "dynamic": lambda drafter, sampling: EagleSource(drafter, DynamicTree(top_k=6, depth=4, total_tokens=24), sampling),
    "jacobi": lambda drafter, sampling: JacobiSource(6),
    "jacobi-coupled": lambda drafter, sampling: JacobiSource(6, coupled=True),
    "jacobi-proactive-tree": lambda drafter, sampling: JacobiSource(12, coupled=True, width=3, depth=3),
}


@pytest.mark.parametrize("cfg", [1.0, 4.0])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("structure", list(DRAFT_STRUCTURES))
@pytest.mark.parametrize("rule_name", list(LOSSLESS_RULES))
def test_every_lossless_configuration_is_greedy_ar(markov, greedy_ar, rule_name, structure, batch, cfg):
    model, drafter = markov
    sampling = SamplingConfig(cfg_scale=cfg, temperature=0.0)
    source = DRAFT_STRUCTURES[structure](drafter, sampling)
    rule = LOSSLESS_RULES[rule_name](neighbour_table(fake_vq(model.config.vocab_size).raw_codebook, 8), source.max_depth)
    assert rule.lossless
    rows = torch.arange(3) if batch == 3 else torch.tensor([4])
    result = decode(model, rows, sampling, MethodOptions(method="sd"), rule=rule, source=source)
    assert torch.equal(result.tokens, greedy_ar[cfg][rows]), f"{rule_name} / {structure}: differs from greedy AR"
    assert [sum(a) for a in result.accept_lengths] == [16] * batch
    if not isinstance(source, JacobiSource):  # the drafter really speculates
        assert float(result.mean_accepted_length.mean()) > 1.5


# --------------------------------------------------------------------------- 6. batched sampling
SAMPLING_CASES = {
    "sd-chain4": dict(method="sd", draft="chain", depth=4),
    "sd-lantern57-sampled": dict(method="sd", draft="static", siblings="sampled"),
    "eagle2": dict(method="eagle2", dynamic_top_k=5, total_tokens=20),
    "lantern-delta0.2-chain4": dict(method="lantern", draft="chain", depth=4, k=8, delta=0.2),
    "lantern++": dict(method="lantern++", k=8),
    "cool-delta2-eagle25": dict(method="cool", draft="static", tree="eagle25", cool_delta=2.0),
    "sjd": dict(method="sjd", window=6),
    "scd": dict(method="scd", window=6),
    "sjd-pac": dict(method="sjd-pac", window=12),
}


@pytest.mark.parametrize("name", list(SAMPLING_CASES))
def test_sampling_batch_rows_accept_different_lengths(markov, name, monkeypatch, tmp_path):
    model, drafter = markov
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    options = MethodOptions(**SAMPLING_CASES[name])
    batch, n_tok, vocab = 8, 16, model.config.vocab_size
    result = decode(model, torch.arange(batch) % 5, SamplingConfig(cfg_scale=4.0, top_k=20), options,
                    generator=torch.Generator().manual_seed(0), drafter=drafter, vq=fake_vq(vocab))
    assert result.tokens.shape == (batch, n_tok) and result.tokens.dtype == torch.long
    assert int(result.tokens.min()) >= 0 and int(result.tokens.max()) < vocab
    lengths = result.accept_lengths
    assert [sum(a) for a in lengths] == [n_tok] * batch
    assert [len(a) for a in lengths] == result.target_forwards.tolist()
    assert len({tuple(a) for a in lengths}) > 1, "every row accepted the same lengths"
    if options.needs_drafter:
        assert bool((result.target_forwards < n_tok - 2).all()), result.target_forwards
        assert bool((result.drafter_forwards > 0).all())
    else:  # a Jacobi window starts from uniform guesses: fewer savings, but some
        assert float(result.target_forwards.float().mean()) < n_tok
    relaxed = options.method in ("lantern", "cool")
    assert (float(result.tv_sum.min()) > 0) == relaxed
    assert torch.allclose(result.tv_sum, result.step_tv.sum(dim=1))

