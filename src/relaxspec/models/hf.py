"""What the transformers families (:mod:`relaxspec.models.janus`, :mod:`relaxspec.models.emu3`,
:mod:`relaxspec.models.lumina`) share: reading a local ``save_pretrained`` folder (safetensors only,
one-line errors), the processor, sampling defaults from ``generation_config.json``, the
per-row-slot KV store the engine writes through their decoder layers (and an EAGLE drafter
through its own layers of the family, :mod:`relaxspec.drafting.family`), forced row ends
(:class:`RowEndTarget`), and where a target's text model is (:func:`text_model_of`).

A family module exposes ``NAME`` (what users read), ``MODEL_TYPE`` (``config.json``'s
``model_type``), ``sampling_defaults(folder)`` and ``open_folder(folder, prompts, *, device, dtype,
image_size, prompt_length, **inputs) -> Opened``, ``inputs`` being the opening inputs its pipeline
declares (Emu3's ``negative_prompt``, Lumina-mGPT's ``tokenizer_path``); its pipeline
(:mod:`relaxspec.pipelines`) names it, and :mod:`relaxspec.pipelines.families` finds the pipeline
from a folder's ``model_type``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from relaxspec.caching import kept_copy
from relaxspec.errors import RelaxspecError
from relaxspec.models.base import run_capturing

#: The oldest transformers whose decoder layers take the cache the way the adapters pass it.
MIN_TRANSFORMERS = (4, 56)


@dataclass
class Opened:
    """A folder opened for generation: the target, its image tokenizer, the conditions
    (``cond_mask`` where the engine masks them), what ``stats.json`` records, the pixel side, and
    ``format(prompts) -> (cond, cond_mask)`` for further prompts (padded to the target's prompt
    length; a longer one is refused)."""

    target: object
    tokenizer: object
    cond: Tensor
    cond_mask: Tensor | None
    image_size: int
    record: dict = field(default_factory=dict)
    format: Callable | None = None


def left_pad(cond: Tensor, mask: Tensor | None, length: int | None, value: int) -> tuple[Tensor, Tensor | None]:
    """Prompts (token ids on the last axis, left-padded) padded on the left to ``length`` with
    ``value`` (their mask with False); a longer prompt set is refused."""
    if length is None or cond.shape[-1] == length:
        return cond, mask
    if cond.shape[-1] > length:
        raise RelaxspecError(f"the prompt is {cond.shape[-1]} tokens; at most {length} fit here")
    extra = length - cond.shape[-1]
    cond = torch.nn.functional.pad(cond, (extra, 0), value=value)
    return cond, None if mask is None else torch.nn.functional.pad(mask, (extra, 0), value=False)


def fit_prompts(cond: Tensor, prompt_length: int | None, context, image: int, what: str) -> Tensor:
    """Prompts ``[N, 2, S]`` (left-padded with -1) padded on the left to ``prompt_length`` -- at
    most what the ``context`` leaves after the ``image`` positions, never less than they need --
    and refused (one line naming ``what`` the image is) when prompt and image exceed the context."""
    if prompt_length is not None:
        room = context - image if isinstance(context, int) else prompt_length
        cond, _ = left_pad(cond, None, max(cond.shape[-1], min(prompt_length, room)), -1)
    needed = cond.shape[-1] + image
    if isinstance(context, int) and needed > context:
        raise RelaxspecError(f"{what} after a {cond.shape[-1]}-token prompt is {needed} positions; the model's context "
                             f"is {context}: give a smaller --image-size or a shorter prompt")
    return cond


def read_config(path) -> dict:
    """``config.json`` of a transformers model folder, as a dict (one-line errors)."""
    folder = Path(path)
    config_file = folder / "config.json"
    if not folder.is_dir() or not config_file.is_file():
        raise RelaxspecError(f"{path}: not a transformers model folder (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError):
        raise RelaxspecError(f"{path}: config.json is not JSON") from None
    if not isinstance(config, dict):
        raise RelaxspecError(f"{path}: config.json is not a model config (a JSON object)")
    return config


def transformers_module(name: str):
    """transformers, checked to be new enough for ``name``'s adapter."""
    try:
        import transformers
    except ImportError as err:
        raise RelaxspecError(f"{name} needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}: "
                             f"pip install \"relaxspec[transformers]\" ({err})") from None
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    if (major, minor) < MIN_TRANSFORMERS:  # the decoder layers' cache argument changed name in 4.56
        raise RelaxspecError(f"{name} needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, "
                             f"this is {transformers.__version__}")
    return transformers


