"""The speculative engine's parts, end to end: KV compaction with an oracle draft source whose
accepted paths run through sibling ranks 1 and 2 (non-contiguous node indices), checked against a
fresh forward's K/V after every step; method options' validation; the drafter's cached root law
against a cache-free drafter forward; the sibling-count tables; and the seam every draft source
declares. (The laws and greedy parity are tests/test_engine.py's.)"""

from __future__ import annotations

import copy

import pytest
import torch

from relaxspec.acceptance import ExactRule, LanternRule
from relaxspec.decoding import decode
from relaxspec.decoding.ar import generate_ar
from relaxspec.drafting.base import DraftTree
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.drafting.dynamic_tree import DynamicTree
from relaxspec.drafting.eagle_source import EagleSource
from relaxspec.drafting.jacobi import JacobiSource
from relaxspec.drafting.static_tree import StaticTree
from relaxspec.drafting.tree_tables import ancestor_matrix
from relaxspec.drafting.trees import TreeSpec, load_tree
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.methods import MethodOptions, build_rule
from relaxspec.sampling import SamplingConfig, process_logits
from helpers.engine import fake_vq, markov_pair, scaled_


@pytest.fixture(scope="module")
def markov():
    return markov_pair()


# --------------------------------------------------------------------------- 3. KV compaction
def random_target(seed: int = 4, vocab: int = 16, block_size: int = 16) -> Transformer:
    torch.manual_seed(seed)
    config = GPTConfig(dim=32, n_layer=2, n_head=2, vocab_size=vocab, num_classes=5, block_size=block_size,
                       multiple_of=32)
    model = Transformer(config).eval()
    scaled_(model, 4.0)
    return model


def reference_cache(model: Transformer, cond: torch.Tensor, tokens: torch.Tensor, streams: int) -> list[tuple]:
    """K/V ``[S*B, H, C + N, D]`` per layer of a fresh causal forward over the whole image."""
    ref = copy.deepcopy(model)
    cls = model.config.cls_token_num
    if streams == 2:
        cond = torch.cat([cond, model.null_condition(cond)])
        tokens = torch.cat([tokens, tokens])
    ref.setup_caches(cond.shape[0], cls + tokens.shape[1])
    with torch.no_grad():
        ref(cond=cond, cache_slots=torch.arange(cls))
        where = cls + torch.arange(tokens.shape[1])
        ref(tokens, where, cache_slots=where)
    return [(layer.attention.kv_cache.k_cache.clone(), layer.attention.kv_cache.v_cache.clone()) for layer in ref.layers]


