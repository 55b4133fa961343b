"""Janus / Janus-Pro (transformers' ``JanusForConditionalGeneration``) as a
:class:`~relaxspec.models.base.TargetModel`, for text-to-image generation.

It drives the model's own modules the way its image-mode ``generate`` does (transformers
``models/janus/modeling_janus.py``): the prompt batch is doubled for classifier-free guidance, the
unconditional rows keeping only BOS and BOI (every other token becomes pad); the language model
runs on input embeddings; next-token scores come from ``generation_head`` on the last hidden
state; an image token's next input is ``generation_aligner(generation_embeddings(token))``; pixels
come from the VQ model. What differs is the cache: relaxspec's engine writes every row at its own
slots and attends through explicit (tree) masks, which transformers' ``StaticCache`` cannot do
(its write position is shared by the batch), so this module keeps its own KV store and runs
the language model's decoder layers with a small cache object that writes per-row slots.

Conditions: prompt token ids ``[B, S]``, left-padded to the adapter's ``prompt_length`` with a
mask ``[B, S]`` (``relaxspec.decoding`` passes it as ``cond_mask``). Positions follow
transformers' left-padding rule: a row's first real token is position 0.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from relaxspec.caching import kept_copy
from relaxspec.errors import RelaxspecError
from relaxspec.models import hf

NAME = "Janus"
MODEL_TYPE = "janus"


class JanusTarget(nn.Module):
    """A Janus model as relaxspec's engine drives it.

    ``model``: a ``JanusForConditionalGeneration``; ``prompt_length``: the condition slots ``C``
    (prompts are left-padded to it); ``bos_token_id`` / ``boi_token_id`` / ``pad_token_id``: the
    tokens the unconditional rows keep or become (default: the model's generation config).
    """

    def __init__(self, model, prompt_length: int, *, bos_token_id: int | None = None,
                 boi_token_id: int | None = None, pad_token_id: int | None = None):
        super().__init__()
        self.hf = model.eval().requires_grad_(False)
        generation = model.generation_config
        self.bos = generation.bos_token_id if bos_token_id is None else bos_token_id
        extra = getattr(generation, "generation_kwargs", None) or {}
        self.boi = extra.get("boi_token_id") if boi_token_id is None else boi_token_id
        self.pad = generation.pad_token_id if pad_token_id is None else pad_token_id
        if None in (self.bos, self.boi, self.pad):
            raise RelaxspecError("the Janus model's generation config needs bos_token_id, pad_token_id and "
                                 "generation_kwargs.boi_token_id")
        tokens = model.model.vision_model.config.num_image_tokens
        grid = math.isqrt(tokens)
        text = model.config.text_config
        self.config = SimpleNamespace(vocab_size=model.model.vqmodel.config.num_embeddings, block_size=tokens,
                                      grid_size=grid, condition_length=int(prompt_length), dim=text.hidden_size,
                                      num_classes=0, model_type="t2i", n_head=text.num_attention_heads)
        self.class_names = None
        self.max_seq = 0
        self._kv = hf.KVStore()

    # ---------------------------------------------------------------- TargetModel
    @property
    def device(self) -> torch.device:
        return self.hf.model.generation_head.proj_out.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.model.generation_head.proj_out.weight.dtype

    @property
    def token_embeddings(self) -> Tensor:
        return self.embed_tokens(torch.arange(self.config.vocab_size, device=self.device))

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        return self.hf.prepare_embeddings_for_image_generation(tokens)

    def head(self, hidden: Tensor) -> Tensor:
        return self.hf.model.generation_head(hidden.to(self.dtype)).float()

    def null_condition(self, cond: Tensor) -> Tensor:
        keep = (cond == self.bos) | (cond == self.boi)
        return torch.where(keep, cond, torch.full_like(cond, self.pad))

    def setup_caches(self, rows: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        self._kv.setup(self.hf.config.text_config, rows, max_seq, dtype or self.dtype, self.device)
        self.max_seq = max_seq

    def clear_caches(self) -> None:
        self._kv.clear()
        self.max_seq = 0

    def move_cache(self, src: Tensor, dst: Tensor) -> None:
        self._kv.move(src, dst)

    def prepare_condition(self, cond: Tensor, attn_mask: Tensor) -> None:
        """Once per decode, before the prefill (the host reads the prompts here only): the
        first image token is predicted from the begin-of-image token, which ends every image-mode
        prompt, so with left padding it sits in the last slot; and each row's left padding, the
        condition keys its last query may not see (kept at one address: a compiled step reads it)."""
        if cond.dim() != 2 or cond.shape[1] != self.config.condition_length:
            raise RelaxspecError(f"Janus conditions are [B, S] prompt token ids with S = {self.config.condition_length} "
                                 f"(load_janus's prompt_length), got {tuple(cond.shape)}")
        if not bool((cond[:, -1] == self.boi).all()):
            raise RelaxspecError("Janus prompts must end with the begin-of-image token and be left-padded: "
                                 "format them with relaxspec.models.janus.format_prompts")
        self._pad = kept_copy(self, "pad", (~attn_mask[:, -1, : cond.shape[1]]).sum(-1))

    @property
    def num_layers(self) -> int:
        """Its language model's decoder layers: ``prefill`` and ``step`` take ``capture=``
        (:func:`relaxspec.models.base.layer_count`)."""
        return len(self.hf.model.language_model.layers)

    def prefill(self, cond: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor,
                capture: tuple[int, ...] | None = None):
        embeds = self.hf.get_input_embeddings()(cond)
        return self._run(embeds, positions, cache_slots, attn_mask, capture)

    def step(self, tokens: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor,
             capture: tuple[int, ...] | None = None):
        return self._run(self.embed_tokens(tokens), positions, cache_slots, attn_mask, capture)

    # ---------------------------------------------------------------- the language model
    def _run(self, embeds: Tensor, positions: Tensor, slots: Tensor, attn_mask: Tensor,
             capture: tuple[int, ...] | None):
        position_ids = (positions - self._pad[:, None]).clamp(min=0)  # transformers' left-padding positions
        normed, hidden = self._kv.run(self.hf.model.language_model, embeds.to(self.dtype), position_ids, slots,
                                      attn_mask, capture)
        return self.head(normed), hidden


def load_janus(path, prompt_length: int, *, device="cpu", dtype=torch.float32) -> tuple[JanusTarget, JanusImageTokenizer]:
    """``(target, tokenizer)`` from a local ``save_pretrained`` folder (safetensors only)."""
    transformers = hf.transformers_module(NAME)
    model = hf.from_pretrained(transformers.JanusForConditionalGeneration, path, NAME, device=device, dtype=dtype)
    # The begin-of-image token is in generation_config.json's generation_kwargs, which
    # transformers 5's loader drops from the GenerationConfig: read it from the file.
    extra = hf.generation_config(path).get("generation_kwargs") or {}
    boi = extra.get("boi_token_id") if isinstance(extra, dict) else None
    return JanusTarget(model, prompt_length, boi_token_id=boi), JanusImageTokenizer(model)


class JanusImageTokenizer:
    """Janus's VQ model as an :class:`~relaxspec.models.base.ImageTokenizer`: its codebook (the
    decoder reads the codes L2-normalised) and pixels in ``[-1, 1]``."""

    def __init__(self, model):
        self.vq = model.model.vqmodel
        config = self.vq.config
        self.config = SimpleNamespace(codebook_size=config.num_embeddings,
                                      downsample_factor=2 ** (len(config.channel_multiplier) - 1))

    @property
    def raw_codebook(self) -> Tensor:
        return self.vq.quantize.embedding.weight

    @property
    def codebook(self) -> Tensor:
        return torch.nn.functional.normalize(self.raw_codebook, dim=-1)

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> Tensor:
        return self.vq.decode(tokens).clamp(-1, 1)


#: transformers' image-generation default for Janus (its generate's guidance_scale fallback).
JANUS_CFG = 5.0


def sampling_defaults(path) -> dict:
    """Sampling for a Janus folder when the user gives none: its ``generation_config.json``'s
    ``guidance_scale`` / ``temperature`` / ``top_k`` / ``top_p`` where set, else CFG 5 and no
    top-k / top-p (DeepSeek's image recipe)."""
    return hf.sampling_defaults(path, {"cfg_scale": JANUS_CFG, "temperature": 1.0, "top_k": 0, "top_p": 1.0})


def format_prompts(processor, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """Prompt token ids ``[N, S]`` (left-padded to the longest) and mask, formatted as transformers'
    Janus image-generation recipe does: the chat template with the generation prompt, then the
    processor in ``generation_mode="image"`` (which appends the begin-of-image token)."""
    hf.check_prompts(prompts)
    try:
        texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                               add_generation_prompt=True) for p in prompts]
        processor.tokenizer.padding_side = "left"
        batch = processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    except (ValueError, TypeError, KeyError) as err:
        raise RelaxspecError(f"the processor could not format the prompts ({hf.first_line(err)})") from None
    return batch["input_ids"], batch["attention_mask"].bool()


