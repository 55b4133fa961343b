"""A tiny Anole folder in the layout of ``leloy/Anole-7b-v0.1-hf`` (a transformers
``save_pretrained`` folder of ``ChameleonForConditionalGeneration`` converted with the VQ decoder):
``config.json`` (Chameleon, with ``vq_config`` and the ``vocabulary_map``), ``generation_config.json``,
two safetensors shards and their index holding the language model and ``model.vqmodel.*`` (encoder,
quantizer, ``post_quant_conv`` and the decoder under taming's names), and the tokenizer files
(``tokenizer.json``: Meta's BPE file with ``<reserved08707>`` renamed ``<image>`` and a post-processor
that adds ``<s>``, as ``LlamaTokenizerFast`` saves it; ``tokenizer_config.json``,
``special_tokens_map.json``, ``preprocessor_config.json``, ``processor_config.json``).

Beside it, :func:`meta_tokenizer_folder` writes the same vocabulary and VQ weights as Meta's
Chameleon tokenizer folder (``text_tokenizer.json``, ``vqgan.yaml``, ``vqgan.ckpt``): what the
official LANTERN code reads to make tests/data/anole/ (``make_golden.py`` there).

The vocabulary has the real layout: 65,536 ids; ``<s> <pad> </s> <unk>`` at 0..3; the 8,192 image
tokens at 4..8195 in code order (code ``c`` is id ``c + 4``, as the official decoding's rank order
assumes); ``<eoss>`` 8196, ``<racm3:break>`` 8197; ``<reservedNNNNN>`` at NNNNN + 4 (so the end of
turn ``<reserved08706>`` is 8710, the id the official prompt hard-codes); byte-level BPE text pieces
from id 9000. The model is 2 layers of width 32 (4 heads, 2 KV heads); the VQ model is 16x (five
levels) at 128 pixels, so an image is 8 x 8 codes.

Every tensor is drawn from a generator seeded by its name, so the files do not depend on the
order in which any library enumerates the weights (the golden tokens were made from them).

Imported by the tests (never a test module itself)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from helpers import lumina as lf

CODES, VOCAB_SIZE, FIRST_IMAGE_ID = 8192, 65536, 4
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
#: The ids the official LANTERN prompt hard-codes, and the image placeholder the HF converter names.
BOS_ID, PAD_ID, SEPARATOR_ID, IMAGE_START_ID, IMAGE_END_ID, IMAGE_TOKEN_ID = 0, 1, 8710, 8197, 8196, 8711
IMAGE_SIZE, GRID = 128, 8
PROMPTS = lf.PROMPTS  # the BPE pieces are trained on them
#: The tiny language model, in the published config's fields (transformers 4.4x names).
MODEL = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, model_parallel_size=1, rms_norm_eps=1e-5,
             rope_theta=10000.0, rope_scaling=None, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
             mlp_bias=False, swin_norm=False, tie_word_embeddings=False, initializer_range=0.02, use_cache=True,
             bos_token_id=BOS_ID, eos_token_id=2, pad_token_id=PAD_ID)
#: The tiny VQ model, as the converter writes ``vq_config`` (transformers' names): five levels (16x),
#: 128 pixels (8 x 8 codes), attention at the 16-pixel level besides the middle.
VQ = dict(embed_dim=4, num_embeddings=CODES, double_latent=False, latent_channels=8, resolution=IMAGE_SIZE,
          in_channels=3, out_channels=3, base_channels=32, channel_multiplier=[1, 1, 2, 2, 2], num_res_blocks=1,
          attn_resolutions=[16], dropout=0.0, attn_type="vanilla", initializer_range=0.02,
          model_type="chameleon_vqgan")


def taming_config(vq: dict = VQ) -> dict:
    """``vq_config`` under taming's yaml names (``vqgan.yaml``'s ``model.params``)."""
    return dict(embed_dim=vq["embed_dim"], n_embed=vq["num_embeddings"], ch=vq["base_channels"],
                ch_mult=list(vq["channel_multiplier"]), num_res_blocks=vq["num_res_blocks"],
                attn_resolutions=list(vq["attn_resolutions"] or []), z_channels=vq["latent_channels"],
                resolution=vq["resolution"], in_channels=vq["in_channels"], out_ch=vq["out_channels"],
                dropout=vq["dropout"], double_z=vq["double_latent"])


def vocabulary(*, image_placeholder: bool) -> tuple[dict[str, int], list]:
    """``(name -> id, merges)`` in the real layout; ``image_placeholder``: id 8711 is ``<image>``
    (the HF converter's rename) instead of Meta's ``<reserved08707>``."""
    pieces, merges = lf._text_tokens()
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    for code in range(CODES):
        vocab[lf.image_token(code)] = FIRST_IMAGE_ID + code
    vocab["<eoss>"], vocab["<racm3:break>"] = IMAGE_END_ID, IMAGE_START_ID
    for token in range(IMAGE_START_ID + 1, VOCAB_SIZE):
        if lf.TEXT_START <= token < lf.TEXT_START + len(pieces):
            vocab[pieces[token - lf.TEXT_START]] = token
        else:
            vocab[f"<reserved{token - 4:05d}>"] = token
    if image_placeholder:
        vocab["<image>"] = vocab.pop("<reserved08707>")
    assert len(vocab) == VOCAB_SIZE
    return vocab, merges


def write_hf_tokenizer(folder: Path, vocab: dict[str, int], merges) -> None:
    """``tokenizer.json`` as the converter's ``LlamaTokenizerFast`` saves Meta's file (the same BPE,
    ``<image>`` for ``<reserved08707>``, and a post-processor that adds ``<s>``), and the small
    tokenizer / processor files beside it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                                  SPECIALS + ["<eoss>", "<racm3:break>", "<reserved08706>", "<image>"]])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", BOS_ID)])
    tokenizer.save(str(folder / "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
                "sep_token": "<reserved08706>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**specials, "add_bos_token": True, "add_eos_token": False, "legacy": False, "image_token": "<image>",
         "model_max_length": 1000000000000000019884624838656, "processor_class": "ChameleonProcessor",
         "tokenizer_class": "LlamaTokenizer"}, indent=2))
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"crop_size": {"height": 512, "width": 512}, "do_center_crop": True, "do_convert_rgb": True,
         "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [1.0, 1.0, 1.0],
         "image_processor_type": "ChameleonImageProcessor", "image_std": [1.0, 1.0, 1.0],
         "processor_class": "ChameleonProcessor", "resample": 1, "rescale_factor": 0.0078,
         "size": {"shortest_edge": 512}}, indent=2))
    (folder / "processor_config.json").write_text(json.dumps(
        {"image_seq_length": 1024, "image_token": "<image>", "processor_class": "ChameleonProcessor"}, indent=2))


