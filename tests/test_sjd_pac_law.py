"""Where SJD-PAC's official code (github.com/KangJialiang/SJD-PAC at 4fbc099,
``scheduler/sjd_pac_iteration_lumina_mgpt.py``, ``SJDPACSpeculativeSampler``) is not the model's law,
and that relaxspec's ``sjd-pac`` is, computed exactly on small laws (docs/METHODS.md says the same).

Each case enumerates every draw of one step, in numpy, from the procedures as written in our words
here, not from the engine (whose whole-image law is checked by tests/test_engine.py):

* the redraw of a position after the first rejection (its lines 185-214): the old draft kept where
  it passes against the position's new (stale) law ``p``, else redrawn from the residual
  ``norm(max(p - q_old, 0))``; the official code draws the other siblings from that residual too
  (Plackett-Luce, its ``torch.multinomial(res_p, K)``) but the next forward verifies them as draws
  from ``p`` without replacement; ``sjd-pac`` draws them from ``p`` without the first;
* the choice of the path (its lines 171-178): every node tested against the residual of the
  siblings before it, then the longest accepted root-to-leaf row, the first of equal ones; the
  exact walk takes the first accepted sibling at each depth.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from helpers.draws import passes, plackett_luce


def normalised(mass):
    return mass / mass.sum()


def residual(p, q):
    mass = np.maximum(p - q, 0.0)
    return normalised(mass) if mass.sum() > 0 else p


def removed(q, tokens):
    rest = q.copy()
    rest[list(tokens)] = 0.0
    return normalised(rest)


def verified(target, siblings, declared):
    """Law of the token one multi-draft test commits: sibling ``k`` accepted with
    ``min(1, t(x) / q_k(x))`` (``q_k`` = ``declared`` without siblings ``0..k-1``), ``t`` then the
    residual; the last residual's draw when all fail."""
    out, alive, t = np.zeros_like(target), 1.0, target
    for k, x in enumerate(siblings):
        q = removed(declared, siblings[:k])
        accept = passes(t, q, x)
        out[x] += alive * accept
        alive *= 1 - accept
        t = residual(t, q)
    return out + alive * t


def redraw_law(q_old, p, target, width: int, official: bool):
    """One position's committed law at the next forward: old draft ``x ~ q_old``, its new law ``p``,
    the next forward's target ``target`` (what it should commit)."""
    rest = residual(p, q_old)
    law = np.zeros_like(p)
    for x_old, q_x in enumerate(q_old):
        keep = min(1.0, p[x_old] / q_x)
        for kept, chance in ((True, keep), (False, 1 - keep)):
            if chance == 0:
                continue
            if official:  # kept: [old, then residual draws]; redrawn: every sibling a residual draw
                tails = plackett_luce(rest, rest, width - kept)
                drawn = [(((x_old,) + toks) if kept else toks, pr) for toks, pr in tails]
            else:  # the first is the coupled draft (law p); the others the next draws from p without it
                first = np.eye(len(p))[x_old] if kept else rest
                drawn = plackett_luce(first, p, width)
            for siblings, pr in drawn:
                law += q_x * chance * pr * verified(target, siblings, p)
    return law


def longest_row_law(q1, q2, t1, t2_given, width: int, longest: bool):
    """The first committed token of a step whose tree is ``width`` siblings at depth 1 (drawn from
    ``q1`` without replacement) each the parent of the same ``width`` siblings at depth 2 (from
    ``q2``); the target is ``t1`` at depth 1 and ``t2_given[x]`` after ``x``. ``longest``: the
    official choice (every node tested, with its own uniform, against its parent target's residual
    of the siblings before it; the longest row wins, the first of equal ones); else the exact walk."""
    law = np.zeros_like(t1)
    for level1, p1 in plackett_luce(q1, q1, width):
        for level2, p2 in plackett_luce(q2, q2, width):
            def chances(target, siblings, declared):  # each node's accept chance, tested alone
                out, t = [], target
                for k, x in enumerate(siblings):
                    q = removed(declared, siblings[:k])
                    out.append(passes(t, q, x))
                    t = residual(t, q)
                return out, t

            first, left = chances(t1, level1, q1)
            below = [chances(t2_given[x], level2, q2)[0] for x in level1]
            if not longest:
                law += p1 * p2 * verified(t1, level1, q1)
                continue
            for flags in itertools.product((0, 1), repeat=width * (width + 1)):
                up, down = flags[:width], np.reshape(flags[width:], (width, width))
                chance = np.prod([c if f else 1 - c for c, f in zip(first, up)])
                chance *= np.prod([c if f else 1 - c for row, fl in zip(below, down) for c, f in zip(row, fl)])
                if chance == 0:
                    continue
                lengths = [up[i] * (1 + down[i].any()) for i in range(width)]  # a depth-2 row needs its parent
                best = int(np.argmax(lengths))
                if lengths[best] > 0:
                    law[level1[best]] += p1 * p2 * chance
                else:  # every depth-1 sibling failed: the residual after the last
                    law += p1 * p2 * chance * left
    return law


