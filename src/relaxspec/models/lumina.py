"""Lumina-mGPT (a Chameleon language model, transformers' ``ChameleonForConditionalGeneration``,
with Meta's Chameleon VQGAN) as a :class:`~relaxspec.models.base.TargetModel`, for text-to-image
generation as the official inference code (Alpha-VLLM/Lumina-mGPT ``inference_solver.py``,
``data/item_processor.py``) does it. docs/models/lumina-mgpt.md lists every choice.

What users bring: the model folder as published (Chameleon ``config.json``, safetensors shards)
and Meta's Chameleon tokenizer folder (``text_tokenizer.json``, ``vqgan.yaml``, ``vqgan.ckpt``).
Image codes and special tokens are found by their names in ``text_tokenizer.json``: a code is
``IMGIMG`` + its decimal digits written as letters ``A``..``J`` + one final character.

The official prompt is one conversation turn: ``<s>`` + the text "Generate an image of {w}x{h}
according to the following prompt:\\n{prompt}" + the turn separator ``<reserved08706>``; the
model then writes ``<racm3:break>``, a height-grid and a width-grid token, ``h`` rows of ``w``
codes each followed by a forced new line ``<reserved08799>``, and ``<eoss>``. Here the image
start and the grid tokens belong to the condition (relaxspec paints the size asked for; the
official code samples them), and the unconditional context is ``[<racm3:break>, H, W]`` alone at
positions 0, 1, 2, as the official guidance processor runs it. New lines are forced, never
drafted or verified, by the row-end companions of :class:`relaxspec.models.hf.RowEndTarget` (as
Emu3's end-of-lines are). ``<eoss>`` and the end of turn are never run: pixels do not need them.

Logits are the LM head's image rows in code order, computed here: transformers' Chameleon forward
sets every image logit to the dtype's minimum (Lumina's own copy does not), so it is never used.

Conditions: ``[B, 2, S]`` token ids (prompt, unconditional context), each left-padded with
``-1`` (:func:`format_prompts`); :meth:`LuminaTarget.null_condition` swaps the two.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from safetensors import safe_open

from relaxspec.errors import RelaxspecError, shown
from relaxspec.files import read_json
from relaxspec.models import hf
from relaxspec.models.chameleon_vqgan import CONFIG_FILE as VQGAN_CONFIG_FILE
from relaxspec.models.chameleon_vqgan import ChameleonVQGAN, load_vqgan, read_vqgan_config

NAME = "Lumina-mGPT"
MODEL_TYPE = "chameleon"
#: The official image sampling: create_logits_processor's defaults (CFG 3, image top-k 2000),
#: temperature 1 (the README's example uses CFG 4.0).
LUMINA_SAMPLING = {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 2000, "top_p": 1.0}
#: The text of the official demos and README (width first; the grid tokens put height first).
PROMPT_TEMPLATE = "Generate an image of {width}x{height} according to the following prompt:\n{prompt}"
TEXT_TOKENIZER = "text_tokenizer.json"
BOS, SEPARATOR = "<s>", "<reserved08706>"
IMAGE_START, IMAGE_END, NEW_LINE = "<racm3:break>", "<eoss>", "<reserved08799>"
IMAGE_PREFIX = "IMGIMG"
#: Pixels per grid-token unit (Lumina's patch size: 2 x 2 codes of the 16x VQGAN).
GRID_UNIT = 32
#: Pixels per code side the grid tokens assume.
DOWNSAMPLE = 16
#: Image side when none is asked for and the config names none: in every released model's list
#: of sizes (512, 768 and 1024 models alike).
DEFAULT_IMAGE_SIZE = 512


def grid_token(units: int) -> str:
    """The token of a side of ``units`` x 32 pixels (``item_processor.get_n_grids_token``)."""
    return f"<reserved{8800 + units:05d}>"


def image_code(name: str) -> int | None:
    """The VQ code an image token's name encodes (``IMGIMG`` + digits as letters A..J + one
    final character, as ``bpe2img`` reads it), ``None`` for a name that is not an image token,
    ``-1`` for an ``IMGIMG`` name that encodes no number."""
    if not name.startswith(IMAGE_PREFIX):
        return None
    digits = "".join(str(ord(c) - ord("A")) if "A" <= c <= "J" else c for c in name[len(IMAGE_PREFIX):-1])
    return int(digits) if re.fullmatch(r"[0-9]+", digits) else -1


@dataclass
class ChameleonVocabulary:
    """Meta's ``text_tokenizer.json``: the text tokenizer (a ``tokenizers.Tokenizer``), the
    vocabulary id of each image code (``image_ids[code]``) and the special tokens' ids."""

    text: object
    size: int
    image_ids: list[int]
    bos: int
    separator: int
    image_start: int
    image_end: int
    new_line: int
    path: str

    def grid_id(self, units: int) -> int:
        token = self.text.token_to_id(grid_token(units))
        if token is None:
            raise RelaxspecError(f"{self.path}: no grid token {grid_token(units)} for a {units * GRID_UNIT}-pixel side")
        return token

    def encode(self, text: str) -> list[int]:
        return self.text.encode(text, add_special_tokens=False).ids


