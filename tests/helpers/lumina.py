"""Tiny Lumina-mGPT files in the layouts users download: a model folder (Chameleon config.json
with its vocabulary_map, two safetensors shards and their index, Lumina's
``[model_parallel_size, head_dim]`` q/k norms, no ``model.vqmodel.*``) and Meta's Chameleon
tokenizer folder (``text_tokenizer.json``, a ``tokenizers`` BPE file; ``vqgan.yaml``, a taming
VQModel config; ``vqgan.ckpt``, ``torch.save({"state_dict": ...})`` with taming's key names).

The vocabulary has the real layout: 65,536 ids; ``<s> <pad> </s> <unk>`` at 0..3; the 8,192
image tokens ``IMGIMG<code digits as A..J>Z`` at 4..8195 (in a shuffled code order, so an adapter
that assumed ``id = code + 4`` would fail); ``<eoss>`` 8196, ``<racm3:break>`` 8197;
``<reservedNNNNN>`` at id NNNNN + 4 everywhere else, except a block of byte-level BPE text tokens
(trained here on the official prompt template and the test prompts) from id 9000.

Imported by the tests (never a test module itself)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CODES = 8192
VOCAB_SIZE = 65536
FIRST_IMAGE_ID = 4
TEXT_START = 9000
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]
#: Ids the official code hard-codes or that third-party annotations give (REFERENCE §7, the notes).
BOS_ID, SEPARATOR_ID, IMAGE_START_ID, IMAGE_END_ID, NEW_LINE_ID = 0, 8710, 8197, 8196, 8803
IMAGE_SIZE = 64  # 2 grid units: 4 x 4 codes
PROMPTS = ["a red fox", "the blue cat under the rain", "a lighthouse"]
#: The tiny language model: Lumina's shapes in miniature (model-parallel q/k norms included).
MODEL = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, model_parallel_size=2, rms_norm_eps=1e-5,
             rope_theta=500.0, tie_word_embeddings=False, swin_norm=False, attention_bias=False, mlp_bias=False,
             mask_image_logits=False, dropout=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=None)
#: The tiny VQGAN: five levels (16x, as Chameleon's), attention at the 8-pixel level besides the middle.
VQGAN = dict(embed_dim=4, n_embed=CODES, ch=32, ch_mult=[1, 1, 2, 2, 2], num_res_blocks=1, attn_resolutions=[8],
             z_channels=8, resolution=64, in_channels=3, out_ch=3, dropout=0.0, double_z=False)


def image_token(code: int) -> str:
    """Meta's name of image code ``code``: digits written as letters A..J, then ``Z``."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def template(prompt: str, size: int) -> str:
    return f"Generate an image of {size}x{size} according to the following prompt:\n{prompt}"


