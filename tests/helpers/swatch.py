"""A toy checkpoint-file family, "Swatch", written as a user would add one: this one file,
registered through a package's ``relaxspec.families`` entry point. No relaxspec file names it.

A Swatch model is two files of its own: ``--swatch-ckpt``, one ``.safetensors`` file holding a
class-conditional transformer's weights with its config in the file's metadata, and
``--swatch-colours``, a JSON list of RGB colours its image tokens decode to (one pixel each).
It draws classes (by id).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from relaxspec.conditions import Condition, class_condition
from relaxspec.errors import RelaxspecError
from relaxspec.pipelines import ImagePipeline, OpeningInput

from helpers.palette import PaletteTokenizer, make_palette, read_palette

GPT = dict(dim=32, n_layer=1, n_head=2, vocab_size=16, model_type="c2i", num_classes=5, block_size=16)
SAMPLING = {"cfg_scale": 2.0, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def make_files(root: Path, seed: int = 0) -> dict:
    """A random-weight Swatch model: its weights file and its colours file."""
    from relaxspec.models.llamagen.gpt import GPTConfig, Transformer

    torch.manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    model = Transformer(GPTConfig(**GPT)).eval()
    weights = root / "swatch.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights),
              metadata={"swatch_config": json.dumps(GPT)})
    return {"ckpt": weights, "colours": make_palette(root / "colours.json", GPT["vocab_size"], seed)}


def read_model(path, device, dtype):
    from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
    from relaxspec.models.weights import load_strict

    try:
        with safe_open(str(path), "pt") as handle:
            config = json.loads((handle.metadata() or {})["swatch_config"])
            state = {key: handle.get_tensor(key) for key in handle.keys()}
    except (OSError, KeyError, ValueError, TypeError) as err:
        raise RelaxspecError(f"--swatch-ckpt {path}: not a Swatch weights file ({type(err).__name__})") from None
    model = Transformer(GPTConfig(**config))
    load_strict(model, state, str(path))
    return model.to(device=device, dtype=dtype).eval()


class SwatchPipeline(ImagePipeline):
    family = "Swatch"
    takes = "classes"
    opened_with = "--swatch-ckpt"
    usage = "a Swatch target: relaxspec generate --swatch-ckpt FILE --swatch-colours FILE --classes IDS"
    inputs = (OpeningInput("swatch_ckpt", "a Swatch weights file (.safetensors with its config)", metavar="FILE",
                           opens=True),
              OpeningInput("swatch_colours", "the JSON list of RGB colours a Swatch model's tokens decode to",
                           metavar="FILE"))

    @classmethod
    def open(cls, opening, inputs: dict) -> "SwatchPipeline":
        from relaxspec.drafting.eagle import load_drafter
        from relaxspec.models.weights import PRECISIONS

        if opening.model_path is not None:
            raise RelaxspecError("a Swatch model is its files: give --swatch-ckpt FILE, not --model-path")
        if inputs.get("swatch_colours") is None:
            raise RelaxspecError("a Swatch model needs its colours: give --swatch-colours FILE")
        target = read_model(inputs["swatch_ckpt"], opening.device, PRECISIONS[opening.precision])
        if opening.image_size is not None and opening.image_size != target.config.grid_size:
            raise RelaxspecError(f"a Swatch image is {target.config.grid_size} pixels")
        tokenizer = PaletteTokenizer(read_palette(inputs["swatch_colours"], target.config.vocab_size))
        drafter = load_drafter(opening.drafter_ckpt, target) if opening.drafter_ckpt is not None else None
        identity = {name: str(Path(value).resolve()) for name, value in inputs.items()}
        pipeline = cls(target, tokenizer.to(opening.device), drafter, sampling=SAMPLING, default_classes="0,1",
                       identity={**identity, "swatch_config": target.config.to_dict()})
        pipeline.drafter_path = opening.drafter_ckpt
        pipeline.files = {name: str(value) for name, value in inputs.items()}
        return pipeline

    def _conditions(self, classes, prompts) -> Condition:
        return class_condition(classes if classes is not None else self.default_classes,
                               self.target.config.num_classes, None)
