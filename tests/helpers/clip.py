"""A tiny random CLIP folder in save_pretrained's layout (tests of the CLIP score and of the
LANTERN reproduction page)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch

LETTERS = list(string.ascii_lowercase)
MERGES = [("c", "a"), ("ca", "t</w>"), ("r", "e"), ("re", "d</w>"), ("d", "o"), ("do", "g</w>")]
SPECIAL = ["<|startoftext|>", "<|endoftext|>"]


def write_clip(folder: Path) -> Path:
    """A random CLIPModel (hidden 32, 2 layers, 32 px images in 8 px patches) with a BPE
    CLIPTokenizer over letters and a CLIP image processor, as save_pretrained writes them."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor
    words = LETTERS + [c + "</w>" for c in LETTERS] + ["".join(merge) for merge in MERGES]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + SPECIAL))}  # specials last: eos is not id 2
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=77).save_pretrained(folder)
    ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    ids = dict(bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
               pad_token_id=vocab["<|endoftext|>"])
    text = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=77, **ids)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                  patch_size=8)
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    with torch.no_grad():  # random towers embed everything near one direction each: point them alike, so
        model.text_projection.weight.neg_()  # cosines are positive, as a trained CLIP's are on real captions
    model.save_pretrained(folder, safe_serialization=True)
    return folder
