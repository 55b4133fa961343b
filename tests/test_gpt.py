"""LlamaGen transformer: 2D RoPE, condition q/k zeroing, KV cache, masks, slots, official shapes."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.gpt import gpt_b_expected_shapes
from relaxspec.models.llamagen.gpt import GPT_SIZES, GPTConfig, Transformer, apply_rope, gpt_config, rope_table_2d

ATOL = 1e-4


# ----------------------------------------------------------------------------------------- RoPE


def rope_angles_reference(grid: int, head_dim: int, cls: int, base: float = 10000.0) -> torch.Tensor:
    """REFERENCE §2.1, element by element: token k = i*grid + j rotates pair p < head_dim/4 by
    i * w_p and pair p >= head_dim/4 by j * w_(p - head_dim/4), w_m = base^(-2m / (head_dim/2));
    condition positions are rows of zeros (cos = sin = 0). Returns [cls + grid^2, head_dim/2, 2]."""
    quarter = head_dim // 4
    table = torch.zeros(cls + grid * grid, head_dim // 2, 2, dtype=torch.float64)
    for k in range(grid * grid):
        i, j = divmod(k, grid)
        for p in range(head_dim // 2):
            m = p if p < quarter else p - quarter
            w = base ** (-2.0 * m / (head_dim / 2))
            angle = (i if p < quarter else j) * w
            table[cls + k, p, 0] = math.cos(angle)
            table[cls + k, p, 1] = math.sin(angle)
    return table


@pytest.mark.parametrize("grid,head_dim,cls", [(4, 16, 1), (3, 8, 5), (16, 64, 1)])
def test_rope_table_matches_formula(grid, head_dim, cls):
    table = rope_table_2d(grid, head_dim, cls_token_num=cls)
    expected = rope_angles_reference(grid, head_dim, cls)
    assert table.shape == expected.shape
    torch.testing.assert_close(table.double(), expected, atol=1e-6, rtol=0)
    assert torch.count_nonzero(table[:cls]) == 0
    # Token (i=1, j=0) rotates only the row half; (0, 1) only the column half.
    quarter = head_dim // 4
    row_step, col_step = table[cls + grid], table[cls + 1]
    assert torch.equal(row_step[quarter:, 0], torch.ones(head_dim // 2 - quarter))
    assert torch.equal(col_step[:quarter, 0], torch.ones(quarter))


def test_apply_rope_is_complex_rotation_of_interleaved_pairs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=gen)  # [B, T, H, D]
    angles = torch.rand(2, 5, 4, generator=gen) * 6
    table = torch.stack([angles.cos(), angles.sin()], dim=-1)  # [B, T, D/2, 2]
    out = apply_rope(x, table)
    as_complex = torch.view_as_complex(x.reshape(2, 5, 3, 4, 2).contiguous())
    rotated = as_complex * torch.polar(torch.ones_like(angles), angles)[:, :, None]
    torch.testing.assert_close(out, torch.view_as_real(rotated).reshape(2, 5, 3, 8))
    # The condition rows of the table are all zero: queries and keys there become exactly zero.
    zero_rows = rope_table_2d(2, 8, cls_token_num=3)[:3].expand(2, 3, 4, 2)
    assert torch.count_nonzero(apply_rope(x[:, :3], zero_rows)) == 0


def reference_attention(attention, x, rope_table, zero_condition=True, cls=0):
    """Layer attention from scratch: q, k rotated with the formula table (complex multiply), q and
    k zeroed at condition positions when ``zero_condition``, causal softmax, ``wo``."""
    b, t, _ = x.shape
    h, d = attention.n_head, attention.head_dim
    q, k, v = attention.wqkv(x).split(h * d, dim=-1)
    angles = torch.atan2(rope_table[..., 1], rope_table[..., 0])[:t].float()  # [T, D/2]
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None]

    def rotate(z):
        z = torch.view_as_complex(z.view(b, t, h, d // 2, 2).contiguous()) * rotation
        z = torch.view_as_real(z).reshape(b, t, h, d)
        if zero_condition:
            z = z.clone()
            z[:, :cls] = 0
        return z.transpose(1, 2)

    q, k, v = rotate(q), rotate(k), v.view(b, t, h, d).transpose(1, 2)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return attention.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, h * d))


def test_condition_queries_and_keys_are_zeroed(tiny_t2i):
    """At condition positions q and k are multiplied by zero, so (1) a condition position attends
    uniformly to the visible keys, and (2) the layer equals a from-scratch attention with that
    zeroing, and differs from one without it."""
    model, cls = tiny_t2i, tiny_t2i.config.cls_token_num
    captions = torch.randn(2, cls, model.config.caption_dim)
    tokens = torch.randint(0, 64, (2, 5))
    layer = model.layers[0]
    seen = {}
    hook = layer.attention.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0], out=out))
    with torch.no_grad():
        model(embeddings=torch.cat([model.embed_condition(captions), model.tok_embeddings(tokens)], dim=1))
        hook.remove()
        x, out = seen["x"], seen["out"]
        v = layer.attention.wqkv(x).split(model.config.dim, dim=-1)[2]
        counts = torch.arange(1, cls + 1, dtype=torch.float32)[None, :, None]
        uniform = layer.attention.wo(v[:, :cls].cumsum(dim=1) / counts)
        torch.testing.assert_close(out[:, :cls], uniform, atol=ATOL, rtol=0)
        table = rope_angles_reference(model.config.grid_size, model.config.head_dim, cls)
        zeroed = reference_attention(layer.attention, x, table, True, cls)
        not_zeroed = reference_attention(layer.attention, x, table, False, cls)
    torch.testing.assert_close(out, zeroed, atol=ATOL, rtol=0)
    assert (out[:, cls:] - not_zeroed[:, cls:]).abs().max() > 1e-2


# ----------------------------------------------------------------------------------- KV cache


def incremental_logits(model, cond, tokens, mask=None):
    """Prefill the condition, then one token per forward through the KV cache. ``mask [B, S, S]``
    (True = may attend) over the full sequence, optional. Returns [B, N, V]: row k predicts token k."""
    cls, n = model.config.cls_token_num, tokens.shape[1]
    model.setup_caches(tokens.shape[0], cls + n)
    try:
        slots = torch.arange(cls)
        logits = [model(cond=cond, positions=slots, cache_slots=slots, kv_len=cls,
                        attn_mask=None if mask is None else mask[:, :cls, :cls])[:, -1:]]
        for k in range(1, n):
            where = torch.tensor([cls + k - 1])
            step_mask = None if mask is None else mask[:, cls + k - 1 : cls + k, : cls + k]
            logits.append(model(tokens[:, k - 1 : k], where, cache_slots=where, kv_len=cls + k, attn_mask=step_mask))
    finally:
        model.clear_caches()
    return torch.cat(logits, dim=1)


def test_cached_incremental_equals_full_forward_c2i(tiny_gpt):
    cond, tokens = torch.tensor([3, 7]), torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        full = tiny_gpt.forward_train(cond, tokens)
        stepped = incremental_logits(tiny_gpt, cond, tokens)
    assert full.shape == (2, 16, 64)
    torch.testing.assert_close(stepped, full, atol=ATOL, rtol=0)


def caption_mask_full(valid: torch.Tensor, length: int) -> torch.Tensor:
    """Upstream t2i mask [B, S, S]: causal, padded caption keys hidden, every position sees itself."""
    b, cls = valid.shape
    keys = torch.cat([valid, torch.ones(b, length - cls, dtype=torch.bool)], dim=1)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (causal[None] & keys[:, None, :]) | torch.eye(length, dtype=torch.bool)[None]


def test_cached_incremental_equals_full_forward_t2i_with_caption_mask(tiny_t2i):
    model, cls = tiny_t2i, tiny_t2i.config.cls_token_num
    captions = torch.randn(2, cls, model.config.caption_dim)
    valid = torch.ones(2, cls, dtype=torch.bool)
    valid[0, :3] = False  # left padding, as upstream
    tokens = torch.randint(0, 64, (2, 16))
    mask = caption_mask_full(valid, cls + 16)
    with torch.no_grad():
        embeddings = torch.cat([model.embed_condition(captions), model.tok_embeddings(tokens[:, :-1])], dim=1)
        full = model(embeddings=embeddings, attn_mask=mask[:, :-1, :-1])[:, cls - 1 :]
        stepped = incremental_logits(model, captions, tokens, mask)
        torch.testing.assert_close(stepped, full, atol=ATOL, rtol=0)
        # Padded caption positions are invisible: changing their features changes nothing...
        changed = captions.clone()
        changed[0, :3] += 5
        torch.testing.assert_close(incremental_logits(model, changed, tokens, mask), stepped, atol=ATOL, rtol=0)
        # ...while without the mask they would.
        unmasked = incremental_logits(model, changed, tokens)
    assert (unmasked[0] - stepped[0]).abs().max() > 1e-2


def test_explicit_causal_mask_equals_causal_forward(tiny_gpt):
    tokens = torch.randint(0, 64, (2, 9))
    causal = torch.ones(9, 9, dtype=torch.bool).tril().expand(2, 9, 9)
    with torch.no_grad():
        plain = tiny_gpt(tokens)
        masked = tiny_gpt(tokens, attn_mask=causal)
        tiny_gpt.setup_caches(2, 9)
        slots = torch.arange(9)
        cached_default = tiny_gpt(tokens, slots, cache_slots=slots)
        cached_masked = tiny_gpt(tokens, slots, cache_slots=slots, attn_mask=causal, kv_len=9)
        tiny_gpt.clear_caches()
    torch.testing.assert_close(masked, plain, atol=ATOL, rtol=0)
    torch.testing.assert_close(cached_default, plain, atol=ATOL, rtol=0)
    torch.testing.assert_close(cached_masked, plain, atol=ATOL, rtol=0)
    # A non-causal mask really is used.
    with torch.no_grad():
        full = tiny_gpt(tokens, attn_mask=torch.ones(2, 9, 9, dtype=torch.bool))
    assert (full[:, :-1] - plain[:, :-1]).abs().max() > 1e-2


def test_out_of_order_slots_with_matching_mask_equal_contiguous(tiny_gpt):
    """Tokens written to arbitrary cache slots, at their true RoPE positions, with a mask that
    lets each see its own prefix, give the contiguous logits; so do two sibling branches that
    share positions in one forward (tree verification)."""
    model, cls, n = tiny_gpt, 1, 8
    cond, tokens = torch.tensor([4]), torch.randint(0, 64, (1, n))
    with torch.no_grad():
        reference = model.forward_train(cond, torch.cat([tokens, tokens[:, :1]], dim=1))[:, 1:]  # row k: after token k
        max_seq = cls + 2 * n
        model.setup_caches(1, max_seq)
        model(cond=cond, positions=torch.arange(cls), cache_slots=torch.arange(cls), kv_len=cls)
        slots = cls + torch.randperm(2 * n)[:n]  # scattered over the cache
        positions = cls + torch.arange(n)
        mask = torch.zeros(1, n, max_seq, dtype=torch.bool)
        mask[..., :cls] = True
        for k in range(n):
            mask[0, k, slots[: k + 1]] = True
        scattered = model(tokens, positions[None], cache_slots=slots[None], attn_mask=mask, kv_len=max_seq)
        torch.testing.assert_close(scattered, reference, atol=ATOL, rtol=0)

        # Two branches after a shared first token: [t0, a1, a2] and [t0, b1, b2], in one forward.
        other = torch.randint(0, 64, (1, 2))
        branch_b = torch.cat([tokens[:, :1], other], dim=1)
        ref_b = model.forward_train(cond, torch.cat([branch_b, branch_b[:, :1]], dim=1))[:, 1:]
        model.setup_caches(1, max_seq)
        model(cond=cond, positions=torch.arange(cls), cache_slots=torch.arange(cls), kv_len=cls)
        tree_tokens = torch.cat([tokens[:, :3], other], dim=1)  # nodes: t0, a1, a2, b1, b2
        tree_pos = torch.tensor([[1, 2, 3, 2, 3]])
        tree_slots = torch.tensor([[1, 2, 3, 4, 5]])
        ancestors = [[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4]]
        tree_mask = torch.zeros(1, 5, 6, dtype=torch.bool)
        tree_mask[..., 0] = True
        for node, path in enumerate(ancestors):
            tree_mask[0, node, [1 + p for p in path]] = True
        tree = model(tree_tokens, tree_pos, cache_slots=tree_slots, attn_mask=tree_mask, kv_len=6)
        model.clear_caches()
    torch.testing.assert_close(tree[:, :3], reference[:, :3], atol=ATOL, rtol=0)
    torch.testing.assert_close(tree[:, [0, 3, 4]], ref_b[:, :3], atol=ATOL, rtol=0)


def test_positions_outside_the_table_are_rejected(tiny_gpt):
    with pytest.raises(ValueError, match="positions"):
        tiny_gpt(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[17]]))


# ----------------------------------------------------------------------- official shapes (GPT-B)


@pytest.mark.parametrize("model_type", ["c2i", "t2i"])
def test_gpt_b_state_dict_matches_official_names_and_shapes(model_type):
    with torch.device("meta"):
        model = Transformer(gpt_config("GPT-B", model_type=model_type))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes == gpt_b_expected_shapes(model_type)
    if model_type == "c2i":
        n = model.num_parameters()
        assert abs(n - 110.9e6) / 110.9e6 < 0.005, n


def test_named_sizes_ffn_widths_and_grid():
    widths = {"GPT-B": 2048, "GPT-L": 2816, "GPT-XL": 3584, "GPT-XXL": 4096, "GPT-3B": 8704}
    for name, width in widths.items():
        config = gpt_config(name)
        assert config.ffn_dim == width, name
        assert config.head_dim == (100 if name == "GPT-3B" else 64)
    assert set(widths) == set(GPT_SIZES)
    assert gpt_config("GPT-B", image_size=384).block_size == 576
    assert gpt_config("GPT-B", image_size=512).block_size == 1024
    assert gpt_config("GPT-B", model_type="t2i").cls_token_num == 120
    assert GPTConfig(dim=64, n_head=4, n_layer=1).ffn_dim == 256
