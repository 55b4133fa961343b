"""Loading LlamaGen's checkpoints: official files (whose configs are a named size or a JSON file,
the head count not being in the weights), relaxspec's folders of a GPT or VQ, and official
LANTERN's HF-Llama folders. Reading files safely, strict loading and saving are every family's
(:mod:`relaxspec.models.weights`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch

from relaxspec.errors import RelaxspecError
from relaxspec.models.weights import PRECISIONS, LoadedState, load_strict, read_state
from relaxspec.models.llamagen.gpt import GPT_SIZES, GPTConfig, Transformer, gpt_config
from relaxspec.models.llamagen.hf_layout import is_lantern_folder, read_lantern_folder
from relaxspec.models.llamagen.vq import VQ_CONFIGS, VQConfig, VQModel

#: Keys some official files carry that are derived buffers, not weights.
IGNORED_KEY = re.compile(r"(^|\.)(freqs_cis|kv_cache\..*|k_cache|v_cache)$")
#: Layouts that carry their config (our folders, official LANTERN's HF-Llama folders).
CONFIGURED = ("relaxspec", "lantern")


def is_gpt_folder(path: str | Path) -> bool:
    """Whether ``path`` is one of relaxspec's LlamaGen GPT folders (``config.json`` of kind ``gpt``)."""
    config_file = Path(path) / "config.json"
    try:
        meta = json.loads(config_file.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(meta, dict) and meta.get("kind") == "gpt" and "config" in meta


def read_llamagen_state(path: str | Path) -> LoadedState:
    """:func:`relaxspec.models.weights.read_state`, and official LANTERN's HF-Llama folders of a
    LlamaGen model (layout "lantern"), read back under upstream names with their GPT config."""
    if is_lantern_folder(path):
        state, fields, config = read_lantern_folder(path)
        return LoadedState(state, "lantern", fields, "gpt", {"lantern_config": config})
    return read_state(path)


def strip_ignored(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop derived buffers (``freqs_cis``, ``kv_cache``) some official files carry."""
    return {k: v for k, v in state_dict.items() if not IGNORED_KEY.search(k)}


# ------------------------------------------------------------------------------------------
# Model specs: a named size or a JSON file of config fields
# ------------------------------------------------------------------------------------------


def _read_json_config(path: Path, what: str, translate=None) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise RelaxspecError(f"{path}: not valid JSON ({err})") from None
    if isinstance(data, dict) and isinstance(data.get("config"), dict):  # a relaxspec config.json
        data = data["config"]
    return _config_fields(data, what, str(path), translate)


def _config_fields(data, what: str, where: str, translate=None) -> dict:
    """``data`` as the fields of ``what`` (GPTConfig / VQConfig), after ``translate`` (another
    layout's names -> these), refusing anything else in one line."""
    if not isinstance(data, dict):
        raise RelaxspecError(f"{where}: expected a JSON object of {what} fields")
    if translate is not None:
        data = translate(data, where)
    known = {f.name for f in dataclasses.fields(GPTConfig if what == "GPTConfig" else VQConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RelaxspecError(f"{where}: unknown {what} fields: {', '.join(unknown)}")
    return data


def _is_config_file(spec: str) -> bool:
    return spec.endswith(".json") or Path(spec).is_file()


def resolve_gpt_model(spec: str | None, ckpt: str, image_size: int, downsample: int) -> tuple[str | None, GPTConfig | None]:
    """A GPT model spec: a named size (returned as the name) or a JSON file of GPTConfig fields
    (returned as a config: fields it leaves out are read from the weights, the grid from
    ``image_size``)."""
    if spec is None or spec in GPT_SIZES:
        return spec, None
    if not _is_config_file(spec):
        raise RelaxspecError(f"unknown GPT model {spec!r}; choose one of {', '.join(GPT_SIZES)} "
                             "or give a JSON file of GPTConfig fields")
    fields = _read_json_config(Path(spec), "GPTConfig")
    grid = image_size // downsample
    if "block_size" in fields and fields["block_size"] != grid * grid:
        side = math.isqrt(max(int(fields["block_size"]), 0))
        raise RelaxspecError(f"image size {image_size} gives a {grid}x{grid} token grid but {spec} describes a "
                             f"{side}x{side} grid ({side * downsample} px)")
    derived = ("model_type", "vocab_size", "num_classes", "caption_dim", "cls_token_num")
    if any(key not in fields for key in derived):
        state = read_llamagen_state(ckpt)
        if state.layout not in CONFIGURED:
            inferred = infer_gpt_fields(state.state_dict)
            for key in derived:
                if key in inferred:
                    fields.setdefault(key, inferred[key])
    fields.setdefault("block_size", grid * grid)
    try:
        return None, GPTConfig(**fields)
    except RelaxspecError:
        raise
    except (TypeError, ValueError) as err:
        raise RelaxspecError(f"{spec}: bad GPT config ({err})") from None


#: Upstream LlamaGen's ``ModelArgs`` (tokenizer/tokenizer_image/vq_model.py) fields -> VQConfig's;
#: its loss weights are training-only and read nothing here.
UPSTREAM_VQ_FIELDS = {"dropout_p": "dropout"}
UPSTREAM_VQ_TRAINING = ("commit_loss_beta", "entropy_loss_ratio")


def upstream_vq_fields(data: dict, where: str) -> dict:
    """VQConfig fields from a JSON object that may be upstream's ``ModelArgs`` as upstream writes
    it (``encoder_ch_mult`` / ``decoder_ch_mult``, ``dropout_p``, the loss weights) or relaxspec's
    own fields, or a mix."""
    data = dict(data)
    for name in UPSTREAM_VQ_TRAINING:
        data.pop(name, None)
    for old, new in UPSTREAM_VQ_FIELDS.items():
        if old in data:
            data.setdefault(new, data.pop(old))
    encoder, decoder = data.pop("encoder_ch_mult", None), data.pop("decoder_ch_mult", None)
    if encoder is not None and decoder is not None and encoder != decoder:
        raise RelaxspecError(f"{where}: encoder_ch_mult {encoder} and decoder_ch_mult {decoder} differ; relaxspec's VQ "
                             "model (as every released one) has one ch_mult")
    if encoder is not None or decoder is not None:
        data.setdefault("ch_mult", encoder if encoder is not None else decoder)
    return data


def resolve_vq_model(spec: str) -> tuple[str | None, VQConfig | None]:
    """A VQ model spec: a named tokenizer, a JSON file of VQConfig fields or of upstream's
    ``ModelArgs`` (as upstream writes it), or the same JSON inline (``{...}``)."""
    if spec in VQ_CONFIGS:
        return spec, None
    if spec.lstrip().startswith("{"):
        where = "--vq-model"
        try:
            fields = _config_fields(json.loads(spec), "VQConfig", where, upstream_vq_fields)
        except json.JSONDecodeError as err:
            raise RelaxspecError(f"--vq-model: not valid JSON ({err})") from None
    elif _is_config_file(spec):
        where, fields = spec, _read_json_config(Path(spec), "VQConfig", upstream_vq_fields)
    else:
        raise RelaxspecError(f"unknown VQ model {spec!r}; choose one of {', '.join(VQ_CONFIGS)} "
                             "or give a JSON file (or inline JSON) of VQConfig or upstream ModelArgs fields")
    try:
        return None, VQConfig(**fields)
    except RelaxspecError as err:
        raise RelaxspecError(f"{where}: {err}") from None
    except (TypeError, ValueError) as err:
        raise RelaxspecError(f"{where}: bad VQ config ({err})") from None



# ------------------------------------------------------------------------------------------
# GPT
# ------------------------------------------------------------------------------------------


def infer_gpt_fields(state_dict: dict[str, torch.Tensor]) -> dict:
    """What the weights alone say about a LlamaGen GPT (everything but the head count)."""
    try:
        vocab, dim = state_dict["tok_embeddings.weight"].shape
        n_layer = 1 + max(int(m.group(1)) for k in state_dict if (m := re.match(r"layers\.(\d+)\.", k)))
        ffn = state_dict["layers.0.feed_forward.w1.weight"].shape[0]
        qkv = state_dict["layers.0.attention.wqkv.weight"].shape[0]
    except (KeyError, ValueError):
        raise RelaxspecError("the weights are not a LlamaGen GPT (no tok_embeddings / layers.N keys)") from None
    fields = dict(dim=int(dim), n_layer=n_layer, vocab_size=int(vocab), ffn_dim=int(ffn), qkv_dim=int(qkv))
    if "cls_embedding.embedding_table.weight" in state_dict:
        fields.update(model_type="c2i", num_classes=int(state_dict["cls_embedding.embedding_table.weight"].shape[0]) - 1,
                      cls_token_num=1)
    elif "cls_embedding.uncond_embedding" in state_dict:
        tokens, caption_dim = state_dict["cls_embedding.uncond_embedding"].shape
        fields.update(model_type="t2i", cls_token_num=int(tokens), caption_dim=int(caption_dim))
    else:
        raise RelaxspecError("the weights have no cls_embedding: neither c2i nor t2i LlamaGen")
    return fields


def gpt_name_for(fields: dict) -> str | None:
    """The named size whose width and depth match the weights, if any."""
    for name, size in GPT_SIZES.items():
        if size["dim"] == fields["dim"] and size["n_layer"] == fields["n_layer"]:
            return name
    return None


def load_gpt(path: str | Path, model_name: str | None = None, *, image_size: int | None = None,
             downsample: int = 16, precision: str = "fp32", device: str | torch.device = "cpu",
             config: GPTConfig | None = None) -> Transformer:
    """Build and load a LlamaGen transformer.

    Our folders carry their config. Official files do not, and the head count cannot be inferred
    from the weights, so ``model_name`` (e.g. "GPT-B") is required for them; ``image_size`` fixes
    the token grid (default 256 px). An official-layout file of a size that has no name (a small
    test model) is loaded with an explicit ``config`` instead; the weights must still fit it exactly.
    """
    if precision not in PRECISIONS:
        raise RelaxspecError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if config is None and model_name is not None and model_name not in GPT_SIZES:
        model_name, config = resolve_gpt_model(model_name, str(path), image_size or 256, downsample)
    loaded = read_llamagen_state(path)
    if loaded.layout in CONFIGURED:
        if loaded.kind != "gpt":
            raise RelaxspecError(f"{path}: this is a {loaded.kind!r} model, not a GPT")
        config = GPTConfig.from_dict(loaded.config)
        if image_size is not None and image_size % downsample:
            raise RelaxspecError(f"image size {image_size} is not a multiple of the tokenizer's downsampling {downsample}")
        if image_size is not None and image_size // downsample != config.grid_size:
            raise RelaxspecError(
                f"image size {image_size} gives a {image_size // downsample}x{image_size // downsample} token grid "
                f"but the model was trained on {config.grid_size}x{config.grid_size}"
            )
    else:
        fields = infer_gpt_fields(loaded.state_dict)  # also refuses weights that are no LlamaGen GPT
        if config is None:
            if model_name is None:
                raise RelaxspecError(f"{path}: an official checkpoint needs --gpt-model (one of {', '.join(GPT_SIZES)})")
            config = gpt_config(model_name, image_size=image_size or 256, downsample=downsample,
                                model_type=fields["model_type"], vocab_size=fields["vocab_size"],
                                cls_token_num=fields["cls_token_num"],
                                **({"num_classes": fields["num_classes"]} if "num_classes" in fields else {"caption_dim": fields["caption_dim"]}))
            if (config.dim, config.n_layer) != (fields["dim"], fields["n_layer"]):
                guess = gpt_name_for(fields)
                raise RelaxspecError(
                    f"{path}: the weights are dim {fields['dim']} x {fields['n_layer']} layers, not {model_name}"
                    + (f" (they look like {guess})" if guess else "")
                )
        freqs = loaded.state_dict.get("freqs_cis")
        if freqs is not None and freqs.shape[0] != config.cls_token_num + config.block_size:
            grid = int(round(max(freqs.shape[0] - config.cls_token_num, 0) ** 0.5))
            raise RelaxspecError(
                f"image size {config.grid_size * downsample} gives a {config.grid_size}x{config.grid_size} token grid "
                f"but the checkpoint was made for {grid}x{grid} ({grid * downsample} px)"
            )
    model = Transformer(config)
    load_strict(model, strip_ignored(loaded.state_dict), str(path))
    # Our folders may name the classes (config.json "class_names"), so users can ask by name.
    names = (loaded.meta or {}).get("class_names")
    model.class_names = list(names) if isinstance(names, list) and len(names) == config.num_classes else None
    return model.to(device=device, dtype=PRECISIONS[precision]).eval()


# ------------------------------------------------------------------------------------------
# VQ
# ------------------------------------------------------------------------------------------


def load_vq(path: str | Path, model_name: str | None = "VQ-16", *, device: str | torch.device = "cpu",
            codebook_size: int | None = None, config: VQConfig | None = None) -> VQModel:
    """Build and load a LlamaGen VQ tokenizer (official ``{"model": sd}`` files or our folders).

    ``config`` replaces the named config for an official-layout file of an unnamed size (the
    GroupNorm group count, like the GPT head count, is not in the weights)."""
    if config is None and model_name is not None and model_name not in VQ_CONFIGS:
        model_name, config = resolve_vq_model(model_name)
    loaded = read_llamagen_state(path)
    if loaded.layout in CONFIGURED:
        if loaded.kind != "vq":
            raise RelaxspecError(f"{path}: this is a {loaded.kind!r} model, not a VQ tokenizer")
        unknown = sorted(set(loaded.config) - set(VQConfig.__dataclass_fields__))
        if unknown:
            raise RelaxspecError(f"{path}: unknown VQ config fields: {', '.join(unknown)}")
        config = VQConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in loaded.config.items()})
    elif config is not None:
        if "quantize.embedding.weight" not in loaded.state_dict:
            raise RelaxspecError(f"{path}: not a LlamaGen VQ checkpoint (no quantize.embedding.weight)")
    else:
        if model_name not in VQ_CONFIGS:
            raise RelaxspecError(f"unknown VQ model {model_name!r}; choose one of {', '.join(VQ_CONFIGS)}")
        config = VQ_CONFIGS[model_name]
        table = loaded.state_dict.get("quantize.embedding.weight")
        if table is None:
            raise RelaxspecError(f"{path}: not a LlamaGen VQ checkpoint (no quantize.embedding.weight)")
        config = dataclasses.replace(config, codebook_size=int(table.shape[0]), codebook_embed_dim=int(table.shape[1]))
    model = VQModel(config)
    load_strict(model, strip_ignored(loaded.state_dict), str(path))
    return model.to(device).eval()


def describe(path: str | Path, model_name: str | None = None) -> dict:
    """What ``relaxspec info`` prints: layout, inferred config, parameter count."""
    loaded = read_llamagen_state(path)
    state = strip_ignored(loaded.state_dict)
    params = sum(v.numel() for k, v in state.items() if k not in ("quantize.codebook_used",) and v.is_floating_point())
    info: dict = {"path": str(path), "layout": loaded.layout, "tensors": len(state), "parameters": params}
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in state.values()})
    info["dtypes"] = dtypes
    if loaded.layout in CONFIGURED:
        info["kind"], info["config"] = loaded.kind, loaded.config
    elif "tok_embeddings.weight" in state:
        fields = infer_gpt_fields(state)
        info["kind"] = "gpt"
        info["config"] = fields
        info["looks_like"] = gpt_name_for(fields)
    elif "quantize.embedding.weight" in state:
        info["kind"] = "vq"
        table = state["quantize.embedding.weight"]
        info["config"] = {"codebook_size": int(table.shape[0]), "codebook_embed_dim": int(table.shape[1])}
    else:
        info["kind"] = "unknown"
    return info
