"""Writes the golden data of tests/test_lantern_drafter.py by running official LANTERN's own
EAGLE drafter code (jadohu/LANTERN, models/drafters/cnets_llamagen.py) on a tiny random drafter in
its released folder layout, attached to the tiny LANTERN-layout target of make_llamagen_golden.py
(llamagen-t2i/). LANTERN's code is not part of relaxspec: give the path of a checkout of it.

    python tests/data/lantern/make_drafter_golden.py /path/to/LANTERN

What is patched to run it here:
- as in make_llamagen_golden.py, ``models/__init__.py`` is not run and ``T5Embedder`` is a stub
  (the captions are given as T5 features);
- transformers 5 turns a config's ``rope_scaling: null`` into a ``rope_parameters`` dict, which
  sends ``LlamaAttention._init_rope`` down its scaling branch (KeyError 'type'); 4.32, which the
  release used, keeps None, so the drafter's config gets ``rope_scaling = None`` back. The module it
  builds (a 1D ``LlamaRotaryEmbedding``, non-persistent buffers) is never called: the forward
  applies the 2D ``freqs_cis`` (cnets_llamagen.py:347-350);
- ``Model.__init__`` hard-codes ``block_size = 256`` for ``input_type`` "t2i" (l.566-569) and
  builds ``self.freqs_cis`` from it (l.575-580): for the tiny 4x4 grid that table is rebuilt with
  the same official function and the same padding, grid 4 (``cls_token_num`` stays the official
  119: the tiny target has LANTERN's 120 caption tokens). Nothing else reads ``block_size``.

The drafter runs teacher-forced as ``topK_genrate`` feeds it (cnets_llamagen.py:744-756):
``input_ids = ([0] * 120 + image tokens)[:, 1:]`` with the target's final hidden states over the
caption prefill and the image tokens, batch ``[cond; uncond]``; its logits are ``lm_head`` of its
output. Then official ``EaModel.generate`` (ea_model_llamagen.py) decodes greedily at CFG 4 with
the drafter (EAGLE-2's tree: total 59, depth 4, top-k 10) on a full (unpadded) caption, run from a
scratch folder that holds the neighbour table where ``EaModel.__init__`` reads it
(``ckpts/llamagen/vq_distances/top_16383_indices.npy``, here a random table of the 64 codes), and
built as ``from_pretrained`` builds it (the config's path, the state dict, ``eval()`` as
``generate_images`` does), with the two patches above; the T5 stub returns that caption.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
TARGET = HERE / "llamagen-t2i"
DRAFTER = HERE / "llamagen-t2i-drafter"
#: The tiny drafter: the released config's keys at the tiny target's width (32, 2 heads), 64 codes;
#: block_size (not in the released configs, where input_type fixes it) names the 4x4 grid.
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 32, "caption_dim": 16, "class_dropout_p": 0.0, "initializer_range": 0.02,
    "intermediate_size": 96, "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 2,
    "num_hidden_layers": 1, "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.32.0.dev0", "use_cache": True, "vocab_size": 64, "input_type": "t2i",
    "block_size": 16,
}
GRID = 4


def official_modules(src: Path):
    sys.path.insert(0, str(HERE))
    from make_llamagen_golden import official_module

    kv = official_module(src)  # registers the packages, stubs T5
    import models.drafters.cnets_llamagen as cnets
    from models.configs.configs import EConfig

    return kv, cnets, EConfig


def official_target(kv):
    from safetensors.torch import load_file
    from transformers.models.llama import LlamaConfig

    saved = json.loads((TARGET / "config.json").read_text())
    config = LlamaConfig(**{k: saved[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads", "intermediate_size", "vocab_size")},
                         rms_norm_eps=saved["rms_norm_eps"], max_position_embeddings=2048, attention_bias=False,
                         pretraining_tp=1, architectures=["LlamaForCausalLM"])
    for key in ("block_size", "num_classes", "input_type", "cls_token_num", "caption_dim", "rope_base",
                "token_dropout_p", "resid_dropout_p", "ffn_dropout_p", "class_dropout_p", "rope_theta"):
        setattr(config, key, saved[key])
    model = kv.LlamaForCausalLM(config).eval()
    state = {k: v.float() for k, v in load_file(str(TARGET / "model.safetensors")).items()}
    model.load_state_dict(state, strict=True)
    return model


def official_drafter(cnets, EConfig):
    from safetensors.torch import save_file

    DRAFTER.mkdir(parents=True, exist_ok=True)
    (DRAFTER / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    config = EConfig.from_pretrained(str(DRAFTER))
    object.__setattr__(config, "rope_scaling", None)  # patch: what transformers 4.32 keeps (see above)
    model = cnets.Model(config, bias=True)
    freqs = cnets.precompute_freqs_cis_2d(GRID, CONFIG["hidden_size"] // CONFIG["num_attention_heads"], 10000,
                                          config.cls_token_num)  # patch: the 4x4 grid's table, as l.577-580
    model.freqs_cis = torch.cat([freqs, torch.zeros_like(freqs[:10])], dim=0)
    # Weights with O(1) activations (fan-in scaled), rounded to fp16 like the released files.
    generator = torch.Generator().manual_seed(292)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            noise = torch.randn(tensor.shape, generator=generator)
            if name == "fc.bias":
                value = 0.1 * noise
            elif tensor.dim() == 1:
                value = 1 + 0.1 * noise
            elif name == "embed_tokens.weight":
                value = noise
            else:
                value = noise / tensor.shape[1] ** 0.5
            tensor.copy_(value.half().float())
    save_file({k: v.half().contiguous() for k, v in model.state_dict().items()}, str(DRAFTER / "model.safetensors"))
    return model.eval(), generator


def teacher_forced(target, drafter, caption, mask, tokens, rounded: bool):
    """Features of [caption; null caption] + tokens 0..n-2 and the drafter's logits over them."""
    null = torch.zeros_like(caption) + target.model.cls_embedding.uncond_embedding
    n = tokens.shape[0]
    with torch.no_grad():
        attention = torch.cat([torch.cat([mask, mask]), torch.ones(2, n - 1, dtype=torch.long)], 1).bool()
        features = target.model(input_ids=tokens[None, :-1].repeat(2, 1), cond_idx=torch.cat([caption, null]),
                                attention_mask=attention, use_cache=False, return_dict=True).last_hidden_state
        if rounded:
            features = features.half().float()  # stored in fp16: the drafter reads the stored values
        input_ids = torch.cat([torch.zeros(120, dtype=torch.long), tokens])[None].repeat(2, 1)[:, 1:]
        hidden = drafter(features, input_ids=input_ids)  # teacher-forced, causal, positions 0..
        return features, target.lm_head(hidden).float()[:, 119:]