def from_pretrained(model_class, path, name: str, *, device="cpu", dtype=torch.float32):
    """``model_class.from_pretrained`` on a local folder, safetensors only; weights that do not
    match the config (missing tensors other than a tied head) are an error."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise RelaxspecError(f"{path}: no config.json: not a transformers model folder")
    if not any(folder.glob("*.safetensors")):
        raise RelaxspecError(f"{path}: no .safetensors weights (relaxspec does not unpickle .bin files)")
    import transformers
    from transformers.utils import logging

    # Loaded in the dtype asked for (an 8B model in fp32 first would need twice the memory);
    # the keyword is `dtype` from transformers 5, `torch_dtype` before.
    major = int(transformers.__version__.split(".")[0])
    dtype_arg = {"dtype" if major >= 5 else "torch_dtype": dtype}
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # its per-tensor loading bar: errors stay one line
    try:
        model, info = model_class.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                  output_loading_info=True, **dtype_arg)
    except Exception as err:  # a truncated or foreign safetensors file, a bad config: say what, not how
        raise RelaxspecError(f"{path}: not a loadable {name} folder ({first_line(err)})") from None
    finally:
        if bars:
            logging.enable_progress_bar()
    missing = [key for key in info.get("missing_keys", []) if not key.endswith("lm_head.weight")]
    if missing:
        raise RelaxspecError(f"{path}: the weights do not match the config ({len(missing)} missing, e.g. {missing[0]})")
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def generation_config(path) -> dict:
    """The folder's ``generation_config.json`` as written (``{}`` without one)."""
    config_file = Path(path) / "generation_config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    except (ValueError, UnicodeDecodeError):
        raise RelaxspecError(f"{config_file}: not a generation config (JSON object)") from None
    if not isinstance(config, dict):
        raise RelaxspecError(f"{config_file}: not a generation config (JSON object)")
    return config


def sampling_defaults(path, fallback: dict) -> dict:
    """Sampling for a folder when the user gives none: its ``generation_config.json``'s
    ``guidance_scale`` / ``temperature`` / ``top_k`` / ``top_p`` where set, else ``fallback``
    (the family's documented recipe)."""
    defaults = dict(fallback)
    config = generation_config(path)
    for theirs, ours in (("guidance_scale", "cfg_scale"), ("temperature", "temperature"), ("top_k", "top_k"),
                         ("top_p", "top_p")):
        if isinstance(config.get(theirs), (int, float)) and not isinstance(config.get(theirs), bool):
            defaults[ours] = config[theirs]
    return defaults


