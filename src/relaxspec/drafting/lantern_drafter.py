"""Official LANTERN's released EAGLE drafters, read onto :class:`~relaxspec.drafting.eagle.EagleDrafter`:
for LlamaGen text-to-image targets (``jadohu/llamagen_drafter``, Stage I, 256 image tokens;
``jadohu/llamagen2_drafter``, Stage II, 1024) and for Anole (``jadohu/anole_drafter``).

A folder holds ``config.json`` (transformers config keys with ``num_hidden_layers`` 1: LlamaGen's
``model_type`` ``"llama"`` with LANTERN's ``input_type`` ``"t2i"`` / ``"t2i2"``, Anole's
``"chameleon"``) and ``pytorch_model.bin`` (a plain state dict, read only with
``torch.load(weights_only=True)``) or ``model.safetensors``. Official LANTERN's drafters
(``models/drafters/cnets_llamagen.py``, ``cnets_anole.py``) compute, for pairs ``t`` of (token,
target feature)::

    h = fc(cat([embed_tokens(x_t), f_t]))      # fc [H, 2H] with bias; embedding FIRST
    h = layer(h)                               # one decoder layer (below); no final norm
    logits = target.lm_head(h)

over ``input_ids = (condition + image tokens)[1:]`` beside the target's final (post-norm) hidden
states from its condition prefill on, so pair ``t < C - 1`` reads the condition (the *condition
pairs* of :mod:`relaxspec.drafting.eagle`) and pair ``C - 1 + j`` is (image token ``j``, the
feature that predicted it).

**LlamaGen.** The caption is 120 features and no tokens: ``input_ids`` are ``[0] * 120 + image
tokens``, the condition pairs ``0 .. 118`` sit at RoPE rows that are all zero (its
``cls_token_num`` 119), image pair ``j`` at the 2D RoPE row of token ``j``. The layer is a LlamaGen
block without its input norm. relaxspec's mapping (LANTERN's targets' block names,
:data:`relaxspec.models.llamagen.hf_layout.BLOCK`) keeps the numbers:

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

**Anole.** The layer is Chameleon's own decoder layer (q/k layer norms applied per head, input
norm present), so the drafter is relaxspec's family drafter of the Anole target's
``ChameleonDecoderLayer`` class (:mod:`relaxspec.drafting.family`) and every name maps to itself
(:data:`ANOLE_LAYER_KEYS`): ``embed_tokens`` (the drafter's own table over the 65,536-token
vocabulary, ``own_embedding``: LANTERN's training copied the target's, image code ``c`` at id
``c + 4``), ``fc``, ``layers.i.self_attn.{q,k,v,o}_proj``, ``layers.i.self_attn.{q,k}_norm``
(weight and bias ``[heads, head_dim]``), ``layers.i.mlp.{gate,up,down}_proj``,
``layers.i.input_layernorm``, ``layers.i.post_attention_layernorm``; the layer config is read
off ``config.json`` with EConfigAnole's defaults. The condition is the prompt: pair ``t`` is
(prompt token ``t + 1``, the feature at prompt position ``t``) at 1D RoPE position ``t``, the
unconditional row's shifted back by ``input_position_diff`` (``L - 2``, clamped at 0: its <s> at
0) and its padding masked (``tokens != <pad>``); image pair ``j`` at the last prompt position plus
``j``. relaxspec reads it at the positions the target gives (padding skipped, so a batch of
left-padded prompts drafts as each prompt alone) with ``condition_pairs`` =
``max_position_embeddings - N - 1`` (``N`` image tokens, 1024 for Anole-7b): the longest prompt the
drafter's RoPE table covers beside the image.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from relaxspec.errors import RelaxspecError, shown
from relaxspec.files import read_json
from relaxspec.models import hf
from relaxspec.models.base import TargetModel
from relaxspec.models.weights import read_state
from relaxspec.models.llamagen.gpt import GPTConfig
from relaxspec.models.llamagen.hf_layout import BLOCK, QKV_PROJ, SKIPPED, blocks_to_upstream, safetensors_keys
from relaxspec.models.anole import AnoleTarget

#: input_type -> image tokens, as official LANTERN's drafter hard-codes them (cnets_llamagen.py:566-573).
GRIDS = {"t2i": 256, "t2i2": 1024}
#: Its condition pairs for both: the target's 120 caption tokens but the last.
CONDITION_PAIRS = 119
#: The weights files, in the order the official loader tries them.
WEIGHTS = ("pytorch_model.bin", "model.safetensors")
#: An Anole drafter: its kind, the transformers layer class it is built of, and the tensors of
#: layer ``{i}`` (the same names in relaxspec's family drafter); ``{bias}`` ones only when the
#: config's ``attention_bias`` / ``mlp_bias`` say so.
ANOLE = "anole"
ANOLE_LAYER = "ChameleonDecoderLayer"
ANOLE_LAYER_KEYS = (
    *(f"layers.{{i}}.self_attn.{name}_proj.weight" for name in "qkvo"),
    *(f"layers.{{i}}.self_attn.{name}_norm.{part}" for name in "qk" for part in ("weight", "bias")),
    *(f"layers.{{i}}.mlp.{name}_proj.weight" for name in ("gate", "up", "down")),
    "layers.{i}.input_layernorm.weight", "layers.{i}.post_attention_layernorm.weight",
)
ANOLE_BIASES = {"attention_bias": tuple(f"layers.{{i}}.self_attn.{name}_proj.bias" for name in "qkvo"),
                "mlp_bias": tuple(f"layers.{{i}}.mlp.{name}_proj.bias" for name in ("gate", "up", "down"))}
#: EConfigAnole's defaults for the keys a config.json may leave out (rms_norm_eps 1e-6 there).
ANOLE_DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
                  "mlp_bias": False, "max_position_embeddings": 2048}


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
    """Refuse (one line) a drafter config that is not one of LANTERN's drafters; returns its kind:
    the LlamaGen ``input_type`` (``"t2i"`` / ``"t2i2"``) or ``"anole"``."""
    kind = config.get("model_type")
    if kind == "chameleon":
        return ANOLE
    if kind != "llama":
        raise RelaxspecError(f"{where}: model_type {shown(kind)} is not a LANTERN drafter's (model_type llama, "
                             "input_type t2i / t2i2, for LlamaGen; model_type chameleon for Anole)")
    stage = config.get("input_type")
    if stage not in GRIDS:
        raise RelaxspecError(f"{where}: input_type {shown(stage)} is not a LANTERN LlamaGen text-to-image drafter's "
                             f"({' or '.join(GRIDS)})")
    return stage


def _is_anole(target: TargetModel) -> bool:
    return isinstance(target, AnoleTarget)


def check_target_family(kind: str, target: TargetModel, where: str) -> None:
    """Refuse (one line) a target of another family than the drafter's, before its weights are read."""
    tcfg = target.config
    if kind == ANOLE and not _is_anole(target):
        what = f"LlamaGen {tcfg.model_type}" if isinstance(tcfg, GPTConfig) else type(target).__name__
        raise RelaxspecError(f"{where}: a LANTERN Anole drafter (model_type chameleon) drafts for an Anole target "
                             f"(--model-path ANOLE_DIR); this one is {what}")
    if kind != ANOLE and not (isinstance(tcfg, GPTConfig) and tcfg.model_type == "t2i"):
        what = f"LlamaGen {tcfg.model_type}" if isinstance(tcfg, GPTConfig) else type(target).__name__
        raise RelaxspecError(f"{where}: a LANTERN LlamaGen drafter drafts for a LlamaGen text-to-image target; "
                             f"this one is {what}")


