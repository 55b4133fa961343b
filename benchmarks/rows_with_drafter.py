"""Rows in parallel with the EAGLE drafter on the embedded model (issue 31): the shipped LANTERN
(raster order) and ZipAR against LANTERN drafting a chain for every open row, and exact EAGLE-2
growing its dynamic tree in raster order against one tree for every open row.

    python benchmarks/rows_with_drafter.py [--classes 1,5,9,13,17,21] [--json out.json]

One thread, eager, CFG 4, temperature 1, one image per class after an untimed round of class 0,
methods alternating image by image;
the speed-up is the median of the per-image ratios to plain AR. No quality is measured here: a
setting that is not faster than the shipped LANTERN needs none.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from relaxspec import embedded
from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.sampling import SamplingConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default="1,5,9,13,17,21")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, vq, drafter = embedded.load(device="cpu")
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0)
    shipped = embedded.defaults()["presets"]["lantern"]
    chain = dict(method="lantern", draft="chain", depth=3, k=shipped["k"], delta=shipped["delta"])
    methods = {"ar": dict(method="ar"), "lantern (shipped, raster)": dict(method="lantern", **shipped),
               "zipar, lead 2": dict(method="zipar", row_lead=2),
               "lantern (shipped tree) per row, lead 3": dict(method="lantern", **shipped, rows=8),
               "lantern (shipped tree) per row, lead 2": dict(method="lantern", **shipped, rows=8, row_lead=2),
               "lantern chain of 3 per row, lead 2": dict(chain, rows=8, row_lead=2),
               "eagle2 (exact, raster)": dict(method="eagle2"),
               "eagle2 per row, lead 2": dict(method="eagle2", rows=8, row_lead=2),
               "eagle2 per row, lead 3": dict(method="eagle2", rows=8, row_lead=3)}
    seconds = {name: [] for name in methods}
    forwards = {name: [] for name in methods}
    for label in [0] + [int(c) for c in args.classes.split(",")]:  # class 0 warms every method up, untimed
        for name, options in methods.items():
            start = time.perf_counter()
            result = decode(target, torch.tensor([label]), sampling, MethodOptions(**options), drafter=drafter, vq=vq,
                            generator=torch.Generator().manual_seed(label))
            if label:
                seconds[name].append(time.perf_counter() - start)
                forwards[name].append(int(result.target_forwards[0]))
    table = []
    for name in methods:
        ratio = statistics.median(a / b for a, b in zip(seconds["ar"], seconds[name]))
        table.append({"method": name, "speedup_vs_eager_ar": ratio, "target_forwards": statistics.mean(forwards[name])})
        print(f"| {name} | {statistics.mean(forwards[name]):.1f} | {ratio:.2f}x |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(table, handle, indent=1)


if __name__ == "__main__":
    main()
