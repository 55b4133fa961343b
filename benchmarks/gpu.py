"""The GPU measurements of docs/BENCHMARKS.md, in one run (``benchmarks/gpu.sh`` calls it).

    python benchmarks/gpu.py --device cuda --out gpu-results

1. **Checks on the device**: for every method on the embedded model, greedy decoding eager and
   compiled give the same tokens, and every lossless method gives greedy AR's tokens.
2. **LlamaGen GPT-XL** (random weights, the official shape: 36 layers, 1280 wide, 16x16 tokens)
   in bf16 at batch 1 with CFG: AR ms/token eager and compiled; the target forward's cost over
   1..64 tokens; every method's step, eager and compiled: ms per step, what the host does per
   step (calls into compiled regions, eager ops, reads), the engine's own time in profile mode,
   and (issue 41) each compiled step in compiled AR steps; inductor's counters (CUDA graphs
   skipped, and why).
3. **The embedded model's speed-ups** on the device (``relaxspec bench``, eager and compiled).
4. **The transformers families at their real shapes** (random weights; parts ``janus``, ``emu3``
   and ``lumina``, each under ten minutes on an H100, so run them as their own calls): a
   Janus-Pro-1B, an Emu3-Gen (8B) and a Lumina-mGPT-7B (512 px) language model in bf16 at batch 1
   with CFG: greedy SJD == AR on the
   device, AR ms/token eager and compiled, the target forward's cost over 1..64 tokens (what a
   speculative step's verification costs), and per-step time and engine overhead of the drafter-
   free methods. Random weights accept nothing beyond chance (MAL ~1): these are costs, not
   speed-ups; the speed-ups need the real checkpoints.

Writes ``OUT/gpu.json`` and ``OUT/gpu.md``. ``--quick`` shrinks every part (a smoke test that
runs on a CPU in minutes: ``python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from relaxspec import embedded
from relaxspec.bench.cost import measure_forward_costs
from relaxspec.bench.counting import host_calls
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
    "zipar lead 2": dict(method="zipar", row_lead=2),  # rows in parallel (not the model's law)
    "pjd": dict(method="pjd"),
    # every open row drafts an EAGLE chain over one drafter cache per image
    "sd-chain rows lead 2": dict(method="sd", draft="chain", depth=3, rows=4096, row_lead=2),
    # every open row grows EAGLE-2's dynamic tree (a wide forward: where a GPU should pay)
    "eagle2 rows lead 2": dict(method="eagle2", rows=4096, row_lead=2),
}
#: The order compiled checks and compiled step costs go in when the budget may run out.
COMPILED_FIRST = ("ar", "lantern (embedded default)", "zipar lead 2", "sd-chain", "sd-chain rows lead 2", "eagle2")
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


class Report:
    """The run's results, written to ``path`` after every item, so a run stopped at a time limit
    keeps what it measured. ``budget`` seconds in all: an item that would start with less than its
    ``need`` left is recorded as skipped; an item that raises is recorded with its error and the
    run goes on (a lease on a GPU has no second try)."""

    def __init__(self, path: Path, budget: float, head: dict):
        self.path, self.deadline, self.data = path, time.perf_counter() + budget, dict(head)
        self.save()

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def item(self, keys: tuple, fn, need: float = 0.0):
        where = self.data
        for key in keys[:-1]:
            where = where.setdefault(key, {})
        if self.left() < need:
            where[keys[-1]] = {"skipped": f"{self.left():.0f} s of the budget left, needs about {need:.0f}"}
            print(f"skipped {'/'.join(keys)}: {where[keys[-1]]['skipped']}", flush=True)
            self.save()
            return None
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as error:  # noqa: BLE001 - recorded, and the run goes on
            traceback.print_exc()
            value = {"error": f"{type(error).__name__}: {error}"}
        where[keys[-1]] = value
        print(f"{'/'.join(keys)} ({time.perf_counter() - start:.0f} s): {value}", flush=True)
        self.save()
        return value

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))


def eager_checks(device: torch.device, images: int, methods: dict) -> tuple[dict, dict]:
    """Greedy tokens of every method, eager: lossless methods == greedy AR."""
    target, vq, drafter = embedded.load(device=device)
    sampling = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    cond = torch.arange(images, device=device)
    tokens = {name: decode(target, cond, sampling, MethodOptions(**options), drafter=drafter, vq=vq).tokens
              for name, options in methods.items()}
    results = {name: {"equals_greedy_ar": bool(torch.equal(t, tokens["ar"])) if name in LOSSLESS + ("ar",) else None}
               for name, t in tokens.items()}
    return results, tokens


def compiled_check(device: torch.device, images: int, options: dict, eager) -> dict:
    """One method's greedy tokens compiled == its eager tokens, and the compiled run's time."""
    target, vq, drafter = embedded.load(device=device)
    sampling = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    cond = torch.arange(images, device=device)
    fast, seconds = timed(lambda: decode(target, cond, sampling, MethodOptions(**options, compile=True),
                                         drafter=drafter, vq=vq).tokens, device)
    return {"compiled_equals_eager": bool(torch.equal(eager, fast)), "first_call_seconds": seconds}


def xl_model(device: torch.device, quick: bool):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = gpt_config("GPT-B" if quick else "GPT-XL", image_size=64 if quick else 256)
    torch.manual_seed(0)
    model = Transformer(config).to(device=device, dtype=dtype).eval()
    drafter = EagleDrafter.for_target(model).to(device=device, dtype=dtype).eval()
    return model, drafter, {"model": "GPT-B (quick)" if quick else "GPT-XL", "dtype": str(dtype),
                            "tokens": config.block_size}


def xl_ar(model, device: torch.device, compile: bool) -> float:
    """AR ms/token (the median of three images after a warm-up, which compiles)."""
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
    cond = torch.zeros(1, dtype=torch.long, device=device)
    options = MethodOptions(method="ar", compile=compile)
    decode(model, cond, sampling, options, generator=torch.Generator(device=device).manual_seed(0))
    times = [timed(lambda: decode(model, cond, sampling, options, generator=torch.Generator(device=device).manual_seed(s)),
                   device)[1] for s in range(3)]
    return 1000 * sorted(times)[1] / model.config.block_size


def step_cost(model, cond, sampling, options: dict, device: torch.device, *, compile: bool, drafter=None,
              cond_mask=None) -> dict:
    """One method: ms per token and per step, MAL, and what the host did per steady step (calls
    into compiled regions, eager aten ops, value reads: :func:`relaxspec.bench.counting.host_calls`);
    one untimed decode first (warm-up, compilation). The engine's own time per step comes from a
    profile-mode decode (``profile=True``: the forwards timed apart, each its own graph when
    compiled, so that decode is slower than the timed one)."""
    opts = MethodOptions(**options, compile=compile)
    run = lambda seed, o=opts: decode(model, cond, sampling, o, drafter=drafter, cond_mask=cond_mask,  # noqa: E731
                                      generator=torch.Generator(device=device).manual_seed(seed))
    run(0)
    result, wall = timed(lambda: run(1), device)
    steps = int(result.target_forwards[0])
    tokens = model.config.block_size
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(2)
    host = host_calls(prof)
    per_step = max(host["steps"] or 0, 1)
    profiled = run(3, MethodOptions(**options, compile=compile, profile=True))
    return {"ms_per_token": 1000 * wall / tokens, "ms_per_step": 1000 * wall / steps,
            "mal": float(result.mean_accepted_length[0]),
            "host_per_step": {key: host[key] / per_step for key in ("calls", "ops", "reads")},
            "profiled_engine_ms_per_step": 1000 * profiled.overhead_seconds / int(profiled.target_forwards[0])}


def in_ar_steps(xl: dict) -> dict:
    """Each compiled method's step in compiled AR steps (its ms per step / compiled AR's ms per
    token): what issue 41 holds ``sd-chain`` to (at most 1.3)."""
    ar = xl.get("ar_ms_per_token_compiled")
    if not isinstance(ar, float):
        return {"skipped": "no compiled AR time"}
    return {name.removesuffix(" compiled"): cost["ms_per_step"] / ar for name, cost in xl.get("engine", {}).items()
            if name.endswith(" compiled") and isinstance(cost, dict) and "ms_per_step" in cost}


def cudagraph_skips() -> dict:
    """Why inductor ran graphs without CUDA graphs, if it did (a graph that updates a tensor not
    marked as kept in place, ...): its counters."""
    from torch._dynamo.utils import counters

    return dict(counters["inductor"]) if "inductor" in counters else {}


def step_costs(model, cond, sampling, wanted: dict, label: str, device: torch.device, *, drafter=None,
               cond_mask=None) -> dict:
    """:func:`step_cost` of each method of ``wanted``, eager and compiled."""
    costs = {}
    for name, options in wanted.items():
        for compile in (False, True):
            key = name + (" compiled" if compile else "")
            costs[key] = step_cost(model, cond, sampling, options, device, compile=compile, drafter=drafter,
                                   cond_mask=cond_mask)
            print(f"{label} {key}: {costs[key]}", flush=True)
    return costs


def janus_shaped(device: torch.device, dtype: torch.dtype, quick: bool):
    """A random Janus-Pro-1B-shaped target (tiny with ``quick``) and a prompt ``[1, S]``: the
    language model, generation head and VQ codebook at their real sizes; the unused vision tower
    and the VQ decoder kept small."""
    from transformers import JanusConfig, JanusForConditionalGeneration, LlamaConfig
    from transformers.models.janus.configuration_janus import JanusVisionConfig, JanusVQVAEConfig

    from relaxspec.models.janus import JanusTarget

    width, layers, heads, vocab, codes, side = (64, 2, 4, 1000, 256, 8) if quick else (2048, 24, 16, 102400, 16384, 24)
    text = LlamaConfig(hidden_size=width, intermediate_size=width * 11 // 4, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                       max_position_embeddings=16384, bos_token_id=1, pad_token_id=0, eos_token_id=2)
    vision = JanusVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                               image_size=side * 16, patch_size=16, projection_dim=width, depth=1,
                               num_image_tokens=side * side)
    vq = JanusVQVAEConfig(embed_dim=8, num_embeddings=codes, base_channels=32, channel_multiplier=[1, 2],
                          num_res_blocks=1, latent_channels=8, resolution=side * 2, in_channels=3, out_channels=3,
                          projection_dim=width, image_token_embed_dim=width, num_patches=side)
    config = JanusConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), vq_config=vq.to_dict(),
                         image_token_id=5)
    model = _built(lambda: JanusForConditionalGeneration(config), device, dtype)
    boi = 6
    prompt = torch.cat([torch.tensor([1]), torch.randint(10, vocab, (30,)), torch.tensor([boi])])[None].to(device)
    return JanusTarget(model, prompt.shape[1], bos_token_id=1, boi_token_id=boi, pad_token_id=0), prompt, None


def emu3_shaped(device: torch.device, dtype: torch.dtype, quick: bool):
    """A random Emu3-Gen-shaped target (8B language model, 184622-token vocabulary, 32768 visual
    codes; tiny with ``quick``) painting a 32x32-token image, and its conditions ``[1, 2, S]``."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration, Emu3TextConfig

    from relaxspec.models.emu3 import Emu3Target

    if quick:
        width, layers, heads, kv, inner, vocab, codes, grid = 64, 2, 4, 2, 128, 2000, 256, 8
    else:
        width, layers, heads, kv, inner, vocab, codes, grid = 4096, 32, 32, 8, 14336, 184622, 32768, 32
    first_visual = vocab - codes - 8
    vocabulary = {f"<|visual token {i:06d}|>": first_visual + i for i in range(codes)}
    vocabulary.update({"<|extra_200|>": vocab - 8, "<|image token|>": vocab - 7, "<image>": vocab - 6})
    text = Emu3TextConfig(vocab_size=vocab, hidden_size=width, intermediate_size=inner, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=9216,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vq = dict(codebook_size=codes, embed_dim=4, latent_channels=4, base_channels=32, channel_multiplier=[1, 2],
              num_res_blocks=1, attn_resolutions=[], hidden_size=64, temporal_downsample_factor=4)
    config = Emu3Config(text_config=text.to_dict(), vq_config=vq, vocabulary_map=vocabulary)
    model = _built(lambda: Emu3ForConditionalGeneration(config), device, dtype)
    prompt = torch.cat([torch.randint(0, first_visual, (30,)), torch.tensor([vocab - 7])])
    negative = torch.randint(0, first_visual, (31,))
    cond = torch.stack([prompt, negative])[None].to(device)
    return Emu3Target(model, cond.shape[2], grid), cond, None


def lumina_shaped(device: torch.device, dtype: torch.dtype, quick: bool):
    """A random Lumina-mGPT-7B-shaped target (Chameleon 7B: 32 layers, 4096 wide, 65536-token
    vocabulary, 8192 image codes at ids 4..8195; tiny with ``quick``) painting a 512-px image
    (32x32 codes, each row ending with a forced new line), and its conditions ``[1, 2, S]``."""
    if quick:
        return lumina_target(device, dtype, width=64, layers=2, heads=4, inner=128, vocab=12000, grid=8)
    return lumina_target(device, dtype, width=4096, layers=32, heads=32, inner=11008, vocab=65536, grid=32)


def lumina_target(device: torch.device, dtype: torch.dtype, *, width: int, layers: int, heads: int, inner: int,
                  vocab: int, grid: int, codes: int = 8192):
    """A random Chameleon language model in Lumina-mGPT's layout (``grid`` x ``grid`` codes, a
    forced new line after every row) and its conditions ``[1, 2, S]`` (prompt, unconditional)."""
    from types import SimpleNamespace

    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    from relaxspec.models.lumina import LuminaTarget

    names = {"<image>": 8711, **{f"IMGIMG{i}Z": 4 + i for i in range(codes)}}  # transformers reads the map
    config = ChameleonConfig(vocabulary_map=names, vocab_size=vocab, hidden_size=width, intermediate_size=inner, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                             vq_config=dict(embed_dim=4, num_embeddings=codes, base_channels=32, channel_multiplier=[1],
                                            latent_channels=4, resolution=16, attn_resolutions=[], num_res_blocks=1))
    model = _built(lambda: ChameleonForConditionalGeneration(config), device, dtype)
    # Meta's layout: image codes at 4 .. 8195, <reservedNNNNN> at NNNNN + 4.
    vocabulary = SimpleNamespace(image_ids=list(range(4, 4 + codes)), new_line=8803, image_start=8197,
                                 grid_id=lambda units: 8804 + units)
    head = [8197, 8804 + grid // 2, 8804 + grid // 2]
    prompt = torch.cat([torch.tensor([0]), torch.randint(9000, vocab, (30,)), torch.tensor([8710]),
                        torch.tensor(head)])
    uncond = torch.cat([torch.full((prompt.shape[0] - 3,), -1), torch.tensor(head)])
    cond = torch.stack([prompt, uncond])[None].to(device)
    return LuminaTarget(model, vocabulary, cond.shape[2], grid), cond, None


def _built(make, device: torch.device, dtype: torch.dtype):
    """``make()`` built on ``device`` in ``dtype`` (an 8B model never passes through the CPU)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make().eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)


FAMILY_METHODS = {"ar": dict(method="ar"), "sjd": dict(method="sjd"), "scd": dict(method="scd"),
                  "gsd": dict(method="gsd")}


def family_costs(name: str, device: torch.device, quick: bool) -> dict:
    """One transformers family at its real shape: greedy SJD == AR, AR ms/token eager and compiled,
    forward costs over 1..64 tokens, and each drafter-free method's per-step time and overhead."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    build = {"janus": janus_shaped, "emu3": emu3_shaped, "lumina": lumina_shaped}[name]
    (target, cond, mask), seconds = timed(lambda: build(device, dtype, quick), device)
    scale = {"janus": 5.0, "emu3": 3.0, "lumina": 3.0}[name]
    out = {"model": f"{name} ({'tiny' if quick else 'real shape'}, random weights)", "dtype": str(dtype),
           "tokens": target.config.block_size, "build_seconds": seconds}
    print(f"{out['model']}: built in {seconds:.1f} s", flush=True)
    greedy = SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0)
    ar = decode(target, cond, greedy, MethodOptions(method="ar"), cond_mask=mask).tokens
    sjd = decode(target, cond, greedy, MethodOptions(method="sjd"), cond_mask=mask).tokens
    out["greedy_sjd_equals_ar"] = bool(torch.equal(ar, sjd))
    print(f"{name}: greedy SJD == AR: {out['greedy_sjd_equals_ar']}", flush=True)
    sampling = SamplingConfig(cfg_scale=scale, temperature=1.0, top_k=0)
    sizes = (1, 2, 4, 8, 16) if quick else (1, 2, 4, 8, 16, 32, 48, 64)
    costs = measure_forward_costs(target, sampling=sampling, target_sizes=sizes, reps=3 if quick else 11, cond=cond,
                                  cond_mask=mask)
    out["target_forward_ms"] = {int(k): 1000 * v for k, v in costs.target.items()}
    print(f"{name}: forward ms {out['target_forward_ms']}", flush=True)
    steps = step_costs(target, cond, sampling, FAMILY_METHODS, name, device, cond_mask=mask)
    out["methods"] = steps
    target.clear_caches()
    return out


def embedded_bench(device: torch.device, folder: Path, images: int, methods: str, compile: bool,
                   seconds: float) -> dict:
    """``relaxspec bench`` of the embedded model on the device (its summary), within ``seconds``."""
    # The names mean the embedded model's tuned presets (defaults.json), as in a plain relaxspec bench.
    command = [sys.executable, "-m", "relaxspec.cli", "bench", "--device", str(device), "--num-images", str(images),
               "--methods", methods, "--no-plots", "--warmup", "1", "--out", str(folder), "--overwrite"]
    subprocess.run(command + (["--compile"] if compile else []), check=True, timeout=seconds)
    return json.loads((folder / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of this script")
    parser.add_argument("--parts", default="checks,xl,embedded",
                        help="comma-separated subset of checks, xl, embedded, janus, emu3, lumina (default: the first "
                             "three; run janus, emu3 and lumina as their own calls)")
    parser.add_argument("--budget", type=float, default=3600.0,
                        help="seconds for the whole run: items that would start past it are recorded as skipped "
                             "(eager checks and costs come first, then compilation, then bench)")
    args = parser.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    name = "gpu.json" if parts <= {"checks", "xl", "embedded"} else f"gpu-{'-'.join(sorted(parts))}.json"
    report = Report(out / name, args.budget,
                    {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "budget_seconds": args.budget})
    images = 2 if args.quick else 8
    tokens: dict = {}
    compiled_order = [*COMPILED_FIRST, *(n for n in METHODS if n not in COMPILED_FIRST)]

    def eager():
        results, got = eager_checks(device, images, METHODS)
        tokens.update(got)
        return results

    if "checks" in parts:
        report.item(("checks", "eager"), eager)
    xl = None
    made: dict = {}

    def make_xl():  # built inside an item: running out of memory there is recorded, and the run goes on
        made["model"], made["drafter"], head = xl_model(device, args.quick)
        return head

    if "xl" in parts and "error" not in report.item(("xl", "model"), make_xl):
        model, drafter = made["model"], made["drafter"]
        sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
        cond = torch.zeros(1, dtype=torch.long, device=device)
        xl = (model, drafter, sampling, cond)
        report.item(("xl", "ar_ms_per_token_eager"), lambda: xl_ar(model, device, False), need=20)
        sizes = (1, 2, 4, 8, 16) if args.quick else (1, 2, 4, 8, 16, 32, 48, 64)
        report.item(("xl", "target_forward_ms"), lambda: {
            int(k): 1000 * v for k, v in measure_forward_costs(model, sampling=sampling, target_sizes=sizes,
                                                               reps=5 if args.quick else 21).target.items()}, need=20)
        # the embedded model's codebook defines LANTERN's neighbours; the random XL has none
        for method, options in METHODS.items():
            if not method.startswith("lantern"):
                report.item(("xl", "engine", method), lambda o=options: step_cost(
                    model, cond, sampling, o, device, compile=False, drafter=drafter), need=20)
    if "checks" in parts and tokens:
        for method in compiled_order:
            report.item(("checks", "compiled", method),
                        lambda m=method: compiled_check(device, images, METHODS[m], tokens[m]), need=45)
    if xl is not None:
        model, drafter, sampling, cond = xl
        report.item(("xl", "ar_ms_per_token_compiled"), lambda: xl_ar(model, device, True), need=90)
        report.item(("xl", "target_forward_ms_compiled"), lambda: {  # what verifying a tree costs under CUDA graphs
            int(k): 1000 * v for k, v in measure_forward_costs(model, sampling=sampling, target_sizes=(1, 4, 8, 16, 32),
                                                               reps=11, compile=True).target.items()}, need=90)
        for method in compiled_order:
            if method != "ar" and not method.startswith("lantern"):
                report.item(("xl", "engine", method + " compiled"), lambda m=method: step_cost(
                    model, cond, sampling, METHODS[m], device, compile=True, drafter=drafter), need=60)
        report.item(("xl", "step_in_ar_steps"), lambda: in_ar_steps(report.data.get("xl", {})))
        report.item(("xl", "inductor_counters"), cudagraph_skips)
    if "embedded" in parts:
        count = 4 if args.quick else 12
        methods = "ar,sd,eagle2,lantern,lantern++,cool,sjd,gsd,zipar"
        report.item(("embedded", "eager"), lambda: embedded_bench(
            device, out / "bench-embedded", count, methods, False, max(report.left(), 1)), need=60)
        report.item(("embedded", "compiled"), lambda: embedded_bench(
            device, out / "bench-embedded-compiled", count, "ar,ar-compiled,lantern,zipar,eagle2", True,
            max(report.left(), 1)), need=120)
    for family in ("janus", "emu3", "lumina"):
        if family in parts:
            report.item((family,), lambda f=family: family_costs(f, device, args.quick), need=60)
    print(f"wrote {report.path}")


if __name__ == "__main__":
    main()
