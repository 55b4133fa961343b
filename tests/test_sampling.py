"""Logits processing (CFG, temperature, top-k, top-p) and plain AR decoding against upstream's loop."""

from __future__ import annotations

import pytest
import torch

from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig, filter_logits, guide, process_logits, sample_from


def test_cfg_formula_by_hand():
    cond = torch.tensor([[2.0, 0.0, -1.0]])
    uncond = torch.tensor([[1.0, 0.5, -1.0]])
    # uncond + (cond - uncond) * 4 = [1 + 4, 0.5 - 2, -1 + 0]
    torch.testing.assert_close(guide(torch.cat([cond, uncond]), 4.0), torch.tensor([[5.0, -1.5, -1.0]]))
    probs = process_logits(torch.cat([cond, uncond]), SamplingConfig(cfg_scale=4.0, temperature=2.0, top_k=0))
    expected = torch.tensor([5.0, -1.5, -1.0]) / 2.0
    torch.testing.assert_close(probs, (expected.exp() / expected.exp().sum())[None])


def filter_reference(row: list[float], top_k: int, top_p: float) -> set[int]:
    """Upstream's top_k_top_p_filtering, one row, in plain Python: keep every token at least as
    large as the k-th largest; then, over what is left sorted by value, keep tokens until the
    cumulative softmax mass exceeds top_p, the token that crosses included (the first always)."""
    kept = set(range(len(row)))
    if top_k > 0:
        kth = sorted(row, reverse=True)[min(top_k, len(row)) - 1]
        kept = {i for i in kept if row[i] >= kth}
    if top_p < 1.0:
        import math

        order = sorted(kept, key=lambda i: -row[i])
        total = sum(math.exp(row[i]) for i in order)
        mass, chosen = 0.0, set()
        for i in order:
            chosen.add(i)
            mass += math.exp(row[i]) / total
            if mass > top_p:
                break
        kept = chosen
    return kept


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (8, 0.7), (30, 0.95), (3, 0.01)])
def test_top_k_top_p_against_brute_force(top_k, top_p):
    gen = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    logits = torch.randn(16, 40, generator=gen) * 2
    filtered = filter_logits(logits, top_k, top_p)
    for row in range(logits.shape[0]):
        kept = set(torch.nonzero(filtered[row] > float("-inf")).flatten().tolist())
        assert kept == filter_reference(logits[row].tolist(), top_k, top_p), row
        assert torch.equal(filtered[row][list(kept)], logits[row][list(kept)])


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (1, 1.0), (5, 1.0), (8, 0.7), (30, 0.95), (3, 0.01), (100, 1.0)])
def test_filters_as_tensors_keep_what_the_numbers_keep(top_k, top_p):
    """Issue 51: a decoding step reads top-k and top-p as tensors (a new value compiles nothing):
    one sort serves both filters, and it keeps exactly the tokens the Python numbers keep (an
    eager step's top-k alone finds its k-th value with topk). Ties with the k-th value survive."""
    gen = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logits = (torch.randn(16, 40, generator=gen) * 2).round(decimals=1)  # rounded: ties at the k-th value
    as_numbers = filter_logits(logits, top_k, top_p)
    as_tensors = filter_logits(logits, torch.tensor(top_k), torch.tensor(top_p))
    assert torch.equal(as_numbers, as_tensors)
    config = SamplingConfig(cfg_scale=1.0, top_k=top_k, top_p=top_p)
    assert torch.equal(process_logits(logits, config), process_logits(logits, config.on("cpu")))


def test_top_k_keeps_ties_and_top_p_acts_after_top_k():
    logits = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).sum() == 4  # ties with the 2nd value survive
    # top-p is computed on the top-k-renormalised distribution: with top_k=1 only one token is left.
    assert torch.isfinite(filter_logits(logits, top_k=1, top_p=0.1)).sum() == 1
    probs = process_logits(torch.tensor([[0.0, 0.1, 5.0, 0.2]]), SamplingConfig(cfg_scale=1.0, top_k=2))
    assert torch.count_nonzero(probs) == 2 and probs.argmax() == 2


def test_sample_from_follows_the_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).expand(20000, 4)
    draws = sample_from(probs, torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=4).float() / 20000
    assert counts[3] == 0
    torch.testing.assert_close(counts, probs[0], atol=0.015, rtol=0)
    assert torch.equal(sample_from(probs[:2], greedy=True), torch.tensor([0, 0]))