def _eps(config: dict, where: str, default: float) -> float:
    eps = config.get("rms_norm_eps", default)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise RelaxspecError(f"{where}: rms_norm_eps must be a small positive number, got {shown(eps)}")
    return float(eps)


def anole_drafter_config(config: dict, target: TargetModel, where: str) -> dict:
    """An Anole LANTERN ``config.json`` -> the :class:`~relaxspec.drafting.eagle.DrafterConfig`
    fields of relaxspec's family drafter of ``target``'s Chameleon layers, checked against it."""
    config = {**ANOLE_DEFAULTS, **{key: value for key, value in config.items() if value is not None}}
    if config["hidden_act"] != "silu":
        raise RelaxspecError(f"{where}: hidden_act {shown(config['hidden_act'])}: Chameleon's MLP is SwiGLU (silu)")
    if config.get("rope_scaling") is not None:
        raise RelaxspecError(f"{where}: rope_scaling {shown(config['rope_scaling'])}: relaxspec reads LANTERN's "
                             "Anole drafter with plain RoPE (rope_scaling null, as released)")
    dim, vocab = _whole(config, "hidden_size", where), _whole(config, "vocab_size", where)
    heads = _whole(config, "num_attention_heads", where)
    kv_heads = _whole(config, "num_key_value_heads", where, heads)
    layers, width = _whole(config, "num_hidden_layers", where), _whole(config, "intermediate_size", where)
    context = _whole(config, "max_position_embeddings", where)
    if dim % heads or heads % kv_heads:
        raise RelaxspecError(f"{where}: hidden_size {dim} and {heads} heads ({kv_heads} key/value heads) do not "
                             "make whole heads")
    tcfg, text = target.config, hf.text_model_of(target).config
    if dim != tcfg.dim:
        raise RelaxspecError(f"{where}: the drafter is {dim} wide (hidden_size), the target {tcfg.dim}")
    if vocab != text.vocab_size:
        raise RelaxspecError(f"{where}: the drafter's vocabulary is {vocab} tokens (vocab_size), the target's "
                             f"{text.vocab_size}")
    pairs = context - tcfg.block_size - 1
    if pairs < 1:
        raise RelaxspecError(f"{where}: max_position_embeddings {context} leaves no room for a prompt beside the "
                             f"target's {tcfg.block_size} image tokens")
    layer = {"hidden_size": dim, "intermediate_size": width, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "hidden_act": "silu", "rms_norm_eps": _eps(config, where, 1e-6),
             "attention_bias": bool(config["attention_bias"]), "mlp_bias": bool(config["mlp_bias"]),
             "rope_theta": float(config["rope_theta"]), "rope_scaling": None, "max_position_embeddings": context,
             "model_parallel_size": 1, "swin_norm": False,  # LANTERN's layer is the plain one whatever it says
             "num_hidden_layers": layers, "attention_dropout": 0.0, "vocab_size": vocab}
    return dict(target={"dim": int(tcfg.dim), "vocab_size": int(tcfg.vocab_size), "block_size": int(tcfg.block_size)},
                n_layer=layers, family=hf.family_of(target), layer={"class": ANOLE_LAYER, "config": layer},
                own_embedding=True, condition_pairs=pairs)


