"""Anole (GAIR-NLP's image-generation tuning of Chameleon; ``leloy/Anole-7b-v0.1-hf``, a
transformers ``save_pretrained`` folder of ``ChameleonForConditionalGeneration`` converted with the
VQ decoder) as a :class:`~relaxspec.models.base.TargetModel`, for text-to-image generation as the
official code does it (LANTERN ``models/kv_variants/modeling_anole_kv.py``
``ChameleonForConditionalGeneration.generate``; GAIR-NLP/anole ``text2image.py`` through Meta's
Chameleon inference). docs/models/anole.md lists every choice.

One folder holds everything: the language model, the VQ model (``model.vqmodel.*``: encoder,
quantizer, ``post_quant_conv`` and, unlike transformers' own converter, the decoder under taming's
names) and the text tokenizer (``tokenizer.json``: Meta's BPE file). The official code reads the
text tokenizer and the VQGAN from Meta's tokenizer folder instead; the converter copied both into
the folder, so no ``--tokenizer-path`` is needed.

The prompt is ``<s>`` + the text (no template) + the end of turn ``<reserved08706>`` (8710) + the
image start ``<racm3:break>`` (8197); the unconditional context is ``<s> <racm3:break>`` alone, at
positions 0 and 1 with its own positions after them (image token ``i`` at ``2 + i``; the
conditional stream's at ``L + i``). Guidance ``uncond + s (cond - uncond)`` on raw logits, then
every non-image logit is masked (LANTERN sets ids outside 4..8195 to the minimum after CFG), so
the engine's vocabulary is the codebook: logits are the LM head's rows of ids 4..8195, code ``c``
at id ``c + 4`` (the official decoding maps an image id to its rank among the image ids). There
are no row ends: an image is ``grid x grid`` codes, 32 x 32 at 512 pixels, read from ``vq_config``.

transformers' ``ChameleonForConditionalGeneration`` forward sets every image logit to the minimum
(it generates text only) and its ``ChameleonVQVAE`` has no decoder, so neither is used: the
language model's layers run through :class:`relaxspec.models.hf.KVStore`, and pixels come from
:class:`relaxspec.models.chameleon_vqgan.ChameleonVQGAN` filled from ``model.vqmodel.*``.

Conditions: ``[B, 2, S]`` token ids (prompt, unconditional context), each left-padded with ``-1``
(:func:`format_prompts`); :meth:`AnoleTarget.null_condition` swaps the two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from safetensors import safe_open

from relaxspec.caching import kept_copy
from relaxspec.errors import RelaxspecError
from relaxspec.models import hf, lumina
from relaxspec.models.chameleon_vqgan import ChameleonVQGAN, VQGANConfig, vqgan_from_state

NAME = "Anole"
MODEL_TYPE = "chameleon"
#: The official image sampling: GAIR-NLP/anole text2image.py runs Meta's Chameleon inference with
#: its default ``Options.Image`` (text guidance 3.0, temperature 0.7, top-p 0.9; its image guidance
#: 1.2 does nothing for a text-only prompt). LANTERN's generate_images.py uses CFG 3.0,
#: temperature 1.0, top-k 2000 instead.
ANOLE_SAMPLING = {"cfg_scale": 3.0, "temperature": 0.7, "top_k": 0, "top_p": 0.9}
TOKENIZER_FILE = "tokenizer.json"
VQ_PREFIX = "model.vqmodel."
#: Under taming's names: what the converter adds to transformers' VQ model, and pixels need.
DECODER_PREFIX = VQ_PREFIX + "decoder."
BOS, END_OF_TURN, IMAGE_START = "<s>", "<reserved08706>", "<racm3:break>"
IMAGE_PREFIX = lumina.IMAGE_PREFIX
#: The ids the official prompt hard-codes ([0] + text + [8710, 8197]) and its first image id.
OFFICIAL_IDS = {BOS: 0, END_OF_TURN: 8710, IMAGE_START: 8197}
FIRST_IMAGE_ID = 4


@dataclass
class AnoleVocabulary:
    """The folder's text tokenizer (a ``tokenizers.Tokenizer``), the vocabulary id of each image
    code (``image_ids[code]``) and the prompt's special ids."""

    text: object
    size: int
    image_ids: list[int]
    bos: int
    end_of_turn: int
    image_start: int

    def encode(self, text: str) -> list[int]:
        # Without the post-processor transformers' tokenizer file adds (<s>): the official code
        # encodes with Meta's file, which has none, and puts <s> itself.
        return self.text.encode(text, add_special_tokens=False).ids