def read_vocabulary(tokenizer_path) -> ChameleonVocabulary:
    """The text tokenizer and image-token map of Meta's Chameleon tokenizer folder."""
    folder = Path(tokenizer_path)
    file = folder / TEXT_TOKENIZER
    if not folder.is_dir():
        raise RelaxspecError(f"{tokenizer_path}: no such folder (Meta's Chameleon tokenizer folder: "
                             f"{TEXT_TOKENIZER}, vqgan.yaml, vqgan.ckpt)")
    if not file.is_file():
        raise RelaxspecError(f"{tokenizer_path}: no {TEXT_TOKENIZER}: not Meta's Chameleon tokenizer folder")
    from tokenizers import Tokenizer

    try:
        text = Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - any parse failure: not a tokenizers file
        raise RelaxspecError(f"{file}: not a tokenizers JSON file ({hf.first_line(err)})") from None
    vocab = text.get_vocab(with_added_tokens=True)
    codes, count = {}, 0
    for name, token in vocab.items():
        code = image_code(name)
        if code is not None:
            codes[code], count = token, count + 1
    if not codes or -1 in codes or len(codes) != count or sorted(codes) != list(range(count)):
        raise RelaxspecError(f"{file}: its {count} {IMAGE_PREFIX} image tokens do not name the codes 0..{count - 1} "
                             "once each")
    special = {}
    for name in (BOS, SEPARATOR, IMAGE_START, IMAGE_END, NEW_LINE):
        if name not in vocab:
            raise RelaxspecError(f"{file}: no {name} token: not the Chameleon vocabulary")
        special[name] = vocab[name]
    return ChameleonVocabulary(text=text, size=text.get_vocab_size(with_added_tokens=True),
                               image_ids=[codes[c] for c in range(len(codes))], bos=special[BOS],
                               separator=special[SEPARATOR], image_start=special[IMAGE_START],
                               image_end=special[IMAGE_END], new_line=special[NEW_LINE], path=str(tokenizer_path))