def official_ea_model(eam, cnets, target, neighbours: np.ndarray):
    """Official ``EaModel`` over ``target`` with the tiny drafter, built as ``from_pretrained``
    builds it (the config's path, the state dict, ``eval()``; EAGLE-2's defaults: 59 nodes, depth 4,
    top-10), from a scratch folder holding ``neighbours`` where ``EaModel.__init__`` reads it, with
    the two patches of the module docstring."""
    import os
    import tempfile

    from safetensors.torch import load_file

    original = eam.EConfig.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        config = original(cls, *args, **kwargs)
        object.__setattr__(config, "rope_scaling", None)  # patch: what transformers 4.32 keeps
        return config

    eam.EConfig.from_pretrained = classmethod(from_pretrained)
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as scratch:
        table = Path(scratch) / "ckpts" / "llamagen" / "vq_distances" / "top_16383_indices.npy"
        table.parent.mkdir(parents=True)
        np.save(table, neighbours)
        os.chdir(scratch)
        try:
            state = load_file(str(DRAFTER / "model.safetensors"))
            model = eam.EaModel(target, None, str(DRAFTER / "config.json"), 59, 4, 10, 1.0, state).eval()
        finally:
            os.chdir(here)
    freqs = cnets.precompute_freqs_cis_2d(GRID, CONFIG["hidden_size"] // CONFIG["num_attention_heads"], 10000, 119)
    model.ea_layer.freqs_cis = torch.cat([freqs, torch.zeros_like(freqs[:10])], dim=0)  # patch: the 4x4 grid
    return model


def official_generation(eam, cnets, target, caption, neighbours, runs):
    """Greedy tokens of official EaModel.generate per (lantern, k, delta) in ``runs``, and the
    first dynamic tree of each run (its root-to-leaf token paths)."""

    class T5:
        def get_text_embeddings(self, prompts):
            return caption.clone(), torch.ones(caption.shape[:2], dtype=torch.long)

    target.t5_model = T5()
    model = official_ea_model(eam, cnets, target, neighbours)
    trees = []
    draft = model.ea_layer.topK_genrate

    def watched(*args, **kwargs):  # records the trees, changes nothing
        out = draft(*args, **kwargs)
        trees.append(out)
        return out

    model.ea_layer.topK_genrate = watched
    results = []
    for lantern, k, delta in runs:
        trees.clear()
        with torch.no_grad():
            ids, _, _ = model.generate(prompt=["caption"], max_length=GRID * GRID, temperature=0.0, top_k=0,
                                       top_p=1.0, cfg=4.0, lantern=lantern, lantern_k=k, lantern_delta=delta)
        draft_tokens, retrieve, _, _ = trees[0]
        paths = sorted(tuple(draft_tokens[0, [i for i in row if i >= 0][1:]].tolist()) for row in retrieve.tolist())
        leaves = np.full((len(paths), max(map(len, paths))), -1, dtype=np.int64)
        for row, path in enumerate(paths):
            leaves[row, : len(path)] = path
        results.append((ids[0].numpy(), leaves))
    target.model.tree_mask = None  # generate leaves its last tree mask on the target's model
    return results


def main(src: Path) -> None:
    kv, cnets, EConfig = official_modules(src)
    import models.ea_model_llamagen as eam

    target = official_target(kv)
    drafter, generator = official_drafter(cnets, EConfig)
    llamagen = dict(np.load(HERE / "llamagen_golden.npz"))
    # (a) Caption 0 of make_llamagen_golden.py (100 of 120 tokens valid, left-padded) and its greedy
    # CFG-4 image; [cond; uncond] as LANTERN's generate builds them (the uncond row keeps the mask).
    caption = torch.from_numpy(llamagen["features"][:1].astype(np.float32))
    mask = torch.from_numpy(llamagen["mask"][:1])
    tokens = torch.from_numpy(llamagen["tokens_cfg4"][0])
    features, logits = teacher_forced(target, drafter, caption, mask, tokens, rounded=True)
    golden = {"tokens": tokens.numpy(), "mask": mask[0].numpy(), "features": features.half().numpy(),
              "logits": logits.numpy()}
    # (b) A full caption (no padding: the two targets' features agree at every position), decoded
    # by official EaModel: EAGLE-2 greedy (= AR), LANTERN k=10 delta=0.3, LANTERN k=5 lambda=3.
    full = torch.randn(1, 120, CONFIG["caption_dim"], generator=generator).half().float()
    codes = CONFIG["vocab_size"]
    neighbours = np.stack([[j for j in torch.randperm(codes, generator=generator).tolist() if j != i]
                           for i in range(codes)]).astype(np.int64)
    runs = official_generation(eam, cnets, target, full, neighbours,
                               [(False, 1, 0.1), (True, 10, 0.3), (True, 5, 3.0)])
    (eagle, _), (delta, delta_tree), (lam, _) = runs
    _, full_logits = teacher_forced(target, drafter, full, torch.ones(1, 120, dtype=torch.long),
                                    torch.from_numpy(eagle), rounded=False)
    golden.update(full_caption=full[0].half().numpy(), full_tokens=eagle, full_logits=full_logits.numpy(),
                  neighbours=neighbours.astype(np.uint8), lantern_delta_tokens=delta, lantern_delta_tree=delta_tree,
                  lantern_lam_tokens=lam)
    np.savez_compressed(HERE / "drafter_golden.npz", **golden)
    print({k: v.shape for k, v in golden.items()}, "->", HERE)
    print("EAGLE-2", eagle, "LANTERN delta", delta, "LANTERN lambda", lam)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
