"""Writes tests/data/zipar/golden.json by running the official LlamaGen-ZipAR code
(github.com/ThisisBillhe/ZipAR at 2a5695c, folder LlamaGen-ZipAR) on the embedded emoji model's
weights, greedy. ZipAR's code is not part of relaxspec: give the path of a checkout of it.

    python tests/data/zipar/make_golden.py /path/to/ZipAR

The embedded model's ``gpt/model.safetensors`` loads strictly into the official ``Transformer``
(``ModelArgs`` from its ``config.json``), as float32. Generation is the official
``autoregressive.models.generate_zipar.generate`` with ``cfg_scale=4``, ``sample_logits=False``
(its argmax), ``model.zipar_window_size = W`` and ``model.reset_zipar()`` before every image. It
runs on the CPU as released (``torch.backends.cuda.sdp_kernel`` is a no-op there); nothing is patched
for the "released" tokens.

The "masked" tokens patch one thing, the bug relaxspec does not copy: the official model's mask is
``causal_mask[:, None, input_pos]``, causal by cache slot, so a lower row's query also attends the
never-written slots of the rows above it (the row above's slots past its current input): zero keys
and values that take a share of the softmax. The patch keeps, before each forward, a record of
the slots written so far (this forward's included) and ANDs it into ``causal_mask``; every other
line runs as released. relaxspec's zipar must give the masked tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
EMBEDDED = ROOT / "src" / "relaxspec" / "embedded" / "gpt"
CLASSES = (0, 5, 17, 42, 77)
WINDOWS = (2, 3, 5)
CFG = 4.0


def official(src: Path):
    sys.path.insert(0, str(src / "LlamaGen-ZipAR"))
    from autoregressive.models import generate_zipar
    from autoregressive.models.gpt import ModelArgs, Transformer

    return Transformer, ModelArgs, generate_zipar


def mask_unwritten(model) -> None:
    """The patch: ``causal_mask`` ANDed with the slots written so far, before each forward."""
    setup, forward = model.setup_caches, model.forward

    def setup_caches(max_batch_size, max_seq_length, dtype):
        setup(max_batch_size, max_seq_length, dtype)
        model.causal_by_slot = model.causal_mask.clone()
        model.written = torch.zeros(model.max_seq_length, dtype=torch.bool)

    def masked_forward(idx, cond_idx, input_pos=None, **kwargs):
        if input_pos is not None:
            model.written[input_pos] = True
            model.causal_mask = model.causal_by_slot & model.written[None, None, :]
        return forward(idx, cond_idx, input_pos, **kwargs)

    model.setup_caches, model.forward = setup_caches, masked_forward


def main(src: Path) -> None:
    from safetensors.torch import load_file

    Transformer, ModelArgs, generate_zipar = official(src)
    config = json.loads((EMBEDDED / "config.json").read_text())["config"]
    weights = {k: v.float() for k, v in load_file(EMBEDDED / "model.safetensors").items()}
    golden = {"classes": list(CLASSES), "windows": list(WINDOWS), "cfg_scale": CFG, "released": {}, "masked": {}}
    for variant in ("released", "masked"):
        model = Transformer(ModelArgs(**config)).eval()
        model.load_state_dict(weights, strict=True)
        if variant == "masked":
            mask_unwritten(model)
        for window in WINDOWS:
            rows = []
            for label in CLASSES:
                model.reset_zipar()
                model.zipar_window_size = window
                with torch.no_grad():
                    ids = generate_zipar.generate(model, torch.tensor([label]), config["block_size"], cfg_scale=CFG,
                                                  sample_logits=False, temperature=1.0, top_k=0, top_p=1.0)
                rows.append(ids[0].tolist())
            golden[variant][str(window)] = rows
    # plain AR through the official generate.py, the same weights: the reference point
    from autoregressive.models import generate as plain

    model = Transformer(ModelArgs(**config)).eval()
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        golden["ar"] = [plain.generate(model, torch.tensor([label]), config["block_size"], cfg_scale=CFG,
                                       sample_logits=False, temperature=1.0, top_k=0, top_p=1.0)[0].tolist()
                        for label in CLASSES]
    (Path(__file__).parent / "golden.json").write_text(json.dumps(golden) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
