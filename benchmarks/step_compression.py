"""Step compression of the drafter-free Jacobi methods (issue 53): image tokens committed per target
forward (the prefill included), for ``sjd``, ``scd``, ``sjd-pac`` and ``sjd-pac-official`` with their registry settings,
on the embedded model (its 8 x 8 grid, the model's own sampling) and on the tiny Lumina-mGPT replica
of ``tests/helpers/lumina.py`` (random weights, a 4 x 4 grid, CFG 3, temperature 1, image top-k
2000: SJD-PAC's settings). Counts, not times: the machine's speed does not enter.

    python benchmarks/step_compression.py --images 48 --out docs/bench/sjd-pac/step_compression.json

Prints one line per model and method: tokens per forward, its mean over images with a 95 %
bootstrap interval, and the ratio to ``sjd``'s (paired by image)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from relaxspec import methods  # noqa: E402
from relaxspec.decoding import decode  # noqa: E402
from relaxspec.evaluation.metrics import bootstrap_ci  # noqa: E402
from relaxspec.sampling import SamplingConfig  # noqa: E402

METHODS = ("sjd", "scd", "sjd-pac", "sjd-pac-official")


def interval(values: np.ndarray) -> tuple[float, float]:
    """The 95 % percentile-bootstrap interval of the mean (2000 resamplings of the images)."""
    return bootstrap_ci(np.mean, values, n_boot=2000)[1:]


def per_image(target, cond, sampling, name: str, images: int, tokens: int, cond_mask=None) -> np.ndarray:
    """Tokens per forward of ``images`` decodes (seed i for the i-th, the conditions in turn)."""
    out = []
    for i in range(images):
        row = slice(i % cond.shape[0], i % cond.shape[0] + 1)
        result = decode(target, cond[row], sampling, methods.resolve(name), generator=torch.Generator().manual_seed(i),
                        cond_mask=None if cond_mask is None else cond_mask[row])
        out.append(tokens / int(result.target_forwards[0]))
    return np.array(out)


def models(work: Path):
    from relaxspec.pipelines import open_pipeline

    pipeline = open_pipeline()
    condition = pipeline.conditions(classes=pipeline.default_classes)
    yield "embedded", pipeline.target, condition.cond, pipeline.sampling(), None

    from helpers import lumina as lf

    from relaxspec.models import lumina

    files = lf.lumina_folders(work)
    opened = lumina.open_folder(files["model_path"], lf.PROMPTS, image_size=lf.IMAGE_SIZE,
                                tokenizer_path=files["tokenizer_path"])
    yield ("lumina-mgpt replica", opened.target, opened.cond,
           SamplingConfig(cfg_scale=3.0, temperature=1.0, top_k=2000), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {}
    with tempfile.TemporaryDirectory() as work:
        for model, target, cond, sampling, mask in models(Path(work)):
            tokens = target.config.block_size
            rows = {name: per_image(target, cond, sampling, name, args.images, tokens, mask) for name in METHODS}
            report[model] = {}
            for name, values in rows.items():
                ratio = values / rows["sjd"]
                spread, ratio_spread = interval(values), interval(ratio)
                report[model][name] = {"tokens_per_forward": float(values.mean()), "interval": spread,
                                       "ratio_to_sjd": float(ratio.mean()), "ratio_interval": ratio_spread}
                print(f"{model}: {name}: {values.mean():.3f} tokens a forward [{spread[0]:.3f}, {spread[1]:.3f}], "
                      f"{ratio.mean():.2f}x sjd [{ratio_spread[0]:.2f}, {ratio_spread[1]:.2f}]", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"images": args.images, "models": report}, indent=1) + "\n")


if __name__ == "__main__":
    main()