def read_vocabulary(path, config: dict) -> AnoleVocabulary:
    """``tokenizer.json`` of an Anole folder, checked against its config's ``vocab_size`` and
    ``vocabulary_map`` and against the ids the official generation hard-codes (one-line errors)."""
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        raise RelaxspecError(f"{path}: no {TOKENIZER_FILE}: an Anole folder carries its text tokenizer (the files "
                             "save_pretrained writes with its processor)")
    from tokenizers import Tokenizer

    try:
        text = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - any parse failure: not a tokenizers file
        raise RelaxspecError(f"{file}: not a tokenizers JSON file ({hf.first_line(err)})") from None
    vocab = text.get_vocab(with_added_tokens=True)
    size = text.get_vocab_size(with_added_tokens=True)
    if size != config.get("vocab_size"):
        raise RelaxspecError(f"{file}: {size} tokens, but the model has {config.get('vocab_size')}: not its tokenizer")
    mapping = config.get("vocabulary_map")
    if isinstance(mapping, dict) and mapping and any(mapping.get(name) != token for name, token in vocab.items()
                                                     if name.startswith(IMAGE_PREFIX) or name in OFFICIAL_IDS):
        raise RelaxspecError(f"{file}: its image and special tokens are not those of config.json's vocabulary_map")
    for name, official in OFFICIAL_IDS.items():
        if vocab.get(name) != official:
            raise RelaxspecError(f"{file}: {name} is id {vocab.get(name)}; the official Anole generation uses "
                                 f"{official}: not the Chameleon vocabulary")
    codes = {token: lumina.image_code(name) for name, token in vocab.items() if name.startswith(IMAGE_PREFIX)}
    # The official decoding maps an image id to its rank among the image ids (Meta's
    # convert_bpe2img); checked equal to the code its name spells, so both readings agree.
    image_ids = sorted(codes)
    if not image_ids or image_ids != list(range(FIRST_IMAGE_ID, FIRST_IMAGE_ID + len(image_ids))) \
            or [codes[token] for token in image_ids] != list(range(len(image_ids))):
        raise RelaxspecError(f"{file}: the {len(image_ids)} {IMAGE_PREFIX} tokens are not ids "
                             f"{FIRST_IMAGE_ID}.. in code order, as the official generation reads them")
    return AnoleVocabulary(text=text, size=size, image_ids=image_ids, bos=vocab[BOS], end_of_turn=vocab[END_OF_TURN],
                           image_start=vocab[IMAGE_START])


