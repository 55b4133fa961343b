"""Official LANTERN's released EAGLE drafters for LlamaGen text-to-image targets
(``jadohu/llamagen_drafter``, Stage I, 256 image tokens; ``jadohu/llamagen2_drafter``, Stage II,
1024), read onto :class:`~relaxspec.drafting.eagle.EagleDrafter`.

A folder holds ``config.json`` (transformers' ``LlamaConfig`` keys with ``num_hidden_layers`` 1
and LANTERN's ``input_type`` ``"t2i"`` / ``"t2i2"``) and ``pytorch_model.bin`` (a plain state dict,
read only with ``torch.load(weights_only=True)``) or ``model.safetensors``. Official LANTERN's
``models/drafters/cnets_llamagen.py`` computes, for pairs ``t`` of (token, target feature)::

    h = fc(cat([embed_tokens(x_t), f_t]))      # fc [H, 2H] with bias; embedding FIRST
    h = h + attn(h)                           # layer 0: no input_layernorm; 2D RoPE
    h = h + mlp(post_attention_layernorm(h))  # no final norm
    logits = target.lm_head(h)

over ``input_ids = ([0] * 120 + image tokens)[1:]`` and the target's final (post-norm) hidden
states from its 120-token caption prefill on: pairs ``0 .. 118`` are (0, the feature at caption
position ``t``) at RoPE rows that are all zero (its ``cls_token_num`` 119), pair ``119 + j`` is
(image token ``j``, the feature that predicted it) at the 2D RoPE row of token ``j``. relaxspec's
mapping (:data:`MAPPING`) keeps the numbers, and the layout is three fields of
:class:`~relaxspec.drafting.eagle.DrafterConfig`:

============================================  ==============================================
LANTERN                                       relaxspec ``EagleDrafter`` (LlamaGen blocks)
============================================  ==============================================
``embed_tokens.weight`` (copied by LANTERN's  ``embed_tokens`` (``own_embedding``; frozen)
training from the target's lm_head)
``fc.weight`` / ``fc.bias`` (bias unless the  ``fc`` (a zero bias for ``"bias": false``)
config says ``"bias": false``)
``layers.i.self_attn.{q,k,v}_proj``           ``layers.i.attention.wqkv`` (rows q, k, v)
``layers.i.self_attn.o_proj``                 ``layers.i.attention.wo``
``layers.i.mlp.{gate,up,down}_proj``          ``layers.i.feed_forward.{w1,w3,w2}``
``layers.i.post_attention_layernorm``         ``layers.i.ffn_norm`` (eps ``rms_norm_eps``)
``layers.0``: no ``input_layernorm``          ``attention_norm`` = identity
(``layers.i.input_layernorm``, i >= 1)        (``layers.i.attention_norm``)
``cls_token_num`` 119 zero RoPE rows          ``condition_pairs`` = 119 (target's 120 - 1)
============================================  ==============================================

Not in the released configs (the official code hard-codes them from ``input_type``: t2i 256,
t2i2 1024 image tokens, 119 condition pairs), ``block_size`` and ``cls_token_num`` are read when
present, so a drafter made for another grid or caption length can say so.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from relaxspec.errors import RelaxspecError, shown
from relaxspec.files import read_json
from relaxspec.models.base import TargetModel
from relaxspec.models.llamagen.checkpoints import read_state
from relaxspec.models.llamagen.gpt import GPTConfig

#: input_type -> image tokens, as official LANTERN's drafter hard-codes them (cnets_llamagen.py:566-573).
GRIDS = {"t2i": 256, "t2i2": 1024}
#: Its condition pairs for both: the target's 120 caption tokens but the last.
CONDITION_PAIRS = 119
#: The weights files, in the order the official loader tries them.
WEIGHTS = ("pytorch_model.bin", "model.safetensors")
#: LANTERN name (layer ``{i}``) -> relaxspec name; q, k and v are stacked into ``wqkv``.
MAPPING = {
    "layers.{i}.self_attn.o_proj.weight": "layers.{i}.attention.wo.weight",
    "layers.{i}.mlp.gate_proj.weight": "layers.{i}.feed_forward.w1.weight",
    "layers.{i}.mlp.up_proj.weight": "layers.{i}.feed_forward.w3.weight",
    "layers.{i}.mlp.down_proj.weight": "layers.{i}.feed_forward.w2.weight",
    "layers.{i}.post_attention_layernorm.weight": "layers.{i}.ffn_norm.weight",
    "layers.{i}.input_layernorm.weight": "layers.{i}.attention_norm.weight",  # layers i >= 1 only
}
QKV = ("layers.{i}.self_attn.q_proj.weight", "layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.v_proj.weight")
#: Derived buffers some exports carry (the unused 1D rotary module's).
SKIPPED = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")


def is_eagle_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder whose ``config.json`` is a transformers config (an EAGLE
    drafter's, LANTERN's among them), not a relaxspec one (which has ``kind``)."""
    config_file = Path(path) / "config.json"
    if not (Path(path).is_dir() and config_file.is_file()):
        return False
    try:
        config = read_json(config_file)
    except RelaxspecError:
        return False
    return isinstance(config, dict) and "kind" not in config and \
        any(key in config for key in ("model_type", "architectures", "hidden_size"))


