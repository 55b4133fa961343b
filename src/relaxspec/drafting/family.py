"""An EAGLE drafter's layers for a transformers-family target (Janus, Emu3, Lumina-mGPT): decoder
layers of the target's own class, built from the target's layer config, with its family's rotary
embedding (REFERENCE §1.6, §6).

A drafter file records the layer's class name and the config fields that shape it
(:data:`LAYER_FIELDS`: width, heads, KV heads, head size, MLP, norms, rotary; Chameleon's
model-parallel q/k norms), never the target's weights; the classes themselves come from the
target the drafter is attached to (the same transformers module as the target's own layers), so
this module imports no transformers. Dropout is off: like the LlamaGen drafter, the drafter
trains without it.

Positions are 1D: pair ``j`` sits at the image-token index ``j`` (what training's
:func:`~relaxspec.training.drafter.drafter_inputs` and decoding's
:class:`~relaxspec.drafting.eagle_source.EagleSource` both pass), rotated by a table of the
family rotary embedding's ``(cos, sin)`` for positions ``0 .. block_size - 1``. While decoding
the layers write per-row cache slots and attend by the engine's (tree) masks through
:class:`relaxspec.models.hf.KVStore`, as the target's own layers do: static shapes, no host
syncs. Without caches (training) attention is plain causal over the inputs.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
from torch import Tensor

from relaxspec.errors import RelaxspecError
from relaxspec.models import hf

#: The text-config fields that shape a decoder layer and its rotary embedding in the transformers
#: families (those a config has are recorded; the rest take the config class's defaults).
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "attention_bias", "mlp_bias", "pretraining_tp", "rope_parameters",
                "rope_theta", "rope_scaling", "partial_rotary_factor", "max_position_embeddings", "model_parallel_size",
                "swin_norm")


def layer_spec(text_model, n_layer: int) -> dict:
    """What rebuilds ``n_layer`` decoder layers shaped like ``text_model``'s: ``{"class": the layer
    class's name, "config": the fields of :data:`LAYER_FIELDS` its config has, with
    ``num_hidden_layers = n_layer`` and no dropout}`` (plain JSON)."""
    given = text_model.config.to_dict()
    config = {name: given[name] for name in LAYER_FIELDS if name in given}
    config.update(num_hidden_layers=int(n_layer), attention_dropout=0.0)
    return {"class": type(text_model.layers[0]).__name__, "config": config}


def layer_config(text_model, spec: dict):
    """``spec["config"]`` as ``text_model``'s config class, with the target's attention
    implementation."""
    try:
        config = type(text_model.config)(**spec["config"])
    except (TypeError, ValueError, KeyError) as err:
        raise RelaxspecError(f"the drafter's layer config does not fit {type(text_model.config).__name__} "
                             f"({hf.first_line(err)})") from None
    config._attn_implementation = getattr(text_model.config, "_attn_implementation", None) or "sdpa"
    return config


def rope_table(text_model, config, count: int) -> Tensor:
    """The family rotary embedding's ``(cos, sin)`` for positions ``0 .. count - 1``:
    ``[count, 2, head_dim]`` (fp32)."""
    rotary = type(text_model.rotary_emb)(config=config)
    cos, sin = rotary(torch.zeros(1), torch.arange(count)[None])
    return torch.stack([cos[0], sin[0]], dim=1).float()


class FamilyLayers(nn.ModuleList):
    """``n_layer`` decoder layers of ``text_model``'s class, shaped by ``spec``
    (:func:`layer_spec`), and their per-row slot caches.

    A ``ModuleList``, so a drafter's weights are named ``layers.<i>.<the family's names>``."""

    def __init__(self, text_model, spec: dict, n_layer: int):
        module = sys.modules.get(type(text_model.layers[0]).__module__)
        layer_class = getattr(module, str(spec["class"]), None)
        if not isinstance(layer_class, type) or not issubclass(layer_class, nn.Module):
            raise RelaxspecError(f"the drafter's layers are {spec['class']}, which this target's family "
                                 f"({type(text_model.layers[0]).__module__}) does not have")
        config = layer_config(text_model, spec)
        super().__init__(layer_class(config, layer_idx=index) for index in range(n_layer))
        self.text_config = config
        self._kv = hf.KVStore(cache_arg=hf.cache_argument(self[0]))

    def setup(self, rows: int, slots: int, dtype: torch.dtype, device) -> None:
        self._kv.setup(self.text_config, rows, slots, dtype, device)

    def clear(self) -> None:
        self._kv.clear()

    @property
    def slots(self) -> int:
        """Slots per row of the current caches (0 without)."""
        return self._kv.slots

    def run(self, h: Tensor, rope: Tensor, positions: Tensor, cache_slots: Tensor | None, attn_mask: Tensor | None,
            kv_len: int | None) -> Tensor:
        """The layers over ``h [R, T, d]`` at ``positions [R, T]`` with ``rope [R, T, 2, head_dim]``
        (their rows of the table). With caches and ``cache_slots [R, T]`` the inputs are written
        to those slots and attend by ``attn_mask [R, T, <= slots]`` (default: causal by slot, over
        the first ``kv_len`` slots if given); without, causal over the ``T`` inputs (or
        ``attn_mask [R, T, T]``)."""
        cos, sin = rope.to(h.dtype).unbind(-2)
        if cache_slots is not None and self._kv.store:
            length = self._kv.slots
            if attn_mask is None:
                keys = torch.arange(length if kv_len is None else kv_len, device=h.device)
                attn_mask = keys[None, None, :] <= cache_slots[:, :, None]
            if attn_mask.shape[-1] < length:  # slots past kv_len are never attended
                attn_mask = nn.functional.pad(attn_mask, (0, length - attn_mask.shape[-1]), value=False)
            return self._kv.run_layers(self, h, positions, (cos, sin), cache_slots, attn_mask)[0]
        if attn_mask is None:
            count = h.shape[1]
            attn_mask = torch.ones(count, count, dtype=torch.bool, device=h.device).tril()[None]
        return hf.run_decoder_layers(self, h, positions, (cos, sin), hf.additive_mask(attn_mask, h.dtype))[0]