def load_processor(path):
    """The folder's processor (tokenizer + chat template), as transformers loads it."""
    return hf.load_processor(path, NAME, chat_template=True)


def open_folder(path, prompts: list[str], *, device="cpu", dtype=torch.float32, image_size: int | None = None,
                prompt_length: int | None = None) -> hf.Opened:
    """A Janus folder ready to decode ``prompts`` (formatted as transformers' recipe does), left-
    padded to ``prompt_length`` when given, or to what the context leaves if that is less (padding
    does not change the law: it is masked and positions skip it)."""
    processor = load_processor(path)
    ids, mask = format_prompts(processor, prompts)
    pad = processor.tokenizer.pad_token_id
    # Checked before the weights load: the image size and the context.
    config = hf.transformers_module(NAME).JanusConfig.from_pretrained(path, local_files_only=True)
    tokens = config.vision_config.num_image_tokens
    size = math.isqrt(tokens) * 2 ** (len(config.vq_config.channel_multiplier) - 1)
    if image_size is not None and image_size != size:
        raise RelaxspecError(f"--image-size {image_size}: this Janus model's image size is fixed by its config ({size})")
    context = config.text_config.max_position_embeddings
    if prompt_length is not None:  # at most what the context leaves, never less than these prompts need
        ids, mask = hf.left_pad(ids, mask, max(ids.shape[1], min(prompt_length, context - tokens)), pad)
    if ids.shape[1] + tokens > context:
        raise RelaxspecError(f"a {ids.shape[1]}-token prompt and {tokens} image tokens exceed the model's context "
                             f"({context} positions): give a shorter prompt")
    target, tokenizer = load_janus(path, prompt_length=ids.shape[1], device=device, dtype=dtype)
    size = target.config.grid_size * tokenizer.config.downsample_factor
    length = ids.shape[1]
    return hf.Opened(target, tokenizer, ids, mask, size, {"prompts": list(prompts), "prompt_tokens": length},
                     format=lambda texts: hf.left_pad(*format_prompts(processor, texts), length, pad))