def _drawn(name: str, shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed))


def _value(name: str, shape, seed: int) -> torch.Tensor:
    """O(1) activations and well-separated logits (fan-in scaled weights, norms near 1)."""
    noise = _drawn(name, shape, seed)
    if "q_norm" in name or "k_norm" in name:
        return (1.0 if name.endswith("weight") else 0.0) + 0.3 * noise
    if "norm" in name:
        return (1.0 if name.endswith("weight") else 0.0) + 0.1 * noise
    if name == "model.embed_tokens.weight":
        return noise
    if name == "lm_head.weight":
        return 4 * noise / shape[1] ** 0.5
    if len(shape) == 1:  # biases
        return 0.1 * noise
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    return noise / fan_in ** 0.5


def anole_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the published checkpoint for ``config`` (a config.json dict): the keys of
    transformers' ``ChameleonForConditionalGeneration`` (language model, VQ encoder, quantizer,
    ``quant_conv``, ``post_quant_conv``) plus the VQ decoder under taming's names
    (``model.vqmodel.decoder.*``, which the converter keeps and transformers' class lacks)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    given = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "transformers_version",
                                                          "model_type")}
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in ChameleonForConditionalGeneration(ChameleonConfig(**given))
                  .state_dict().items()}
    state = {name: _value(name, shape, seed) for name, shape in shapes.items()}
    decoder = lf.taming_decoder_state(taming_config(config["vq_config"]), seed=seed)
    for key, value in decoder.items():
        if key.startswith(("decoder.", "post_quant_conv.", "quantize.embedding.")):
            state[f"model.vqmodel.{key}"] = value
    return state


