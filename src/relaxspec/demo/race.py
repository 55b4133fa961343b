"""The demo's work, without the web page: decode one image plainly and with a method, streaming
partial images as tokens are committed, and the numbers and heat map that explain the speed-up.

Nothing here imports gradio (:mod:`relaxspec.demo.app` does); every function is tested directly.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from relaxspec import methods
from relaxspec.conditions import Condition, check_prompts
from relaxspec.decoding import DecodeResult
from relaxspec.errors import RelaxspecError
from relaxspec.files import write_png
from relaxspec.inputs import check_seed, check_upscale
from relaxspec.pipelines import ImagePipeline
from relaxspec.sampling import SamplingConfig, batch_seed

#: The setting the page's one knob sets, per method (other methods have no knob).
KNOBS = {"lantern": "delta", "lantern++": "lam", "cool": "cool_delta", "gsd": "group_p_gap"}
#: Pending (not yet committed) token cells are painted this grey.
PENDING = np.array([40, 40, 46], dtype=np.uint8)
#: Stream a partial image at most this often (seconds), so drawing stays a small share of the time.
FRAME_SECONDS = 0.1


@dataclass
class DemoModel:
    """What the demo decodes with: a pipeline (:func:`relaxspec.pipelines.open_pipeline`: the
    target, its tokenizer, its drafter or ``None``, its presets and sampling defaults), and the
    method and class (or prompt) the page starts with."""

    pipeline: ImagePipeline
    default_method: str = "lantern"
    default_class: str | None = None

    @property
    def target(self):
        return self.pipeline.target

    @property
    def vq(self):
        return self.pipeline.tokenizer

    @property
    def drafter(self):
        return self.pipeline.drafter

    @property
    def presets(self) -> dict:
        return self.pipeline.presets

    @property
    def sampling(self) -> dict:
        return self.pipeline.sampling_defaults

    @property
    def prompts(self) -> bool:
        """True when the page takes a prompt instead of a class."""
        return self.pipeline.takes == "prompts"

    @property
    def class_names(self) -> list[str] | None:
        return self.pipeline.class_names

    @property
    def grid(self) -> int:
        return self.pipeline.grid


@dataclass
class RaceRequest:
    """One press of the button, as typed: validated by :func:`check_request`."""

    condition: str
    method: str
    knob: float | None = None
    seed: int = 0
    cfg_scale: float | None = None
    upscale: int | None = None  # None: enough to show the image at about 256 px


@dataclass
class Lane:
    """One side of the race as it stands: the image so far, committed tokens, and when done the
    decode's result and its drawing-free seconds."""

    label: str
    image: np.ndarray
    done: int = 0
    result: DecodeResult | None = None
    seconds: float | None = None


def condition_of(model: DemoModel, text: str, encode: bool = True) -> Condition | None:
    """The page's condition box -> the condition: one class (name or id), or a prompt, checked by
    the pipeline as every command checks it. ``encode=False``: a prompt is only checked as text
    (encoding it, a text encoder's forward, is the race's work), and ``None`` is returned."""
    text = str(text).strip()
    if not model.prompts:
        if not text:
            raise RelaxspecError("choose a class")
        if len([part for part in text.split(",") if part.strip()]) != 1:
            raise RelaxspecError(f"choose one class, got {len(text.split(','))}")
        return model.pipeline.conditions(classes=text)
    if not text:
        raise RelaxspecError("write a prompt")
    if not encode:
        check_prompts([text])
        return None
    return model.pipeline.conditions(prompts=[text])