def _whole(config: dict, key: str, where: str, default=None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RelaxspecError(f"{where}: config.json needs a whole number {key} >= 1, got {shown(value)}")
    return value


def check_family(config: dict, where: str) -> str:
    """Refuse (one line) a drafter config that is not LANTERN's LlamaGen text-to-image drafter;
    returns its ``input_type``."""
    kind = config.get("model_type")
    if kind == "chameleon":
        raise RelaxspecError(f"{where}: an Anole (Chameleon) LANTERN drafter (model_type chameleon): relaxspec reads "
                             "only LANTERN's LlamaGen drafters (model_type llama, input_type t2i / t2i2), not Anole's "
                             "layout (Chameleon layers with q/k norms, 1D RoPE)")
    if kind != "llama":
        raise RelaxspecError(f"{where}: model_type {shown(kind)} is not a LANTERN LlamaGen drafter (model_type llama, "
                             "input_type t2i / t2i2)")
    stage = config.get("input_type")
    if stage not in GRIDS:
        raise RelaxspecError(f"{where}: input_type {shown(stage)} is not a LANTERN LlamaGen text-to-image drafter's "
                             f"({' or '.join(GRIDS)})")
    return stage


def drafter_config(config: dict, target: TargetModel, where: str) -> dict:
    """A LANTERN ``config.json`` -> the fields of the
    :class:`~relaxspec.drafting.eagle.DrafterConfig` of its network, checked against ``target``
    (one-line refusals naming the mismatch)."""
    stage = check_family(config, where)
    if config.get("hidden_act", "silu") != "silu":
        raise RelaxspecError(f"{where}: hidden_act {shown(config['hidden_act'])}: LlamaGen blocks are SwiGLU (silu)")
    if config.get("qkv_bias") or config.get("attention_bias"):
        raise RelaxspecError(f"{where}: attention with biases is not LANTERN's LlamaGen drafter")
    dim, vocab = _whole(config, "hidden_size", where), _whole(config, "vocab_size", where)
    heads = _whole(config, "num_attention_heads", where)
    kv_heads = _whole(config, "num_key_value_heads", where, heads)
    layers, width = _whole(config, "num_hidden_layers", where), _whole(config, "intermediate_size", where)
    image_tokens = _whole(config, "block_size", where, GRIDS[stage])
    pairs = _whole(config, "cls_token_num", where, CONDITION_PAIRS)
    eps = config.get("rms_norm_eps", 1e-6)  # EConfig's default
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise RelaxspecError(f"{where}: rms_norm_eps must be a small positive number, got {shown(eps)}")

    tcfg = target.config
    if not isinstance(tcfg, GPTConfig) or tcfg.model_type != "t2i":
        what = f"LlamaGen {tcfg.model_type}" if isinstance(tcfg, GPTConfig) else type(target).__name__
        raise RelaxspecError(f"{where}: a LANTERN LlamaGen drafter drafts for a LlamaGen text-to-image target; "
                             f"this one is {what}")
    side, target_side = math.isqrt(image_tokens), tcfg.grid_size
    if dim != tcfg.dim:
        raise RelaxspecError(f"{where}: the drafter is {dim} wide (hidden_size), the target {tcfg.dim}")
    if vocab != tcfg.vocab_size:
        raise RelaxspecError(f"{where}: the drafter's vocabulary is {vocab} codes (vocab_size), the target's "
                             f"{tcfg.vocab_size}")
    if image_tokens != tcfg.block_size:
        raise RelaxspecError(f"{where}: the drafter was made for a {side}x{side} token grid ({image_tokens} image "
                             f"tokens, input_type {stage}), the target's is {target_side}x{target_side}")
    if pairs + 1 != tcfg.cls_token_num:
        raise RelaxspecError(f"{where}: the drafter reads a {pairs + 1}-token caption, the target's is "
                             f"{tcfg.cls_token_num} tokens")
    # SwiGLU width: GPTConfig rounds int(8 * dim / 3) (times a multiplier) up to multiple_of.
    base = int(2 * 4 * dim / 3)
    ffn = dict(multiple_of=width, ffn_dim_multiplier=None if width >= base else width / base)
    try:
        blocks = GPTConfig(dim=dim, n_layer=layers, n_head=heads, n_kv_head=kv_heads, rope_base=10000.0,
                           norm_eps=float(eps), vocab_size=vocab, model_type="t2i",
                           caption_dim=int(getattr(tcfg, "caption_dim", 2048)), cls_token_num=pairs + 1,
                           block_size=image_tokens, **ffn)
    except RelaxspecError as err:
        raise RelaxspecError(f"{where}: {err}") from None
    if blocks.ffn_dim != width:
        raise RelaxspecError(f"{where}: intermediate_size {width} cannot be built for hidden_size {dim}")
    return dict(target=blocks.to_dict(), n_layer=layers, first_attention_norm=False, own_embedding=True,
                condition_pairs=pairs)


def to_relaxspec(state: dict[str, torch.Tensor], layers: int, fc_bias: bool, where: str) -> dict[str, torch.Tensor]:
    """LANTERN's drafter state dict -> :class:`EagleDrafter`'s (refusing, under LANTERN's names,
    a file with keys missing or extra)."""
    state = {key: value for key, value in state.items() if not SKIPPED.search(key)}
    expected = ["embed_tokens.weight", "fc.weight"] + (["fc.bias"] if fc_bias else [])
    for i in range(layers):
        expected += [name.format(i=i) for name in (*QKV, *MAPPING) if i or "input_layernorm" not in name]
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = [f"{label}: {', '.join(keys[:6])}" + (f", ... ({len(keys)} in all)" if len(keys) > 6 else "")
                 for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise RelaxspecError(f"{where}: the weights are not a {layers}-layer LANTERN LlamaGen drafter's "
                             f"({'; '.join(parts)})")
    out = {"embed_tokens.weight": state["embed_tokens.weight"], "fc.weight": state["fc.weight"],
           "fc.bias": state["fc.bias"] if fc_bias else state["fc.weight"].new_zeros(state["fc.weight"].shape[0])}
    for i in range(layers):
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat([state[name.format(i=i)] for name in QKV])
        for name, ours in MAPPING.items():
            if name.format(i=i) in state:
                out[ours.format(i=i)] = state[name.format(i=i)]
    return out


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception:  # noqa: BLE001 - read_state says what is wrong with the file
        return []


def _refuse_a_model(keys, where: str) -> None:
    """LANTERN's target folders (the LlamaGen model under HF-Llama names) are no drafters."""
    if any(key.startswith(("model.", "lm_head.")) for key in keys):
        raise RelaxspecError(f"{where}: this is a LlamaGen model in LANTERN's layout, not a drafter: open it with "
                             "--gpt-ckpt")


def read_lantern_drafter(path: str | Path, target: TargetModel) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """Official LANTERN's LlamaGen drafter folder, read and checked against ``target``: the
    :class:`~relaxspec.drafting.eagle.DrafterConfig` fields of its network, its state dict under
    :class:`~relaxspec.drafting.eagle.EagleDrafter`'s names, and the weights file read
    (:func:`relaxspec.drafting.eagle.load_drafter` builds the drafter)."""
    folder = Path(path)
    where = str(folder)
    config = read_json(folder / "config.json", f"{where}/config.json")
    if not isinstance(config, dict):
        raise RelaxspecError(f"{where}/config.json: not a JSON object")
    check_family(config, where)  # before any weights are read (an Anole drafter's are gigabytes)
    weights = next((folder / name for name in WEIGHTS if (folder / name).is_file()), None)
    if weights is None:
        raise RelaxspecError(f"{where}: a LANTERN drafter folder needs {' or '.join(WEIGHTS)} beside config.json")
    if weights.suffix == ".safetensors":  # a whole model's file is refused from its header, unread
        _refuse_a_model(_safetensors_keys(weights), where)
    loaded = read_state(weights)  # a .bin only ever through torch.load(weights_only=True), memory-mapped
    if loaded.layout not in ("raw", "safetensors"):
        raise RelaxspecError(f"{weights}: holds a {loaded.layout!r} container; a LANTERN drafter file is a plain state "
                             "dict (torch.save(model.state_dict()))")
    _refuse_a_model(loaded.state_dict, where)
    fields = drafter_config(config, target, where)
    fc_bias = config.get("bias", True) is not False
    return fields, to_relaxspec(loaded.state_dict, fields["n_layer"], fc_bias, where), weights