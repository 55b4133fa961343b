"""What a compiled speculative step costs, in compiled AR steps, and where a profiled step's time
goes (issue 41), on the embedded model.

    python benchmarks/step_share.py [--methods ar,sd,lantern] [--classes 1,5,9,13,17,21] [--json out.json]

One thread, CFG 4, temperature 1, ``compile=True``, each method's embedded preset (``--methods``
takes the names of ``relaxspec bench``; ``ar`` is compiled AR and is always timed, as the unit).
A step's time is read between two calls of ``on_step`` (on the CPU the loop reads its count at
once, so each call follows its step's end): the median over the steps of every image, after an
untimed warm-up decode (which compiles); methods alternate image by image. **AR steps**: a
method's median step over compiled AR's -- what issue 41 asks to bring near 1 (a step near one
target forward).

**Profiled split**: one more decode of each image in profile mode (``profile=True``: each model
forward its own compiled graph, timed by a stopwatch, the engine eager between them): the shares
of that decode's time spent in the target's forwards, in the drafter's, and elsewhere (the
engine). It says how heavy the drafter's forwards are against the target's; the engine's share
in it is the eager engine's, not the one-graph step's (whose engine the step's time in AR steps
bounds). An older checkout (run this file with its ``src`` first on ``PYTHONPATH``) timed every
decode so: there the split is that of its ordinary step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from relaxspec import embedded
from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.errors import RelaxspecError
from relaxspec.methods import resolve
from relaxspec.sampling import SamplingConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="ar,sd,lantern")
    parser.add_argument("--classes", default="1,5,9,13,17,21")
    parser.add_argument("--json", help="also write the numbers as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, vq, drafter = embedded.load()
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0)
    presets = embedded.defaults()["presets"]
    names = list(dict.fromkeys(["ar", *args.methods.split(",")]))
    options = {name: resolve(name, {"compile": True}, presets) if name != "ar" else MethodOptions("ar", compile=True)
               for name in names}
    steps: dict[str, list[float]] = {name: [] for name in names}
    split: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}

    def profiled(name: str) -> MethodOptions:
        try:
            return MethodOptions.from_layers(options[name].method, [options[name].to_dict(), {"profile": True}])
        except RelaxspecError:  # an older checkout, which timed every decode's forwards
            return options[name]

    def run(opts: MethodOptions, label: int, on_step=None):
        return decode(target, torch.tensor([label]), sampling, opts, drafter=drafter, vq=vq,
                      generator=torch.Generator().manual_seed(label), on_step=on_step)

    for name in names:  # warm-up: compiles
        run(options[name], 0)
        run(profiled(name), 0)
    for label in [int(c) for c in args.classes.split(",")]:
        for name in names:
            stamps: list[float] = []
            run(options[name], label, lambda tokens, done: stamps.append(time.perf_counter()))
            steps[name] += [b - a for a, b in zip(stamps, stamps[1:])]
            result = run(profiled(name), label)
            forwards = result.target_forward_seconds or 0.0
            drafted = result.drafter_forward_seconds or 0.0
            split[name].append((forwards, drafted, result.seconds))
    ar = statistics.median(steps["ar"])
    out = {}
    print("| method | step ms (median) | AR steps | profiled: target / drafter / engine | steps |")
    print("|---|---|---|---|---|")
    for name in names:
        step = statistics.median(steps[name])
        total = sum(s[2] for s in split[name])
        shares = [sum(s[i] for s in split[name]) / total for i in (0, 1)]
        shares.append(1 - sum(shares))
        out[name] = {"step_ms": 1000 * step, "ar_steps": step / ar, "profiled_shares": shares,
                     "steps": len(steps[name])}
        print(f"| {name} | {1000 * step:.2f} | {step / ar:.2f} | {' / '.join(f'{x:.0%}' for x in shares)} | "
              f"{len(steps[name])} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
