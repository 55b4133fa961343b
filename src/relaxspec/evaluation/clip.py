"""CLIP score of generated images against their own prompts, as the text-to-image papers report it.

Two definitions (:data:`DEFINITIONS`), because the papers use two:

* ``lantern`` (the default): what official LANTERN's ``eval_fid_clip`` computes for the LANTERN and
  LANTERN++ tables, with OpenAI's ViT-B/32: the mean over images of ``cos(E_image(i),
  E_text("A photo depicts " + prompt(i)))``, a raw cosine (no factor 100, no clamp), the prefix as
  Hessel et al. 2021's CLIPScore recommends;
* ``torchmetrics``: torchmetrics' ``CLIPScore``, ``100 * max(cos(E_image(i), E_text(prompt(i))), 0)``
  averaged. torchmetrics' code clamps the *mean* instead of each pair; the two agree whenever every
  cosine is positive, always the case for a trained CLIP on real captions. We clamp per pair, so
  each image has its own score and the bootstrap interval resamples images.

``E`` are the projected CLIP embeddings. Inputs, from a local CLIP folder in ``save_pretrained``'s
layout (e.g. openai/clip-vit-base-patch32, downloaded by the user):

* the image: the folder's own ``CLIPImageProcessor`` (resize, centre crop, rescale, normalise as its
  ``preprocessor_config.json`` says), on its PIL backend, the one OpenAI's CLIP preprocessing
  matches, whether or not torchvision is installed;
* the text: the folder's tokenizer, truncated to the model's length (77 tokens for every OpenAI
  CLIP) with the end-of-text token kept, as OpenAI's ``tokenize(truncate=True)`` and LANTERN's
  prefix insertion keep it. torchmetrics cuts the token ids instead, which drops the end-of-text
  token a longer caption's embedding is read at; for captions within 77 tokens (all of COCO's but a
  handful) both give the same embedding.

Weights are read from safetensors only (never a pickle); the model runs in float32 on the device
given. Needs the optional extra ``relaxspec[transformers]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from relaxspec.errors import RelaxspecError
from relaxspec.files import read_json
from relaxspec.models.hf import first_line, from_pretrained
from relaxspec.evaluation.metrics import bootstrap_ci

#: ``config.json``'s ``model_type`` of a CLIP folder (text and vision towers together).
CLIP_MODEL_TYPE = "clip"
#: Images (and prompts) per forward.
BATCH_SIZE = 64
#: Bootstrap resamplings of the images for the 95% interval.
N_BOOT = 1000


@dataclass(frozen=True)
class Definition:
    """One way to turn cosines into a CLIP score: ``prefix`` before each prompt, then ``scale *
    cos`` (clamped at 0 when ``clamp``) per image, averaged."""

    prefix: str
    scale: float
    clamp: bool
    text: str


DEFINITIONS = {
    "lantern": Definition("A photo depicts ", 1.0, False, "mean over images of cos(image, 'A photo depicts ' + prompt), "
                          "CLIP projections (official LANTERN's eval_fid_clip: the LANTERN and LANTERN++ tables, "
                          "OpenAI ViT-B/32)"),
    "torchmetrics": Definition("", 100.0, True, "mean over images of 100 * max(cos(image, prompt), 0), CLIP "
                               "projections (torchmetrics' CLIPScore)"),
}


def check_clip_folder(path, flag: str = "--clip-path") -> Path:
    """Refuse, in one line and without loading anything, a folder that is not a CLIP model in
    ``save_pretrained``'s layout: config.json with ``model_type`` clip, safetensors weights, the
    tokenizer and the image processor's config."""
    folder = Path(path)
    where = f"{flag} {path}"
    if not folder.is_dir():
        raise RelaxspecError(f"{where}: not a folder (give a local CLIP model folder, as save_pretrained writes it)")
    if not (folder / "config.json").is_file():
        raise RelaxspecError(f"{where}: no config.json: not a transformers model folder")
    config = read_json(folder / "config.json", f"{where}: config.json")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != CLIP_MODEL_TYPE:
        raise RelaxspecError(f"{where}: config.json's model_type is {model_type!r}, not {CLIP_MODEL_TYPE!r} (a CLIPModel "
                             "folder, with both text and vision towers)")
    if not any(folder.glob("*.safetensors")):
        pickled = [p.name for p in folder.glob("*.bin")]
        held = f"holds only {pickled[0]}" if pickled else "has no weights"
        raise RelaxspecError(f"{where}: {held}; relaxspec reads .safetensors only and never unpickles (convert "
                             "with save_pretrained(safe_serialization=True))")
    if not ((folder / "tokenizer.json").is_file() or
            ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file())):
        raise RelaxspecError(f"{where}: no tokenizer (tokenizer.json, or vocab.json and merges.txt): save the CLIP "
                             "processor with the model")
    if not (folder / "preprocessor_config.json").is_file():
        raise RelaxspecError(f"{where}: no preprocessor_config.json (its CLIPImageProcessor): save the CLIP processor "
                             "with the model")
    return folder


