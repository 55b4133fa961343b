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

from relaxspec.errors import RelaxspecError


class _SlotCache:
    """The cache object the decoder layers call: ``update`` writes this call's keys and values at
    per-row slots and returns every slot's (the mask decides what is attended)."""

    def __init__(self, store: list[tuple[Tensor, Tensor]]):
        self.store = store
        self.slots: Tensor | None = None  # [R, T], set before each forward

    def update(self, key: Tensor, value: Tensor, layer_idx: int, cache_kwargs=None):
        keys, values = self.store[layer_idx]
        index = self.slots[:, None, :, None].expand(-1, key.shape[1], -1, key.shape[3])
        keys.scatter_(2, index, key.to(keys.dtype))
        values.scatter_(2, index, value.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


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
                                      grid_size=grid, cls_token_num=int(prompt_length), dim=text.hidden_size,
                                      num_classes=0, model_type="t2i", n_head=text.num_attention_heads)
        self.class_names = None
        self.max_seq = 0
        self._store: list[tuple[Tensor, Tensor]] = []

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
        text = self.hf.config.text_config
        heads = text.num_key_value_heads or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        shape = (rows, heads, max_seq, head_dim)
        dtype = dtype or self.dtype
        if self._store and self._store[0][0].shape == shape and self._store[0][0].dtype == dtype \
                and self._store[0][0].device == self.device:
            return
        self._store = [(torch.zeros(shape, dtype=dtype, device=self.device),
                        torch.zeros(shape, dtype=dtype, device=self.device))
                       for _ in range(text.num_hidden_layers)]
        self.max_seq = max_seq

    def clear_caches(self) -> None:
        self._store, self.max_seq = [], 0

    def move_cache(self, src: Tensor, dst: Tensor) -> None:
        for keys, values in self._store:
            for store in (keys, values):
                source = store.gather(2, src[:, None, :, None].expand(-1, store.shape[1], -1, store.shape[3]))
                store.scatter_(2, dst[:, None, :, None].expand(-1, store.shape[1], -1, store.shape[3]), source)

    def prefill(self, cond: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor):
        # The first image token is predicted from the begin-of-image token, which ends every
        # image-mode prompt: with left padding it sits in the last slot (checked once per decode).
        if not bool((cond[:, -1] == self.boi).all()):
            raise RelaxspecError("Janus prompts must end with the begin-of-image token and be left-padded: "
                                 "format them with relaxspec.models.janus.format_prompts")
        # A row's left padding: the condition keys its last query may not see.
        self._pad = (~attn_mask[:, -1, : cond.shape[1]]).sum(-1)
        embeds = self.hf.get_input_embeddings()(cond)
        return self._run(embeds, positions, cache_slots, attn_mask)

    def step(self, tokens: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor):
        return self._run(self.embed_tokens(tokens), positions, cache_slots, attn_mask)

    # ---------------------------------------------------------------- the language model
    def _run(self, embeds: Tensor, positions: Tensor, slots: Tensor, attn_mask: Tensor):
        lm = self.hf.model.language_model
        hidden = embeds.to(self.dtype)
        position_ids = (positions - self._pad[:, None]).clamp(min=0)  # transformers' left-padding positions
        position_embeddings = lm.rotary_emb(hidden, position_ids)
        cache = _SlotCache(self._store)
        cache.slots = slots
        mask = torch.zeros(attn_mask.shape, dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill(~attn_mask, torch.finfo(hidden.dtype).min)[:, None]
        for layer in lm.layers:
            out = layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                        use_cache=True, cache_position=None, position_embeddings=position_embeddings)
            hidden = out[0] if isinstance(out, tuple) else out
        hidden = lm.norm(hidden)
        return self.head(hidden), hidden