def published_config(vocab: dict[str, int], **changes) -> dict:
    """config.json as the converter writes it (transformers 4.4x field names)."""
    return {"architectures": ["ChameleonForConditionalGeneration"], "model_type": "chameleon", **MODEL,
            "torch_dtype": "float32", "transformers_version": "4.44.0.dev0", "vq_config": dict(VQ),
            "vocabulary_map": dict(vocab), **changes}


def write_anole_folder(folder: Path, config: dict, state: dict[str, torch.Tensor], vocab, merges,
                       shards: int = 2) -> Path:
    """The published layout: config.json, generation_config.json, ``shards`` safetensors files and
    their index, the tokenizer and processor files."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": 2, "pad_token_id": PAD_ID, "transformers_version": "4.44.0.dev0"}))
    keys = list(state)
    weight_map = {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[index::shards]
        save_file({key: state[key].contiguous() for key in part}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_hf_tokenizer(folder, vocab, merges)
    return folder


def meta_tokenizer_folder(folder: Path, state: dict[str, torch.Tensor], vq: dict = VQ) -> Path:
    """Meta's Chameleon tokenizer folder for the same model: ``text_tokenizer.json`` (no
    ``<image>`` rename, no post-processor), ``vqgan.yaml`` and ``vqgan.ckpt`` holding the folder's
    VQ quantizer, ``post_quant_conv`` and decoder under taming's names."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = vocabulary(image_placeholder=False)
    lf.write_text_tokenizer(folder / "text_tokenizer.json", vocab, merges)
    (folder / "vqgan.yaml").write_text(lf.vqgan_yaml(taming_config(vq)))
    taming = {key[len("model.vqmodel."):]: value for key, value in state.items()
              if key.startswith(("model.vqmodel.decoder.", "model.vqmodel.post_quant_conv.",
                                 "model.vqmodel.quantize.embedding."))}
    torch.save({"state_dict": taming, "global_step": 0}, folder / "vqgan.ckpt")
    return folder


