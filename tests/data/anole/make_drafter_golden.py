"""How drafter_golden.npz and drafter_golden.json here were made: official LANTERN's own Anole EAGLE
drafter code (jadohu/LANTERN ``models/drafters/cnets_anole.py``) and its ``EaModel``
(``models/ea_model_anole.py``, as ``entrypoints/generate_images.py --model anole`` runs it), on
CPU in fp32, with a tiny random drafter in the released layout of ``jadohu/anole_drafter``
(tests/helpers/anole.py ``DRAFTER_CONFIG``, ``drafter_state``: config.json + pytorch_model.bin)
attached to the tiny Anole folder of make_golden.py. Not a test and not part of relaxspec:
LANTERN's code is read from a copy given on the command line and never enters this repository.

Two steps, two Python environments, as make_golden.py (LANTERN pins transformers 4.45.2):

    python tests/data/anole/make_drafter_golden.py build /tmp/anole-drafter-golden
    LANTERN_PYTHON tests/data/anole/make_drafter_golden.py run /tmp/anole-drafter-golden \\
        --lantern LANTERN_SRC --commit LANTERN_COMMIT --out tests/data/anole

``build`` writes what make_golden.py's does (the tiny folder and Meta's tokenizer folder at
LANTERN's relative path), the drafter folder beside it, and the neighbour table where
``EaModel.__init__`` reads it (``ckpts/anole/vq_distances/top_8191_indices.npy``).

What ``run`` changes in LANTERN, and why the computation stays the same:

1. As make_golden.py: ``TokenManager(..., device='cuda')`` gets ``device='cpu'`` (the model stays
   on the CPU in fp32).
2. The neighbour table is not the 8192 x 8191 distance ranking of Anole's VQGAN but a fixed one of
   511 neighbours per code (helpers' ``neighbour_table``: offsets +1, -1, +2, -2, ...); LANTERN
   reads only its first ``lantern_k`` columns (``nearest_latents[x - 4][:, :, :k]``), so a table
   with fewer columns is the same table to it.
3. Greedy: ``generate(..., temperature=0)`` takes LANTERN's ``logits_processor=None`` path
   (argmax roots, greedy posterior and its relaxed variant); ``max_length`` is the tiny grid's 64.
   ``EaModel.from_pretrained``'s defaults build the drafter (EAGLE-2's dynamic tree: 59 tokens,
   depth 4, top-10), ``eval()`` as generate_images.py does.
4. Observation only: ``ea_layer.topK_genrate`` is wrapped to record each run's first draft tree.
5. Issue 43 (``parity``): every prompt alone, greedy at CFG 3, exact and LANTERN on the dynamic
   tree and on the static one (``static_tree=True``: ``generate``'s default ``naive_extend_57``).

Teacher-forced (no change to the code): for each prompt alone (the official batch of one), the
target's final hidden states over ``[prompt; unconditional context] + image tokens 0..62`` (its
greedy CFG-3 tokens, golden.json) with the positions and mask ``generate`` builds (the
unconditional row shifted back by ``input_position_diff``, padding masked), through ``EaModel``'s
forward into a fresh KV cache as ``initialize_tree`` runs it; then the drafter's forward over them
with ``input_ids = (prompt + image tokens)[:, 1:]``, the same positions and mask, as
``topK_genrate``'s first call feeds it. Recorded: its output features at the image pairs (pair
``L - 1 + j`` is image token ``j``) and, for prompt 0, its logits there at every 256th image id and
the target's features.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Image ids whose logits are stored (every 256th of 4..8195).
LOGIT_IDS = list(range(4, 8196, 256))
#: The official generations recorded: (name, lantern, lantern_k, lantern_delta) at CFG 3, prompt 0.
RUNS = [("eagle", False, 1, 0.1), ("lantern_delta", True, 64, 0.3), ("lantern_lam", True, 128, 3.0)]
#: Issue 43's runs on each of the three prompts (prompts of different lengths, each alone as the
#: official code runs them): (name, lantern, lantern_k, lantern_delta, static_tree); the static
#: runs on ``generate``'s default tree, ``naive_extend_57``.
PARITY_RUNS = [("eagle", False, 1, 0.1, False), ("lantern_delta", True, 64, 0.2, False),
               ("lantern_lam", True, 128, 3.0, False), ("lantern_pp", True, 128, 3.0, True),
               ("static", False, 1, 0.1, True)]


def build(root: Path) -> None:
    import numpy as np

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parents[1]))  # tests/, for helpers
    from make_golden import build as build_folder
    from helpers import anole as af

    build_folder(root)
    af.write_drafter_folder(root / "anole-drafter")
    table = root / "ckpts/anole/vq_distances/top_8191_indices.npy"
    table.parent.mkdir(parents=True, exist_ok=True)
    np.save(table, af.neighbour_table())


def official_inputs(prompt_ids: list[int], tokens: list[int]):
    """``[cond; uncond]`` ids over prompt + image tokens, their positions and mask, as
    ``EaModel.generate`` builds them (ea_model_anole.py l.1026-1041) extended over the image."""
    import torch

    length = len(prompt_ids)
    cond = torch.tensor(prompt_ids + tokens)
    uncond = torch.tensor([1] * (length - 2) + [0, 8197] + tokens)
    ids = torch.stack([cond, uncond])
    steps = torch.arange(ids.shape[1])
    positions = torch.stack([steps, (steps - (length - 2)).clamp(min=0)])
    return ids, positions, ids != 1


def run(root: Path, lantern: Path, commit: str, out: Path) -> None:
    import numpy as np
    import torch
    import transformers

    built = json.loads((root / "built.json").read_text())
    golden = json.loads((HERE / "golden.json").read_text())
    os.chdir(root)  # TokenManager and EaModel read ckpts/anole/... relative to here
    sys.path.insert(0, str(lantern))
    import models.kv_variants.modeling_anole_kv as official
    import models.ea_model_anole as eam
    from models.drafters.kv_cache import initialize_past_key_values

    real_manager = official.TokenManager
    patched = lambda *files, device=None: real_manager(*files, device="cpu")  # noqa: E731 - change 1
    official.TokenManager = patched
    model = eam.EaModel.from_pretrained(base_model_path=built["model_path"],
                                        ea_model_path=str(root / "anole-drafter")).eval()
    assert model.base_model.dtype == torch.float32 and model.ea_layer.fc.weight.dtype == torch.float32
    head = model.base_model.lm_head
    arrays, record = {}, {"runs": {}}

    for index in range(3):  # teacher-forced, each prompt alone
        run_golden = golden["runs"][f"prompt{index}"]
        prompt_ids = run_golden["first_call"]["input_ids"][0]
        tokens = run_golden["tokens"][0]
        ids, positions, mask = official_inputs(prompt_ids, tokens)
        model.reset_tree_mode()
        past, past_data, current = initialize_past_key_values(model.base_model, 2)
        with torch.no_grad():
            _, features = model(input_ids=ids[:, :-1], past_key_values=past, attention_mask=mask[:, :-1],
                                position_ids=positions[:, :-1])
            model.ea_layer.reset()
            hidden = model.ea_layer(features, input_ids=ids[:, 1:], attention_mask=mask[:, :-1],
                                    position_ids=positions[:, :-1], use_cache=False)
            logits = head(hidden)
        image = slice(len(prompt_ids) - 1, None)  # pair L - 1 + j is image token j
        arrays[f"drafter_features_prompt{index}"] = hidden[:, image].numpy()
        if index == 0:
            arrays["drafter_logits_prompt0"] = logits[:, image][..., LOGIT_IDS].numpy()
            arrays["features_prompt0"] = features.numpy()

    trees = []
    draft = model.ea_layer.topK_genrate

    def watched(*args, **kwargs):  # change 4: observation only
        result = draft(*args, **kwargs)
        trees.append(result)
        return result

    model.ea_layer.topK_genrate = watched
    prompt = golden["runs"]["prompt0"]["prompts"]
    for name, use_lantern, k, delta in RUNS:
        trees.clear()
        with torch.no_grad():
            tokens, mean_accept, _ = model.generate(prompt=prompt, max_length=64, temperature=0.0, top_k=0,
                                                    top_p=1.0, cfg=3.0, lantern=use_lantern, lantern_k=k,
                                                    lantern_delta=delta)  # change 3
        draft_tokens, retrieve, _, _ = trees[0]
        leaves = sorted([int(t) - 4 for t in draft_tokens[0, [i for i in row if i >= 0][1:]].tolist()]
                        for row in retrieve.tolist())
        record["runs"][name] = {"lantern": use_lantern, "k": k, "delta": delta,
                                "codes": (tokens.reshape(-1) - 4).tolist(), "mean_accept": float(mean_accept),
                                "first_tree_paths": leaves}
    record["parity"] = {}
    for index in range(3):
        prompts = golden["runs"][f"prompt{index}"]["prompts"]
        for name, use_lantern, k, delta, static in PARITY_RUNS:
            with torch.no_grad():
                tokens, _, _ = model.generate(prompt=prompts, max_length=64, temperature=0.0, top_k=0, top_p=1.0,
                                              cfg=3.0, lantern=use_lantern, lantern_k=k, lantern_delta=delta,
                                              static_tree=static)
            record["parity"][f"prompt{index}_{name}"] = {"prompts": prompts, "lantern": use_lantern, "k": k,
                                                          "delta": delta, "static_tree": static,
                                                          "codes": (tokens.reshape(-1) - 4).tolist()}
    record.update(prompt=prompt, cfg=3.0, logit_ids=LOGIT_IDS, fingerprint=built["fingerprint"],
                  made_with={"lantern": f"jadohu/LANTERN {commit}", "transformers": transformers.__version__,
                             "torch": torch.__version__, "tree": "EaModel.from_pretrained defaults (59, 4, 10)"})
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafter_golden.json").write_text(json.dumps(record, separators=(",", ":")) + "\n")
    np.savez_compressed(out / "drafter_golden.npz", **arrays)
    print({key: value.shape for key, value in arrays.items()})
    print({name: (run["codes"][:8], run["mean_accept"]) for name, run in record["runs"].items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["build", "run"])
    parser.add_argument("root", type=Path)
    parser.add_argument("--lantern", type=Path, help="a copy of jadohu/LANTERN's files (run)")
    parser.add_argument("--commit", default="(commit not given)", help="the commit that copy is of (run)")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    if args.step == "build":
        build(args.root.resolve())
    else:
        run(args.root.resolve(), args.lantern.resolve(), args.commit, args.out.resolve())


if __name__ == "__main__":
    main()
