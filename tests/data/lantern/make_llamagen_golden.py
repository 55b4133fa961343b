"""Writes the golden data of tests/test_lantern_llamagen.py by running official LANTERN's own
LlamaGen model code (jadohu/LANTERN, models/kv_variants/modeling_llamagen_kv.py) on a tiny random
model in its released folder layout. LANTERN's code is not part of relaxspec: give the path of a
checkout of it.

    python tests/data/lantern/make_llamagen_golden.py /path/to/LANTERN

What is patched to run it here, none of which touches the computation:
- ``models/__init__.py`` is not run (it imports the Lumina-mGPT path, which needs transformers'
  removed ``LogitsWarper``): the ``models`` packages are registered empty and the model file is
  imported from its own path;
- ``T5Embedder`` (built in ``LlamaForCausalLM.__init__`` on CUDA from a hard-coded folder) is a
  stub: the captions here are given as T5 features, as upstream's ``--caption-features`` are.

Greedy decoding is read from the official code's own parts: each step runs
``LlamaModel.forward`` on the whole sequence (``cond_idx`` = [caption; null caption], the caption
mask for both rows, as its ``generate`` builds them), ``lm_head``, then CFG ``uncond + (cond -
uncond) * scale`` and the argmax.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "llamagen-t2i"
#: The tiny model: LlamaGen's t2i network at 2 layers of width 32 (head dim 16), 64 codes, a 4x4
#: grid, 120 caption tokens of 16 features (LANTERN's caption embedder always holds 120 null tokens).
SIZE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=256,
            vocab_size=64, block_size=16, caption_dim=16, cls_token_num=120)
SCALES = (4.0, 1.5)


def official_module(src: Path):
    def package(name: str, path: Path):
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module

    package("models", src / "models")
    package("models.base_models", src / "models" / "base_models")
    package("models.base_models.llamagen", src / "models" / "base_models" / "llamagen")
    t5 = types.ModuleType("models.base_models.llamagen.t5")
    t5.T5Embedder = lambda **kwargs: None
    sys.modules["models.base_models.llamagen.t5"] = t5
    sys.path.insert(0, str(src))
    import models.kv_variants.modeling_llamagen_kv as official

    return official


def main(src: Path) -> None:
    from safetensors.torch import save_file
    from transformers.models.llama import LlamaConfig

    official = official_module(src)
    config = LlamaConfig(**{k: v for k, v in SIZE.items() if k in ("hidden_size", "num_hidden_layers",
                                                                    "num_attention_heads", "num_key_value_heads",
                                                                    "intermediate_size", "vocab_size")},
                         rms_norm_eps=1e-5, max_position_embeddings=2048, attention_bias=False, pretraining_tp=1,
                         architectures=["LlamaForCausalLM"])
    for key, value in dict(block_size=SIZE["block_size"], num_classes=1000, input_type="t2i",
                           cls_token_num=SIZE["cls_token_num"], caption_dim=SIZE["caption_dim"], rope_base=10000.0,
                           token_dropout_p=0.1, resid_dropout_p=0.1, ffn_dropout_p=0.1, class_dropout_p=0.1,
                           rope_theta=10000.0).items():
        setattr(config, key, value)
    model = official.LlamaForCausalLM(config).eval()
    # Weights with O(1) activations and well-separated logits (std-0.02 weights give near-uniform
    # laws, where an argmax can hinge on rounding), rounded to fp16 so the file is small.
    generator = torch.Generator().manual_seed(29)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not tensor.is_floating_point():
                continue
            noise = torch.randn(tensor.shape, generator=generator)
            if tensor.dim() == 1:
                value = 1 + 0.1 * noise
            elif "embed_tokens" in name or "uncond_embedding" in name:
                value = noise
            else:
                value = noise / tensor.shape[1] ** 0.5
            tensor.copy_(value.half().float())
    state = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    FOLDER.mkdir(parents=True, exist_ok=True)
    save_file(state, str(FOLDER / "model.safetensors"))
    (FOLDER / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["LlamaForCausalLM"]},
                                                   indent=2, sort_keys=True, default=str) + "\n")

    # Two captions, left-padded as upstream and LANTERN lay them out: 100 and 7 valid T5 tokens.
    features = torch.randn(2, SIZE["cls_token_num"], SIZE["caption_dim"], generator=generator).half().float()
    mask = torch.zeros(2, SIZE["cls_token_num"], dtype=torch.long)
    mask[0, -100:] = 1
    mask[1, -7:] = 1
    features = features * mask[:, :, None]
    golden = {"features": features.half().numpy(), "mask": mask.numpy().astype(np.int64)}
    null = torch.zeros_like(features) + model.model.cls_embedding.uncond_embedding
    cond = torch.cat([features, null])
    with torch.no_grad():
        for scale in SCALES:
            tokens = torch.zeros(2, 0, dtype=torch.long)
            first = None
            for step in range(SIZE["block_size"]):
                attention = torch.cat([torch.cat([mask, mask]), torch.ones(4, step, dtype=torch.long)], 1).bool()
                hidden = model.model(input_ids=tokens.repeat(2, 1) if step else None, cond_idx=cond,
                                     attention_mask=attention, use_cache=False, return_dict=True).last_hidden_state
                logits = model.lm_head(hidden[:, -1]).float()
                conditional, unconditional = logits.chunk(2)
                guided = unconditional + (conditional - unconditional) * scale
                if first is None:
                    first = guided
                tokens = torch.cat([tokens, guided.argmax(-1, keepdim=True)], 1)
            golden[f"tokens_cfg{scale:g}"] = tokens.numpy()
            golden[f"first_logits_cfg{scale:g}"] = first.numpy()
    np.savez(HERE / "llamagen_golden.npz", **golden)
    print({k: v.shape for k, v in golden.items()}, "->", HERE)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