class OracleTreeSource:
    """A static-tree draft source that knows the target's greedy continuation ``truth [B, N]``.

    Each step it places the true tokens along one of ``rank_paths`` (rotating), which go through
    sibling ranks 1 and 2: the elder siblings hold wrong tokens (tested and rejected first), so
    accepted paths are long and their node indices non-contiguous; every other node is random.
    ``update`` checks that the target's KV cache after compaction equals a fresh forward's.
    """

    def __init__(self, spec: TreeSpec, truth: torch.Tensor, rank_paths, model: Transformer, reference, streams: int):
        self.spec, self.truth, self.model, self.reference, self.streams = spec, truth, model, reference, streams
        self.max_nodes, self.max_depth, self.forwards = spec.num_nodes, spec.depth, 0
        # no fixed tree shape declared (its trees carry no children table): the engine runs it eagerly
        self.level_widths, self.forwards_per_step, self.models, self.watch = None, 0, (), None
        self.caption_rows = "upstream"
        index = {p: i + 1 for i, p in enumerate(spec.paths)}
        self.node_paths = [[index[tuple(rp[:d])] for d in range(1, len(rp) + 1)] for rp in rank_paths]
        self.children = {i: [j for j in range(spec.num_nodes) if int(spec.parents[j]) == i] for i in range(spec.num_nodes)}
        self.steps, self.log, self.kv_checks = 0, [], 0

    def start(self, first_tokens, first_probs, first_hidden, streams, num_tokens, generator, greedy, **context) -> None:
        assert greedy
        self.vocab, self.gen = first_probs.shape[-1], torch.Generator().manual_seed(7)

    def propose(self, roots, root_index, greedy) -> DraftTree:
        batch, nodes, n_tok = roots.shape[0], self.spec.num_nodes, self.truth.shape[1]
        rows = torch.arange(batch)
        tokens = torch.randint(0, self.vocab, (batch, nodes), generator=self.gen)
        tokens[:, 0] = roots
        self.path = self.node_paths[self.steps % len(self.node_paths)]
        self.steps += 1
        parent = 0
        for depth, node in enumerate(self.path, start=1):
            truth = self.truth[rows, (root_index + depth).clamp(max=n_tok - 1)]
            for sibling in self.children[parent]:  # no other sibling may carry the true token
                shift = torch.randint(1, self.vocab, (batch,), generator=self.gen)
                tokens[:, sibling] = torch.where(tokens[:, sibling] == truth, (truth + shift) % self.vocab, tokens[:, sibling])
            tokens[:, node] = truth
            parent = node
        parents = self.spec.parents.expand(batch, -1)
        ancestors = ancestor_matrix(self.spec.parents[None], self.spec.depth).expand(batch, -1, -1)
        proposals = torch.nn.functional.one_hot(tokens, self.vocab).float()
        return DraftTree(tokens, parents, self.spec.depths.expand(batch, -1), proposals,
                         torch.ones(batch, nodes, dtype=torch.bool), ancestors)

    def update(self, committed, path, count, root_index, target_probs, target_hidden) -> None:
        batch, cls = self.truth.shape[0], self.model.config.cls_token_num
        self.log.append((path.clone(), count.clone(), root_index.clone(), list(self.path)))
        committed_now = root_index + 1 + count  # tokens committed after this step
        for layer, (k_ref, v_ref) in zip(self.model.layers, self.reference):
            cache = layer.attention.kv_cache
            for b in range(batch):
                # Slots of the condition and of tokens 0 .. n - 2 (the bonus is not cached yet).
                length = cls + int(committed_now[b]) - 1
                for s in range(self.streams):
                    row = b + s * batch
                    for live, ref in ((cache.k_cache, k_ref), (cache.v_cache, v_ref)):
                        assert torch.allclose(live[row, :, :length], ref[row, :, :length], rtol=1e-5, atol=1e-5), (
                            f"KV cache of row {b} differs from a fresh forward after committing {int(committed_now[b])} tokens")
        self.kv_checks += 1

    def close(self) -> None:
        pass


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_kv_compaction_of_non_contiguous_accepted_paths(cfg):
    model = random_target()
    cond = torch.arange(5)
    sampling = SamplingConfig(cfg_scale=cfg, temperature=0.0)
    truth = generate_ar(model, cond, sampling).tokens
    spec = load_tree("eagle25")
    rank_paths = [(1, 0, 0), (0, 1, 1), (0, 0, 0, 2), (0, 0, 0, 0, 1), (2, 1), (0, 2, 1)]
    streams = 2 if sampling.use_cfg else 1
    source = OracleTreeSource(spec, truth, rank_paths, model, reference_cache(model, cond, truth, streams), streams)
    result = decode(model, cond, sampling, MethodOptions(method="sd"), source=source)
    assert torch.equal(result.tokens, truth)
    assert float(result.mean_accepted_length.min()) > 2.0
    # The accepted paths were the oracle's (rank 1 and 2 siblings, non-contiguous node indices)
    # whenever the image had room for the whole path.
    full_paths = 0
    for path, count, root_index, oracle in source.log:
        for b in range(5):
            # Drafts may reach depth 16 - n - 1 (n = root_index + 1 tokens committed before).
            if len(oracle) <= 14 - int(root_index[b]):
                assert path[b, 1 : len(oracle) + 1].tolist() == oracle
                assert int(count[b]) == len(oracle) + 1
                full_paths += 1
    assert full_paths >= 10 and source.kv_checks == len(source.log)


# --------------------------------------------------------------------------- 5. options
def test_method_options_validation_and_aliases():
    with pytest.raises(RelaxspecError):
        MethodOptions(method="lantern", delta=0.1, lam=2.0)
    for bad in (dict(method="medusa"), dict(method="sd", siblings="random"), dict(method="sd", depth=0),
                dict(method="lantern", delta=1.5), dict(method="lantern", lam=0.5), dict(method="sjd", window=0),
                dict(method="lantern", residual="zeroed"), dict(method="cool", cool_delta=0.0)):
        with pytest.raises(RelaxspecError):
            MethodOptions(**bad)
    plus = MethodOptions(method="lantern++")
    assert (plus.method, plus.draft, plus.delta) == ("lantern", "static", None)
    assert plus.lam is not None and plus.lam > 1 and plus.tree == "naive_extend_57"
    assert MethodOptions(method="lantern").delta is not None  # plain LANTERN: the additive budget
    eagle2 = MethodOptions(method="eagle2")
    assert (eagle2.method, eagle2.draft) == ("sd", "dynamic")

    model = random_target(vocab=16)
    vq = fake_vq(16)
    rule = build_rule(MethodOptions(method="lantern++", k=4, lam=3.0), vq)
    assert isinstance(rule, LanternRule) and rule.lam == 3.0 and rule.delta is None and rule.k == 4
    assert isinstance(build_rule(MethodOptions(method="sd")), ExactRule)
    with pytest.raises(RelaxspecError):  # LANTERN's neighbours come from the tokenizer
        decode(model, torch.arange(2), SamplingConfig(), MethodOptions(method="lantern"),
               drafter=EagleDrafter.for_target(model))
    with pytest.raises(RelaxspecError):  # drafter methods need a drafter
        decode(model, torch.arange(2), SamplingConfig(), MethodOptions(method="sd"))


