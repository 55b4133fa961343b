"""The GPU measurements of docs/BENCHMARKS.md, in one run (``benchmarks/gpu.sh`` calls it).

    python benchmarks/gpu.py --device cuda --out gpu-results          # about nine minutes

The default parts (``checks,xl``) fit one 600-second call on a lent H100 / H200, compiles included,
in this order (each item is skipped, and says so, once the ``--budget`` would not cover it):

1. **Checks on the device** (the embedded model, greedy, eight images): eager tokens of ``ar``,
   ``sd-chain``, ``lantern`` (the model's preset), ``zipar`` and ``gsd`` (lossless ones == greedy
   AR), then compiled == eager for ``ar`` and ``sd-chain``, and a fused-feature (EAGLE-3) drafter's
   ``sd-chain``: eager == greedy AR, compiled == eager, nothing compiled by a second call.
2. **LlamaGen GPT-XL** (random weights, the official shape: 36 layers, 1280 wide, 16x16 tokens) in
   bf16 at batch 1 with CFG, every step compiled with CUDA graphs, the caches sized for all five
   methods first: ``ar``, ``sd-chain`` (a chain of four), ``zipar`` (rows, lead 2), ``gsd`` and
   ``lantern`` (the embedded model's preset: a chain of six, k 64 over a random codebook, delta
   0.5) -- ms a step and a token,
   MAL, each step in compiled AR steps (issue 51 holds ``sd-chain`` to 1.3 at most), and what
   each timed decode did beyond its warm-up: CUDA-graph recordings and re-recordings, cudagraph
   skips, graphs compiled (all 0 when every address holds and no setting is a constant).
3. The remaining compiled checks (``lantern``, ``zipar``, ``gsd`` compiled == eager), then GPT-XL
   eager AR and the target forward's cost over 1..64 tokens.

Other parts, each its own call: ``heldout`` (first in its call, e.g. ``--parts
heldout,checks``: the README's held-out command on the device, compiled, against compiled AR --
issue 53's exact methods at 2x compiled AR -- with the quality columns where ``data/emoji`` is
there), ``embedded`` (``relaxspec bench`` of the embedded model on the
device, eager and compiled), ``janus``, ``emu3``, ``lumina`` (the transformers families at their
real shapes, random weights: greedy SJD == AR, AR eager and compiled, forward costs, the
drafter-free methods' steps).

Writes ``OUT/gpu.json`` and ``OUT/gpu.md`` after every item, so a run cut short keeps what it
measured. ``--quick`` shrinks every part (GPT-B at 64 px, two images; with ``--device cpu`` the
graphs are traced by aot_eager): a smoke test of this script that runs on a CPU in minutes,
``python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

import relaxspec.compiling
from relaxspec import embedded
from relaxspec.bench.cost import measure_forward_costs
from relaxspec.bench.counting import host_calls
from relaxspec.decoding import decode, reserve
from relaxspec.methods import MethodOptions
from relaxspec.drafting.eagle import EagleDrafter
from relaxspec.methods import BuildContext
from relaxspec.models.llamagen.gpt import Transformer, gpt_config
from relaxspec.sampling import SamplingConfig

#: What gpu.py decodes (the embedded model's names mean its presets, as generate reads them).
METHODS = {
    "ar": dict(method="ar"),
    "sd-chain": dict(method="sd", draft="chain", depth=4),
    # the embedded model's default method with its own preset (defaults.json), as generate uses it
    "lantern": {"method": "lantern", **embedded.defaults()["presets"]["lantern"]},
    "zipar": dict(method="zipar", row_lead=2),  # rows in parallel (not the model's law)
    "gsd": dict(method="gsd"),  # reads the target's token embeddings: runs on the random XL too
    "sjd-pac": dict(method="sjd-pac"),  # the 64-node proactive tree (issue 53): exact
}
#: On GPT-XL, in the order measured (LANTERN, whose step graph is the largest to compile, last):
#: the embedded model's LANTERN preset (a chain of six, k 64 over a random codebook, delta 0.5).
XL_METHODS = {name: METHODS[name] for name in ("ar", "sd-chain", "zipar", "gsd", "lantern")}
LOSSLESS = ("sd-chain", "sjd-pac")
#: The compiled checks made before GPT-XL (the rest after it, as the budget allows).
CHECKED_FIRST = ("ar", "sd-chain")


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
    """The run's results, written to ``path`` (JSON) and beside it as markdown (``.md``) after every
    item, so a run stopped at a time limit keeps what it measured. ``budget`` seconds in all: an
    item that would start with less than its ``need`` left is recorded as skipped; an item that
    raises is recorded with its error and the run goes on (a lease on a GPU has no second try)."""

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
        self.path.with_suffix(".md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    """The record as markdown: the head's fields, then one line per measured value (nested keys
    joined by ' / '), numbers rounded."""
    lines = ["# GPU run", ""]

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix} / {key}" if prefix else str(key), inner)
        else:
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(f"- {prefix}: {shown}")

    walk("", data)
    return "\n".join(lines) + "\n"


class GraphCounts:
    """What compiling did, read before and after an item: the graphs dynamo made (``graphs``), the
    CUDA graphs recorded (``recordings``), recorded again for a function recorded before
    (``rerecordings``: an address moved) and the graphs inductor ran without CUDA graphs
    (``cudagraph_skips``). The recordings are counted by wrapping the CUDA-graph tree manager's
    ``record_function`` (a torch internal: ``None`` where this torch has none)."""

    def __init__(self):
        self.recorded: list = []
        try:
            from torch._inductor import cudagraph_trees

            manager = cudagraph_trees.CUDAGraphTreeManager
            real = manager.record_function

            def record_function(tree, new_inputs, function_id, *args, **kwargs):
                self.recorded.append(function_id)
                return real(tree, new_inputs, function_id, *args, **kwargs)

            manager.record_function = record_function
            self.hooked = True
        except (ImportError, AttributeError):
            self.hooked = False

    def read(self) -> dict:
        from torch._dynamo.utils import counters

        rerecorded = len(self.recorded) - len(set(self.recorded))
        return {"graphs": counters["stats"]["unique_graphs"],
                "recordings": len(self.recorded) if self.hooked else None,
                "rerecordings": rerecorded if self.hooked else None,
                "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}

    @staticmethod
    def since(before: dict, after: dict) -> dict:
        return {key: None if after[key] is None else after[key] - before[key] for key in after}


def embedded_parts(device: torch.device):
    return embedded.load(device=device)


def eager_checks(device: torch.device, images: int, methods: dict) -> tuple[dict, dict]:
    """Greedy tokens of every method, eager: lossless methods == greedy AR."""
    target, vq, drafter = embedded_parts(device)
    sampling = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    cond = torch.arange(images, device=device)
    tokens = {name: decode(target, cond, sampling, MethodOptions(**options), drafter=drafter, vq=vq).tokens
              for name, options in methods.items()}
    results = {name: {"equals_greedy_ar": bool(torch.equal(t, tokens["ar"])) if name in LOSSLESS + ("ar",) else None}
               for name, t in tokens.items()}
    return results, tokens


def compiled_check(device: torch.device, images: int, options: dict, eager, counts: GraphCounts) -> dict:
    """One method's greedy tokens compiled == its eager tokens (the first compiled call, which
    compiles), and a second compiled call's compiling (none expected)."""
    target, vq, drafter = embedded_parts(device)
    sampling = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    cond = torch.arange(images, device=device)
    run = lambda: decode(target, cond, sampling, MethodOptions(**options, compile=True), drafter=drafter,  # noqa: E731
                         vq=vq).tokens
    fast, seconds = timed(run, device)
    before = counts.read()
    again = run()
    return {"compiled_equals_eager": bool(torch.equal(eager, fast)) and bool(torch.equal(eager, again)),
            "first_call_seconds": seconds, "second_call": GraphCounts.since(before, counts.read())}


