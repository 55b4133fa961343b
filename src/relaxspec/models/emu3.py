"""Emu3 (transformers' ``Emu3ForConditionalGeneration``) as a
:class:`~relaxspec.models.base.TargetModel`, for text-to-image generation.

transformers' recipe (its Emu3 model page): the processor with ``return_for_image_generation=True``
appends ``<|image start|>{h}*{w}<|image token|>`` to each prompt; ``generate`` runs with a
``prefix_allowed_tokens_fn`` that allows only visual tokens, except where a row of ``w`` ends
(end-of-line ``<|extra_200|>`` is forced) and after the last row (end-of-frame, end-of-image,
end-of-sequence); classifier-free guidance comes from ``negative_prompt_ids``: its
``UnbatchedClassifierFreeGuidanceLogitsProcessor`` runs the model a second time on the negative
prompt followed by the generated tokens and mixes the two log-softmaxes.

Here the engine's vocabulary is the VQ codebook: logits are the LM head's rows of the visual
tokens, in code order (what the prefix constraint leaves; CFG on raw logits differs from the
log-softmax mix by a per-row constant, so the law is the same). End-of-line tokens are forced,
never drafted or verified, by the row-end companions of :class:`relaxspec.models.hf.RowEndTarget`
(twice the queries per forward and twice the cache slots). The trailing end-of-frame /
end-of-image / end-of-sequence tokens are never needed for pixels and are not run.

Conditions: ``[B, 2, S]`` token ids, the prompt and the negative prompt, each left-padded with
``-1`` to ``S`` (:func:`format_prompts`); the unconditional rows run the negative prompt.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor

from relaxspec.errors import RelaxspecError
from relaxspec.models import hf

NAME = "Emu3"
MODEL_TYPE = "emu3"
#: transformers' Emu3 image-generation example's negative prompt.
NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer digits, cropped, "
                   "worst quality, low quality, normal quality, jpeg artifacts, signature, watermark, username, blurry.")
#: Emu3's documented image sampling (BAAI's recipe): CFG 3, top-k 2048.
EMU3_SAMPLING = {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 2048, "top_p": 1.0}
#: Pixels per token side the processor's image-generation sizes assume.
PROCESSOR_DOWNSAMPLE = 8
EOL, WRAPPER = "<|extra_200|>", "<|image token|>"


class Emu3Target(hf.RowEndTarget):
    """An Emu3 model as relaxspec's engine drives it (:class:`relaxspec.models.hf.RowEndTarget`:
    end-of-line companions, ``[B, 2, S]`` conditions).

    ``model``: an ``Emu3ForConditionalGeneration``; ``prompt_length``: the condition slots ``S``;
    ``grid``: image tokens per side (the processor's ``h = w`` for the image area).
    """

    def __init__(self, model, prompt_length: int, grid: int):
        mapping = model.vocabulary_mapping
        codes = model.model.vqmodel.config.codebook_size
        img2bpe = mapping.img2bpe
        if sorted(img2bpe) != list(range(codes)):
            raise RelaxspecError(f"the Emu3 vocabulary map has {len(img2bpe)} visual tokens for a {codes}-code VQ "
                                 "codebook: they must be <|visual token 000000|> .. one per code")
        vocab = mapping.vocab_map
        if EOL not in vocab or WRAPPER not in vocab:
            raise RelaxspecError(f"the Emu3 vocabulary map lacks {EOL} (end of line) or {WRAPPER} (image start)")
        visual = torch.tensor([img2bpe[k] for k in range(codes)], dtype=torch.long)
        super().__init__(model, visual, prompt_length, grid, model.config.text_config)
        self.eol, self.wrapper = vocab[EOL], vocab[WRAPPER]
        self.row_end = self.eol

    @property
    def visual_ids(self) -> Tensor:
        return self.code_ids

    @property
    def text_model(self):
        return self.hf.model.text_model

    family, formatter, prompt_end = NAME, "relaxspec.models.emu3.format_prompts", "the image-start tokens"

    def ends_well(self, cond: Tensor, valid: Tensor) -> Tensor:
        return valid[:, -1].all() & ((cond[:, 0, -1] == self.wrapper) | (cond[:, 1, -1] == self.wrapper)).all()


class Emu3ImageTokenizer:
    """Emu3's VQ model as an :class:`~relaxspec.models.base.ImageTokenizer`: its codebook (the
    decoder reads the stored codes) and pixels in ``[-1, 1]``, unnormalised with the image
    processor's mean and std as its ``postprocess`` does."""

    def __init__(self, model, grid: int, mean=None, std=None):
        self.vq = model.model.vqmodel
        self.grid = int(grid)
        self.config = SimpleNamespace(codebook_size=self.vq.config.codebook_size,
                                      downsample_factor=self.vq.vision_spatial_factor)
        from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD  # the image processor's defaults

        self.mean = torch.tensor(OPENAI_CLIP_MEAN if mean is None else mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(OPENAI_CLIP_STD if std is None else std, dtype=torch.float32).view(1, -1, 1, 1)

    @property
    def raw_codebook(self) -> Tensor:
        return self.vq.quantize.embedding.weight

    @property
    def codebook(self) -> Tensor:
        return self.raw_codebook

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> Tensor:
        pixels = self.vq.decode(tokens.view(tokens.shape[0], self.grid, self.grid)).float()
        unit = pixels * self.std.to(pixels.device) + self.mean.to(pixels.device)
        return (unit * 2 - 1).clamp(-1, 1)


def load_emu3(path, prompt_length: int, grid: int, *, device="cpu", dtype=torch.float32, mean=None,
              std=None) -> tuple[Emu3Target, Emu3ImageTokenizer]:
    """``(target, tokenizer)`` from a local ``save_pretrained`` folder (safetensors only), for
    ``grid x grid`` images and prompts of ``prompt_length`` tokens."""
    transformers = hf.transformers_module(NAME)
    model = hf.from_pretrained(transformers.Emu3ForConditionalGeneration, path, NAME, device=device, dtype=dtype)
    return Emu3Target(model, prompt_length, grid), Emu3ImageTokenizer(model, grid, mean, std)


def sampling_defaults(path) -> dict:
    """Sampling for an Emu3 folder when the user gives none: its ``generation_config.json``'s
    where set, else Emu3's documented recipe (CFG 3, top-k 2048)."""
    return hf.sampling_defaults(path, EMU3_SAMPLING)


def format_prompts(processor, prompts: list[str], *, image_size: int | None = None,
                   negative_prompt: str = NEGATIVE_PROMPT) -> tuple[Tensor, int]:
    """Conditions ``[N, 2, S]`` (prompt, negative prompt; left-padded with -1) and the token grid
    side, formatted as transformers' Emu3 recipe does: the processor with
    ``return_for_image_generation=True`` (image area ``image_size**2``, else the processor's) for the
    prompts and plainly for the negative prompt. An empty negative prompt is transformers' guidance
    without ``negative_prompt_ids``: the unconditional context is the prompt's last token."""
    hf.check_prompts(prompts)
    if image_size is not None and (image_size < PROCESSOR_DOWNSAMPLE or image_size % PROCESSOR_DOWNSAMPLE):
        raise RelaxspecError(f"--image-size {image_size}: Emu3 images are {PROCESSOR_DOWNSAMPLE}-pixel tokens; give a "
                             f"multiple of {PROCESSOR_DOWNSAMPLE}")
    area = {} if image_size is None else {"image_area": image_size * image_size}
    try:
        processor.tokenizer.padding_side = "left"
        batch = processor(text=list(prompts), padding=True, return_tensors="pt", return_for_image_generation=True,
                          **area)
        negative = None if not negative_prompt else processor(text=[negative_prompt], return_tensors="pt")
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise RelaxspecError(f"the processor could not format the prompts ({hf.first_line(err)})") from None
    height, width = (int(v) for v in batch["image_sizes"][0])
    if height != width or height < 1:
        raise RelaxspecError(f"the processor's image-generation size is {height}x{width} tokens: relaxspec paints "
                             "square token grids (ratio 1:1)")
    ids = batch["input_ids"].masked_fill(~batch["attention_mask"].bool(), -1)
    wrapper = processor.tokenizer.convert_tokens_to_ids(WRAPPER)
    uncond = torch.tensor([[wrapper]]) if negative is None else negative["input_ids"][:1]
    length = max(ids.shape[1], uncond.shape[1])
    ids = torch.nn.functional.pad(ids, (length - ids.shape[1], 0), value=-1)
    uncond = torch.nn.functional.pad(uncond, (length - uncond.shape[1], 0), value=-1).expand(ids.shape[0], -1)
    return torch.stack([ids, uncond], 1), height


def open_folder(path, prompts: list[str], *, device="cpu", dtype=torch.float32, image_size: int | None = None,
                negative_prompt: str | None = None, prompt_length: int | None = None) -> hf.Opened:
    """An Emu3 folder ready to decode ``prompts`` (formatted as transformers' recipe does), left-
    padded to ``prompt_length`` when given, or to what the context leaves if that is less (padding
    does not change the law: it is masked and positions skip it)."""
    negative = NEGATIVE_PROMPT if negative_prompt is None else negative_prompt
    processor = hf.load_processor(path, NAME)
    cond, grid = format_prompts(processor, prompts, image_size=image_size, negative_prompt=negative)
    context = hf.read_config(path).get("text_config", {}).get("max_position_embeddings")
    image = grid * (grid + 1) + 3  # transformers' sequence after the prompt: rows + end-of-lines, 3 end tokens
    cond = hf.fit_prompts(cond, prompt_length, context, image, f"a {grid}x{grid}-token image")
    image_processor = getattr(processor, "image_processor", None)
    target, tokenizer = load_emu3(path, cond.shape[2], grid, device=device, dtype=dtype,
                                  mean=getattr(image_processor, "image_mean", None),
                                  std=getattr(image_processor, "image_std", None))
    length = cond.shape[2]

    def format(texts: list[str]) -> tuple[Tensor, None]:  # further prompts, for this target's length
        more, _ = format_prompts(processor, texts, image_size=image_size, negative_prompt=negative)
        return hf.left_pad(more, None, length, -1)

    return hf.Opened(target, tokenizer, cond, None, grid * tokenizer.config.downsample_factor,
                     {"prompts": list(prompts), "negative_prompt": negative, "prompt_tokens": length}, format=format)