def _text_tokens() -> tuple[list[str], list[tuple[str, str]]]:
    """Byte-level BPE pieces (in their trained order) and merges, learnt on the prompts' text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = [template(p, s) for p in PROMPTS + ["a picture", "a dog", "the sea at night"] for s in (32, 64, 128, 256)]
    corpus += ["a red fox " * 40, "lowres, bad anatomy, blurry."]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus * 3, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    pieces = sorted(model["vocab"], key=model["vocab"].get)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return pieces, merges


def vocabulary() -> tuple[dict[str, int], list[tuple[str, str]], dict[int, int]]:
    """``(name -> id, merges, id -> image code)`` in the real layout."""
    pieces, merges = _text_tokens()
    vocab = {name: i for i, name in enumerate(SPECIALS)}
    order = torch.randperm(CODES, generator=torch.Generator().manual_seed(0)).tolist()
    id_to_code = {}
    for slot, code in enumerate(order):
        vocab[image_token(code)] = FIRST_IMAGE_ID + slot
        id_to_code[FIRST_IMAGE_ID + slot] = code
    vocab["<eoss>"], vocab["<racm3:break>"] = IMAGE_END_ID, IMAGE_START_ID
    for token in range(IMAGE_START_ID + 1, VOCAB_SIZE):
        if TEXT_START <= token < TEXT_START + len(pieces):
            vocab[pieces[token - TEXT_START]] = token
        else:
            vocab[f"<reserved{token - 4:05d}>"] = token
    assert len(vocab) == VOCAB_SIZE
    return vocab, merges, id_to_code


def write_text_tokenizer(path: Path, vocab: dict[str, int], merges) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in
                                  SPECIALS + ["<eoss>", "<racm3:break>", "<reserved08706>", "<reserved08799>"]])
    tokenizer.save(str(path))


def _scrambled(shape, generator, *, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * scale


def taming_decoder_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random taming ``VQModel`` state dict: the keys the decoder reads (named by taming's
    architecture, enumerated here independently of relaxspec's module) plus encoder, quant_conv
    and loss keys a Lightning checkpoint carries and the decoder ignores."""
    gen = torch.Generator().manual_seed(seed)
    state = {}

    def conv(name, cin, cout, k):
        state[f"{name}.weight"] = _scrambled((cout, cin, k, k), gen, scale=(cin * k * k) ** -0.5)
        state[f"{name}.bias"] = _scrambled((cout,), gen, scale=0.1)

    def norm(name, channels):
        state[f"{name}.weight"] = 1 + _scrambled((channels,), gen, scale=0.1)
        state[f"{name}.bias"] = _scrambled((channels,), gen, scale=0.1)

    def resnet(name, cin, cout):
        norm(f"{name}.norm1", cin)
        conv(f"{name}.conv1", cin, cout, 3)
        norm(f"{name}.norm2", cout)
        conv(f"{name}.conv2", cout, cout, 3)
        if cin != cout:
            conv(f"{name}.nin_shortcut", cin, cout, 1)

    def attn(name, channels):
        norm(f"{name}.norm", channels)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", channels, channels, 1)

    ch, mult, z = config["ch"], config["ch_mult"], config["z_channels"]
    state["quantize.embedding.weight"] = _scrambled((config["n_embed"], config["embed_dim"]), gen)
    conv("post_quant_conv", config["embed_dim"], z, 1)
    conv("quant_conv", z, config["embed_dim"], 1)  # encoder side: ignored
    conv("encoder.conv_in", config["in_channels"], ch, 3)
    state["loss.discriminator.main.0.weight"] = torch.zeros(4, 3, 4, 4)
    channels, resolution = ch * mult[-1], config["resolution"] // 2 ** (len(mult) - 1)
    conv("decoder.conv_in", z, channels, 3)
    resnet("decoder.mid.block_1", channels, channels)
    attn("decoder.mid.attn_1", channels)
    resnet("decoder.mid.block_2", channels, channels)
    for level in reversed(range(len(mult))):
        out = ch * mult[level]
        for block in range(config["num_res_blocks"] + 1):
            resnet(f"decoder.up.{level}.block.{block}", channels, out)
            channels = out
            if resolution in config["attn_resolutions"]:
                attn(f"decoder.up.{level}.attn.{block}", out)
        if level:
            conv(f"decoder.up.{level}.upsample.conv", out, out, 3)
            resolution *= 2
    norm("decoder.norm_out", channels)
    conv("decoder.conv_out", channels, config["out_ch"], 3)
    return state


def vqgan_yaml(config: dict) -> str:
    """``vqgan.yaml`` as taming writes it (with the loss config relaxspec ignores)."""
    dd = {k: v for k, v in config.items() if k not in ("embed_dim", "n_embed")}
    lines = ["model:", "  base_learning_rate: 4.5e-06", "  target: taming.models.vqgan.VQModel", "  params:",
             f"    embed_dim: {config['embed_dim']}", f"    n_embed: {config['n_embed']}", "    ddconfig:"]
    lines += [f"      {key}: {json.dumps(value).lower() if isinstance(value, bool) else json.dumps(value)}"
              for key, value in dd.items()]
    lines += ["    lossconfig:", "      target: taming.modules.losses.vqperceptual.VQLPIPSWithDiscriminator",
              "      params:", "        disc_start: 0", "        codebook_weight: 1.0"]
    return "\n".join(lines) + "\n"


