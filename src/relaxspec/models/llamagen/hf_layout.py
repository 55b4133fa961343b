"""LlamaGen in official LANTERN's Hugging-Face layout: the folders it released of the LlamaGen
text-to-image targets (``jadohu/LlamaGen-T2I``, Stage I, 256 image tokens; ``jadohu/LlamaGen-T2I-2``,
Stage II, 1024), as its ``modeling_llamagen_kv`` reads them.

A folder holds ``config.json`` (transformers' ``LlamaConfig`` keys: ``architectures``
``["LlamaForCausalLM"]``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
``intermediate_size``, ``vocab_size``, ``rms_norm_eps``, and LlamaGen's own: ``input_type``
``"t2i"`` / ``"c2i"``, ``caption_dim``, ``cls_token_num``, ``block_size``, ``rope_base``,
``num_classes``) and ``model.safetensors`` under HF-Llama names. It is upstream LlamaGen's network
renamed, with the same interleaved 2D RoPE (no q/k permutation), so it maps onto
:class:`~relaxspec.models.llamagen.gpt.Transformer` key for key (:data:`BLOCK`, :data:`OUTSIDE`; q, k and v
stacked into ``wqkv``). The text encoder (Flan-T5-XL) and the VQ (``vq_ds16_t2i.pt``) are not in
the folder: they come from ``--t5-path`` (or ``--caption-features``) and ``--vq-ckpt``, as for
upstream's files.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import load_file
from safetensors import safe_open

from relaxspec.errors import RelaxspecError, shown
from relaxspec.files import read_json
from relaxspec.models.llamagen.gpt import GPTConfig

#: A LlamaGen block's tensors under HF-Llama names -> upstream's (both within ``layers.N.``); q, k
#: and v (:data:`QKV_PROJ`) stack into ``attention.wqkv.weight``. LANTERN's targets and drafters
#: name their blocks alike (a drafter's layer 0 has no ``input_layernorm``).
BLOCK = {"self_attn.o_proj.weight": "attention.wo.weight", "mlp.gate_proj.weight": "feed_forward.w1.weight",
         "mlp.up_proj.weight": "feed_forward.w3.weight", "mlp.down_proj.weight": "feed_forward.w2.weight",
         "input_layernorm.weight": "attention_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight"}
QKV_PROJ = tuple(f"self_attn.{part}_proj.weight" for part in "qkv")
#: The target's other tensors: HF-Llama name -> upstream name (the caption embedder keeps its own).
OUTSIDE = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "output.weight"}
LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
#: Entries that are no weights of the network (derived buffers some exports carry).
SKIPPED = re.compile(r"(^|\.)(rotary_emb\.(inv_freq|cos_cached|sin_cached)|freqs_cis)$")
#: The config keys a folder must have, and the GPTConfig field each becomes.
CONFIG_FIELDS = {"hidden_size": "dim", "num_hidden_layers": "n_layer", "num_attention_heads": "n_head",
                 "vocab_size": "vocab_size", "block_size": "block_size"}


def is_lantern_folder(path) -> bool:
    """Whether ``path`` is a folder in official LANTERN's layout of a LlamaGen model: a
    ``config.json`` of ``LlamaForCausalLM`` with LlamaGen's ``input_type``."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return False
    try:
        config = read_json(config_file)
    except RelaxspecError:
        return False
    return isinstance(config, dict) and "input_type" in config and \
        "LlamaForCausalLM" in (config.get("architectures") or [])


def is_drafter_folder(path) -> bool:
    """Whether a LANTERN-layout folder holds one of its EAGLE drafters rather than a target: its
    weights have the drafter's ``fc``, or (as the drafters are released) it has only a
    ``pytorch_model.bin`` and one layer."""
    folder = Path(path)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        try:
            layers = read_json(folder / "config.json").get("num_hidden_layers")
        except (RelaxspecError, AttributeError):
            return False
        return (folder / "pytorch_model.bin").is_file() and layers == 1
    return "fc.weight" in safetensors_keys(weights)


