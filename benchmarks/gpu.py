"""The GPU measurements of docs/BENCHMARKS.md, in one run (``benchmarks/gpu.sh`` calls it).

    python benchmarks/gpu.py --device cuda --out gpu-results

1. **Checks on the device**: for every method on the embedded model, greedy decoding eager and
   compiled give the same tokens, and every lossless method gives greedy AR's tokens.
2. **LlamaGen GPT-XL** (random weights, the official shape: 36 layers, 1280 wide, 16x16 tokens)
   in bf16 at batch 1 with CFG: AR ms/token eager and compiled; the target forward's cost over
   1..64 tokens; per-step engine overhead (a step's time minus its forwards) of every method.
3. **The embedded model's speed-ups** on the device (``relaxspec bench``, eager and compiled).

Writes ``OUT/gpu.json`` and ``OUT/gpu.md``. ``--quick`` shrinks every part (a smoke test that
runs on a CPU in minutes: ``python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from relaxspec import embedded
from relaxspec.bench.cost import measure_forward_costs
from relaxspec.decoding import MethodOptions, decode
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.models.llamagen.gpt import Transformer, gpt_config
from relaxspec.sampling import SamplingConfig

METHODS = {
    "ar": dict(method="ar"),
    "sd-chain": dict(method="sd", draft="chain", depth=4),
    # the embedded model's default method with its own preset (defaults.json), as generate uses it
    "lantern (embedded default)": {"method": "lantern", **embedded.defaults()["presets"]["lantern"]},
    "lantern++ (57 nodes)": dict(method="lantern++", tree="lantern57", k=64),
    "cool": dict(method="cool", draft="chain", depth=4),
    "eagle2": dict(method="eagle2"),
    "sjd": dict(method="sjd"),
    "scd": dict(method="scd"),
    "gsd": dict(method="gsd"),  # reads the target's token embeddings: runs on the random XL too
}
LOSSLESS = ("sd-chain", "eagle2", "sjd", "scd")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def checks(device: torch.device, images: int) -> dict:
    """Greedy tokens: compiled == eager for every method, lossless methods == greedy AR."""
    target, vq, drafter = embedded.load(device=device)
    sampling = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    cond = torch.arange(images, device=device)
    results = {}
    reference = None
    for name, options in METHODS.items():
        eager = decode(target, cond, sampling, MethodOptions(**options), drafter=drafter, vq=vq).tokens
        fast = decode(target, cond, sampling, MethodOptions(**options, compile=True), drafter=drafter, vq=vq).tokens
        if name == "ar":
            reference = eager
        results[name] = {"compiled_equals_eager": bool(torch.equal(eager, fast)),
                         "equals_greedy_ar": bool(torch.equal(eager, reference)) if name in LOSSLESS + ("ar",) else None}
        print(f"check {name}: {results[name]}", flush=True)
    return results


def gpt_xl(device: torch.device, quick: bool) -> dict:
    """AR ms/token eager and compiled, forward cost over 1..64 tokens, engine overhead per step."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = gpt_config("GPT-B" if quick else "GPT-XL", image_size=64 if quick else 256)
    torch.manual_seed(0)
    model = Transformer(config).to(device=device, dtype=dtype).eval()
    drafter = EagleDrafter.for_target(model).to(device=device, dtype=dtype).eval()
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
    cond = torch.zeros(1, dtype=torch.long, device=device)
    out = {"model": "GPT-B (quick)" if quick else "GPT-XL", "dtype": str(dtype), "tokens": config.block_size}
    for compile in (False, True):
        options = MethodOptions(method="ar", compile=compile)
        decode(model, cond, sampling, options, generator=torch.Generator(device=device).manual_seed(0))  # warm-up / compile
        times = [timed(lambda: decode(model, cond, sampling, options, generator=torch.Generator(device=device).manual_seed(s)),
                       device)[1] for s in range(3)]
        key = "ar_ms_per_token_" + ("compiled" if compile else "eager")
        out[key] = 1000 * sorted(times)[1] / config.block_size
        print(f"{out['model']} AR compile={compile}: {out[key]:.2f} ms/token", flush=True)
    sizes = (1, 2, 4, 8, 16) if quick else (1, 2, 4, 8, 16, 32, 48, 64)
    costs = measure_forward_costs(model, sampling=sampling, target_sizes=sizes, reps=5 if quick else 21)
    out["target_forward_ms"] = {int(k): 1000 * v for k, v in costs.target.items()}
    engine = {}
    for name, options in METHODS.items():
        if name.startswith("lantern"):  # the embedded model's codebook defines neighbours; XL has none here
            continue
        for compile in (False, True):
            opts = MethodOptions(**options, compile=compile)
            decode(model, cond, sampling, opts, drafter=drafter, generator=torch.Generator(device=device).manual_seed(0))
            result, wall = timed(lambda: decode(model, cond, sampling, opts, drafter=drafter,
                                                generator=torch.Generator(device=device).manual_seed(1)), device)
            steps = int(result.target_forwards[0])
            key = name + (" compiled" if compile else "")
            engine[key] = {"ms_per_step": 1000 * wall / steps, "engine_ms_per_step": 1000 * result.overhead_seconds / steps,
                           "mal": float(result.mean_accepted_length[0])}
            print(f"{out['model']} {key}: {engine[key]}", flush=True)
    out["engine"] = engine
    return out


def embedded_speedups(device: torch.device, out: Path, quick: bool) -> dict:
    """``relaxspec bench`` of the embedded model on the device, eager and compiled."""
    folder = out / "bench-embedded"
    # The names mean the embedded model's tuned presets (defaults.json), as in a plain relaxspec bench.
    command = [sys.executable, "-m", "relaxspec.cli", "bench", "--device", str(device), "--num-images",
               "4" if quick else "24", "--methods", "ar,ar-compiled,sd,eagle2,lantern,lantern++,cool,sjd,scd,gsd",
               "--no-plots", "--warmup", "1", "--out", str(folder), "--overwrite"]
    subprocess.run(command, check=True)
    compiled = list(command)
    compiled[compiled.index(str(folder))] = str(folder) + "-compiled"
    subprocess.run(compiled + ["--compile"], check=True)
    return {"eager": json.loads((folder / "summary.json").read_text()),
            "compiled": json.loads((Path(str(folder) + "-compiled") / "summary.json").read_text())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of this script")
    parser.add_argument("--parts", default="checks,xl,embedded", help="comma-separated subset to run")
    args = parser.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__}
    parts = set(args.parts.split(","))
    if "checks" in parts:
        report["checks"] = checks(device, 2 if args.quick else 8)
    if "xl" in parts:
        report["xl"] = gpt_xl(device, args.quick)
    if "embedded" in parts:
        report["embedded"] = embedded_speedups(device, out, args.quick)
    (out / "gpu.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'gpu.json'}")


if __name__ == "__main__":
    main()