def write_tokenizer_folder(folder: Path, vocab, merges, vqgan: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = dict(VQGAN if vqgan is None else vqgan)
    write_text_tokenizer(folder / "text_tokenizer.json", vocab, merges)
    (folder / "vqgan.yaml").write_text(vqgan_yaml(config))
    torch.save({"state_dict": taming_decoder_state(config), "global_step": 0, "epoch": 0}, folder / "vqgan.ckpt")
    return folder


def tiny_chameleon(vocab: dict[str, int], seed: int = 0):
    """A random ``ChameleonForConditionalGeneration`` (transformers' class, full ``[heads,
    head_dim]`` q/k norms made from one row per model-parallel shard), with O(1) activations and
    well-separated logits."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    mapping = dict(vocab)
    mapping["<image>"] = mapping.pop("<reserved08707>")  # as transformers' converter writes vocabulary_map
    vq = dict(embed_dim=4, num_embeddings=CODES, base_channels=32, channel_multiplier=[1, 1], latent_channels=4,
              resolution=32, attn_resolutions=[], num_res_blocks=1)
    config = ChameleonConfig(**MODEL, vocabulary_map=mapping, vq_config=vq)
    torch.manual_seed(seed)
    model = ChameleonForConditionalGeneration(config).eval()
    gen = torch.Generator().manual_seed(seed)
    shards = config.model_parallel_size
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.vqmodel."):
                continue
            if "_norm." in name and param.dim() == 2:  # q/k norms: one row per shard, repeated for its heads
                rows = (1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn(shards, param.shape[1],
                                                                                       generator=gen)
                param.copy_(rows.repeat_interleave(param.shape[0] // shards, dim=0))
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif name == "lm_head.weight":
                param.copy_(4 * torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
    return model


def lumina_state(model) -> dict[str, torch.Tensor]:
    """What a Lumina checkpoint holds for ``model``: q/k norms as ``[model_parallel_size,
    head_dim]`` (each shard's first head row), no ``model.vqmodel.*``."""
    shards = model.config.model_parallel_size
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.vqmodel."):
            continue
        if ".q_norm." in key or ".k_norm." in key:
            value = value[:: value.shape[0] // shards]
        state[key] = value.contiguous().clone()
    return state


def published_config(config) -> dict:
    """``config`` as Lumina's released config.json writes it (transformers 4.43 and Lumina's
    training class): ``rope_theta`` / ``rope_scaling`` rather than ``rope_parameters``,
    ``torch_dtype``, ``z_loss_weight``, and the VQ config with Meta's yaml keys beside
    transformers' names (as the converter writes it)."""
    written = config.to_dict()
    written.pop("rope_parameters", None)
    written.pop("dtype", None)
    vq = written["vq_config"]
    vq.update(ch=vq["base_channels"], ch_mult=vq["channel_multiplier"], n_embed=vq["num_embeddings"],
              z_channels=vq["latent_channels"], out_ch=3, double_z=False)
    written.update(architectures=["ChameleonXLLMXForConditionalGeneration"], rope_theta=config.rope_parameters[
        "rope_theta"], rope_scaling=None, torch_dtype="bfloat16", transformers_version="4.43.3", z_loss_weight=1e-5)
    return written


def write_model_folder(folder: Path, model, state: dict | None = None, shards: int = 2) -> Path:
    """config.json (with vocabulary_map) and ``state`` (default :func:`lumina_state`) in
    ``shards`` safetensors files with their index, as ``save_pretrained`` shards them."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(published_config(model.config), indent=2))
    state = lumina_state(model) if state is None else state
    keys = list(state)
    weight_map = {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[index::shards]
        save_file({key: state[key] for key in part}, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def lumina_folders(root: Path) -> dict:
    """A model folder and a tokenizer folder under ``root``: ``{"model_path", "tokenizer_path",
    "model" (the in-memory transformers model), "vocab", "id_to_code"}``."""
    vocab, merges, id_to_code = vocabulary()
    model = tiny_chameleon(vocab)
    return {"model_path": write_model_folder(root / "Lumina-mGPT-tiny", model),
            "tokenizer_path": write_tokenizer_folder(root / "chameleon-tokenizer", vocab, merges),
            "model": model, "vocab": vocab, "merges": merges, "id_to_code": id_to_code}


def replica_in(workdir, prefix: str) -> tuple[Path, dict]:
    """The work folder of a golden script's first stage (``workdir``, or a new temporary one named
    ``prefix...``) and the replica built in its ``replica`` folder (:func:`lumina_folders`)."""
    import tempfile

    work = Path(workdir or tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    return work, lumina_folders(work / "replica")
