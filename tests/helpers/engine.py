"""Tiny LlamaGen-format targets and drafters whose laws the engine's tests can enumerate, a
fake tokenizer with a codebook, and a small static tree."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from relaxspec.decoding.verify import VerifyResult, verify_tree
from relaxspec.drafting.base import DraftTree
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer

SMALL_TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def scaled_(module: torch.nn.Module, factor: float) -> None:
    """Multiply every parameter by ``factor`` (random init is std 0.02: distributions would be
    nearly uniform and every test weak)."""
    with torch.no_grad():
        for param in module.parameters():
            param.mul_(factor)


def tiny_target(seed: int = 1, scale: float = 4.0) -> Transformer:
    """V = 4 codes, a 2x2 grid (4 image tokens), 3 classes; one layer keeps 100000-image runs
    cheap (this seed's laws depend on the whole prefix: TV 0.1-0.25 between prefixes that end
    in the same token)."""
    torch.manual_seed(seed)
    config = GPTConfig(dim=8, n_layer=1, n_head=2, vocab_size=4, num_classes=3, block_size=4, multiple_of=8)
    model = Transformer(config).eval()
    scaled_(model, scale)
    return model


def peaked_target(config: GPTConfig, seed: int = 0, head_scale: float = 20.0) -> Transformer:
    """A random LlamaGen target in eval mode whose output head is scaled by ``head_scale``: its
    laws are peaked, so a drafter has something to learn (drafter-training tests)."""
    torch.manual_seed(seed)
    target = Transformer(config)
    with torch.no_grad():
        target.output.weight.mul_(head_scale)
    return target.eval()


def tiny_drafter(model: Transformer, seed: int = 1, scale: float = 4.0) -> EagleDrafter:
    """An untrained EAGLE drafter with scaled weights: its q is far from uniform and far from p."""
    torch.manual_seed(seed)
    drafter = EagleDrafter.for_target(model).eval()
    scaled_(drafter, scale)
    return drafter


def markov_pair(seed: int = 0, vocab: int = 32, block_size: int = 16, mix: float = 0.1,
                classes: int = 5, n_layer: int = 2) -> tuple[Transformer, EagleDrafter]:
    """A target that is nearly a Markov chain over tokens, and a drafter that computes the chain.

    Target: unit-RMS token embeddings ``e(x)``; attention and MLP outputs scaled by ``mix``, so
    the final state is ``e(x) + O(mix)`` and ``p(. | prefix) ~ softmax(W e(x_last))``. The
    condition (and the rest of the prefix) only enter through the ``O(mix)`` attention term.
    Drafter: ``fc`` copies the token embedding (plus a small share of the target feature), the
    drafter block is near identity, and the head is the target's, so ``q ~ softmax(W e(x))``:
    close to ``p`` but not equal, and rows of a batch accept different lengths. ``n_layer``: the
    target's blocks (one makes a step's graph smaller to trace, what compile tests pay).
    """
    torch.manual_seed(seed)
    dim = 32
    config = GPTConfig(dim=dim, n_layer=n_layer, n_head=2, vocab_size=vocab, num_classes=classes,
                       block_size=block_size, multiple_of=32)
    model = Transformer(config).eval()
    scaled_(model, 8.0)
    with torch.no_grad():
        emb = model.tok_embeddings.weight
        emb.div_(emb.pow(2).mean(dim=1, keepdim=True).sqrt())
        for layer in model.layers:
            layer.attention.wo.weight.mul_(mix)
            layer.feed_forward.w2.weight.mul_(mix)
            layer.attention_norm.weight.fill_(1.0)
            layer.ffn_norm.weight.fill_(1.0)
        model.norm.weight.fill_(1.0)
        model.output.weight.copy_(torch.randn(vocab, dim) * (3.0 / dim**0.5))
    drafter = EagleDrafter.for_target(model).eval()
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, :dim] = torch.eye(dim)
        drafter.fc.weight[:, dim:] = torch.randn(dim, dim) * (0.1 / dim**0.5)
    return model, drafter


def fake_vq(vocab: int, seed: int = 3) -> SimpleNamespace:
    """What the engine reads from a tokenizer for LANTERN: its (raw / normalised) codebook."""
    codebook = torch.randn(vocab, 8, generator=torch.Generator().manual_seed(seed))
    return SimpleNamespace(raw_codebook=codebook, codebook=torch.nn.functional.normalize(codebook, dim=1))


def explicit_chain(drafter: EagleDrafter, features: torch.Tensor, tokens: torch.Tensor, committed: int,
                   depth: int) -> torch.Tensor:
    """The ``depth``-th draft's logits after committed pair ``committed``, made as decoding makes
    it: one causal sequence of the committed pairs, then the drafter's own guesses fed back."""
    in_features, in_tokens = features[:, : committed + 1], tokens[:, : committed + 1]
    for _ in range(depth):
        count = in_tokens.shape[1]
        positions = torch.arange(count).expand(tokens.shape[0], -1)
        guess, logits = drafter(in_features, in_tokens, positions)
        next_pair = count  # the pair the guess feeds: (guessed feature, the path's token there)
        if next_pair >= tokens.shape[1]:
            break
        # a fused-feature drafter's committed pairs are the target's fused streams: at its width first
        in_features = torch.cat([drafter.lift(in_features), guess[:, -1:]], dim=1)
        in_tokens = torch.cat([in_tokens, tokens[:, next_pair : next_pair + 1]], dim=1)
    return logits[:, -1]


def verify_fields(rule, target_probs, tokens, parents, proposals, depth, valid, **options) -> VerifyResult:
    """:func:`verify_tree` on a tree given as its fields (the tests' trees are dicts of them)."""
    return verify_tree(rule, DraftTree(tokens, parents, depth, proposals, valid), target_probs, **options)
