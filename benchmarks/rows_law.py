"""How far rows in parallel are from the model's law: the one-step TV per token between the law a
token was drawn from under ZipAR's schedule and the model's raster-order law on the same tokens.

    python benchmarks/rows_law.py --lead 3 --classes 0,5,17,42,63,77,85,91 --json rows-law.json

For each class (cfg 4, temperature 1, seed = the class), the slow reference of
``tests/helpers/rows_reference.py`` paints the embedded model's 8 x 8 grid with every row open at
the lead, sampling each token from the law it computes, under three rule sets:

- ``before``: relaxspec's rows engine until 2026-11-27 (a finished row's last token never kept,
  the row above's input of the same forward hidden, a new row's first token from the row above's
  latest token);
- ``official``: the official LlamaGen-ZipAR code's rules, what relaxspec's engine does now (its
  tokens are the engine's, ``tests/test_rows.py``);
- ``zero-keys``: the official code as released, which also attends the never-written slots of the
  rows above as zero keys.

Then the model's raster-order law of every token given the tokens before it in raster order is
computed by one teacher-forced forward, and the TV distance ``0.5 |p - q|_1`` between the two laws
is averaged over the 63 tokens after the first (the first is drawn from the same law in every
case). The reference is the engine's rule set, not the engine: the engine does not hand out the
laws it draws from, and a greedy test holds the two equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.rows_reference import VARIANTS, reference_rows_laws  # noqa: E402

from relaxspec.decoding.target import GuidedTarget  # noqa: E402
from relaxspec.embedded import load  # noqa: E402
from relaxspec.sampling import SamplingConfig  # noqa: E402


def raster_laws(model, label: int, tokens: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """``[N - 1, V]``: the model's law of tokens ``1 .. N-1`` given the tokens before each."""
    target = GuidedTarget(model, torch.tensor([label]), sampling)
    target.prefill()
    count = tokens.shape[0] - 1
    places = (target.cls + torch.arange(count))[None, :]
    probs, _ = target.forward(tokens[None, :-1], places, places)
    return probs[0]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lead", type=int, default=3)
    parser.add_argument("--classes", default="0,5,17,42,63,77,85,91")
    parser.add_argument("--json", help="write the per-image numbers here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load(with_drafter=False)[0]
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0)
    classes = [int(c) for c in args.classes.split(",")]
    grid = model.config.grid_size
    results = {}
    for variant in VARIANTS:
        per_image = []
        for label in classes:
            tokens, laws = reference_rows_laws(model, torch.tensor([label]), sampling, grid, args.lead, variant=variant,
                                               generator=torch.Generator().manual_seed(label))
            raster = raster_laws(model, label, tokens[0], sampling)
            tv = 0.5 * (laws[0, 1:].double() - raster.double()).abs().sum(-1)
            per_image.append(float(tv.mean()))
        results[variant] = per_image
        print(f"{variant:>10}: TV per token {statistics.mean(per_image):.3f} "
              f"(images {min(per_image):.3f} to {max(per_image):.3f})", flush=True)
    # one open row: the reference is raster order, so its TV is 0 (a check of the measurement)
    tokens, laws = reference_rows_laws(model, torch.tensor([classes[0]]), sampling, 1, args.lead,
                                       generator=torch.Generator().manual_seed(0))
    check = float((0.5 * (laws[0, 1:] - raster_laws(model, classes[0], tokens[0], sampling)).abs().sum(-1)).max())
    print(f"one open row (raster order): largest TV {check:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"lead": args.lead, "classes": classes, "tv_per_token": results,
                                               "raster_check": check}, indent=1) + "\n")


if __name__ == "__main__":
    main()