def drafter_config(config: dict, target: TargetModel, where: str) -> dict:
    """A LANTERN ``config.json`` -> the fields of the
    :class:`~relaxspec.drafting.eagle.DrafterConfig` of its network, checked against ``target``
    (one-line refusals naming the mismatch)."""
    stage = check_family(config, where)
    check_target_family(stage, target, where)
    if stage == ANOLE:
        return anole_drafter_config(config, target, where)
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
    eps = _eps(config, where, 1e-6)  # EConfig's default

    tcfg = target.config
    side, target_side = math.isqrt(image_tokens), tcfg.grid_size
    if dim != tcfg.dim:
        raise RelaxspecError(f"{where}: the drafter is {dim} wide (hidden_size), the target {tcfg.dim}")
    if vocab != tcfg.vocab_size:
        raise RelaxspecError(f"{where}: the drafter's vocabulary is {vocab} codes (vocab_size), the target's "
                             f"{tcfg.vocab_size}")
    if image_tokens != tcfg.block_size:
        raise RelaxspecError(f"{where}: the drafter was made for a {side}x{side} token grid ({image_tokens} image "
                             f"tokens, input_type {stage}), the target's is {target_side}x{target_side}")
    if pairs + 1 != tcfg.condition_length:
        raise RelaxspecError(f"{where}: the drafter reads a {pairs + 1}-token caption, the target's is "
                             f"{tcfg.condition_length} tokens")
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
    # trained on the caption rows LANTERN's converted target computes (padded ones included)
    return dict(target=blocks.to_dict(), n_layer=layers, first_attention_norm=False, own_embedding=True,
                condition_pairs=pairs, caption_rows="lantern")


def expected_keys(kind: str, layers: int, fc_bias: bool, config: dict) -> list[str]:
    """The tensor names of a ``layers``-layer LANTERN drafter of ``kind``, as its files hold them."""
    expected = ["embed_tokens.weight", "fc.weight"] + (["fc.bias"] if fc_bias else [])
    if kind == ANOLE:
        names = ANOLE_LAYER_KEYS + sum((keys for flag, keys in ANOLE_BIASES.items() if config.get(flag)), ())
        return expected + [name.format(i=i) for i in range(layers) for name in names]
    for i in range(layers):  # LlamaGen blocks, named as LANTERN's targets name theirs; layer 0 has no input norm
        expected += [f"layers.{i}.{name}" for name in (*QKV_PROJ, *BLOCK) if i or name != "input_layernorm.weight"]
    return expected