def gpt_fields(config: dict, where: str) -> dict:
    """A LANTERN ``config.json`` -> :class:`~relaxspec.models.llamagen.gpt.GPTConfig` fields
    (one-line errors for a missing or unreadable key)."""
    missing = [key for key in CONFIG_FIELDS if not isinstance(config.get(key), int) or isinstance(config[key], bool)]
    if missing:
        raise RelaxspecError(f"{where}: config.json needs whole-number {', '.join(missing)} (LANTERN's LlamaGen "
                             "layout)")
    kind = config.get("input_type")
    if kind not in ("t2i", "t2i2", "c2i"):
        raise RelaxspecError(f"{where}: input_type {shown(kind)} is not LlamaGen's t2i or c2i")
    fields = {field: config[key] for key, field in CONFIG_FIELDS.items()}
    fields["model_type"] = "c2i" if kind == "c2i" else "t2i"  # t2i2: Stage II, told apart by block_size
    fields["n_kv_head"] = config.get("num_key_value_heads") or config["num_attention_heads"]
    fields["norm_eps"] = float(config.get("rms_norm_eps", 1e-5))
    fields["rope_base"] = float(config.get("rope_base", config.get("rope_theta", 10000.0)))
    if fields["model_type"] == "t2i":
        fields["caption_dim"] = int(config.get("caption_dim", 2048))
        fields["cls_token_num"] = int(config.get("cls_token_num", 120))
    else:
        fields["num_classes"] = int(config.get("num_classes", 1000))
        fields["cls_token_num"] = int(config.get("cls_token_num", 1))
    return fields


def read_lantern_folder(path) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """``(state dict under upstream LlamaGen names, GPTConfig fields, config.json)`` of a
    LANTERN-layout folder; the weights must fill the network exactly (checked when loaded)."""
    folder = Path(path)
    where = str(folder)
    if is_drafter_folder(folder):
        raise RelaxspecError(f"{where}: this is official LANTERN's EAGLE drafter, not a LlamaGen model: give it as "
                             "--drafter-ckpt (with the target it was trained for as --gpt-ckpt)")
    config = read_json(folder / "config.json", f"{where}/config.json")
    fields = gpt_fields(config, where)
    gpt = GPTConfig.from_dict(fields)
    width = config.get("intermediate_size")
    if width is not None and width != gpt.ffn_dim:
        raise RelaxspecError(f"{where}: intermediate_size {width} is not LlamaGen's SwiGLU width {gpt.ffn_dim} for "
                             f"hidden_size {gpt.dim}")
    weights = folder / "model.safetensors"
    if not weights.is_file():
        named = "pytorch_model.bin" if (folder / "pytorch_model.bin").is_file() else "no weights"
        raise RelaxspecError(f"{where}: LANTERN's LlamaGen folder needs model.safetensors (found {named}; relaxspec "
                             "does not unpickle .bin files)")
    try:
        hf = load_file(str(weights))
    except Exception as err:  # noqa: BLE001 - a damaged or foreign file
        raise RelaxspecError(f"{weights}: not a readable safetensors file ({err})") from None
    return to_upstream(hf, gpt.n_layer, where), fields, config


def blocks_to_upstream(hf: dict[str, torch.Tensor], prefix: str, where: str):
    """The LlamaGen blocks among ``hf`` (keys ``{prefix}layers.N.<HF-Llama name>``) under upstream
    names, q, k and v rows stacked into ``wqkv`` in that order, as upstream splits them; and the
    entries that are no block's (derived buffers dropped). One-line errors for a block tensor
    LlamaGen does not have or a layer without all of q, k and v."""
    state: dict[str, torch.Tensor] = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    rest, unknown = {}, []
    for key, tensor in hf.items():
        match = LAYER_KEY.fullmatch(key[len(prefix):]) if key.startswith(prefix) else None
        if SKIPPED.search(key):
            continue
        if match is None:
            rest[key] = tensor
        elif match.group(2) in QKV_PROJ:
            qkv.setdefault(match.group(1), {})[match.group(2)] = tensor
        elif match.group(2) in BLOCK:
            state[f"layers.{match.group(1)}.{BLOCK[match.group(2)]}"] = tensor
        else:
            unknown.append(key)
    if unknown:
        raise RelaxspecError(f"{where}: weights LlamaGen does not have: {', '.join(unknown[:4])}"
                             + (f", ... ({len(unknown)} in all)" if len(unknown) > 4 else ""))
    for layer, parts in sorted(qkv.items(), key=lambda item: int(item[0])):
        if set(parts) != set(QKV_PROJ):
            lacking = ", ".join(name.split(".")[1] for name in QKV_PROJ if name not in parts)
            raise RelaxspecError(f"{where}: layer {layer} lacks {lacking}")
        state[f"layers.{layer}.attention.wqkv.weight"] = torch.cat([parts[name] for name in QKV_PROJ])
    return state, rest