@pytest.mark.parametrize("kwargs,message", [
    (dict(cfg_scale=-1.0), "cfg"), (dict(top_p=0.0), "top-p"), (dict(top_p=1.5), "top-p"),
    (dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top-k"), (dict(top_k=2.5), "top-k"),
])
def test_sampling_config_validation(kwargs, message):
    with pytest.raises(RelaxspecError, match=message):
        SamplingConfig(**kwargs)


# ------------------------------------------------------------------------------------- decoding


class RowCounter:
    def __init__(self, model):
        self.rows = []
        self.handle = model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        tensor = args[0] if args else next(kwargs[k] for k in ("tokens", "cond", "embeddings") if kwargs.get(k) is not None)
        self.rows.append(tensor.shape[0])


def test_cfg_scale_one_uses_a_single_stream(tiny_gpt):
    cond = torch.tensor([1, 2, 3])
    counter = RowCounter(tiny_gpt)
    decode(tiny_gpt, cond, SamplingConfig(cfg_scale=1.0, temperature=0.0))
    assert set(counter.rows) == {3}
    counter.rows.clear()
    decode(tiny_gpt, cond, SamplingConfig(cfg_scale=1.5, temperature=0.0))
    assert set(counter.rows) == {6}  # [cond; uncond]
    counter.handle.remove()


def upstream_loop(model, cond, cfg_scale, temperature=0.0, top_k=0, top_p=1.0, cond_mask=None):
    """LlamaGen's ``generate`` rewritten from its description, with argmax selection and no KV
    cache: the whole prefix is re-run every step. Rows are [cond; uncond]; the null condition is
    class ``num_classes`` (c2i) or ``uncond_embedding`` (t2i); padded caption keys are hidden in
    both streams and every position sees itself; logits are guided, divided by
    max(temperature, 1e-5), top-k then top-p filtered, softmaxed, and the top-1 token is taken."""
    config = model.config
    cls = config.cls_token_num
    if config.model_type == "c2i":
        null = torch.full_like(cond, config.num_classes)
    else:
        null = model.cls_embedding.uncond_embedding.expand_as(cond)
    rows = torch.cat([cond, null]) if cfg_scale != 1.0 else cond
    streams = rows.shape[0] // cond.shape[0]
    tokens = torch.zeros(rows.shape[0], 0, dtype=torch.long)
    with torch.no_grad():
        prefix = model.embed_condition(rows)
        for _ in range(config.block_size):
            hidden = torch.cat([prefix, model.tok_embeddings(tokens)], dim=1)
            length = hidden.shape[1]
            mask = None
            if cond_mask is not None:
                keys = torch.cat([cond_mask.repeat(streams, 1), torch.ones(rows.shape[0], length - cls, dtype=torch.bool)], 1)
                mask = (torch.ones(length, length, dtype=torch.bool).tril()[None] & keys[:, None]) | torch.eye(length, dtype=torch.bool)
            logits = model(embeddings=hidden, attn_mask=mask)[:, -1].float()
            if streams == 2:
                c, u = logits.chunk(2)
                logits = u + (c - u) * cfg_scale
            logits = filter_logits(logits / max(temperature, 1e-5), top_k, top_p)
            chosen = torch.topk(logits.softmax(-1), k=1, dim=-1).indices
            tokens = torch.cat([tokens, chosen.repeat(streams, 1)], dim=1)
    return tokens[: cond.shape[0]]


@pytest.mark.parametrize("cfg_scale,top_k,top_p", [(4.0, 20, 1.0), (1.0, 0, 1.0), (2.5, 0, 0.8)])
def test_greedy_matches_upstream_loop_and_is_deterministic(tiny_gpt, cfg_scale, top_k, top_p):
    cond = torch.tensor([0, 5, 9])
    sampling = SamplingConfig(cfg_scale=cfg_scale, temperature=0.0, top_k=top_k, top_p=top_p)
    first = decode(tiny_gpt, cond, sampling)
    second = decode(tiny_gpt, cond, sampling, MethodOptions(method="ar"))
    assert torch.equal(first.tokens, second.tokens)
    assert first.tokens.dtype == torch.int64 and first.tokens.shape == (3, 16)
    assert torch.equal(first.tokens, upstream_loop(tiny_gpt, cond, cfg_scale, 0.0, top_k, top_p))
    assert first.target_forwards.tolist() == [16, 16, 16]
    assert torch.allclose(first.mean_accepted_length, torch.ones(3)) and first.tv_sum.abs().max() == 0
    # Each greedy token is the argmax of a teacher-forced, guided full forward over the result.
    with torch.no_grad():
        rows = torch.cat([cond, torch.full_like(cond, 10)]) if cfg_scale != 1.0 else cond
        logits = tiny_gpt.forward_train(rows, first.tokens.repeat(rows.shape[0] // 3, 1))
        guided = guide(logits, cfg_scale) if cfg_scale != 1.0 else logits
    assert torch.equal(guided.argmax(-1), first.tokens)


def test_greedy_t2i_with_caption_mask_matches_upstream_loop(tiny_t2i):
    captions = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, :4] = False
    sampling = SamplingConfig(cfg_scale=3.0, temperature=0.0, top_k=0)
    result = decode(tiny_t2i, captions, sampling, cond_mask=mask)
    assert torch.equal(result.tokens, upstream_loop(tiny_t2i, captions, 3.0, cond_mask=mask))
    assert not torch.equal(result.tokens, decode(tiny_t2i, captions, sampling).tokens)  # the mask matters


def test_seeded_sampling_is_reproducible(tiny_gpt):
    cond = torch.tensor([2, 2])
    sampling = SamplingConfig(cfg_scale=2.0, temperature=1.0, top_k=0)
    a = decode(tiny_gpt, cond, sampling, generator=torch.Generator().manual_seed(7)).tokens
    b = decode(tiny_gpt, cond, sampling, generator=torch.Generator().manual_seed(7)).tokens
    c = decode(tiny_gpt, cond, sampling, generator=torch.Generator().manual_seed(8)).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a[0], a[1])  # rows draw their own tokens
