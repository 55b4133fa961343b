"""What a changed setting costs a warm process (issue 51): the time to the first image after
``--cfg-scale``, the temperature, top-k or a rule's number changes, compiled.

    python benchmarks/settings_change.py [--method lantern] [--threads 1]

One process, the embedded model, ``relaxspec.generate(..., compile=True)``: a first image (it
compiles), the same settings again (warm), then one image after each change, each timed from the
call to the image, with the graphs dynamo compiled for it (``unique_graphs``). A setting that
reaches the compiled step as data compiles nothing; one that is a constant of the graph compiles
the step again (minutes at GPT-XL size). Inductor's cache is a fresh folder, so no earlier
process's kernels are reused. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="lantern")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))
    import torch

    import relaxspec

    torch.set_num_threads(args.threads)
    counters = torch._dynamo.utils.counters
    base = dict(cfg_scale=4.0, temperature=1.0, top_k=0, top_p=1.0)
    # a rule's number changed with the rest of the preset given as it is (a given bound resets the
    # preset's other fields to the registry's, LANTERN's k among them: a shape)
    rule = {"lantern": ("delta", 0.5, 0.4, {"k": 64}), "lantern++": ("lam", 5.0, 3.0, {}),
            "cool": ("cool_delta", 4.0, 2.0, {}), "gsd": ("group_p_gap", 0.15, 0.1, {})}.get(args.method)
    runs = [("first image (compiles)", base, {}), ("same settings again", base, {}),
            ("cfg scale 4 -> 5", dict(base, cfg_scale=5.0), {}),
            ("temperature 1 -> 0.9", dict(base, cfg_scale=5.0, temperature=0.9), {}),
            ("top-k 0 -> 100", dict(base, cfg_scale=5.0, temperature=0.9, top_k=100), {}),
            ("top-k 100 -> 200", dict(base, cfg_scale=5.0, temperature=0.9, top_k=200), {})]
    if rule is not None:
        name, before, after, rest = rule
        runs += [(f"{name} {before} given", dict(base, cfg_scale=5.0, temperature=0.9, top_k=200), {name: before, **rest}),
                 (f"{name} {before} -> {after}", dict(base, cfg_scale=5.0, temperature=0.9, top_k=200),
                  {name: after, **rest})]
    results = {"method": args.method, "torch": torch.__version__, "threads": args.threads, "runs": []}
    for what, sampling, fields in runs:
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        relaxspec.generate("heart", args.method, sampling=sampling, seed=0, compile=True, **fields)
        seconds = time.perf_counter() - start
        results["runs"].append({"change": what, "seconds": round(seconds, 2),
                                "graphs_compiled": counters["stats"]["unique_graphs"] - graphs})
        print(f"{what}: {seconds:.2f} s, {results['runs'][-1]['graphs_compiled']} graphs", file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
