"""Ops, host syncs and host->device copies per decoding step on the embedded model, per method.

    python benchmarks/engine_counts.py [--batch 1] [--images 4] [--json out.json]

Counts come from :class:`relaxspec.bench.counting.StepCounter` (a ``TorchFunctionMode`` that
treats every tensor as if it lived on a GPU): means over the steps of ``--images`` decodes
(cfg 4, temperature 1, eager). To count an older checkout, run this file with that checkout's
``src`` first on ``PYTHONPATH``: the counter is loaded from beside this script when the checkout
has none.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from relaxspec import embedded
from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.sampling import SamplingConfig

from checkout import counting_attr

StepCounter = counting_attr("StepCounter")

METHODS = {
    "ar": dict(method="ar"),
    "sd chain 4": dict(method="sd", draft="chain", depth=4),
    # the embedded model's default method with its own preset (defaults.json), as generate uses it
    "lantern (embedded default)": {"method": "lantern", **embedded.defaults()["presets"]["lantern"]},
    "lantern++ (57-node tree)": dict(method="lantern++", tree="lantern57", k=64),
    "eagle2": dict(method="eagle2"),
    "sjd": dict(method="sjd"),
    "scd": dict(method="scd"),
    "sjd-pac": dict(method="sjd-pac"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--images", type=int, default=4, help="decodes per method (default 4)")
    parser.add_argument("--json", help="also write the table as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, vq, drafter = embedded.load()
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
    rows = {}
    print("| method | host syncs / step (max) | lagged reads / step | host->device copies / step | engine ops / step | "
          "drafter ops / step | target forward ops / step |")
    print("|---|---|---|---|---|---|---|")
    for name, options in METHODS.items():
        windows = []
        for image in range(args.images):
            with StepCounter(target, drafter, sites=False) as counter:
                decode(target, torch.arange(args.batch) + image, sampling, MethodOptions(**options), drafter=drafter,
                       vq=vq, generator=torch.Generator().manual_seed(image))
            windows += counter.steps
        # (an older checkout's counter has no lagged reads: its loop read every step's count blocking)
        mean = {key: sum(getattr(w, key, 0) for w in windows) / len(windows)
                for key in ("syncs", "lagged_reads", "host_copies", "engine_ops", "drafter_ops", "target_ops")}
        mean["max_syncs"] = max(w.syncs for w in windows)
        mean["steps"] = len(windows)
        rows[name] = mean
        print(f"| {name} | {mean['syncs']:.1f} ({mean['max_syncs']}) | {mean['lagged_reads']:.1f} | {mean['host_copies']:.1f} | "
              f"{mean['engine_ops']:.0f} | {mean['drafter_ops']:.0f} | {mean['target_ops']:.0f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