def load_processor(path, name: str, *, chat_template: bool = False):
    """The folder's processor, as transformers loads it (without torchvision installed its image
    processor is the PIL one)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except Exception as err:
        raise RelaxspecError(f"{path}: no usable processor ({first_line(err)}): the folder needs the tokenizer and "
                             "processor files save_pretrained writes") from None
    if not hasattr(processor, "tokenizer"):
        raise RelaxspecError(f"{path}: the processor has no tokenizer")
    if chat_template and not getattr(processor, "chat_template", None):
        raise RelaxspecError(f"{path}: the processor has no chat template: {name} prompts are formatted with it")
    return processor


def first_line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def check_prompts(prompts: list[str]) -> None:
    if not prompts:
        raise RelaxspecError("no prompts given")
    empty = [i for i, p in enumerate(prompts) if not str(p).strip()]
    if empty:
        raise RelaxspecError(f"prompt {empty[0] + 1} is empty")


class SlotCache:
    """The cache object the decoder layers call: ``update`` writes this call's keys and values at
    per-row slots and returns every slot's (the mask decides what is attended). transformers'
    ``StaticCache`` cannot do this: its write position is shared by the batch."""

    def __init__(self, store: list[tuple[Tensor, Tensor]], slots: Tensor, index: tuple[Tensor, Tensor]):
        self.store, self.slots, self.index = store, slots, index  # slots [R, T]; index: KVStore.index

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.store[layer_idx]
        # index_put_ on the layer's tensors themselves: inductor writes it in place (a scatter_ into
        # a tensor the step receives is compiled as a copy of the layer's whole K or V: issue 51)
        at = (*self.index, self.slots[:, None, :])  # [R, H, T]
        keys.index_put_(at, key.to(keys.dtype))
        values.index_put_(at, value.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class KVStore:
    """Static per-layer KV tensors ``[R, kv_heads, slots, head_dim]`` for a transformers text
    model, and the decoder-layer loop over them.

    Allocated at the shape asked for and kept while it is asked for again (the engine asks for
    the most slots any decode of the model has needed: :func:`relaxspec.caching.grown`), so a
    compiled step reads and writes the same tensors every decode; a new shape frees the old
    tensors before it allocates. Writes and moves are ``index_put_`` on the tensors themselves,
    which a compiled step performs in place."""

    def __init__(self, cache_arg: str | None = None):
        self.store: list[tuple[Tensor, Tensor]] = []
        self.index: tuple[Tensor, Tensor] | None = None  # rows [R, 1, 1], heads [1, H, 1]: with slots [R, 1, T]
        self._cache_arg = cache_arg  # the layers' cache keyword (cache_argument), found on first use if None

    def setup(self, text_config, rows: int, slots: int, dtype: torch.dtype, device) -> None:
        heads = text_config.num_key_value_heads or text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        shape = (rows, heads, slots, head_dim)
        current = self.store[0][0] if self.store else None
        if current is not None and tuple(current.shape) == shape and current.dtype == dtype \
                and current.device == torch.device(device) and len(self.store) == text_config.num_hidden_layers:
            return
        self.store = []  # freed before the new one is made
        self.store = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                      for _ in range(text_config.num_hidden_layers)]
        self.index = (torch.arange(rows, device=device).view(rows, 1, 1), torch.arange(heads, device=device).view(1, heads, 1))

    def clear(self) -> None:
        self.store, self.index = [], None

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Copy slots ``src [R, n]`` onto ``dst [R, n]`` in every layer (all reads of a layer
        before its writes, so a source slot may also be a destination)."""
        at_src, at_dst = (*self.index, src[:, None, :]), (*self.index, dst[:, None, :])
        for keys, values in self.store:
            for tensor in (keys, values):
                tensor.index_put_(at_dst, tensor[at_src])

    def run(self, text_model, hidden: Tensor, position_ids: Tensor, slots: Tensor, attn_mask: Tensor,
            capture: tuple[int, ...] | None = None) -> tuple[Tensor, Tensor]:
        """The decoder layers and final norm of ``text_model`` over ``hidden [R, T, D]`` at
        ``position_ids``, writing ``slots [R, T]`` and attending by ``attn_mask [R, T, slots]``:
        the normed final states (what the head reads) and the hidden states a drafter reads, the
        same or, with ``capture``, the streams entering those layers ``[R, T, k * D]``
        (:func:`relaxspec.models.base.run_capturing`)."""
        position_embeddings = text_model.rotary_emb(hidden, position_ids)
        hidden, captured = self.run_layers(text_model.layers, hidden, position_ids, position_embeddings, slots,
                                           attn_mask, capture)
        hidden = text_model.norm(hidden)
        return hidden, hidden if captured is None else captured

    def run_layers(self, layers, hidden: Tensor, position_ids: Tensor, position_embeddings: tuple[Tensor, Tensor],
                   slots: Tensor, attn_mask: Tensor,
                   capture: tuple[int, ...] | None = None) -> tuple[Tensor, Tensor | None]:
        """Decoder ``layers`` (no final norm) over ``hidden [R, T, D]`` with the rotary
        ``position_embeddings`` (cos, sin) of ``position_ids``, writing ``slots [R, T]`` and attending
        by ``attn_mask [R, T, slots]``: what :meth:`run` does between the rotary embedding and the
        norm, and what an EAGLE drafter built of the family's layers runs
        (:mod:`relaxspec.drafting.family`)."""
        cache = SlotCache(self.store, slots, self.index)
        if self._cache_arg is None:
            self._cache_arg = cache_argument(layers[0])
        mask = additive_mask(attn_mask, hidden.dtype)
        return run_decoder_layers(layers, hidden, position_ids, position_embeddings, mask, capture=capture,
                                  **{self._cache_arg: cache})

    @property
    def slots(self) -> int:
        """Slots per row of the current views (0 before :meth:`setup`)."""
        return self.store[0][0].shape[2] if self.store else 0