def fused_check(device: torch.device, images: int, ar, counts: GraphCounts) -> dict:
    """A fused-feature (EAGLE-3) drafter (untrained, on the embedded target): greedy ``sd-chain``
    eager == greedy AR, compiled == eager, and what a second compiled call compiles (nothing)."""
    target, vq, _ = embedded_parts(device)
    torch.manual_seed(0)
    drafter = EagleDrafter.for_target(target, fused_layers=True).to(device).eval()
    sampling = SamplingConfig(cfg_scale=4.0, temperature=0.0)
    cond = torch.arange(images, device=device)
    run = lambda compile: decode(target, cond, sampling, MethodOptions(**METHODS["sd-chain"], compile=compile),  # noqa: E731
                                 drafter=drafter, vq=vq).tokens
    eager = run(False)
    fast, seconds = timed(lambda: run(True), device)
    before = counts.read()
    again = run(True)
    return {"fused_layers": drafter.config.fused_layers, "eager_equals_greedy_ar": bool(torch.equal(eager, ar)),
            "compiled_equals_eager": bool(torch.equal(eager, fast)) and bool(torch.equal(eager, again)),
            "first_call_seconds": seconds, "second_call": GraphCounts.since(before, counts.read())}


def xl_model(device: torch.device, quick: bool):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = gpt_config("GPT-B" if quick else "GPT-XL", image_size=64 if quick else 256)
    torch.manual_seed(0)
    model = Transformer(config).to(device=device, dtype=dtype).eval()
    drafter = EagleDrafter.for_target(model).to(device=device, dtype=dtype).eval()
    codebook = torch.randn(config.vocab_size, 8, generator=torch.Generator().manual_seed(0))
    vq = SimpleNamespace(raw_codebook=codebook, codebook=torch.nn.functional.normalize(codebook, dim=1))
    return model, drafter, vq, {"model": "GPT-B (quick)" if quick else "GPT-XL", "dtype": str(dtype),
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


def prepared_parts(model, drafter, vq, sampling, wanted: dict, device: torch.device) -> dict:
    """Each method's options and parts (source, rule), built once, with the caches sized for them
    all (:func:`relaxspec.decoding.reserve`: every graph is then made at its final shape)."""
    parts = {}
    for name, fields in wanted.items():
        options = MethodOptions(**fields, compile=True)
        context = BuildContext(target=model, tokenizer=vq, drafter=drafter if options.needs_drafter else None,
                               sampling=sampling)
        if options.method != "ar":
            options.family.check_fits(options, context)
            options.family.use_effective(options, context)
        source, rule = (None, None) if options.method == "ar" else options.family.parts(options, context)
        reserve(model, options, source)
        parts[name] = (options, source, rule)
    return parts


def xl_compiled(model, drafter, vq, cond, sampling, prepared: tuple, device: torch.device, counts: GraphCounts,
                ar_ms: float | None) -> dict:
    """One method on GPT-XL, compiled: a warm-up decode (it compiles), then two timed decodes
    (the median time), their MAL and what they compiled or recorded (nothing, when every address
    holds); the step in compiled AR steps when AR's time per token is known."""
    options, source, rule = prepared

    def run(seed):
        return decode(model, cond, sampling, options, drafter=drafter if options.needs_drafter else None, vq=vq,
                      source=source, rule=rule, generator=torch.Generator(device=device).manual_seed(seed))

    _, warmup = timed(lambda: run(0), device)
    before = counts.read()
    results = [timed(lambda s=seed: run(s), device) for seed in (1, 2)]
    after = counts.read()
    wall = sorted(seconds for _, seconds in results)[0]
    result = results[0][0]
    steps = int(result.target_forwards[0])
    out = {"warmup_seconds": warmup, "ms_per_token": 1000 * wall / model.config.block_size,
           "ms_per_step": 1000 * wall / steps, "mal": float(result.mean_accepted_length[0]),
           "timed_decodes": GraphCounts.since(before, after)}
    if ar_ms:
        out["step_in_ar_steps"] = out["ms_per_step"] / ar_ms
    return out


def step_costs(model, cond, sampling, wanted: dict, label: str, device: torch.device, *, cond_mask=None) -> dict:
    """Each method of ``wanted``, eager and compiled: ms per token and per step, MAL, and what the
    host did per steady step (calls into compiled regions, eager aten ops, value reads:
    :func:`relaxspec.bench.counting.host_calls`), after an untimed warm-up decode."""
    costs = {}
    for name, options in wanted.items():
        for compile in (False, True):
            opts = MethodOptions(**options, compile=compile)
            run = lambda seed, o=opts: decode(model, cond, sampling, o, cond_mask=cond_mask,  # noqa: E731
                                              generator=torch.Generator(device=device).manual_seed(seed))
            run(0)
            result, wall = timed(lambda: run(1), device)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run(2)
            host = host_calls(prof)
            per_step = max(host["steps"] or 0, 1)
            steps = int(result.target_forwards[0])
            key = name + (" compiled" if compile else "")
            costs[key] = {"ms_per_token": 1000 * wall / model.config.block_size, "ms_per_step": 1000 * wall / steps,
                          "mal": float(result.mean_accepted_length[0]),
                          "host_per_step": {k: host[k] / per_step for k in ("calls", "ops", "reads")}}
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
                  "sjd-pac": dict(method="sjd-pac"), "gsd": dict(method="gsd")}


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


