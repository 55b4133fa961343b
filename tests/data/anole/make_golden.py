"""How golden.json and golden.npz here were made: the official LANTERN code's Anole base path
(``models/kv_variants/modeling_anole_kv.py``, ``ChameleonForConditionalGeneration.generate`` and
``decode_ids``, as ``entrypoints/generate_images.py --model anole --model_type base`` runs them),
greedy, on the tiny Anole folder of tests/helpers/anole.py. Not a test and not part of relaxspec:
LANTERN's code is read from a copy given on the command line and never enters this repository.

Two steps, two Python environments (the tiny folder is written with the project's transformers,
LANTERN runs with the one it pins, 4.45.2):

    python tests/data/anole/make_golden.py build /tmp/anole-golden
    LANTERN_PYTHON tests/data/anole/make_golden.py run /tmp/anole-golden --lantern LANTERN_SRC \\
        --commit LANTERN_COMMIT --out tests/data/anole

``build`` writes the tiny folder and, beside it, the same model as the official code reads it:
Meta's tokenizer folder at ``ckpts/anole/chameleon/tokenizer/`` (LANTERN's hard-coded relative
path; ``run`` works in that folder, so no path in LANTERN's code is changed).

What ``run`` changes in LANTERN, and why the computation stays the same:

1. ``TokenManager(..., device='cuda')`` in the model's constructor gets ``device='cpu'``: the VQ
   model and the vocabulary tables then live on the CPU, where the tiny model runs (the entrypoint
   moves the model to 'cuda'; here it stays on the CPU in fp32, the precision generate_images.py
   offers as ``--precision fp32``).
2. Greedy decoding is ``generate(..., temperature=1.0, top_k=1, top_p=1.0)``: ``sample`` keeps the
   largest logit alone and ``torch.multinomial`` draws it with probability 1 (no code change).
3. ``max_length`` is the tiny grid's 64 codes instead of generate_images.py's 1024.
4. Pixels: ``decode_ids`` -> ``TokenManager.pil_from_bpe_tokens`` pads to 1024 codes and
   ``ImageTokenizer.pil_from_img_toks`` reshapes to ``(1, 32, 32, emb)``: both hard-code Anole's
   32 x 32 grid. Here its three steps are called with the tiny grid's ``(1, 8, 8, emb)``:
   ``translation.convert_bpe2img``, ``quantize.get_codebook_entry`` + ``_vq_model.decode``, and
   ``_pil_from_chw_tensor``; with 1024 codes that is exactly ``pil_from_img_toks``.
5. Observation only: the model's ``forward`` is wrapped to record the ids, positions and mask of
   its first two calls (the prompt as the official code builds it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

#: (name, prompt indices, guidance scale): each prompt alone, and one at scale 1. One prompt per
#: run, as generate_images.py calls it: LANTERN's base generate builds the conditional positions as
#: one row ``[1, L]`` beside ``B`` unconditional rows, which only fits a batch of one.
RUNS = [("prompt0", [0], 3.0), ("prompt1", [1], 3.0), ("prompt2", [2], 3.0), ("prompt0_cfg1", [0], 1.0)]
PIXEL_STRIDE = 4


def build(root: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for helpers
    from helpers import anole as af

    made = af.anole_folder(root)
    af.meta_tokenizer_folder(root / "ckpts/anole/chameleon/tokenizer", made["state"])
    (root / "built.json").write_text(json.dumps({"model_path": str(made["model_path"]), "prompts": af.PROMPTS,
                                                 "grid": af.GRID, "fingerprint": af.fingerprint(made["state"])}))


def run(root: Path, lantern: Path, commit: str, out: Path) -> None:
    import numpy as np
    import torch
    import transformers

    built = json.loads((root / "built.json").read_text())
    os.chdir(root)  # LANTERN's TokenManager reads ckpts/anole/chameleon/tokenizer/ relative to here
    sys.path.insert(0, str(lantern))
    import models.kv_variants.modeling_anole_kv as official

    real_manager = official.TokenManager
    official.TokenManager = lambda *files, device=None: real_manager(*files, device="cpu")  # change 1
    model, info = official.ChameleonForConditionalGeneration.from_pretrained(built["model_path"],
                                                                             output_loading_info=True)
    model = model.to(dtype=torch.float32).eval()
    assert not info["missing_keys"], info["missing_keys"][:3]
    assert all(key.startswith("model.vqmodel.decoder.") for key in info["unexpected_keys"])

    calls = []
    forward = model.forward

    def recording(**kwargs):  # change 5: observation only
        if len(calls) < 2:
            calls.append({key: kwargs[key].tolist() for key in ("input_ids", "position_ids", "attention_mask")})
        return forward(**kwargs)

    model.forward = recording
    grid = built["grid"]
    manager = model.tokenizer
    vq = manager.image_tokenizer._vq_model
    golden, arrays = {"runs": {}}, {}
    for name, which, cfg in RUNS:
        calls.clear()
        prompts = [built["prompts"][i] for i in which]
        tokens, _, _ = model.generate(prompt=prompts, max_length=grid * grid, temperature=1.0, top_k=1, top_p=1.0,
                                      cfg=cfg)  # changes 2 and 3
        tokens = tokens.reshape(len(prompts), grid * grid)  # [B, N, 1] as generate stacks them
        golden["runs"][name] = {"prompts": prompts, "cfg": cfg, "tokens": tokens.tolist(),
                                "first_call": calls[0], "second_call_positions": calls[1]["position_ids"]}
        if cfg != 1.0:  # change 4: pil_from_img_toks's steps at the tiny grid
            codes = manager.translation.convert_bpe2img(tokens[0])
            entry = vq.quantize.get_codebook_entry(codes, (1, grid, grid, vq.quantize.embedding.weight.shape[-1]))
            image = np.asarray(manager.image_tokenizer._pil_from_chw_tensor(vq.decode(entry)[0]))
            arrays[f"pixels_{name}"] = image[::PIXEL_STRIDE, ::PIXEL_STRIDE]
            golden["runs"][name]["image_shape"] = list(image.shape)
    golden.update(fingerprint=built["fingerprint"], pixel_stride=PIXEL_STRIDE,
                  made_with={"lantern": f"jadohu/LANTERN {commit}",
                             "transformers": transformers.__version__, "torch": torch.__version__,
                             "greedy": "temperature 1.0, top_k 1, top_p 1.0"})
    out.mkdir(parents=True, exist_ok=True)
    (out / "golden.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    np.savez_compressed(out / "golden.npz", **arrays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["build", "run"])
    parser.add_argument("root", type=Path)
    parser.add_argument("--lantern", type=Path, help="a copy of jadohu/LANTERN's files (run)")
    parser.add_argument("--commit", default="(commit not given)", help="the commit that copy is of (run)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    if args.step == "build":
        build(args.root.resolve())
    else:
        run(args.root.resolve(), args.lantern.resolve(), args.commit, args.out.resolve())


if __name__ == "__main__":
    main()