def cache_argument(layer) -> str:
    """The keyword a decoder layer takes its cache by: ``cache`` since transformers 5.x,
    ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"


def additive_mask(attn_mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask ``[R, T, S]`` (True = attend) as the additive ``[R, 1, T, S]`` the layers take."""
    mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
    return mask.masked_fill(~attn_mask, torch.finfo(dtype).min)[:, None]


def run_decoder_layers(layers, hidden: Tensor, position_ids: Tensor, position_embeddings: tuple[Tensor, Tensor],
                       mask: Tensor, capture: tuple[int, ...] | None = None, **cache) -> tuple[Tensor, Tensor | None]:
    """transformers decoder ``layers`` in turn over ``hidden [R, T, D]`` with the additive ``mask``
    ``[R, 1, T, S]`` and, where given, the cache keyword (:func:`cache_argument`): the last output
    and, with ``capture``, the streams entering those layers
    (:func:`relaxspec.models.base.run_capturing`)."""
    def run(layer, hidden):
        out = layer(hidden, attention_mask=mask, position_ids=position_ids, use_cache=bool(cache), cache_position=None,
                    position_embeddings=position_embeddings, **cache)
        return out[0] if isinstance(out, tuple) else out
    return run_capturing(layers, hidden, run, capture)


def text_model_of(target):
    """The transformers text model a transformers-family target runs (decoder ``layers``, ``norm``,
    ``rotary_emb`` and their ``config``): the target's ``text_model`` where it names one (Emu3,
    Lumina-mGPT), else its model's decoder (Janus: ``model.language_model``); ``None`` for any
    other target (LlamaGen, or a model known only by the protocol)."""
    model = getattr(target, "hf", None)
    candidates = [getattr(target, "text_model", None)]
    if model is not None:
        candidates += [model.get_decoder() if hasattr(model, "get_decoder") else None,
                       getattr(getattr(model, "model", None), "language_model", None)]
    for text_model in candidates:
        if text_model is not None and all(hasattr(text_model, name) for name in ("layers", "rotary_emb", "config")):
            return text_model
    return None


def family_of(target) -> str | None:
    """A transformers-family target's ``model_type`` (``config.json``'s: ``janus``, ``emu3``,
    ``chameleon``), ``None`` for any other target."""
    text_model = text_model_of(target)
    if text_model is None:
        return None
    config = getattr(getattr(target, "hf", None), "config", None)
    return str(getattr(config, "model_type", None) or text_model.config.model_type)