def run_bench(device: torch.device, folder: Path, images: int, methods: str, seconds: float, *more: str) -> dict:
    """``relaxspec bench`` of the embedded model on the device (the method names mean its tuned
    presets, defaults.json, as in a plain ``relaxspec bench``), ``more`` its further arguments; its
    summary. Stopped after ``seconds``, it is reported from the images it finished (``relaxspec
    bench`` keeps every image's record as it goes: ``--report-only`` rebuilds the summary)."""
    command = [sys.executable, "-m", "relaxspec.cli", "bench", "--device", str(device), "--num-images", str(images),
               "--methods", methods, "--no-plots", "--no-progress", "--warmup", "1", "--out", str(folder), *more]
    try:
        subprocess.run(command, check=True, timeout=max(seconds, 1))
    except subprocess.TimeoutExpired:
        subprocess.run([*command, "--report-only"], check=True, timeout=120)
    return json.loads((folder / "summary.json").read_text())


def embedded_bench(device: torch.device, folder: Path, images: int, methods: str, compile: bool,
                   seconds: float) -> dict:
    """The embedded model's speed-ups on the device, eager or compiled, against eager AR."""
    return run_bench(device, folder, images, methods, seconds, "--overwrite", *(["--compile"] if compile else []))


#: The README's held-out command's classes: 25 the tuning never saw.
HELDOUT_CLASSES = ",".join(str(c) for c in range(1, 98, 4))
#: What the held-out part races (issue 53: an exact method at 2x compiled AR), against compiled AR.
HELDOUT_METHODS = "ar-compiled,sd,sjd,scd,sjd-pac,lantern"


