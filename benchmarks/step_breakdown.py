"""Where a speculative step's time goes on the embedded model (issue 31, item 5): the target's
forward, the draft source (drafter forwards and drafting), verification (with and without the TV
record) and the KV moves, per step, for one method.

    python benchmarks/step_breakdown.py [--method lantern] [--compile] [--classes 1,5,9,13,17,21]

One thread, CFG 4, temperature 1, the model's own preset for the method; one untimed decode first
(the warm-up, which compiles). Each method is run with its TV record on, then off, so the
record's own cost is the difference of the two verification times. The decodes run in profile
mode (``profile=True``): the parts are timed apart, so with ``--compile`` each forward and the walk
are their own graphs and the engine between them runs eagerly -- the split of such a step, not
the time of the one-graph step a plain ``--compile`` decode runs (``benchmarks/step_profile.py``
and ``relaxspec bench --compile`` measure that).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import relaxspec.decoding.steps as steps
from relaxspec import embedded
from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.decoding.target import GuidedTarget
from relaxspec.sampling import SamplingConfig


def timed_sections(spent: collections.Counter) -> None:
    """Time verify_tree and the KV moves into ``spent`` (seconds), wrapping them where the engine calls them."""
    verify = steps.verify_tree

    def timed_verify(*args, **kwargs):
        start = time.perf_counter()
        out = verify(*args, **kwargs)
        spent["verify"] += time.perf_counter() - start
        return out

    steps.verify_tree = timed_verify
    move = GuidedTarget.move_cache

    def timed_move(self, *args):
        start = time.perf_counter()
        out = move(self, *args)
        spent["kv moves"] += time.perf_counter() - start
        return out

    GuidedTarget.move_cache = timed_move


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="lantern")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--classes", default="1,5,9,13,17,21")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, vq, drafter = embedded.load(device="cpu")
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0)
    preset = embedded.defaults()["presets"].get(args.method, {})
    spent: collections.Counter = collections.Counter()
    timed_sections(spent)
    for record in (True, False):
        options = MethodOptions(args.method, **preset, compile=args.compile, record_tv=record, profile=True)
        decode(target, torch.tensor([0]), sampling, options, drafter=drafter, vq=vq,
               generator=torch.Generator().manual_seed(0))
        spent.clear()
        steps, total = 0, collections.Counter()
        for label in [int(c) for c in args.classes.split(",")]:
            result = decode(target, torch.tensor([label]), sampling, options, drafter=drafter, vq=vq,
                            generator=torch.Generator().manual_seed(label))
            steps += int(result.target_forwards[0]) - 1
            total["step"] += result.seconds
            total["target forward"] += result.target_forward_seconds
            total["draft source"] += result.drafter_seconds
            total["drafter forwards"] += result.drafter_forward_seconds
        rest = total["step"] - total["target forward"] - total["draft source"] - spent["verify"] - spent["kv moves"]
        parts = {"target forward": total["target forward"], "draft source": total["draft source"],
                 "  of it, drafter forwards": total["drafter forwards"], "verify": spent["verify"],
                 "kv moves": spent["kv moves"], "rest": rest}
        print(f"{args.method}{' compiled' if args.compile else ''}, TV record {'on' if record else 'off'}: "
              f"{1000 * total['step'] / steps:.2f} ms a step ({steps} steps)")
        for name, seconds in parts.items():
            print(f"  {name:26s} {1000 * seconds / steps:6.2f} ms  {seconds / total['step']:5.1%}")


if __name__ == "__main__":
    main()
