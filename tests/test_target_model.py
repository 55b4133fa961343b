"""The TargetModel seam: the engine decodes a model that is not LlamaGen, knowing only the
protocol (relaxspec.models.base), and LlamaGen implements it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from relaxspec import methods
from relaxspec.decoding import decode
from relaxspec.decoding.ar import generate_ar
from relaxspec.models.base import ImageTokenizer, TargetModel, TeacherForcedTarget
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.models.llamagen.vq import VQConfig, VQModel
from relaxspec.sampling import SamplingConfig


class AveragingTarget(nn.Module):
    """Not a transformer: the hidden state of a query is the mean of the cached vectors of the
    slots it may attend to (the condition's and every token's embedding), so a wrong mask, slot or
    KV compaction changes the logits."""

    def __init__(self, vocab: int = 12, grid: int = 3, classes: int = 3, dim: int = 16, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(vocab_size=vocab, block_size=grid * grid, grid_size=grid, condition_length=1, dim=dim,
                                      num_classes=classes, model_type="c2i")
        self.class_names = None
        self.embedding = nn.Embedding(vocab, dim)
        self.classes = nn.Embedding(classes + 1, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():
            self.out.weight.mul_(8.0)
        self.max_seq, self.cache = 0, None

    @property
    def device(self):
        return self.out.weight.device

    @property
    def dtype(self):
        return self.out.weight.dtype

    @property
    def token_embeddings(self):
        return self.embedding.weight

    def null_condition(self, cond):
        return torch.full_like(cond, self.config.num_classes)

    def setup_caches(self, rows, max_seq, dtype=None):
        self.cache, self.max_seq = torch.zeros(rows, max_seq, self.config.dim), max_seq

    def clear_caches(self):
        self.cache, self.max_seq = None, 0

    def move_cache(self, src, dst):
        self.cache.scatter_(1, dst[..., None].expand(-1, -1, self.config.dim),
                            self.cache.gather(1, src[..., None].expand(-1, -1, self.config.dim)))

    def _attend(self, vectors, cache_slots, attn_mask):
        self.cache.scatter_(1, cache_slots[..., None].expand(-1, -1, self.config.dim), vectors)
        weights = attn_mask.float() / attn_mask.float().sum(-1, keepdim=True)
        hidden = weights @ self.cache
        return self.head(hidden), hidden

    def prefill(self, cond, positions, cache_slots, attn_mask):
        return self._attend(self.classes(cond)[:, None], cache_slots, attn_mask)

    def step(self, tokens, positions, cache_slots, attn_mask):
        return self._attend(self.embed_tokens(tokens), cache_slots, attn_mask)

    def embed_tokens(self, tokens):
        return self.embedding(tokens)

    def head(self, hidden):
        return self.out(hidden).float()

    def forward_train(self, cond, tokens, return_hidden=False):
        """Teacher-forced: the hidden state before image token k is the mean over the condition
        and tokens 0..k-1 (what decoding computes step by step)."""
        vectors = torch.cat([self.classes(cond)[:, None], self.embed_tokens(tokens[:, :-1])], dim=1)
        hidden = vectors.cumsum(1) / torch.arange(1, vectors.shape[1] + 1, device=vectors.device)[None, :, None]
        logits = self.head(hidden)
        return (logits, hidden) if return_hidden else logits


def test_llamagen_implements_the_protocols():
    target = Transformer(GPTConfig(dim=32, n_layer=1, n_head=2, vocab_size=16, num_classes=3, block_size=4,
                                   multiple_of=32))
    assert isinstance(target, TargetModel)
    assert target.token_embeddings.shape == (16, 32) and target.device == torch.device("cpu")
    from conftest import TINY_VQ

    assert isinstance(VQModel(VQConfig(**TINY_VQ)), ImageTokenizer)
    assert isinstance(AveragingTarget(), TargetModel)


@pytest.mark.parametrize("cfg", [1.0, 3.0])
@pytest.mark.parametrize("name, given", [("sjd", {"window": 4}), ("scd", {"window": 3}),
                                         ("gsd", {"window": 4, "group_p_gap": 0.0})])
def test_the_engine_decodes_a_model_it_knows_only_by_the_protocol(name, given, cfg):
    """Greedy lossless speculative decoding of another family equals its greedy AR tokens."""
    model = AveragingTarget()
    cond = torch.arange(3)
    greedy = SamplingConfig(cfg_scale=cfg, temperature=0.0, top_k=0)
    ar = generate_ar(model, cond, greedy).tokens
    assert len(set(map(tuple, ar.tolist()))) > 1  # the condition matters
    result = decode(model, cond, greedy, methods.resolve(name, given))
    assert torch.equal(result.tokens, ar)
    assert result.mean_accepted_length.mean() > 1.0
    sampled = decode(model, cond, SamplingConfig(cfg_scale=cfg, top_k=0), methods.resolve(name, given),
                     generator=torch.Generator().manual_seed(0))
    assert [sum(a) for a in sampled.accept_lengths] == [model.config.block_size] * 3


def test_teacher_forcing_matches_decoding():
    model = AveragingTarget()
    cond = torch.arange(3)
    tokens = generate_ar(model, cond, SamplingConfig(cfg_scale=1.0, temperature=0.0, top_k=0)).tokens
    logits = model.forward_train(cond, tokens)
    assert torch.equal(logits.argmax(-1), tokens)  # greedy: each token is the argmax of its prefix
    assert isinstance(model, TeacherForcedTarget)


def test_an_eagle_drafter_for_a_model_it_knows_only_by_the_protocol(tmp_path, monkeypatch):
    """The drafter is sized from the protocol's config and borrows the target's embeddings and
    head; trained by the recipe on the target's own samples, every exact structure and LANTERN at
    delta 0 give greedy AR's tokens."""
    from relaxspec.drafting.eagle import EagleDrafter, load_drafter
    from relaxspec.training.drafter import DrafterTrainConfig, train_drafter

    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))  # LANTERN's neighbour table
    model = AveragingTarget()
    drafter = EagleDrafter.for_target(model)
    assert drafter.config.target_config.dim == model.config.dim and drafter.config.target_config.head_dim % 4 == 0
    config = DrafterTrainConfig(out=str(tmp_path / "drafter"), self_samples=12, steps=4, batch_size=4, warmup_steps=1,
                                eval_interval=2, checkpoint_interval=2, val_fraction=0.25, lr=1e-3)
    trained = train_drafter(config, target=model).drafter
    reloaded = load_drafter(tmp_path / "drafter", model)
    cond = torch.arange(3)
    greedy = SamplingConfig(cfg_scale=3.0, temperature=0.0, top_k=0)
    ar = generate_ar(model, cond, greedy).tokens
    vq = SimpleNamespace(raw_codebook=torch.randn(12, 4), codebook=torch.randn(12, 4))
    for name, given in [("sd", {"draft": "chain", "depth": 3}), ("sd-static", {"tree": "eagle25"}), ("eagle2", {}),
                        ("lantern", {"draft": "chain", "delta": 0.0, "k": 4})]:
        for candidate in (trained, reloaded):
            result = decode(model, cond, greedy, methods.resolve(name, given), drafter=candidate, vq=vq)
            assert torch.equal(result.tokens, ar), name