def to_relaxspec(state: dict[str, torch.Tensor], kind: str, layers: int, fc_bias: bool, config: dict,
                 where: str) -> dict[str, torch.Tensor]:
    """LANTERN's drafter state dict -> :class:`EagleDrafter`'s (refusing, under LANTERN's names,
    a file with keys missing or extra)."""
    state = {key: value for key, value in state.items() if not SKIPPED.search(key)}  # derived buffers
    expected = expected_keys(kind, layers, fc_bias, config)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = [f"{label}: {', '.join(keys[:6])}" + (f", ... ({len(keys)} in all)" if len(keys) > 6 else "")
                 for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        family = "Anole" if kind == ANOLE else "LlamaGen"
        raise RelaxspecError(f"{where}: the weights are not a {layers}-layer LANTERN {family} drafter's "
                             f"({'; '.join(parts)})")
    fc = state["fc.weight"]
    out = {"embed_tokens.weight": state["embed_tokens.weight"], "fc.weight": fc,
           "fc.bias": state["fc.bias"] if fc_bias else fc.new_zeros(fc.shape[0])}
    if kind == ANOLE:  # relaxspec's family drafter has the same names
        return {**state, **out}
    blocks, _ = blocks_to_upstream(state, "", where)
    return {**out, **blocks}


def _refuse_a_model(keys, where: str, kind: str) -> None:
    """LANTERN's target folders (the LlamaGen model under HF-Llama names; Anole's transformers
    folder) are no drafters."""
    if any(key.startswith(("model.", "lm_head.")) for key in keys):
        if kind == ANOLE:
            raise RelaxspecError(f"{where}: this is a Chameleon model, not a drafter: open an Anole folder with "
                                 "--model-path")
        raise RelaxspecError(f"{where}: this is a LlamaGen model in LANTERN's layout, not a drafter: open it with "
                             "--gpt-ckpt")


def read_lantern_drafter(path: str | Path, target: TargetModel) -> tuple[dict, dict[str, torch.Tensor], Path]:
    """Official LANTERN's drafter folder (LlamaGen's or Anole's), read and checked against ``target``: the
    :class:`~relaxspec.drafting.eagle.DrafterConfig` fields of its network, its state dict under
    :class:`~relaxspec.drafting.eagle.EagleDrafter`'s names, and the weights file read
    (:func:`relaxspec.drafting.eagle.load_drafter` builds the drafter)."""
    folder = Path(path)
    where = str(folder)
    config = read_json(folder / "config.json", f"{where}/config.json")
    if not isinstance(config, dict):
        raise RelaxspecError(f"{where}/config.json: not a JSON object")
    kind = check_family(config, where)  # before any weights are read (an Anole drafter's are gigabytes)
    check_target_family(kind, target, where)
    if kind == ANOLE and (folder / "model.safetensors.index.json").is_file():
        _refuse_a_model(["model."], where, kind)  # a sharded model folder (Anole's own)
    weights = next((folder / name for name in WEIGHTS if (folder / name).is_file()), None)
    if weights is None:
        raise RelaxspecError(f"{where}: a LANTERN drafter folder needs {' or '.join(WEIGHTS)} beside config.json")
    if weights.suffix == ".safetensors":  # a whole model's file is refused from its header, unread
        _refuse_a_model(safetensors_keys(weights), where, kind)
    loaded = read_state(weights)  # a .bin only ever through torch.load(weights_only=True), memory-mapped
    if loaded.layout not in ("raw", "safetensors"):
        raise RelaxspecError(f"{weights}: holds a {loaded.layout!r} container; a LANTERN drafter file is a plain state "
                             "dict (torch.save(model.state_dict()))")
    _refuse_a_model(loaded.state_dict, where, kind)
    fields = drafter_config(config, target, where)
    fc_bias = config.get("bias", True) is not False
    state = to_relaxspec(loaded.state_dict, kind, fields["n_layer"], fc_bias, config, where)
    return fields, state, weights