@dataclass
class Clip:
    """A loaded CLIP folder: the model (float32, eval), its tokenizer and image processor, and the
    text length prompts are truncated to."""

    model: torch.nn.Module
    tokenizer: object
    image_processor: object
    max_length: int
    folder: Path

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_clip(path, device: str | torch.device = "cpu", flag: str = "--clip-path") -> Clip:
    """The CLIP folder at ``path`` (checked by :func:`check_clip_folder`), on ``device``."""
    folder = check_clip_folder(path, flag)
    try:
        from transformers import AutoTokenizer, CLIPModel
        try:  # transformers >= 5: the PIL backend by name (the default one needs torchvision)
            from transformers import CLIPImageProcessorPil as ImageProcessor
        except ImportError:  # transformers 4: CLIPImageProcessor is the PIL / numpy one
            from transformers import CLIPImageProcessor as ImageProcessor
    except ImportError as err:
        raise RelaxspecError(f"{flag} needs transformers: pip install \"relaxspec[transformers]\" ({err})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        image_processor = ImageProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # a damaged tokenizer or processor file: say what, not how
        raise RelaxspecError(f"{flag} {path}: no usable CLIP processor ({first_line(err)})") from None
    model = from_pretrained(CLIPModel, folder, "CLIP", device=device, dtype=torch.float32)
    max_length = int(min(model.config.text_config.max_position_embeddings, tokenizer.model_max_length))
    return Clip(model, tokenizer, image_processor, max_length, folder)


def _projected(output) -> torch.Tensor:
    """``get_*_features``' result as ``[n, projection_dim]``: a tensor before transformers 5, an
    output whose ``pooler_output`` is the projection from 5 on."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _unit(features: torch.Tensor) -> torch.Tensor:
    features = features.float()
    return features / features.norm(dim=-1, keepdim=True)


@torch.no_grad()
def text_embeddings(clip: Clip, prompts: Sequence[str], batch_size: int = BATCH_SIZE) -> torch.Tensor:
    """Unit-norm text embeddings ``[n, projection_dim]`` of ``prompts`` (truncated to
    ``clip.max_length`` tokens, end-of-text kept)."""
    rows = []
    for start in range(0, len(prompts), batch_size):
        batch = clip.tokenizer(list(prompts[start:start + batch_size]), padding=True, truncation=True,
                               max_length=clip.max_length, return_tensors="pt")
        rows.append(_unit(_projected(clip.model.get_text_features(
            input_ids=batch["input_ids"].to(clip.device), attention_mask=batch["attention_mask"].to(clip.device)))))
    return torch.cat(rows).cpu()


def _rgb(image):
    """A path, a PIL image or ``[H, W, 3]`` uint8 pixels as an RGB PIL image."""
    if isinstance(image, (str, Path)):
        with Image.open(image) as opened:
            return opened.convert("RGB")
    if isinstance(image, np.ndarray):
        return Image.fromarray(image).convert("RGB")
    return image.convert("RGB")


@torch.no_grad()
def image_embeddings(clip: Clip, images: Sequence, transform=None) -> torch.Tensor:
    """Unit-norm image embeddings ``[n, projection_dim]`` of one batch of images (paths, PIL images
    or ``[H, W, 3]`` uint8 arrays), preprocessed by the folder's image processor (after
    ``transform``, ``[H, W, 3] uint8 -> [h, w, 3] uint8``, when given)."""
    pictures = [_rgb(image) for image in images]
    if transform is not None:
        pictures = [Image.fromarray(transform(np.asarray(picture))) for picture in pictures]
    pixels = clip.image_processor(images=pictures, return_tensors="pt")["pixel_values"]
    return _unit(_projected(clip.model.get_image_features(pixel_values=pixels.to(clip.device)))).cpu()


def clip_scores(clip: Clip, images: Sequence, prompts: Sequence[str], *, batch_size: int = BATCH_SIZE,
                progress: bool = False, definition: str = "lantern", transform=None) -> np.ndarray:
    """Per-image CLIP scores ``[n]`` (float64) of image ``i`` against its own prompt
    ``prompts[i]`` under ``definition`` (:data:`DEFINITIONS`). Each distinct prompt is embedded
    once."""
    if definition not in DEFINITIONS:
        raise RelaxspecError(f"CLIP score definition must be one of {', '.join(DEFINITIONS)}, got {definition!r}")
    rule = DEFINITIONS[definition]
    if len(images) != len(prompts):
        raise RelaxspecError(f"{len(images)} images but {len(prompts)} prompts: each image is scored against its own")
    if not images:
        raise RelaxspecError("no images to score")
    distinct = list(dict.fromkeys(prompts))
    texts = text_embeddings(clip, [rule.prefix + prompt for prompt in distinct], batch_size)
    row_of = {prompt: row for row, prompt in enumerate(distinct)}
    rows = torch.tensor([row_of[prompt] for prompt in prompts])
    scores = np.empty(len(images))
    bar = tqdm(total=len(images), unit="image", desc="CLIP score", disable=True if not progress else None)
    for start in range(0, len(images), batch_size):
        index = slice(start, min(start + batch_size, len(images)))
        cosine = (image_embeddings(clip, images[index], transform) * texts[rows[index]]).sum(-1)
        scores[index] = (rule.scale * (cosine.clamp(min=0) if rule.clamp else cosine)).double().numpy()
        bar.update(index.stop - index.start)
    bar.close()
    return scores


def clip_score(images: Sequence, prompts: Sequence[str], path, *, device: str | torch.device = "cpu",
               batch_size: int = BATCH_SIZE, progress: bool = False, n_boot: int = N_BOOT, seed: int = 0,
               definition: str = "lantern", transform=None) -> dict:
    """``eval.json``'s ``clip`` entry: ``value`` (the mean CLIP score), ``lo`` / ``hi`` (its
    percentile-bootstrap 95% interval over the images), ``images`` and ``model`` (the folder)."""
    clip = load_clip(path, device)
    scores = clip_scores(clip, images, prompts, batch_size=batch_size, progress=progress, definition=definition,
                         transform=transform)
    value, lo, hi = bootstrap_ci(np.mean, scores, n_boot=n_boot, seed=seed)
    return {"value": value, "lo": float(lo), "hi": float(hi), "images": len(scores),
            "model": str(clip.folder.resolve()), "text_max_tokens": clip.max_length,
            "definition": definition, "formula": DEFINITIONS[definition].text, "interval": f"95% percentile bootstrap over the images ({n_boot} resamplings)"}


__all__ = ["DEFINITIONS", "Clip", "Definition", "check_clip_folder", "clip_score", "clip_scores", "image_embeddings", "load_clip",
           "text_embeddings"]
