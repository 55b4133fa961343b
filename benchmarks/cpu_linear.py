"""What packing the weights buys a CPU forward: the embedded target's linear layers, multiplied
the way an eager step does (``F.linear``) and the way a compiled CPU step does (oneDNN's packed
layout, :func:`relaxspec.compiling.pack_linears`), at the row counts a decode uses (2 = one token
on both CFG streams; 14 = the shipped chain's seven tokens; 28 = fourteen tokens).

    python benchmarks/cpu_linear.py [--rounds 40] [--threads 1] [--dtype bf16]

Alternates the two on every round and prints the medians with the pairwise ratio; the memory
line reads the same bytes with a plain ``sum``, what a product bound by reading its weights could
approach. Numbers in docs/BENCHMARKS.md ("Packed weights on the CPU")."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from relaxspec import embedded
from relaxspec.compiling import PackedLinear, pack_linears
from relaxspec.models.llamagen.checkpoints import load_gpt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="2,14,28", help="comma-separated row counts")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the weights' and inputs' dtype")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = load_gpt(embedded.path("gpt")).to(dtype)
    pack_linears(model)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not layers:
        raise SystemExit("packing is off here (RELAXSPEC_PACK_WEIGHTS=0, no oneDNN or not x86-64): nothing to compare")
    megabytes = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers) / 1e6
    print(f"{len(layers)} linear layers, {megabytes:.1f} MB of {args.dtype} weights, {args.threads} thread(s)")
    flat = torch.cat([layer.weight.detach().flatten() for layer in layers])
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {layer.in_features: torch.randn(rows, layer.in_features, dtype=dtype) for layer in layers}

            def plain():
                for layer in layers:
                    F.linear(inputs[layer.in_features], layer.weight)

            def packed():
                for layer in layers:
                    torch.ops.relaxspec.packed_linear(inputs[layer.in_features], layer.packed_weight, None,
                                                      layer.out_features)

            times = {"linear": [], "packed": [], "sum": []}
            for _ in range(args.rounds):
                for name, fn in (("linear", plain), ("packed", packed), ("sum", flat.sum)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            ratio = statistics.median(a / b for a, b in zip(times["linear"], times["packed"]))
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            print(f"rows {rows:3d}: F.linear {med['linear']:6.2f} ms ({megabytes / med['linear']:4.1f} GB/s), "
                  f"packed {med['packed']:6.2f} ms ({megabytes / med['packed']:4.1f} GB/s), "
                  f"F.linear / packed {ratio:.2f}x; reading the weights (sum) {med['sum']:.2f} ms")


if __name__ == "__main__":
    main()
