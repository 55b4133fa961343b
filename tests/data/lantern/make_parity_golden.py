"""Writes tests/data/lantern/parity_golden.npz (issue 43): official LANTERN's own greedy outputs on
captions of different padded lengths, with the tiny released-layout target and drafter of
make_llamagen_golden.py and make_drafter_golden.py. LANTERN's code is not part of relaxspec: give
the path of a checkout of it.

    python tests/data/lantern/make_parity_golden.py /path/to/LANTERN

What is patched is what make_drafter_golden.py patches (the T5 stub, the drafter's config and RoPE
table for the tiny 4x4 grid), nothing in the computation. The T5 stub returns each caption as T5
does, right-padded with its mask; official ``EaModel.generate`` left-pads it, zeroes the padded
features and masks them in both CFG streams.

Recorded, for each of three captions (120, 37 and 7 valid tokens of 120), greedy at CFG 4, with
official ``EaModel.generate`` on its defaults (EAGLE-2's tree: 59 nodes, depth 4 -- five draft
levels in relaxspec's count -- top-10):
- ``ar``: official greedy EAGLE (= greedy AR);
- ``add``: LANTERN additive, k 10, delta 0.2; ``mul``: LANTERN multiplicative, k 5, lambda 5;
- ``pp``: LANTERN++ on the static tree ``naive_extend_57`` (``static_tree=True``, its default
  tree), k 10, lambda 5; ``static``: the same tree, exact (lantern off);
and the target's final hidden states at the 120 caption positions of both streams ``[2, 120, 32]``
as LANTERN's converted target computes them (its HF mask) with the weights in fp32
(``condition_fp32``), bf16 (``condition_bf16``) and fp16 (``condition_fp16``).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_drafter_golden import CONFIG, GRID, official_ea_model, official_modules, official_target  # noqa: E402

VALID = (120, 37, 7)
RUNS = {"ar": dict(lantern=False, lantern_k=1, lantern_delta=0.1),
        "add": dict(lantern=True, lantern_k=10, lantern_delta=0.2),
        "mul": dict(lantern=True, lantern_k=5, lantern_delta=5.0),
        "pp": dict(lantern=True, lantern_k=10, lantern_delta=5.0, static_tree=True),
        "static": dict(lantern=False, lantern_k=1, lantern_delta=0.1, static_tree=True)}


def condition_states(target, right_padded: torch.Tensor, valid: int, dtype: torch.dtype) -> np.ndarray:
    """The target's final hidden states at the caption positions, [cond; uncond], as
    ``initialize_tree`` computes them (LANTERN's layout of the caption, its mask)."""
    mask = torch.zeros(1, 120, dtype=torch.long)
    mask[0, -valid:] = 1
    caption = torch.cat([right_padded[0, valid:], right_padded[0, :valid]])[None] * mask[:, :, None]
    null = torch.zeros_like(caption) + target.model.cls_embedding.uncond_embedding
    model = copy.deepcopy(target).to(dtype)  # (a copy: casting in place would round the fp32 weights)
    with torch.no_grad():
        hidden = model.model(cond_idx=torch.cat([caption, null]).to(dtype), attention_mask=torch.cat([mask, mask]),
                             use_cache=False, return_dict=True).last_hidden_state
    return hidden.float().numpy()


def main(src: Path) -> None:
    kv, cnets, EConfig = official_modules(src)
    import models.ea_model_llamagen as eam

    target = official_target(kv)
    drafter_golden = dict(np.load(HERE / "drafter_golden.npz"))
    neighbours = drafter_golden["neighbours"].astype(np.int64)
    generator = torch.Generator().manual_seed(4343)
    golden = {"valid": np.array(VALID)}
    captions = []
    for valid in VALID:  # as T5 returns them: the valid tokens first, zeros after
        caption = torch.zeros(1, 120, CONFIG["caption_dim"])
        caption[0, :valid] = torch.randn(valid, CONFIG["caption_dim"], generator=generator).half().float()
        captions.append(caption)
    # relaxspec's layout: left-padded features and mask, as --caption-features takes them
    golden["features"] = np.stack([torch.cat([c[0, v:], c[0, :v]]).half().numpy() for c, v in zip(captions, VALID)])
    golden["mask"] = np.stack([np.r_[np.zeros(120 - v, np.int64), np.ones(v, np.int64)] for v in VALID])
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        golden[f"condition_{name}"] = np.stack([condition_states(target, c, v, dtype)
                                                for c, v in zip(captions, VALID)]).astype(np.float32)
    model = official_ea_model(eam, cnets, target, neighbours)
    current = {}

    class T5:
        def get_text_embeddings(self, prompts):
            caption, valid = current["caption"], current["valid"]
            mask = torch.zeros(1, 120, dtype=torch.long)
            mask[0, :valid] = 1
            return caption.clone(), mask

    target.t5_model = T5()
    for run, options in RUNS.items():
        rows = []
        for caption, valid in zip(captions, VALID):
            current.update(caption=caption, valid=valid)
            model.base_model.model.tree_mask = None
            with torch.no_grad():
                ids, _, _ = model.generate(prompt=["caption"], max_length=GRID * GRID, temperature=0.0, top_k=0,
                                           top_p=1.0, cfg=4.0, **options)
            rows.append(ids[0].numpy())
        golden[f"tokens_{run}"] = np.stack(rows)
        print(run, golden[f"tokens_{run}"])
    np.savez_compressed(HERE / "parity_golden.npz", **golden)
    print({k: v.shape for k, v in golden.items()}, "->", HERE)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