def heldout_bench(device: torch.device, folder: Path, images: int, seconds: float) -> dict:
    """The README's held-out command on the device: compiled, batch 1, the 25 held-out classes,
    quality against the real validation emoji (``data/emoji``, when present) with the embedded
    classifier, speed-ups against compiled AR; its summary, within ``seconds``. A run that fails
    is run again without sjd-pac, so one method failing on the device loses not the others'."""
    root = Path(__file__).resolve().parents[1]
    real = root / "data" / "emoji" / "val.npz"
    quality = (["--classifier", str(root / "src" / "relaxspec" / "embedded" / "classifier"), "--real-data", str(real)]
               if real.exists() else [])
    deadline = time.perf_counter() + seconds

    def bench(methods: str, where: Path) -> dict:
        summary = run_bench(device, where, images, methods, deadline - time.perf_counter(), "--compile", "--classes",
                            HELDOUT_CLASSES, "--baseline", "ar-compiled", *quality)
        return {**summary, "real_data": real.exists()}

    try:
        return bench(HELDOUT_METHODS, folder)
    except subprocess.CalledProcessError as error:
        rest = ",".join(m for m in HELDOUT_METHODS.split(",") if m != "sjd-pac")
        return {"error": f"{error}", "without_sjd_pac": bench(rest, folder.with_name(folder.name + "-without-sjd-pac"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test of this script")
    parser.add_argument("--parts", default="checks,xl",
                        help="comma-separated subset of heldout, checks, xl, embedded, janus, emu3, lumina "
                             "(default: checks,xl, what fits one 600-second call; run the others as their own calls)")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for the whole run: items that would start past it are recorded as skipped")
    parser.add_argument("--heldout-images", type=int, default=100, help="images of the heldout part (default 100)")
    parser.add_argument("--heldout-dir", help="the heldout part's bench folder (default OUT/bench-heldout)")
    parser.add_argument("--heldout-spare", type=float, default=150.0,
                        help="seconds of the budget the heldout part leaves to the parts after it (default 150)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.quick and device.type == "cpu":
        relaxspec.compiling.BACKEND = "aot_eager"  # traced as on the GPU, run by aten: minutes, not hours
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    name = "gpu.json" if parts <= {"checks", "xl"} else f"gpu-{'-'.join(sorted(parts))}.json"
    report = Report(out / name, args.budget,
                    {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "torch": torch.__version__, "budget_seconds": args.budget, "backend": relaxspec.compiling.BACKEND})
    counts = GraphCounts()
    images = 2 if args.quick else 8
    tokens: dict = {}

    def eager():
        results, got = eager_checks(device, images, METHODS)
        tokens.update(got)
        return results

    def checks(names, need):
        for method in names:
            if method in tokens:
                report.item(("checks", "compiled", method),
                            lambda m=method: compiled_check(device, images, METHODS[m], tokens[m], counts), need=need)

    if "heldout" in parts:  # first: it is what the run is for when asked (issue 53's held-out speed on a GPU)
        report.item(("heldout",), lambda: heldout_bench(
            device, Path(args.heldout_dir or out / "bench-heldout"), 8 if args.quick else args.heldout_images,
            max(report.left() - args.heldout_spare, 1)), need=60)
    if "checks" in parts:
        report.item(("checks", "eager"), eager, need=20)
        checks(CHECKED_FIRST, 60)
        if "ar" in tokens:
            report.item(("checks", "fused"), lambda: fused_check(device, images, tokens["ar"], counts), need=60)
    made: dict = {}

    def make_xl():  # built inside an item: running out of memory there is recorded, and the run goes on
        made["model"], made["drafter"], made["vq"], head = xl_model(device, args.quick)
        return head

    xl = "xl" in parts and "error" not in (report.item(("xl", "model"), make_xl, need=60) or {"error": 1})
    if xl:
        model, drafter, vq = made["model"], made["drafter"], made["vq"]
        sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0)
        cond = torch.zeros(1, dtype=torch.long, device=device)

        def prepare_xl():
            made["parts"] = prepared_parts(model, drafter, vq, sampling, XL_METHODS, device)
            return sorted(made["parts"])

        report.item(("xl", "prepared"), prepare_xl, need=30)
        ar_ms = None
        for method in XL_METHODS:
            if method not in made.get("parts", {}):
                continue
            value = report.item(("xl", "compiled", method), lambda m=method: xl_compiled(
                model, drafter, vq, cond, sampling, made["parts"][m], device, counts, ar_ms), need=90)
            if method == "ar" and isinstance(value, dict) and "ms_per_token" in value:
                ar_ms = value["ms_per_token"]  # AR's step commits one token: its ms per step
        report.item(("xl", "compile_counts"), counts.read)
    if "checks" in parts:
        checks([m for m in METHODS if m not in CHECKED_FIRST], 60)
    if xl:
        report.item(("xl", "ar_ms_per_token_eager"), lambda: xl_ar(model, device, False), need=30)
        sizes = (1, 2, 4, 8, 16) if args.quick else (1, 2, 4, 8, 16, 32, 48, 64)
        report.item(("xl", "target_forward_ms"), lambda: {
            int(k): 1000 * v for k, v in measure_forward_costs(model, sampling=sampling, target_sizes=sizes,
                                                               reps=5 if args.quick else 21).target.items()}, need=30)
    if "embedded" in parts:
        count = 4 if args.quick else 12
        methods = "ar,sd,eagle2,lantern,lantern++,cool,sjd,sjd-pac,gsd,zipar"
        report.item(("embedded", "eager"), lambda: embedded_bench(
            device, out / "bench-embedded", count, methods, False, max(report.left(), 1)), need=60)
        report.item(("embedded", "compiled"), lambda: embedded_bench(
            device, out / "bench-embedded-compiled", count, "ar,ar-compiled,lantern,zipar,eagle2", True,
            max(report.left(), 1)), need=120)
    for family in ("janus", "emu3", "lumina"):
        if family in parts:
            report.item((family,), lambda f=family: family_costs(f, device, args.quick), need=60)
    print(f"wrote {report.path} and {report.path.with_suffix('.md')}")


if __name__ == "__main__":
    main()
