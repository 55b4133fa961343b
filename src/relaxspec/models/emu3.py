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
never drafted or verified: every forward feeds, next to each input token, an end-of-line
*companion* at the next position, written to a companion cache slot (slot ``max_seq + s`` for
slot ``s``). Where the input token ends a row, the companion's output is what the forward returns
(it predicts the next row's first token) and later queries attend the companion's slot, exactly as
if the end-of-line had been generated; elsewhere the companion is computed and never seen. The
price: twice the queries per forward and twice the cache slots. The trailing end-of-frame /
end-of-image / end-of-sequence tokens are never needed for pixels and are not run.

Conditions: ``[B, 2, S]`` token ids, the prompt and the negative prompt, each left-padded with
``-1`` to ``S`` (:func:`format_prompts`); :meth:`Emu3Target.null_condition` swaps the two, so the
unconditional rows run the negative prompt. Positions follow transformers: a row's first real
token is position 0, and image token ``k`` (row ``r``) sits ``r`` end-of-lines further on.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

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


class Emu3Target(nn.Module):
    """An Emu3 model as relaxspec's engine drives it.

    ``model``: an ``Emu3ForConditionalGeneration``; ``prompt_length``: the condition slots ``S``;
    ``grid``: image tokens per side (the processor's ``h = w`` for the image area).
    """

    def __init__(self, model, prompt_length: int, grid: int):
        super().__init__()
        self.hf = model.eval().requires_grad_(False)
        mapping = model.vocabulary_mapping
        codes = model.model.vqmodel.config.codebook_size
        img2bpe = mapping.img2bpe
        if sorted(img2bpe) != list(range(codes)):
            raise RelaxspecError(f"the Emu3 vocabulary map has {len(img2bpe)} visual tokens for a {codes}-code VQ "
                                 "codebook: they must be <|visual token 000000|> .. one per code")
        vocab = mapping.vocab_map
        if EOL not in vocab or WRAPPER not in vocab:
            raise RelaxspecError(f"the Emu3 vocabulary map lacks {EOL} (end of line) or {WRAPPER} (image start)")
        self.eol, self.wrapper = vocab[EOL], vocab[WRAPPER]
        visual = torch.tensor([img2bpe[k] for k in range(codes)], dtype=torch.long, device=self.device)
        self.register_buffer("visual_ids", visual, persistent=False)
        # The LM head's visual rows, in code order: logits over the codebook in one matmul.
        self.register_buffer("head_weight", model.lm_head.weight[visual].detach().clone(), persistent=False)
        text = model.config.text_config
        self.grid = int(grid)
        self.config = SimpleNamespace(vocab_size=codes, block_size=self.grid ** 2, grid_size=self.grid,
                                      cls_token_num=int(prompt_length), dim=text.hidden_size, num_classes=0,
                                      model_type="t2i", n_head=text.num_attention_heads)
        self.class_names = None
        self.max_seq = 0
        self._kv = hf.KVStore()

    # ---------------------------------------------------------------- TargetModel
    @property
    def device(self) -> torch.device:
        return self.hf.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.lm_head.weight.dtype

    @property
    def token_embeddings(self) -> Tensor:
        return self.embed_tokens(torch.arange(self.config.vocab_size, device=self.device))

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        return self.hf.get_input_embeddings()(self.visual_ids[tokens])

    def head(self, hidden: Tensor) -> Tensor:
        return (hidden.to(self.head_weight.dtype) @ self.head_weight.T).float()

    def null_condition(self, cond: Tensor) -> Tensor:
        return cond.flip(1)  # the negative prompt where the prompt was

    def setup_caches(self, rows: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        # Slots 0..max_seq-1 as the engine numbers them, then each one's end-of-line companion.
        self._kv.setup(self.hf.config.text_config, rows, 2 * max_seq, dtype or self.dtype, self.device)
        if self.max_seq != max_seq or getattr(self, "_slot_pos", torch.empty(0)).shape != (rows, max_seq) \
                or self._slot_pos.device != self.device:
            self._slot_pos = torch.full((rows, max_seq), -1, dtype=torch.long, device=self.device)
            self._keys = torch.arange(max_seq, device=self.device)
        self.max_seq = max_seq

    def clear_caches(self) -> None:
        self._kv.clear()
        self.max_seq = 0

    def move_cache(self, src: Tensor, dst: Tensor) -> None:
        self._kv.move(torch.cat([src, src + self.max_seq], 1), torch.cat([dst, dst + self.max_seq], 1))
        self._slot_pos.scatter_(1, dst, self._slot_pos.gather(1, src))

    def prefill(self, cond: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor):
        if cond.dim() != 3 or cond.shape[1] != 2:
            raise RelaxspecError("Emu3 conditions are [B, 2, S] token ids (prompt, negative prompt): format them with "
                                 "relaxspec.models.emu3.format_prompts")
        if cond.shape[2] != self.config.cls_token_num:
            raise RelaxspecError(f"these prompts are {cond.shape[2]} tokens; this target was made for "
                                 f"{self.config.cls_token_num} (load_emu3's prompt_length)")
        ids = cond[:, 0]
        valid = ids >= 0
        # Checked once per decode: left padding, and the prompt ends with the image-start tokens.
        if not bool((valid[:, 1:] >= valid[:, :-1]).all() and valid[:, -1].all()
                    and ((cond[:, 0, -1] == self.wrapper) | (cond[:, 1, -1] == self.wrapper)).all()):
            raise RelaxspecError("Emu3 prompts must be left-padded and end with the image-start tokens: format them "
                                 "with relaxspec.models.emu3.format_prompts")
        rows = ids.shape[0]
        self._pad = (~valid).sum(-1)
        self._key_valid = torch.ones(rows, self.max_seq, dtype=torch.bool, device=self.device)
        self._key_valid[:, : ids.shape[1]] = valid
        self._slot_pos.fill_(-1)
        self._slot_pos.scatter_(1, cache_slots, positions)
        own = self._keys[None, None, :] == cache_slots[:, :, None]
        mask = (attn_mask & self._key_valid[:, None, :]) | own  # a padded position still sees itself
        mask = torch.cat([mask, torch.zeros_like(mask)], -1)  # no companions in the prompt
        hidden = self._kv.run(self.hf.model.text_model, self.hf.get_input_embeddings()(ids.clamp(min=0)),
                              self._real_positions(positions), cache_slots, mask)
        return self.head(hidden), hidden

    def step(self, tokens: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor):
        rows, count = tokens.shape
        cls, width = self.config.cls_token_num, self.grid
        self._slot_pos.scatter_(1, cache_slots, positions)
        slot_pos = self._slot_pos
        ends_key = (slot_pos >= cls) & ((slot_pos - cls) % width == width - 1)  # [R, M] slots whose companion is real
        ends_row = (positions >= cls) & ((positions - cls) % width == width - 1)  # [R, T]
        own = self._keys[None, None, :] == cache_slots[:, :, None]
        seen = attn_mask & self._key_valid[:, None, :]
        companions = attn_mask & ends_key[:, None, :]
        mask = torch.cat([torch.cat([seen, companions & ~own], -1),  # a token comes before its own end-of-line
                          torch.cat([seen, companions | own], -1)], 1)  # an end-of-line sees itself
        real = self._real_positions(positions)
        embeds = torch.cat([self.embed_tokens(tokens),
                            self.hf.get_input_embeddings().weight[self.eol].expand(rows, count, -1)], 1)
        hidden = self._kv.run(self.hf.model.text_model, embeds.to(self.dtype), torch.cat([real, real + 1], 1),
                              torch.cat([cache_slots, cache_slots + self.max_seq], 1), mask)
        hidden = torch.where(ends_row[..., None], hidden[:, count:], hidden[:, :count])
        return self.head(hidden), hidden

    def _real_positions(self, positions: Tensor) -> Tensor:
        """Engine positions -> transformers' position ids: left padding removed, and image token
        ``k`` moved on by the ``k // grid`` end-of-lines before it."""
        cls = self.config.cls_token_num
        image = (positions - cls).clamp(min=0)
        return (positions - self._pad[:, None]).clamp(min=0) + torch.where(positions >= cls, image // self.grid, 0)


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
    if prompt_length is not None:  # at most what the context leaves, never less than these prompts need
        room = context - image if isinstance(context, int) else prompt_length
        cond, _ = hf.left_pad(cond, None, max(cond.shape[2], min(prompt_length, room)), -1)
    needed = cond.shape[2] + image
    if isinstance(context, int) and needed > context:
        raise RelaxspecError(f"a {grid}x{grid}-token image after a {cond.shape[2]}-token prompt is {needed} positions; "
                             f"the model's context is {context}: give a smaller --image-size or a shorter prompt")
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
