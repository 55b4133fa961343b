"""Rows in parallel against sequence length (issue 31's scaling table): target forwards and wall
time per image of ``zipar`` and ``pjd`` against plain AR, on random-weight LlamaGen models at
256 and 384 px (16 x 16 and 24 x 24 tokens), or (``--family lumina``) on random-weight
Lumina-mGPT-layout models (Chameleon, a forced new line after every row) at 16 x 16 and 24 x 24
codes. Structure only: random weights say nothing of quality, and their acceptance is not a
trained model's.

    python benchmarks/rows_scaling.py [--family llamagen|lumina] [--images 3] [--dim 256] [--layers 4] [--json out.json]

One thread, eager, CFG 4, temperature 1. Methods alternate image by image (so a busy moment of
the machine hits all of them); the speed-up is the median of the per-image ratios to AR.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.sampling import SamplingConfig

METHODS = {"ar": dict(method="ar"), "zipar": dict(method="zipar"), "zipar lead 2": dict(method="zipar", row_lead=2),
           "pjd": dict(method="pjd")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("llamagen", "lumina"), default="llamagen")
    parser.add_argument("--images", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0)
    table = []
    for pixels in (256, 384):
        grid = pixels // 16
        torch.manual_seed(0)
        if args.family == "lumina":
            from gpu import lumina_target  # benchmarks/gpu.py: the same Lumina-mGPT layout it measures on a GPU

            model, conditions, _ = lumina_target(torch.device("cpu"), torch.float32, width=args.dim, layers=args.layers,
                                                 heads=8, inner=args.dim * 2, vocab=12000, grid=grid)
        else:
            model = Transformer(GPTConfig(dim=args.dim, n_layer=args.layers, n_head=8, vocab_size=16384,
                                          num_classes=1000, block_size=grid * grid)).eval()
            conditions = None
        seconds = {name: [] for name in METHODS}
        forwards = {name: [] for name in METHODS}
        for image in range(args.images + 1):  # the first round warms up and is dropped
            for name, fields in METHODS.items():
                generator = torch.Generator().manual_seed(image)
                start = time.perf_counter()
                cond = torch.tensor([image % 1000]) if conditions is None else conditions
                result = decode(model, cond, sampling, MethodOptions(**fields), generator=generator)
                if image:
                    seconds[name].append(time.perf_counter() - start)
                    forwards[name].append(int(result.target_forwards[0]))
        for name in METHODS:
            ratios = [ar / mine for ar, mine in zip(seconds["ar"], seconds[name])]
            row = {"pixels": pixels, "tokens": grid * grid, "method": name,
                   "target_forwards": statistics.mean(forwards[name]),
                   "seconds_per_image": statistics.median(seconds[name]),
                   "speedup_vs_ar": statistics.median(ratios), "ratios": [round(r, 3) for r in ratios]}
            table.append(row)
            print(f"{pixels}px {grid}x{grid} {name:13s} forwards {row['target_forwards']:6.1f}  "
                  f"{row['seconds_per_image']:6.2f} s/image  {row['speedup_vs_ar']:.2f}x AR  {row['ratios']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"family": args.family, "images": args.images, "dim": args.dim, "layers": args.layers, "rows": table}, handle, indent=1)


if __name__ == "__main__":
    main()