def resolve_request(model: DemoModel, request: RaceRequest,
                    encode: bool = True) -> tuple[Condition | None, methods.MethodOptions, SamplingConfig]:
    """The condition, the method's options and the sampling a request means, validated as
    ``relaxspec generate`` validates them: a :class:`RelaxspecError` says what is wrong.
    ``encode=False``: the cheap check before a race is queued (a prompt is not encoded)."""
    condition = condition_of(model, request.condition, encode)
    name = methods.canonical(request.method or "")
    if name in ("ar", "ar-compiled"):
        raise RelaxspecError("choose a speculative method: AR is the other side of the race")
    given = {}
    if request.knob is not None:
        knob = KNOBS.get(name)
        if knob is None:
            raise RelaxspecError(f"--method {name} has no knob on this page: leave it empty")
        given[knob] = float(request.knob)
    options = methods.resolve(name, given, model.presets)
    if options.needs_drafter and model.drafter is None:
        raise RelaxspecError(f"--method {name} drafts with an EAGLE drafter and this model has none: "
                             "choose sjd, scd, sjd-pac or gsd")
    seed = request.seed
    if isinstance(seed, float) and seed.is_integer():  # the page's number box sends floats
        seed = int(seed)
    request.seed = check_seed(seed)
    side = model.grid * model.vq.config.downsample_factor
    if request.upscale is None:
        request.upscale = max(1, 256 // side)
    check_upscale(request.upscale, side)
    sampling = dict(model.sampling)
    if request.cfg_scale is not None:
        sampling["cfg_scale"] = float(request.cfg_scale)
    return condition, options, SamplingConfig(**sampling)


def partial_image(model: DemoModel, tokens: torch.Tensor, done, upscale: int = 1) -> np.ndarray:
    """The image of ``tokens [N]`` with only some committed: the first ``done`` (an int), or those
    a mask ``done [N]`` marks (rows in parallel commit out of raster order). The VQ decode of the
    committed tokens (pending ones read as token 0) with every pending token's cell painted
    grey, enlarged ``upscale`` times (nearest neighbour). uint8 ``[H, W, 3]``."""
    n = tokens.shape[0]
    committed = done.cpu().bool() if isinstance(done, torch.Tensor) else torch.arange(n) < done
    filled = torch.where(committed, tokens.cpu(), torch.zeros_like(tokens.cpu()))
    pixels = model.pipeline.pixels(filled[None]).copy()[0]
    grid = model.grid
    cell = pixels.shape[0] // grid
    pending = np.repeat(np.repeat((~committed).numpy().reshape(grid, grid), cell, 0), cell, 1)
    pixels[pending] = PENDING
    return enlarge(pixels, upscale)


def enlarge(image: np.ndarray, factor: int) -> np.ndarray:
    return np.repeat(np.repeat(image, factor, 0), factor, 1) if factor > 1 else image


def heat_map(accept_lengths: list[int], grid: int, cell: int = 8, per_token=None) -> np.ndarray:
    """Each token's cell coloured by how many tokens the step that committed it committed
    (1: dark blue ... longest: yellow): where the method ran fast. ``per_token [N]``: those counts
    given per token (rows in parallel, whose steps do not commit in raster order); else they
    follow from ``accept_lengths``. uint8 ``[grid*cell, grid*cell, 3]``."""
    if per_token is not None:
        per_token = np.asarray(per_token)[: grid * grid]
    else:
        per_token = np.concatenate([np.full(k, k) for k in accept_lengths])[: grid * grid]
    top = max(int(per_token.max()), 2)
    t = (per_token - 1) / (top - 1)
    stops = np.array([[38, 30, 120], [33, 145, 140], [253, 231, 37]], dtype=np.float64)  # viridis-like
    lo = np.clip((t * 2).astype(int), 0, 1)
    frac = (t * 2 - lo)[:, None]
    colours = (stops[lo] * (1 - frac) + stops[lo + 1] * frac).astype(np.uint8)
    return enlarge(colours.reshape(grid, grid, 3), cell)


class Stopped(Exception):
    """Raised inside a decode whose lane was abandoned (the page's request was cancelled)."""


#: One decode at a time per model: the KV cache lives on the model.
_MODEL_LOCKS: dict[int, threading.Lock] = {}


def model_lock(model: DemoModel) -> threading.Lock:
    return _MODEL_LOCKS.setdefault(id(model.target), threading.Lock())


def run_lane(model: DemoModel, condition: Condition, options, sampling: SamplingConfig, seed: int, upscale: int,
             label: str) -> Iterator[Lane]:
    """Decode one image with ``options`` and yield the lane after each drawn frame (at most every
    :data:`FRAME_SECONDS`) and once finished. Decoding runs in a worker thread, one at a time per
    model; drawing happens here. If the caller stops iterating (a cancelled request), the decode
    is stopped at its next step and the thread joined before this generator closes."""
    frames: queue.Queue = queue.Queue()
    last = [0.0]
    stop = threading.Event()
    n_tok = model.target.config.block_size

    def on_step(tokens, done):
        if stop.is_set():
            raise Stopped()
        now = time.perf_counter()
        if now - last[0] >= FRAME_SECONDS:
            last[0] = now
            mask = done[0].cpu().clone() if done.dim() == 2 else None  # rows in parallel: which are committed
            frames.put(("frame", tokens[0].cpu().clone(), mask if mask is not None else int(done[0])))

    def work():
        try:
            with model_lock(model):
                generator = torch.Generator(device=model.target.device).manual_seed(batch_seed(seed, 0))
                result = model.pipeline.generate(condition, options, sampling, generator=generator, on_step=on_step)
            frames.put(("done", result, None))
        except Stopped:
            frames.put(("stopped", None, None))
        except Exception as err:  # re-raised in the caller's thread
            frames.put(("error", err, None))

    blank = enlarge(np.broadcast_to(PENDING, (model.grid * model.vq.config.downsample_factor,) * 2 + (3,)).copy(),
                    upscale)
    lane = Lane(label, blank)
    yield lane
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        while True:
            kind, payload, done = frames.get()
            if kind == "error":
                raise payload
            if kind == "done":
                lane.result, lane.done = payload, n_tok
                lane.seconds = payload.seconds
                lane.image = partial_image(model, payload.tokens[0], n_tok, upscale)
                yield lane
                return
            lane.done = int(done.sum()) if isinstance(done, torch.Tensor) else done
            lane.image = partial_image(model, payload, done, upscale)
            yield lane
    finally:
        stop.set()
        thread.join()


def describe_lane(lane: Lane, baseline: Lane | None = None) -> str:
    """The lane's numbers as one Markdown block."""
    if lane.result is None:
        return f"**{lane.label}** — {lane.done} tokens committed …"
    result = lane.result
    n_tok = result.tokens.shape[1]
    lines = [f"**{lane.label}** — {n_tok} tokens in **{lane.seconds * 1000:.0f} ms**",
             f"target forwards: {int(result.target_forwards[0])} · MAL {float(result.mean_accepted_length[0]):.2f}"]
    if baseline is not None and baseline.seconds:
        lines.append(f"speed-up vs AR: **{baseline.seconds / lane.seconds:.2f}x**")
    if result.tv_recorded and float(result.tv_sum[0]) > 0:
        lines.append(tv_line(float(result.tv_sum[0])))
    elif result.tv_recorded:
        lines.append("sum of one-step TVs: 0 (exact: the model's own law)")
    return "  \n".join(lines)


def tv_line(tv_sum: float) -> str:
    """One image's TV record named for what it is: the sum of its tokens' one-step TVs, which
    bounds the TV distance of that image's law from the model's only while it is below 1."""
    if tv_sum < 1:
        return f"sum of one-step TVs: {tv_sum:.3f} (below 1: it bounds this image's TV from the model's law)"
    return f"sum of one-step TVs: {tv_sum:.2f} (1 or more: no bound on this image's TV; docs/METHODS.md)"


def save_run(out: Path, ar: Lane, mine: Lane) -> Path:
    """Both final images side by side as ``out/NNNN.png``, numbered after the runs already there
    (a restarted demo keeps them)."""
    gap = np.full((ar.image.shape[0], max(4, ar.image.shape[1] // 32), 3), 255, dtype=np.uint8)
    taken = [int(p.stem) for p in Path(out).glob("[0-9][0-9][0-9][0-9].png")]
    path = Path(out) / f"{max(taken, default=-1) + 1:04d}.png"
    write_png(path, np.concatenate([ar.image, gap, mine.image], axis=1))
    return path