class LuminaTarget(hf.RowEndTarget):
    """A Lumina-mGPT model as relaxspec's engine drives it (:class:`relaxspec.models.hf.RowEndTarget`:
    new-line companions, ``[B, 2, S]`` conditions: the prompt and the unconditional context).

    ``model``: a ``ChameleonForConditionalGeneration`` (:func:`load_chameleon`); ``vocabulary``:
    :func:`read_vocabulary`'s; ``prompt_length``: the condition slots ``S``; ``grid``: codes per
    image side (``image size / 16``).
    """

    def __init__(self, model, vocabulary: ChameleonVocabulary, prompt_length: int, grid: int):
        if grid < 2 or grid % 2:
            raise RelaxspecError(f"a Lumina-mGPT image is an even number of codes per side, not {grid}")
        image = torch.tensor(vocabulary.image_ids, dtype=torch.long)
        super().__init__(model, image, prompt_length, grid, model.config)
        self.new_line = self.row_end = vocabulary.new_line
        head = [vocabulary.image_start, vocabulary.grid_id(grid // 2), vocabulary.grid_id(grid // 2)]
        self.register_buffer("image_head", torch.tensor(head, device=self.device), persistent=False)

    @property
    def image_ids(self) -> Tensor:
        return self.code_ids

    @property
    def text_model(self):
        return self.hf.model

    family, formatter = NAME, "relaxspec.models.lumina.format_prompts"

    @property
    def prompt_end(self) -> str:
        return f"the image start and the grid tokens of a {self.grid * DOWNSAMPLE}-pixel image"

    def ends_well(self, cond: Tensor, valid: Tensor) -> Tensor:
        # Both contexts end with this target's image start and grid tokens.
        return (cond[:, :, -3:] == self.image_head).all()


def to_uint8(pixels: Tensor) -> Tensor:
    """Pixels ``[B, 3, H, W]`` in ``[-1, 1]`` -> ``[B, H, W, 3]`` uint8 on the CPU, as the
    official code converts them: clamp, ``(x + 1) / 2``, ``x 255``, then truncation (not rounding)."""
    unit = (pixels.detach().float().cpu().clamp(-1.0, 1.0) + 1.0) / 2.0
    return (unit.permute(0, 2, 3, 1) * 255).to(torch.uint8)


def sampling_defaults(path) -> dict:
    """Sampling for a Lumina-mGPT folder when the user gives none: its ``generation_config.json``'s
    where set, else the official image sampling (CFG 3, top-k 2000, temperature 1)."""
    return hf.sampling_defaults(path, LUMINA_SAMPLING)


def check_image_size(image_size: int) -> None:
    if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < GRID_UNIT \
            or image_size % GRID_UNIT:
        raise RelaxspecError(f"--image-size {image_size}: Lumina-mGPT sizes are whole 32-pixel grid units; give a "
                             f"positive multiple of {GRID_UNIT}")


def format_prompts(vocabulary: ChameleonVocabulary, prompts: list[str], *, image_size: int) -> Tensor:
    """Conditions ``[N, 2, S]`` (prompt, unconditional context; left-padded with -1) for square
    ``image_size`` images, as the official inference does: ``<s>`` + the template text +
    ``<reserved08706>`` + ``<racm3:break>`` + height and width grid tokens; the unconditional
    context is the last three alone."""
    hf.check_prompts(prompts)
    check_image_size(image_size)
    units = image_size // GRID_UNIT
    head = [vocabulary.image_start, vocabulary.grid_id(units), vocabulary.grid_id(units)]
    rows = [[vocabulary.bos]
            + vocabulary.encode(PROMPT_TEMPLATE.format(width=image_size, height=image_size, prompt=prompt))
            + [vocabulary.separator] + head for prompt in prompts]
    length = max(len(row) for row in rows)
    ids = torch.tensor([[-1] * (length - len(row)) + row for row in rows])
    uncond = torch.tensor([-1] * (length - len(head)) + head).expand(len(rows), -1)
    return torch.stack([ids, uncond], 1)


# ---------------------------------------------------------------- loading
def read_chameleon_config(path) -> dict:
    """``config.json`` of a Chameleon (Lumina-mGPT) model folder (one-line errors)."""
    config = hf.read_config(path)
    if config.get("model_type") != MODEL_TYPE:
        raise RelaxspecError(f"{path}: model type {config.get('model_type')!r}, not {MODEL_TYPE!r}: not a Chameleon "
                             "(Lumina-mGPT) folder")
    return config


def check_vocabulary(config: dict, vocabulary: ChameleonVocabulary, path) -> None:
    """The tokenizer folder belongs to this model: the same vocabulary size and, where the config
    carries its ``vocabulary_map``, the same image tokens."""
    size = config.get("vocab_size")
    if size != vocabulary.size:
        raise RelaxspecError(f"{vocabulary.path}: {vocabulary.size} tokens, but {path} is a {size}-token model: not "
                             "its Chameleon tokenizer folder")
    mapping = config.get("vocabulary_map")
    if isinstance(mapping, dict) and mapping:
        theirs = sorted((image_code(name), token) for name, token in mapping.items() if image_code(name) is not None)
        if theirs != list(enumerate(vocabulary.image_ids)):
            raise RelaxspecError(f"{vocabulary.path}: its image tokens are not those of {path}'s vocabulary_map: not "
                                 "its Chameleon tokenizer folder")


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except (KeyError, TypeError, AttributeError):
            raise RelaxspecError(f"{index}: not a safetensors index (a weight_map)") from None
        inside = folder.resolve()
        outside = [name for name in names if not isinstance(name, str) or (folder / name).resolve().parent != inside]
        if outside:
            raise RelaxspecError(f"{index}: names the shard {shown(outside[0])} outside its folder (refused: a model's "
                                 "weights are files of its own folder)")
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise RelaxspecError(f"{folder}: {missing[0]} (named in its index) is missing")
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise RelaxspecError(f"{folder}: no .safetensors weights (relaxspec does not unpickle .bin files)")
    return files


def _is_qk_norm(key: str) -> bool:
    return ".self_attn.q_norm." in key or ".self_attn.k_norm." in key


def load_chameleon(path, *, device="cpu", dtype=torch.float32, aside: tuple[str, ...] = ()):
    """transformers' ``ChameleonForConditionalGeneration`` from a Lumina-mGPT folder, its
    safetensors read here (one tensor at a time, cast to ``dtype`` on ``device``).

    Lumina's q/k norms are ``[model_parallel_size, head_dim]``, one row per shard; transformers'
    are ``[heads, head_dim]``, so each row is repeated for the shard's heads (``repeat_interleave``,
    as Lumina's own layer norm does in its forward). ``model.vqmodel.*`` (the image encoder,
    which Lumina's checkpoints drop) may be absent, and is then left out of the model; any other
    missing, unexpected or misshapen tensor is an error. Tensors whose names start with one of
    ``aside`` are left in the files, as if absent (Anole's VQ model, which
    :mod:`relaxspec.models.anole` reads itself)."""
    transformers = hf.transformers_module(NAME)

    folder = Path(path)
    read_chameleon_config(folder)
    files = safetensors_files(folder)
    try:
        config = transformers.ChameleonConfig.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - a config transformers cannot read: say what, in one line
        raise RelaxspecError(f"{path}: not a loadable {NAME} config ({hf.first_line(err)})") from None
    if not isinstance(getattr(config, "vocabulary_map", None), dict):
        config.vocabulary_map = {}  # transformers' image-token mapping, which relaxspec does not use
    with torch.device("meta"):  # no memory and no random init for weights the files replace
        model = transformers.ChameleonForConditionalGeneration(config)
    expected = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    shapes, where = {}, {}
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as opened:
                for key in opened.keys():
                    if not key.startswith(aside):
                        shapes[key], where[key] = tuple(opened.get_slice(key).get_shape()), file
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file
        raise RelaxspecError(f"{path}: unreadable safetensors ({hf.first_line(err)})") from None
    encoder = [key for key in expected if key.startswith("model.vqmodel.")]
    optional = set(encoder) if not any(key in shapes for key in encoder) else set()
    if config.tie_word_embeddings:
        optional.add("lm_head.weight")
    missing = [key for key in expected if key not in shapes and key not in optional]
    unexpected = [key for key in shapes if key not in expected]
    if missing or unexpected:
        what = (f"{len(missing)} missing, e.g. {missing[0]}" if missing
                else f"{len(unexpected)} unexpected, e.g. {unexpected[0]}")
        raise RelaxspecError(f"{path}: the weights do not match the config ({what})")
    repeats = {}
    for key, shape in shapes.items():
        want = expected[key]
        if shape == want:
            continue
        if _is_qk_norm(key) and len(shape) == 2 and shape[1] == want[1] and shape[0] and want[0] % shape[0] == 0:
            repeats[key] = want[0] // shape[0]  # one row per model-parallel shard, for its heads
            continue
        raise RelaxspecError(f"{path}: {key} is {shape}; the config makes it {want}")
    device = torch.device(device)
    state = {}
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            for key in filter(shapes.__contains__, opened.keys()):
                tensor = opened.get_tensor(key)
                if key in repeats:
                    tensor = tensor.repeat_interleave(repeats[key], dim=0)
                state[key] = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if optional & set(encoder):
        model.model.vqmodel = None  # not needed for text-to-image (Lumina's training code deletes it too)
    if config.tie_word_embeddings and "lm_head.weight" not in shapes:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(device)  # buffers made on meta
    left = [name for name, value in (*model.named_parameters(), *model.named_buffers()) if value.is_meta]
    if left:
        raise RelaxspecError(f"{path}: {len(left)} tensors the files do not give, e.g. {left[0]}")
    return model.eval().requires_grad_(False)


def _check_codebook(vocabulary: ChameleonVocabulary, tokenizer_path) -> None:
    config = read_vqgan_config(Path(tokenizer_path) / VQGAN_CONFIG_FILE)
    if config.n_embed != len(vocabulary.image_ids):
        raise RelaxspecError(f"{tokenizer_path}: the VQGAN has {config.n_embed} codes but {TEXT_TOKENIZER} "
                             f"{len(vocabulary.image_ids)} {IMAGE_PREFIX} tokens")
    if config.downsample_factor != DOWNSAMPLE:
        raise RelaxspecError(f"{tokenizer_path}: the VQGAN downsamples {config.downsample_factor}x; Lumina-mGPT's "
                             f"grid tokens assume {DOWNSAMPLE}x")


def _check_folders(path, tokenizer_path, vocabulary: ChameleonVocabulary) -> dict:
    """The model folder's config, checked against the tokenizer folder (before any weights load)."""
    config = read_chameleon_config(path)
    check_vocabulary(config, vocabulary, path)
    _check_codebook(vocabulary, tokenizer_path)
    return config


def _load(path, tokenizer_path, vocabulary: ChameleonVocabulary, prompt_length: int, image_size: int, *, device,
          dtype) -> tuple[LuminaTarget, ChameleonVQGAN]:
    vq = load_vqgan(tokenizer_path, device=device)
    model = load_chameleon(path, device=device, dtype=dtype)
    return LuminaTarget(model, vocabulary, prompt_length, image_size // DOWNSAMPLE), vq


def load_lumina(path, tokenizer_path, prompt_length: int, image_size: int, *, device="cpu",
                dtype=torch.float32) -> tuple[LuminaTarget, ChameleonVQGAN]:
    """``(target, tokenizer)`` from a Lumina-mGPT model folder and Meta's Chameleon tokenizer
    folder, for ``image_size`` x ``image_size`` images and prompts of ``prompt_length`` tokens.
    The VQGAN decodes in fp32 whatever ``dtype`` the language model is loaded in."""
    vocabulary = read_vocabulary(tokenizer_path)
    _check_folders(path, tokenizer_path, vocabulary)
    check_image_size(image_size)
    return _load(path, tokenizer_path, vocabulary, prompt_length, image_size, device=device, dtype=dtype)


def default_image_size(config: dict) -> int:
    """The folder's trained image side where its config names one (``image_size`` or
    ``target_size``; the released configs name none), else 512."""
    for key in ("target_size", "image_size"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_IMAGE_SIZE


def open_folder(path, prompts: list[str], *, device="cpu", dtype=torch.float32, image_size: int | None = None,
                prompt_length: int | None = None, tokenizer_path=None) -> hf.Opened:
    """A Lumina-mGPT folder ready to decode ``prompts`` (formatted as the official inference
    does), with Meta's Chameleon tokenizer folder ``tokenizer_path``; left-padded to
    ``prompt_length`` when given, or to what the context leaves if that is less (padding does not
    change the law: it is masked and positions skip it)."""
    if tokenizer_path is None:
        raise RelaxspecError(f"a {NAME} folder needs Meta's Chameleon tokenizer folder (text_tokenizer.json, "
                             "vqgan.yaml, vqgan.ckpt): give --tokenizer-path DIR (a Chameleon folder is read as "
                             "Anole's when its weights hold the VQ decoder, model.vqmodel.decoder.*)")
    read_chameleon_config(path)  # a foreign folder is named before the tokenizer folder is read
    vocabulary = read_vocabulary(tokenizer_path)
    config = _check_folders(path, tokenizer_path, vocabulary)
    image_size = default_image_size(config) if image_size is None else image_size
    cond = format_prompts(vocabulary, prompts, image_size=image_size)
    grid = image_size // DOWNSAMPLE
    context = config.get("max_position_embeddings")
    image = grid * (grid + 1)  # the codes and a new line after each row; <eoss> and the end of turn are never run
    cond = hf.fit_prompts(cond, prompt_length, context, image,
                          f"a {image_size}x{image_size} image ({grid}x{grid} codes and their new lines)")
    target, tokenizer = _load(path, tokenizer_path, vocabulary, cond.shape[2], image_size, device=device, dtype=dtype)
    length = cond.shape[2]

    def format(texts: list[str]) -> tuple[Tensor, None]:  # further prompts, for this target's length
        return hf.left_pad(format_prompts(vocabulary, texts, image_size=image_size), None, length, -1)

    return hf.Opened(target, tokenizer, cond, None, image_size,
                     {"prompts": list(prompts), "prompt_tokens": length, "tokenizer_path": str(tokenizer_path)},
                     format=format)