def to_upstream(hf: dict[str, torch.Tensor], layers: int, where: str) -> dict[str, torch.Tensor]:
    """A LANTERN target's HF-Llama names -> upstream LlamaGen names."""
    state, rest = blocks_to_upstream(hf, "model.", where)
    unknown = []
    for key, tensor in rest.items():
        if key in OUTSIDE:
            state[OUTSIDE[key]] = tensor
        elif key.startswith("model.cls_embedding."):
            state[key[len("model."):]] = tensor
        else:
            unknown.append(key)
    if unknown:
        raise RelaxspecError(f"{where}: weights LlamaGen does not have: {', '.join(unknown[:4])}"
                             + (f", ... ({len(unknown)} in all)" if len(unknown) > 4 else ""))
    return state


def from_upstream(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_upstream`: upstream LlamaGen names -> LANTERN's HF-Llama names
    (what LANTERN's conversion of a LlamaGen checkpoint holds; tests write folders with it)."""
    inverse, block = {v: k for k, v in OUTSIDE.items()}, {v: k for k, v in BLOCK.items()}
    hf = {}
    for key, tensor in state.items():
        match = LAYER_KEY.fullmatch(key)
        if SKIPPED.search(key):
            continue
        if key in inverse:
            hf[inverse[key]] = tensor
        elif key.startswith("cls_embedding."):
            hf["model." + key] = tensor
        elif match.group(2) == "attention.wqkv.weight":
            dim = tensor.shape[1]
            kv = (tensor.shape[0] - dim) // 2
            for name, part in zip(QKV_PROJ, tensor.split([dim, kv, kv])):
                hf[f"model.layers.{match.group(1)}.{name}"] = part
        else:
            hf[f"model.layers.{match.group(1)}.{block[match.group(2)]}"] = tensor
    return hf


def safetensors_keys(path) -> list[str]:
    """The tensor names of a safetensors file, read from its header (``[]`` for a file that is not
    one: the readers that load it say what is wrong)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception:  # noqa: BLE001 - a damaged or foreign file
        return []


def lantern_config(gpt) -> dict:
    """The ``config.json`` LANTERN's folder holds for a :class:`GPTConfig` (the keys its
    ``modeling_llamagen_kv`` reads)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": gpt.dim,
            "num_hidden_layers": gpt.n_layer, "num_attention_heads": gpt.n_head, "num_key_value_heads": gpt.n_kv_head,
            "intermediate_size": gpt.ffn_dim, "vocab_size": gpt.vocab_size, "rms_norm_eps": gpt.norm_eps,
            "rope_base": gpt.rope_base, "rope_theta": gpt.rope_base, "block_size": gpt.block_size,
            "input_type": gpt.model_type, "caption_dim": gpt.caption_dim, "cls_token_num": gpt.cls_token_num,
            "num_classes": gpt.num_classes, "max_position_embeddings": 2048, "attention_bias": False,
            "pretraining_tp": 1, "hidden_act": "silu", "token_dropout_p": 0.1, "resid_dropout_p": 0.1,
            "ffn_dropout_p": 0.1, "class_dropout_p": 0.1, "torch_dtype": "float32"}


__all__ = ["BLOCK", "OUTSIDE", "QKV_PROJ", "blocks_to_upstream", "from_upstream", "gpt_fields", "is_drafter_folder",
           "is_lantern_folder", "lantern_config", "read_lantern_folder", "safetensors_keys", "to_upstream"]
