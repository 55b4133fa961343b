"""What a warm compiled speculative step asks of the host, per method, counted by ``torch.profiler``
(issue 41): calls into compiled regions, aten ops run eagerly outside them, and reads of a value.

    python benchmarks/step_profile.py [--images 2] [--methods ar,sd-chain,...] [--json out.json]

The embedded model, batch 1, cfg 4, temperature 1, one thread, ``compile=True``. Each method
decodes once untimed (the warm-up, which compiles), then ``--images`` decodes under the
profiler. A step is one target forward after the prefill (``target_forwards - 1`` per image).
Two counts each: **per step**, the steady state -- the host's calls from the first compiled
region to the last one of a decode, over the steps between (the prologue -- the eager prefill,
the first token, the drafter's first catch-up -- and the read-out left out) -- and **per decode
step**, everything the decode made over its steps (the prologue and read-out spread over them).

* **compiled calls**: top-level ``Torch-Compiled Region`` events (each is one graph call; on a
  GPU one CUDA-graph replay);
* **eager ops**: top-level ``aten::`` events outside every compiled region (each an eager
  dispatch, on a GPU one or more kernel launches of ~8-11 us between the graphs);
* **reads**: top-level ``aten::item`` / ``aten::_local_scalar_dense`` calls (on a GPU, a read of
  a device value blocks the host until the queue drains; a read of a host buffer does not, which
  the profiler cannot tell apart: ``tests/test_fast_engine.py`` counts those with
  :class:`relaxspec.bench.counting.StepCounter`).

To count an older checkout, run this file with that checkout's ``src`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from relaxspec import embedded
from relaxspec.decoding import decode
from relaxspec.methods import MethodOptions
from relaxspec.sampling import SamplingConfig

from checkout import counting_attr

host_calls = counting_attr("host_calls")

METHODS = {
    "ar": dict(method="ar"),
    "sd-chain": dict(method="sd", draft="chain", depth=4),
    "sd (embedded preset)": {"method": "sd", **embedded.defaults()["presets"]["sd"]},
    "lantern (embedded preset)": {"method": "lantern", **embedded.defaults()["presets"]["lantern"]},
    "lantern++ (57 nodes)": dict(method="lantern++", tree="lantern57", k=64),
    "cool": dict(method="cool", draft="chain", depth=4),
    "eagle2": dict(method="eagle2"),
    "sjd": dict(method="sjd"),
    "scd": dict(method="scd"),
    "sjd-pac": dict(method="sjd-pac"),
    "gsd": dict(method="gsd"),
    "zipar lead 2": dict(method="zipar", row_lead=2),
    "pjd": dict(method="pjd"),
    "sd-chain rows lead 2": dict(method="sd", draft="chain", depth=3, rows=4096, row_lead=2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2, help="profiled decodes per method (default 2)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated names of METHODS")
    parser.add_argument("--json", help="also write the table as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, vq, drafter = embedded.load()
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
    rows = {}
    print("| method | compiled calls / step | eager aten ops / step | reads / step | per decode step: calls / ops / "
          "reads | steps |")
    print("|---|---|---|---|---|---|")
    for name in args.methods.split(","):
        options = MethodOptions(**METHODS[name], compile=True)

        def one(image: int):
            return decode(target, torch.tensor([image]), sampling, options, drafter=drafter, vq=vq,
                          generator=torch.Generator().manual_seed(image))

        one(0)  # warm-up: compiles
        totals = {"calls": 0, "ops": 0, "reads": 0}
        inner = dict(totals)
        steps = inner_steps = 0
        for image in range(1, args.images + 1):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                result = one(image)
            events = prof.events()
            whole, steady = host_calls(events, steady=False), host_calls(events)
            for key in totals:
                totals[key] += whole[key]
                inner[key] += steady[key]
            steps += int(result.target_forwards.max()) - 1
            # the steps between the decode's first compiled call and its last (exactly so where a step is one
            # call; about so for an older checkout, whose steps made several)
            inner_steps += int(result.target_forwards.max()) - 2
        row = {key: value / max(inner_steps, 1) for key, value in inner.items()}
        row.update({f"decode_{key}": value / steps for key, value in totals.items()})
        row["steps"] = steps
        rows[name] = row
        print(f"| {name} | {row['calls']:.2f} | {row['ops']:.1f} | {row['reads']:.2f} | "
              f"{row['decode_calls']:.2f} / {row['decode_ops']:.1f} / {row['decode_reads']:.2f} | {steps} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
