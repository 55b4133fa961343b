"""LlamaGen VQ tokenizer: official key names/shapes, shapes of encode/decode, normalised lookup."""

import pytest
import torch
import torch.nn.functional as F

from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.vq import VQ_CONFIGS, VQConfig, VQModel, to_uint8

TINY = VQConfig(
    codebook_size=64, codebook_embed_dim=8, z_channels=16, ch=32, ch_mult=(1, 2),
    num_res_blocks=1, norm_groups=8,
)


@pytest.fixture
def tiny() -> VQModel:
    torch.manual_seed(0)
    return VQModel(TINY).eval()


def test_vq16_state_dict_matches_official_keys_and_size() -> None:
    model = VQModel(VQ_CONFIGS["VQ-16"])
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    expected = {
        "encoder.conv_in.weight": (128, 3, 3, 3),
        "encoder.conv_blocks.0.res.0.norm1.weight": (128,),
        "encoder.conv_blocks.0.downsample.conv.weight": (128, 128, 3, 3),
        "encoder.conv_blocks.2.res.0.nin_shortcut.weight": (256, 128, 1, 1),
        "encoder.conv_blocks.4.attn.1.proj_out.weight": (512, 512, 1, 1),
        "encoder.mid.1.q.weight": (512, 512, 1, 1),
        "encoder.conv_out.weight": (256, 512, 3, 3),
        "decoder.conv_in.weight": (512, 256, 3, 3),
        "decoder.mid.2.conv2.weight": (512, 512, 3, 3),
        # The decoder lists levels lowest resolution first, with num_res_blocks + 1 blocks each.
        "decoder.conv_blocks.0.attn.2.k.weight": (512, 512, 1, 1),
        "decoder.conv_blocks.0.upsample.conv.weight": (512, 512, 3, 3),
        "decoder.conv_blocks.1.res.0.nin_shortcut.weight": (256, 512, 1, 1),
        "decoder.conv_out.weight": (3, 128, 3, 3),
        "quantize.embedding.weight": (16384, 8),
        "quantize.codebook_used": (65536,),
        "quant_conv.weight": (8, 256, 1, 1),
        "post_quant_conv.weight": (256, 8, 1, 1),
        "post_quant_conv.bias": (256,),
    }
    for name, shape in expected.items():
        assert shapes.get(name) == shape, name
    # Attention only at the lowest resolution; no resampling after the last level.
    assert not any(k.startswith("encoder.conv_blocks.0.attn") for k in shapes)
    assert not any(k.startswith("encoder.conv_blocks.4.downsample") for k in shapes)
    assert not any(k.startswith("decoder.conv_blocks.4.upsample") for k in shapes)
    assert len(shapes) == 344  # as upstream's VQ_16()
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - 71.9e6) / 71.9e6 < 0.01
    assert VQ_CONFIGS["VQ-16"].downsample_factor == 16
    assert VQ_CONFIGS["VQ-8"].downsample_factor == 8


def test_encode_decode_shapes(tiny: VQModel) -> None:
    images = torch.rand(2, 3, 16, 12) * 2 - 1
    with torch.no_grad():
        tokens = tiny.encode(images)
        assert tokens.shape == (2, 8 * 6) and tokens.dtype == torch.int64
        assert 0 <= int(tokens.min()) and int(tokens.max()) < TINY.codebook_size
        assert tiny.codes_to_latents(tokens.view(2, 8, 6)).shape == (2, 8, 8, 6)
        assert tiny.decode(tokens.view(2, 8, 6)).shape == (2, 3, 16, 12)
        square = tiny.encode(torch.rand(2, 3, 16, 16) * 2 - 1)
        flat, grid = tiny.decode(square), tiny.decode(square.view(2, 8, 8))
    torch.testing.assert_close(flat, grid)
    assert flat.shape == (2, 3, 16, 16)


def test_lookup_uses_normalised_codebook(tiny: VQModel) -> None:
    # Trained codebooks are not unit-norm; give rows very different norms so that a lookup
    # without normalisation would pick different codes.
    with torch.no_grad():
        scales = torch.logspace(-1, 1, TINY.codebook_size).unsqueeze(1)
        tiny.quantize.embedding.weight.copy_(torch.randn(TINY.codebook_size, 8) * scales)
        images = torch.rand(3, 3, 16, 16) * 2 - 1
        tokens = tiny.encode(images)
        latents = tiny.quant_conv(tiny.encoder(images)).permute(0, 2, 3, 1).reshape(-1, 8)
        raw = tiny.raw_codebook
        expected = torch.cdist(F.normalize(latents, dim=-1), F.normalize(raw, dim=-1)).argmin(1)
        unnormalised = torch.cdist(latents, raw).argmin(1)
    assert torch.equal(tokens.flatten(), expected)
    assert not torch.equal(expected, unnormalised)
    norms = tiny.codebook.norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms))
    assert (raw.norm(dim=-1) - 1).abs().max() > 0.5
    # Decoding starts from the normalised vectors too.
    torch.testing.assert_close(tiny.codes_to_latents(tokens)[0, :, 0, 0], tiny.codebook[tokens[0, 0]])


def test_bad_inputs_raise_clear_errors(tiny: VQModel) -> None:
    with pytest.raises(RelaxspecError, match="norm_groups"):
        VQConfig(ch=30, norm_groups=8)
    with pytest.raises(RelaxspecError, match="ch_mult"):
        VQConfig(ch_mult=())
    with pytest.raises(RelaxspecError, match="multiples of 2"):
        tiny.encode(torch.zeros(1, 3, 15, 16))
    with pytest.raises(RelaxspecError, match="square"):
        tiny.decode(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(RelaxspecError, match=r"\[0, 64\)"):
        tiny.decode(torch.full((1, 4), 64))


def test_to_uint8_matches_upstream_rounding() -> None:
    values = torch.tensor([-1.0, 0.0, 1.0, -2.0, 2.0, 0.5])  # 0.5 -> 191.75 -> 191
    images = values.view(1, 3, 1, 2)
    pixels = to_uint8(images)
    assert pixels.dtype == torch.uint8 and pixels.shape == (1, 1, 2, 3)
    assert pixels.permute(0, 3, 1, 2).flatten().tolist() == [0, 128, 255, 0, 255, 191]


def test_decode_never_returns_a_tensor_that_requires_grad(tiny: VQModel) -> None:
    assert all(p.requires_grad for p in tiny.parameters())  # a model fresh from training code
    with torch.enable_grad():
        images = tiny.decode(torch.randint(0, 64, (2, 16)))
    assert not images.requires_grad and images.grad_fn is None
    # the decoder itself still trains: the VQ recipe calls it directly
    latents = tiny.codes_to_latents(torch.randint(0, 64, (1, 16)))
    assert tiny.decoder(tiny.post_quant_conv(latents)).requires_grad