# --------------------------------------------------------------------------- drafter cache
class CheckedEagleSource(EagleSource):
    """An :class:`EagleSource` that, before every proposal, checks its cached root law ``q``
    against a cache-free drafter forward over all committed (feature, token) pairs, the features
    coming from a fresh teacher-forced target forward. Catch-up must overwrite the draft slots of
    rejected nodes, or ``q`` silently drifts (exactness survives that, speed does not)."""

    def __init__(self, drafter, structure, sampling, model, cond):
        super().__init__(drafter, structure, sampling)
        self.model, self.cond, self.checked = model, cond, 0

    def start(self, first_tokens, first_probs, first_hidden, streams, num_tokens, generator, greedy, **context) -> None:
        # The record must exist before the base class feeds pair 0 through catch_up.
        self.seq = torch.zeros(first_tokens.shape[0], num_tokens + self.max_nodes + 1, dtype=torch.long)
        super().start(first_tokens, first_probs, first_hidden, streams, num_tokens, generator, greedy, **context)

    def catch_up(self, features, tokens, first, count, keep=True):
        for b in range(tokens.shape[0]):
            c = int(count[b])
            self.seq[b, int(first[b]) : int(first[b]) + c] = tokens[b, :c]
        return super().catch_up(features, tokens, first, count, keep)

    def propose(self, roots, root_index, greedy):
        n_tok = self.model.config.block_size
        seq = self.seq[:, :n_tok]
        with torch.no_grad():
            _, hidden = self.model.forward_train(self.cond, seq, return_hidden=True)
            feats = [hidden]
            if self.streams == 2:
                feats.append(self.model.forward_train(self.model.null_condition(self.cond), seq, return_hidden=True)[1])
            feats = torch.cat(feats)
            positions = torch.arange(n_tok).expand(feats.shape[0], -1)
            _, logits = self.drafter(feats, seq.repeat(self.streams, 1), positions)  # no cache: causal
        fresh = process_logits(logits, self.sampling)  # [B, N, V]
        for b in range(roots.shape[0]):
            r = int(root_index[b])
            if r < n_tok - 1:
                assert int(seq[b, r]) == int(roots[b])
                assert torch.allclose(self.root_q[b], fresh[b, r], atol=1e-5), f"row {b}: cached drafter q at root {r} is stale"
                self.checked += 1
        return super().propose(roots, root_index, greedy)


@pytest.mark.parametrize("structure, cfg, temperature", [
    ("chain4", 4.0, 1.0), ("eagle25", 1.0, 0.0), ("lantern57", 4.0, 1.0), ("dynamic", 4.0, 0.0)])
def test_drafter_cache_matches_fresh_forward(markov, structure, cfg, temperature):
    model, drafter = markov
    cond = torch.arange(5)
    sampling = SamplingConfig(cfg_scale=cfg, temperature=temperature)
    shape = (DynamicTree(top_k=6, depth=4, total_tokens=24) if structure == "dynamic"
             else StaticTree(load_tree(structure), "sampled"))
    source = CheckedEagleSource(drafter, shape, sampling, model, cond)
    result = decode(model, cond, sampling, MethodOptions(method="sd"), source=source,
                    generator=torch.Generator().manual_seed(0))
    assert source.checked >= 10 and float(result.mean_accepted_length.mean()) > 1.5


def test_rank_counts_add_with_padding():
    from relaxspec.decoding.result import add_counts, total_rank_counts

    a = torch.tensor([[1, 2], [3, 4]])
    b = torch.tensor([[10], [20], [30]])
    assert add_counts(None, a).tolist() == a.tolist()
    assert add_counts(a, a).tolist() == [[2, 4], [6, 8]]
    assert add_counts(a, b).tolist() == add_counts(b, a).tolist() == [[11, 2], [23, 4], [30, 0]]
    tables = [{"tests": x.tolist(), "accepts": (x // 2).tolist()} for x in (a, b)]
    assert total_rank_counts(tables) == {"tests": [[11, 2], [23, 4], [30, 0]], "accepts": [[5, 1], [11, 2], [15, 0]]}
    assert total_rank_counts([]) == {"tests": [], "accepts": []}


def test_every_source_and_structure_declares_the_seam(markov):
    from relaxspec.drafting.base import DraftSource, DraftStructure, FeatureDrafter
    from relaxspec.drafting.trees import TreeSpec

    model, drafter = markov
    structures = [StaticTree(TreeSpec.chain(3)), DynamicTree(top_k=2, depth=2, total_tokens=5)]
    assert all(isinstance(s, DraftStructure) for s in structures)
    assert isinstance(JacobiSource(window=4), DraftSource)
    eagle = EagleSource(drafter, structures[0], SamplingConfig(cfg_scale=1.0))
    assert isinstance(eagle, DraftSource)
    first = torch.zeros(1, dtype=torch.long)
    eagle.start(first, torch.full((1, model.config.vocab_size), 1.0 / model.config.vocab_size),
                torch.zeros(1, 1, model.config.dim), 1, 4, None, True)
    assert isinstance(eagle, FeatureDrafter)  # root law, root feature and cache exist once started
    assert not isinstance(object(), DraftSource)