class RowEndTarget(torch.nn.Module):
    """A transformers text model whose image rows each end with a forced token (Emu3's
    end-of-line, Lumina-mGPT's new line), as a :class:`~relaxspec.models.base.TargetModel` over
    the codebook.

    The engine's vocabulary is the codebook: logits are the LM head's rows of the image tokens
    (``code_ids``, in code order). Row-end tokens are forced, never drafted or verified: every
    forward feeds, next to each input token, a row-end *companion* at the next position, written
    to a companion cache slot (slot ``max_seq + s`` for slot ``s``). Where the input token ends a
    row, the companion's output is what the forward returns (it predicts the next row's first
    token) and later queries attend the companion's slot, exactly as if the row end had been
    generated; elsewhere the companion is computed and never seen. The price: twice the queries
    per forward and twice the cache slots.

    Conditions are ``[B, 2, S]`` token ids, the prompt and the unconditional context, each
    left-padded with ``-1``; :meth:`null_condition` swaps them. Positions follow transformers: a
    row's first real token is position 0, and image token ``k`` (row ``r``) sits ``r`` row ends
    further on. Subclasses set ``text_model``, ``text_config`` and ``row_end`` (the forced token's
    id) and check their conditions in :meth:`check_conditions`.
    """

    def __init__(self, model, code_ids: Tensor, prompt_length: int, grid: int, text_config):
        super().__init__()
        self.hf = model.eval().requires_grad_(False)
        self.register_buffer("code_ids", code_ids.to(self.device), persistent=False)
        # The LM head's image rows, in code order: logits over the codebook in one matmul.
        self.register_buffer("head_weight", model.lm_head.weight[self.code_ids].detach().clone(), persistent=False)
        self.grid = int(grid)
        self.config = SimpleNamespace(vocab_size=len(code_ids), block_size=self.grid ** 2, grid_size=self.grid,
                                      condition_length=int(prompt_length), dim=text_config.hidden_size, num_classes=0,
                                      model_type="t2i", n_head=text_config.num_attention_heads)
        self.text_config = text_config
        self.class_names = None
        self.max_seq = 0
        self._kv = KVStore()

    text_model = None  # the decoder layers, norm and rotary embedding (a property in subclasses)
    row_end: int = -1
    family = "model"  # what messages call it
    formatter = ""  # the function that formats its prompts, for messages
    prompt_end = ""  # what a formatted prompt ends with, for messages

    def check_conditions(self, cond: Tensor) -> None:
        """Refuse conditions this target was not made for (one line): ``[B, 2, S]`` of this
        target's prompt length, left-padded, ending as :meth:`ends_well` says."""
        if cond.dim() != 3 or cond.shape[1] != 2:
            raise RelaxspecError(f"{self.family} conditions are [B, 2, S] token ids (prompt, unconditional context): "
                                 f"format them with {self.formatter}")
        if cond.shape[2] != self.config.condition_length:
            raise RelaxspecError(f"these prompts are {cond.shape[2]} tokens; this target was made for "
                                 f"{self.config.condition_length} (its prompt_length)")
        valid = cond[:, 0] >= 0
        if not bool((valid[:, 1:] >= valid[:, :-1]).all() and self.ends_well(cond, valid)):
            raise RelaxspecError(f"{self.family} prompts must be left-padded and end with {self.prompt_end}: format "
                                 f"them with {self.formatter}")

    def ends_well(self, cond: Tensor, valid: Tensor) -> Tensor:
        """Whether every formatted prompt ends as this family's image generation starts."""
        return valid[:, -1].all()

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
        return self.hf.get_input_embeddings()(self.code_ids[tokens])

    def head(self, hidden: Tensor) -> Tensor:
        return (hidden.to(self.head_weight.dtype) @ self.head_weight.T).float()

    def null_condition(self, cond: Tensor) -> Tensor:
        return cond.flip(1)  # the unconditional context where the prompt was

    def condition_tokens(self, cond: Tensor) -> Tensor:
        """``[R, S]``: each row's own context (the first of its two), -1 where padded -- the
        tokens :meth:`prefill` reads (:func:`relaxspec.models.base.condition_tokens`)."""
        return cond[:, 0]

    def setup_caches(self, rows: int, max_seq: int, dtype: torch.dtype | None = None) -> None:
        # Slots 0..max_seq-1 as the engine numbers them, then each one's row-end companion.
        self._kv.setup(self.text_config, rows, 2 * max_seq, dtype or self.dtype, self.device)
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

    def prepare_condition(self, cond: Tensor, attn_mask: Tensor) -> None:
        """Once per decode, before the prefill (the host reads the prompts here only): the
        prompts checked, each row's left padding and which condition keys are real (kept at one
        address across decodes of a shape: a compiled step reads them), and every slot's position
        reset to the condition's."""
        self.check_conditions(cond)
        ids = cond[:, 0]
        valid = ids >= 0
        self._pad = kept_copy(self, "pad", (~valid).sum(-1))
        key_valid = torch.ones(ids.shape[0], self.max_seq, dtype=torch.bool, device=self.device)
        key_valid[:, : ids.shape[1]] = valid
        self._key_valid = kept_copy(self, "key_valid", key_valid)
        if self.row_end_companions:
            self._slot_pos.fill_(-1)
            self._slot_pos[:, : ids.shape[1]] = torch.arange(ids.shape[1], device=self.device)

    @property
    def num_layers(self) -> int:
        """Its decoder layers: ``prefill`` and ``step`` take ``capture=``
        (:func:`relaxspec.models.base.layer_count`)."""
        return len(self.text_model.layers)

    def prefill(self, cond: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor,
                capture: tuple[int, ...] | None = None):
        ids = cond[:, 0]
        own = self._keys[None, None, :] == cache_slots[:, :, None]
        mask = (attn_mask & self._key_valid[:, None, :]) | own  # a padded position still sees itself
        if self.row_end_companions:
            mask = torch.cat([mask, torch.zeros_like(mask)], -1)  # no companions in the prompt
        normed, hidden = self._kv.run(self.text_model, self.hf.get_input_embeddings()(ids.clamp(min=0)),
                                      self._real_positions(positions), cache_slots, mask, capture)
        return self.head(normed), hidden

    #: Rows in parallel may say which companions a query sees (``step``'s ``companion_mask``).
    row_end_companions = True

    def step(self, tokens: Tensor, positions: Tensor, cache_slots: Tensor, attn_mask: Tensor,
             companion_mask: Tensor | None = None, capture: tuple[int, ...] | None = None):
        """``companion_mask [R, T, max_seq]``: the slots whose row-end companion each query sees
        (rows in parallel keep a row end's companion apart from its token); ``None``: a slot's
        companion is seen with its token where that token ends a row."""
        rows, count = tokens.shape
        cls, width = self.config.condition_length, self.grid
        self._slot_pos.scatter_(1, cache_slots, positions)
        slot_pos = self._slot_pos
        ends_row = (positions >= cls) & ((positions - cls) % width == width - 1)  # [R, T]
        own = self._keys[None, None, :] == cache_slots[:, :, None]
        seen = attn_mask & self._key_valid[:, None, :]
        if companion_mask is None:
            ends_key = (slot_pos >= cls) & ((slot_pos - cls) % width == width - 1)  # [R, M] slots whose companion is real
            companions = attn_mask & ends_key[:, None, :]
        else:
            companions = companion_mask
        mask = torch.cat([torch.cat([seen, companions & ~own], -1),  # a token comes before its own row end
                          torch.cat([seen, companions | own], -1)], 1)  # a row end sees itself
        real = self._real_positions(positions)
        embeds = torch.cat([self.embed_tokens(tokens),
                            self.hf.get_input_embeddings().weight[self.row_end].expand(rows, count, -1)], 1)
        normed, hidden = self._kv.run(self.text_model, embeds.to(self.dtype), torch.cat([real, real + 1], 1),
                                      torch.cat([cache_slots, cache_slots + self.max_seq], 1), mask, capture)
        normed, hidden = (torch.where(ends_row[..., None], x[:, count:], x[:, :count]) for x in (normed, hidden))
        return self.head(normed), hidden

    def _real_positions(self, positions: Tensor) -> Tensor:
        """Engine positions -> transformers' position ids: left padding removed, and image token
        ``k`` moved on by the ``k // grid`` row ends before it."""
        cls = self.config.condition_length
        image = (positions - cls).clamp(min=0)
        return (positions - self._pad[:, None]).clamp(min=0) + torch.where(positions >= cls, image // self.grid, 0)