def load_janus(path, prompt_length: int, *, device="cpu", dtype=torch.float32) -> tuple[JanusTarget, JanusImageTokenizer]:
    """``(target, tokenizer)`` from a local ``save_pretrained`` folder (safetensors only)."""
    from pathlib import Path

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise RelaxspecError(f"{path}: no config.json: not a transformers model folder")
    if not any(folder.glob("*.safetensors")):
        raise RelaxspecError(f"{path}: no .safetensors weights (relaxspec does not unpickle .bin files)")
    try:
        import transformers
        from transformers import JanusForConditionalGeneration
    except ImportError as err:
        raise RelaxspecError(f"Janus needs transformers >= 4.56: pip install \"relaxspec[transformers]\" ({err})") from None
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    if (major, minor) < (4, 56):  # the decoder layers' cache argument changed name in 4.56
        raise RelaxspecError(f"Janus needs transformers >= 4.56, this is {transformers.__version__}")
    try:
        model, info = JanusForConditionalGeneration.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                                    output_loading_info=True)
    except Exception as err:  # a truncated or foreign safetensors file, a bad config: say what, not how
        raise RelaxspecError(f"{path}: not a loadable Janus folder ({type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''})") from None
    missing = [key for key in info.get("missing_keys", []) if not key.endswith("lm_head.weight")]
    if missing:
        raise RelaxspecError(f"{path}: the weights do not match the config ({len(missing)} missing, e.g. {missing[0]})")
    model = model.to(device=device, dtype=dtype)
    # The begin-of-image token is in generation_config.json's generation_kwargs, which
    # transformers 5's loader drops from the GenerationConfig: read it from the file.
    boi = None
    config_file = folder / "generation_config.json"
    if config_file.is_file():
        import json

        try:
            extra = json.loads(config_file.read_text()).get("generation_kwargs") or {}
            boi = extra.get("boi_token_id") if isinstance(extra, dict) else None
        except (ValueError, UnicodeDecodeError, AttributeError):
            raise RelaxspecError(f"{config_file}: not a generation config (JSON object)") from None
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
    from pathlib import Path
    import json

    defaults = {"cfg_scale": JANUS_CFG, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    config_file = Path(path) / "generation_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        raise RelaxspecError(f"{config_file}: not a generation config (JSON object)") from None
    if not isinstance(config, dict):
        raise RelaxspecError(f"{config_file}: not a generation config (JSON object)")
    for theirs, ours in (("guidance_scale", "cfg_scale"), ("temperature", "temperature"), ("top_k", "top_k"),
                         ("top_p", "top_p")):
        if isinstance(config.get(theirs), (int, float)) and not isinstance(config.get(theirs), bool):
            defaults[ours] = config[theirs]
    return defaults


def format_prompts(processor, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """Prompt token ids ``[N, S]`` (left-padded to the longest) and mask, formatted as transformers'
    Janus image-generation recipe does: the chat template with the generation prompt, then the
    processor in ``generation_mode="image"`` (which appends the begin-of-image token)."""
    if not prompts:
        raise RelaxspecError("no prompts given")
    empty = [i for i, p in enumerate(prompts) if not str(p).strip()]
    if empty:
        raise RelaxspecError(f"prompt {empty[0] + 1} is empty")
    try:
        texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                               add_generation_prompt=True) for p in prompts]
        processor.tokenizer.padding_side = "left"
        batch = processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    except (ValueError, TypeError, KeyError) as err:
        raise RelaxspecError(f"the processor could not format the prompts ({err})") from None
    return batch["input_ids"], batch["attention_mask"].bool()


def load_processor(path):
    """The folder's processor (tokenizer + chat template), as transformers loads it."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as err:
        raise RelaxspecError(f"{path}: no usable processor ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}): "
                             "the folder needs the tokenizer and chat template save_pretrained writes") from None
    if not hasattr(processor, "tokenizer") or not getattr(processor, "chat_template", None):
        raise RelaxspecError(f"{path}: the processor has no chat template (or no tokenizer): Janus prompts are "
                             "formatted with it")
    return processor