class AnoleTarget(hf.RowEndTarget):
    """An Anole model as relaxspec's engine drives it: ``[B, 2, S]`` conditions (the prompt and the
    unconditional context, left-padded with ``-1``), logits over the codebook, and no forced
    tokens -- :class:`relaxspec.models.hf.RowEndTarget` whose rows end with nothing, so one query
    and one cache slot per token (its companions are never run).

    ``model``: a ``ChameleonForConditionalGeneration`` (:func:`relaxspec.models.lumina.load_chameleon`);
    ``vocabulary``: :func:`read_vocabulary`'s; ``prompt_length``: the condition slots ``S``;
    ``grid``: codes per image side.
    """

    family, formatter = NAME, "relaxspec.models.anole.format_prompts"
    row_end_companions = False  # no row ends: rows in parallel condition it as LlamaGen
    prompt_end = "<racm3:break> (the prompt after <reserved08706>; the unconditional context is <s> <racm3:break>)"

    def __init__(self, model, vocabulary: AnoleVocabulary, prompt_length: int, grid: int):
        super().__init__(model, torch.tensor(vocabulary.image_ids, dtype=torch.long), prompt_length, grid,
                         model.config)
        self.image_start = vocabulary.image_start

    @property
    def text_model(self):
        return self.hf.model

    def ends_well(self, cond: Tensor, valid: Tensor) -> Tensor:
        # Both contexts (the engine stacks each condition with its swap) end with the image start.
        return (cond[:, :, -1] == self.image_start).all()

    def setup_caches(self, rows: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        self._kv.setup(self.text_config, rows, max_seq, dtype or self.dtype, self.device)
        self._keys = kept_copy(self, "keys", torch.arange(max_seq, device=self.device))  # one address a shape
        self.max_seq = max_seq

    def move_cache(self, src: Tensor, dst: Tensor) -> None:
        self._kv.move(src, dst)

    def step(self, tokens: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor,
             capture: tuple[int, ...] | None = None):
        normed, hidden = self._kv.run(self.text_model, self.embed_tokens(tokens).to(self.dtype),
                                      self._real_positions(positions), cache_slots,
                                      attn_mask & self._key_valid[:, None, :], capture)
        return self.head(normed), hidden

    def _real_positions(self, positions: Tensor) -> Tensor:
        """Engine positions -> the model's: left padding removed, so the prompt starts at 0 and
        the unconditional context's <s> <racm3:break> sit at 0 and 1, as the official code places
        them."""
        return (positions - self._pad[:, None]).clamp(min=0)


def format_prompts(vocabulary: AnoleVocabulary, prompts: list[str]) -> Tensor:
    """Conditions ``[N, 2, S]`` (prompt, unconditional context; left-padded with -1) as the
    official generation builds them: ``<s>`` + the text + ``<reserved08706>`` + ``<racm3:break>``;
    the unconditional context ``<s> <racm3:break>``."""
    hf.check_prompts(prompts)
    rows = [[vocabulary.bos] + vocabulary.encode(prompt) + [vocabulary.end_of_turn, vocabulary.image_start]
            for prompt in prompts]
    length = max(len(row) for row in rows)
    ids = torch.tensor([[-1] * (length - len(row)) + row for row in rows])
    uncond = torch.tensor([-1] * (length - 2) + [vocabulary.bos, vocabulary.image_start]).expand(len(rows), -1)
    return torch.stack([ids, uncond], 1)


# ---------------------------------------------------------------- the folder
def weight_names(path) -> list[str]:
    """The tensor names of a folder's safetensors files (their index's, where there is one)."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            raise RelaxspecError(f"{index}: not a safetensors index (a weight_map)") from None

    names = []
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as opened:
                names += list(opened.keys())
        except Exception as err:  # noqa: BLE001 - a truncated or foreign file
            raise RelaxspecError(f"{file}: unreadable safetensors ({hf.first_line(err)})") from None
    return names


def is_anole_folder(path) -> bool:
    """Whether a Chameleon folder is Anole's: its weights hold the VQ decoder
    (``model.vqmodel.decoder.*``), which Lumina-mGPT's checkpoints and transformers' own converter
    leave out. Never raises (a folder it cannot read is not claimed)."""
    try:
        return any(name.startswith(DECODER_PREFIX) for name in weight_names(path))
    except (RelaxspecError, OSError):
        return False


#: transformers' ``ChameleonVQVAEConfig`` defaults: ``save_pretrained`` leaves out every field equal
#: to them (the real ``leloy/Anole-7b-v0.1-hf`` uses exactly these), and transformers fills them in.
VQ_DEFAULTS = {"embed_dim": 256, "num_embeddings": 8192, "double_latent": False, "latent_channels": 256,
               "resolution": 512, "in_channels": 3, "base_channels": 128, "channel_multiplier": [1, 1, 2, 2, 4],
               "num_res_blocks": 2, "attn_resolutions": None, "dropout": 0.0, "attn_type": "vanilla"}


def vq_config(config: dict, path) -> VQGANConfig:
    """``config.json``'s ``vq_config`` (transformers' names; the fields it leaves out are
    transformers' defaults, :data:`VQ_DEFAULTS`) as the taming decoder's config."""
    vq = config.get("vq_config")
    if vq is None or isinstance(vq, dict):
        vq = {**VQ_DEFAULTS, **(vq or {})}
    try:
        if vq.get("attn_type", "vanilla") != "vanilla":
            raise RelaxspecError(f"{path}: vq_config attn_type {vq['attn_type']!r}: relaxspec decodes the Chameleon "
                                 "decoder ('vanilla' attention) only")
        return VQGANConfig(embed_dim=int(vq["embed_dim"]), n_embed=int(vq["num_embeddings"]),
                           ch=int(vq["base_channels"]), ch_mult=tuple(int(m) for m in vq["channel_multiplier"]),
                           num_res_blocks=int(vq["num_res_blocks"]),
                           attn_resolutions=tuple(int(r) for r in vq.get("attn_resolutions") or ()),
                           z_channels=int(vq["latent_channels"]), resolution=int(vq["resolution"]),
                           in_channels=int(vq.get("in_channels", 3)), out_ch=int(vq.get("out_channels", 3)),
                           dropout=float(vq.get("dropout", 0.0)))
    except RelaxspecError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise RelaxspecError(f"{path}: config.json has no usable vq_config ({type(err).__name__}: {err})") from None


def read_anole_config(path) -> tuple[dict, VQGANConfig]:
    """``config.json`` of an Anole folder and its VQ config (one-line errors)."""
    config = lumina.read_chameleon_config(path)
    return config, vq_config(config, path)


def load_vq(path, config: VQGANConfig, *, device="cpu") -> ChameleonVQGAN:
    """The VQ model's quantizer, ``post_quant_conv`` and decoder from the folder's safetensors
    (``model.vqmodel.*``), in fp32 on ``device`` (the official code decodes in fp32)."""
    state = {}
    for file in lumina.safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt") as opened:
            for key in opened.keys():
                if key.startswith(VQ_PREFIX):
                    state[key[len(VQ_PREFIX):]] = opened.get_tensor(key)
    if not any(key.startswith("decoder.") for key in state):
        raise RelaxspecError(f"{path}: no VQ decoder weights ({DECODER_PREFIX}*): not an Anole folder (a Chameleon "
                             "folder converted without them cannot paint images)")
    return vqgan_from_state(config, state, f"{path}", "config.json's vq_config", device=device)


def load_anole(path, prompt_length: int, *, device="cpu", dtype=torch.float32) -> tuple[AnoleTarget, ChameleonVQGAN]:
    """``(target, tokenizer)`` from an Anole folder, for prompts of ``prompt_length`` tokens. The
    VQ model decodes in fp32 whatever ``dtype`` the language model is loaded in."""
    config, vq = read_anole_config(path)
    vocabulary = read_vocabulary(path, config)
    return _load(path, vocabulary, vq, prompt_length, device=device, dtype=dtype)


def _load(path, vocabulary: AnoleVocabulary, vq: VQGANConfig, prompt_length: int, *, device,
          dtype) -> tuple[AnoleTarget, ChameleonVQGAN]:
    _check_codebook(vocabulary, vq, path)
    tokenizer = load_vq(path, vq, device=device)
    # The language model without model.vqmodel.* (pixels need only the part read above).
    model = lumina.load_chameleon(path, device=device, dtype=dtype, aside=(VQ_PREFIX,))
    return AnoleTarget(model, vocabulary, prompt_length, vq.resolution // vq.downsample_factor), tokenizer


def _check_codebook(vocabulary: AnoleVocabulary, vq: VQGANConfig, path) -> None:
    if vq.n_embed != len(vocabulary.image_ids):
        raise RelaxspecError(f"{path}: the VQ codebook has {vq.n_embed} codes but {TOKENIZER_FILE} "
                             f"{len(vocabulary.image_ids)} {IMAGE_PREFIX} tokens")
    if vq.resolution % vq.downsample_factor:
        raise RelaxspecError(f"{path}: vq_config resolution {vq.resolution} is not a whole number of "
                             f"{vq.downsample_factor}-pixel codes")


def to_uint8(pixels: Tensor) -> Tensor:
    """Pixels ``[B, 3, H, W]`` in ``[-1, 1]`` -> ``[B, H, W, 3]`` uint8, as the official code
    converts them (Meta's ``_pil_from_chw_tensor``: clamp, ``(x + 1) / 2``, ``x 255``, truncation)."""
    return lumina.to_uint8(pixels)


def sampling_defaults(path) -> dict:
    """Sampling for an Anole folder when the user gives none: its ``generation_config.json``'s
    where set, else the official image sampling (CFG 3, temperature 0.7, top-p 0.9)."""
    return hf.sampling_defaults(path, ANOLE_SAMPLING)


def open_folder(path, prompts: list[str], *, device="cpu", dtype=torch.float32, image_size: int | None = None,
                prompt_length: int | None = None) -> hf.Opened:
    """An Anole folder ready to decode ``prompts`` (formatted as the official generation does),
    left-padded to ``prompt_length`` when given, or to what the context leaves if that is less
    (padding does not change the law: it is masked and positions skip it). The image size is the
    VQ model's (``vq_config.resolution``, 512 for Anole-7b): Anole has no size conditioning."""
    config, vq = read_anole_config(path)
    vocabulary = read_vocabulary(path, config)
    if image_size is not None and image_size != vq.resolution:
        raise RelaxspecError(f"--image-size {image_size}: an {NAME} image is {vq.resolution} pixels (its VQ model's "
                             "resolution, the official 32 x 32 codes at 512); leave --image-size out")
    grid = vq.resolution // vq.downsample_factor
    cond = format_prompts(vocabulary, prompts)
    cond = hf.fit_prompts(cond, prompt_length, config.get("max_position_embeddings"), grid * grid,
                          f"a {vq.resolution}x{vq.resolution} image ({grid}x{grid} codes)")
    target, tokenizer = _load(path, vocabulary, vq, cond.shape[2], device=device, dtype=dtype)
    length = cond.shape[2]

    def format(texts: list[str]) -> tuple[Tensor, None]:  # further prompts, for this target's length
        return hf.left_pad(format_prompts(vocabulary, texts), None, length, -1)

    return hf.Opened(target, tokenizer, cond, None, vq.resolution, {"prompts": list(prompts), "prompt_tokens": length},
                     format=format)