def tv(a, b):
    return 0.5 * float(np.abs(a - b).sum())


def laws(seed: int, vocab: int = 4, count: int = 1):
    rng = np.random.default_rng(seed)
    return [rng.dirichlet(np.full(vocab, 2.0)) for _ in range(count)]


@pytest.mark.parametrize("width", [2, 3])
def test_siblings_drawn_from_the_residual_are_not_the_law_they_are_verified_as(width):
    """The official redraw moves the committed law away from the target (TV up to several hundredths
    over random laws); sjd-pac's commits the target exactly. Width 1 is the same for both (SCD)."""
    official, ours = [], []
    for seed in range(20):
        q_old, p, target = laws(seed, count=3)
        official.append(tv(redraw_law(q_old, p, target, width, official=True), target))
        ours.append(tv(redraw_law(q_old, p, target, width, official=False), target))
        single = redraw_law(q_old, p, target, 1, official=True)
        assert tv(single, target) < 1e-12 and tv(single, redraw_law(q_old, p, target, 1, official=False)) < 1e-12
    assert max(ours) < 1e-12
    assert np.mean(official) > 0.01 and max(official) > 0.05, official


def test_the_longest_row_is_not_the_law_the_first_accepted_sibling_is():
    """Choosing the longest accepted row (the official code, depth 3) favours depth-1 siblings whose
    children pass: the first committed token's law is not the target's; the exact walk's is."""
    t1, q1, q2 = laws(7, count=3)
    t2_given = laws(8, count=4)
    width = 2  # (every node's flag enumerated: 2 ** 6 cases a draw)
    assert tv(longest_row_law(q1, q2, t1, t2_given, width, longest=False), t1) < 1e-12
    assert tv(longest_row_law(q1, q2, t1, t2_given, width, longest=True), t1) > 0.02
    # a target half token 0, after which only token 3 passes: the official choice commits 0 less often
    t1, q1 = np.array([0.5, 0.5, 0.0, 0.0]), np.array([0.25] * 4)
    t2_given = [np.array([0.0, 0.0, 0.0, 1.0])] + [np.array([0.25] * 4)] * 3
    official = longest_row_law(q1, q1, t1, t2_given, 2, longest=True)
    assert official[0] < 0.46 and tv(longest_row_law(q1, q1, t1, t2_given, 2, longest=False), t1) < 1e-12


@pytest.mark.parametrize("path, count, expected", [
    ([0, 2], 2, [5, 7, 8, -1]),  # sibling 1 accepted: below it along first siblings, then the chain's nodes
    ([0, 1], 2, [3, 7, 8, -1]),  # sibling 0 accepted: the chain
    ([0, 1, 3, 7], 4, [8, -1, -1, -1]),
    ([0], 1, [1, 3, 7, 8]),  # nothing accepted: the root's first siblings
])
def test_a_new_position_takes_the_law_of_the_node_below_the_accepted_path(path, count, expected):
    """sjd-pac's redraw of window position ``j`` after ``count = a + 1`` commits reads the output of
    the node at depth ``a + 1 + j`` below the last accepted node along first siblings -- conditioned
    on the accepted path, as the official code's accepted row -- and the chain's node where the tree
    has none there (-1 here: past the window, the uniform law). Window 8, width 2, depth 3: nodes
    (0), (1), (0,0), (0,1), (1,0), (1,1), then the chain (0,0,0), (0,0,0,0) = nodes 7, 8."""
    import torch

    from relaxspec.drafting.jacobi import JacobiSource

    source = JacobiSource(8, coupled=True, width=2, depth=3)
    assert source._shape.spec.paths[4] == (1, 0) and source._shape.spec.paths[6:] == ((0, 0, 0), (0, 0, 0, 0))
    vocab, nodes = 16, source.max_nodes
    source.start(torch.zeros(1, dtype=torch.long), torch.full((1, vocab), 1.0 / vocab), None, 1, 64, None, True)
    laws = torch.eye(vocab)[1:nodes + 1][None] * 0.9 + 0.1 / vocab  # node n's law peaks on token n + 1
    padded = torch.tensor([path + [-1] * (5 - len(path))])
    source.update(None, padded, torch.tensor([count]), None, laws, None)
    assert (source.drafts[0] - 1).tolist() == expected  # the uniform law's argmax is token 0