def anole_folder(root: Path, name: str = "Anole-tiny", seed: int = 0) -> dict:
    """The tiny Anole folder under ``root``: ``{"model_path", "config", "state", "vocab"}``."""
    vocab, merges = vocabulary(image_placeholder=True)
    config = published_config(vocab)
    state = anole_state(config, seed)
    path = write_anole_folder(root / name, config, state, vocab, merges)
    return {"model_path": path, "config": config, "state": state, "vocab": vocab, "merges": merges}


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    """A content hash of a state dict (names, shapes and fp32 bytes, in name order): which tiny
    folder the golden data were made from."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().float().contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------- official LANTERN's Anole drafter
#: A tiny drafter in the released layout of ``jadohu/anole_drafter`` (config.json's keys, as
#: LANTERN's data/configs/anole_config.json has them) at the tiny model's width, with heads, MLP
#: width and context of its own (2 heads of 16, 96, 256), so a reader that took them from the
#: target would be caught.
DRAFTER_CONFIG = {
    "architectures": ["ChameleonForConditionalGeneration"], "attention_bias": False, "attention_dropout": 0.0,
    "boi_token_id": IMAGE_START_ID, "bos_token_id": 1, "eoi_token_id": IMAGE_END_ID, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": MODEL["hidden_size"], "image_token_id": IMAGE_TOKEN_ID,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 256, "mlp_bias": False,
    "model_parallel_size": 1, "model_type": "chameleon", "num_attention_heads": 2, "num_hidden_layers": 1,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0, "swin_norm": False,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.43.0.dev0", "use_cache": True,
    "vocab_size": VOCAB_SIZE,
    "vq_config": {"attn_resolutions": [], "ch": 128, "ch_mult": [1, 1, 2, 2, 4], "double_z": False,
                  "model_type": "chameleon_vqgan", "n_embed": CODES, "out_ch": 3, "z_channels": 256},
}


def drafter_state(config: dict = DRAFTER_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """The drafter's state dict under LANTERN's names (``cnets_anole.Model``: its own token table,
    ``fc`` over [embedding; feature] with bias, one Chameleon layer with q/k norms and input norm),
    rounded to bf16 as the release is stored; drawn per name like the model's, but from its own
    seeds (the token table is not the model's, so a reader that used the target's is caught)."""
    dim, width, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    head_dim, kv_heads = dim // heads, config["num_key_value_heads"]
    shapes = {"embed_tokens.weight": (config["vocab_size"], dim), "fc.weight": (dim, 2 * dim), "fc.bias": (dim,)}
    for i in range(config["num_hidden_layers"]):
        layer = f"layers.{i}."
        shapes.update({layer + "self_attn.q_proj.weight": (heads * head_dim, dim),
                       layer + "self_attn.k_proj.weight": (kv_heads * head_dim, dim),
                       layer + "self_attn.v_proj.weight": (kv_heads * head_dim, dim),
                       layer + "self_attn.o_proj.weight": (dim, dim),
                       layer + "self_attn.q_norm.weight": (heads, head_dim),
                       layer + "self_attn.q_norm.bias": (heads, head_dim),
                       layer + "self_attn.k_norm.weight": (kv_heads, head_dim),
                       layer + "self_attn.k_norm.bias": (kv_heads, head_dim),
                       layer + "mlp.gate_proj.weight": (width, dim), layer + "mlp.up_proj.weight": (width, dim),
                       layer + "mlp.down_proj.weight": (dim, width), layer + "input_layernorm.weight": (dim,),
                       layer + "post_attention_layernorm.weight": (dim,)})
    state = {}
    for name, shape in shapes.items():
        value = _drawn("drafter." + name, shape, seed) if name == "embed_tokens.weight" else \
            _value("drafter." + name, shape, seed)
        state[name] = value.to(torch.bfloat16)
    return state


def write_drafter_folder(folder: Path, config: dict = DRAFTER_CONFIG, state: dict | None = None,
                         weights: str = "pytorch_model.bin") -> Path:
    """The released layout: ``config.json`` and ``pytorch_model.bin`` (``torch.save`` of the plain
    state dict) or ``model.safetensors``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = drafter_state(config) if state is None else state
    if weights == "pytorch_model.bin":
        torch.save(state, folder / weights)
    else:
        from safetensors.torch import save_file

        save_file({key: value.contiguous() for key, value in state.items()}, str(folder / weights))
    return folder


#: The neighbour table the drafter golden data were decoded with: code ``c``'s neighbours are the
#: codes at these offsets (mod 8192), nearest first -- a fixed table both LANTERN (its
#: ``top_8191_indices.npy``, of which it reads the first k columns) and relaxspec (--neighbours) read.
NEIGHBOUR_OFFSETS = [sign * step for step in range(1, 257) for sign in (1, -1)][:511]


def neighbour_table(count: int = len(NEIGHBOUR_OFFSETS)):
    """int64 ``[8192, count]``: each code's first ``count`` neighbours."""
    import numpy as np

    codes = np.arange(CODES)[:, None]
    return ((codes + np.asarray(NEIGHBOUR_OFFSETS[:count])[None, :]) % CODES).astype(np.int64)
