"""``relaxspec info`` (what a checkpoint is), ``relaxspec build-tree`` (a static draft tree from
measured acceptance rates) and ``relaxspec make-test-checkpoints`` (random-weight files in the
official LlamaGen layout, for users without the released weights, the README demo and the tests)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from relaxspec.models.llamagen.checkpoints import describe
from relaxspec.models.llamagen.files import TEST_PRESETS, describe_lines, write_test_checkpoints
from relaxspec.cli.options import device_option
from relaxspec.decoding.result import add_counts
from relaxspec.pipelines.open import reopen_pipeline, folder_pipeline_class
from relaxspec.pipelines.families import opening_inputs, folder_entries, pipeline_class, file_families, all_families
from relaxspec.files import read_json
from relaxspec.inputs import check_threads
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.gpt import GPT_SIZES
from relaxspec.models.llamagen.vq import VQ_CONFIGS
from relaxspec.sampling import SamplingConfig
from relaxspec.drafting.trees import build_tree, expected_accept_length, best_tree_for_cost
from relaxspec.bench.cost import measure_forward_costs
from relaxspec import embedded

#: ``relaxspec info embedded`` describes the shipped model (unless a file of that name is there).
EMBEDDED = "embedded"
def add_info_parser(subparsers) -> None:
    info = subparsers.add_parser("info", help="describe a checkpoint",
                               description="Print a checkpoint's layout, inferred config and parameter count.")
    info.set_defaults(handler=cmd_info)
    info.add_argument("ckpt", metavar="CKPT", nargs="?", help="a checkpoint file, relaxspec or transformers folder, "
                                                              "or 'embedded' for the shipped emoji model")
    info.add_argument("--families", action="store_true", help="list the model families relaxspec opens (built in and "
                                                              "from installed packages) and the inputs each takes")
    info.add_argument("--json", action="store_true", help="print JSON")


def add_build_tree_parser(subparsers) -> None:
    tree = subparsers.add_parser("build-tree", help="choose a static draft tree from measured acceptance rates",
                               description=(
        "Pick the static tree with the largest expected accepted length for a node budget from the per-depth, "
        "per-rank acceptance counts that `relaxspec generate` stores in stats.json (measure with a wide tree, "
        "e.g. --draft static --tree probe6x8)."))
    tree.set_defaults(handler=cmd_build_tree)
    tree.add_argument("--stats", required=True, action="append", metavar="STATS_JSON",
                      help="stats.json of one or more generate runs (repeatable; counts are summed)")
    tree.add_argument("--budget", default="57", metavar="N|auto",
                      help="drafted nodes (default 57), or 'auto': time the target and drafter of the stats' run on "
                           "this machine and pick the size that commits the most tokens per second")
    tree.add_argument("--max-budget", type=int, default=64, help="largest size --budget auto considers (default 64)")
    tree.add_argument("--threads", type=int, default=None,
                      help="torch CPU threads while timing (--budget auto; default: 1 on CPU)")
    tree.add_argument("--max-depth", type=int, default=None, help="deepest level (default: as measured)")
    tree.add_argument("--max-children", type=int, default=None, help="children per node (default: as measured)")
    tree.add_argument("--min-tests", type=int, default=20,
                      help="rates measured on fewer tests are treated as 0 (default 20)")
    tree.add_argument("--out", required=True, metavar="TREE_JSON", help="where to write the tree")


def add_make_test_checkpoints_parser(subparsers) -> None:
    make = subparsers.add_parser("make-test-checkpoints", help="write random-weight checkpoints", description=(
        "Write random-weight GPT and VQ checkpoints in the official LlamaGen layout ({'model': state_dict}, "
        "upstream key names and shapes): gpt.pt and vq.pt, plus gpt.json / vq.json configs for unnamed sizes."))
    make.set_defaults(handler=cmd_make_test_checkpoints)
    make.add_argument("--out", required=True, metavar="DIR")
    make.add_argument("--preset", choices=tuple(TEST_PRESETS), default="small",
                      help="small: fast 256 px demo (default); tiny: 16 px, for unit tests")
    make.add_argument("--gpt-model", dest="gpt_size", choices=tuple(GPT_SIZES),
                      help="write this named size instead of the preset's GPT")
    make.add_argument("--vq-model", dest="vq_size", choices=tuple(VQ_CONFIGS),
                      help="write this named tokenizer instead of the preset's")
    make.add_argument("--model-type", choices=("c2i", "t2i"), default="c2i")
    make.add_argument("--image-size", type=int,
                      help="resolution the GPT config is written for (default: the preset's; 256 with --vq-model)")
    make.add_argument("--seed", type=int, default=0)


def cmd_build_tree(args: argparse.Namespace) -> int:
    tests = accepts = None
    for path in args.stats:
        data = read_json(path)
        counts = data.get("acceptance_counts") if isinstance(data, dict) else None
        if not isinstance(counts, dict) or not counts.get("tests"):
            raise RelaxspecError(f"{path}: no acceptance_counts (run relaxspec generate with a drafter method first)")
        t, a = torch.tensor(counts["tests"], dtype=torch.float64), torch.tensor(counts["accepts"], dtype=torch.float64)
        tests, accepts = add_counts(tests, t), add_counts(accepts, a)
    auto = str(args.budget).strip().lower() == "auto"
    if not auto:
        try:
            args.budget = int(args.budget)
        except ValueError:
            raise RelaxspecError(f"--budget must be a number of nodes or 'auto', got {args.budget!r}") from None
    if (not auto and args.budget < 1) or args.min_tests < 0 or args.max_budget < 1:
        raise RelaxspecError("--budget and --max-budget must be >= 1 and --min-tests >= 0")
    rates = torch.where(tests >= max(args.min_tests, 1), accepts / tests.clamp(min=1), torch.zeros_like(tests))
    record = {"rates": rates.tolist(), "tests": tests.tolist()}
    if auto:
        spec, record["costs"], record["curve"] = _tree_for_this_machine(args, rates)
    else:
        spec = build_tree(rates, args.budget, args.max_depth, args.max_children)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"paths": [list(p) for p in spec.paths], "expected_mal": 1 + expected_accept_length(spec, rates), **record}
    out.write_text(json.dumps(record) + "\n")
    print(f"{out}: {len(spec.paths)} nodes, depth {spec.depth}, per level {spec.level_sizes()}, "
          f"expected MAL {record['expected_mal']:.3f} (use --draft {out})")
    return 0


def _tree_for_this_machine(args: argparse.Namespace, rates: torch.Tensor):
    """``--budget auto``: time the stats' own target and drafter here, then pick the tree size
    with the most expected tokens per second. Returns the tree, the costs and the whole curve."""
    settings = read_json(args.stats[0]).get("settings") or {}
    named = settings.get("model_path") or any(settings.get(name) for name, (declared, _) in opening_inputs().items()
                                               if declared.opens)
    if not named or not settings.get("drafter_ckpt"):
        raise RelaxspecError(f"{args.stats[0]}: --budget auto needs a run that names its model and drafter checkpoints "
                             "(a relaxspec generate run with a drafter method)")
    device = device_option(settings.get("device", "cpu"))
    threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else None)
    if threads is not None:
        torch.set_num_threads(check_threads(threads))
    prompts = settings.get("prompts")
    # The run's own model, reopened as the run opened it (any family the pipelines serve).
    pipeline = reopen_pipeline(settings, device=device, prompts=prompts[:1] if prompts else None)
    condition = pipeline.conditions(prompts=prompts[:1]) if pipeline.takes == "prompts" else None
    sampling = SamplingConfig(**settings.get("sampling", {}))
    costs = measure_forward_costs(pipeline.target, pipeline.drafter, sampling=sampling,
                                  target_sizes=sorted({1, 2, 4, 8, 12, 16, 24, 32, 48, 64, args.max_budget + 1}),
                                  cond=None if condition is None else condition.cond.to(pipeline.device),
                                  cond_mask=None if condition is None or condition.mask is None
                                  else condition.mask.to(pipeline.device))
    spec, curve = best_tree_for_cost(rates, costs.step_seconds, args.max_budget, args.max_depth, args.max_children)
    ar = costs.target_seconds(1)
    print("nodes  depth  expected MAL  step ms  tokens/s  est. speed-up vs AR (forwards only)")
    for row in curve:
        mark = " <-" if row["nodes"] == len(spec.paths) else ""
        print(f"{row['nodes']:5d}  {row['depth']:5d}  {row['expected_mal']:12.3f}  {1000 * row['step_seconds']:7.2f}  "
              f"{row['tokens_per_second']:8.1f}  {row['tokens_per_second'] * ar:5.2f}x{mark}")
    return spec, costs.to_dict(), curve


#: transformers model types relaxspec reads, and what for.
T5_USE = "a text encoder: give it as --t5-path to encode --prompt for LlamaGen t2i models"


def transformers_use(model_type: str, path: Path | None = None) -> str:
    """What relaxspec does with a folder of ``model_type`` (the pipelines say it for theirs; the
    folder ``path`` tells families that share a model type apart)."""
    if model_type == "t5":
        return T5_USE
    if model_type in folder_entries():
        return (pipeline_class(model_type) if path is None else folder_pipeline_class(path)).usage
    return "nothing yet: this model type is not supported"


def transformers_folder(path: Path) -> dict | None:
    """What a save_pretrained folder is (``None`` if ``path`` is not one): its model type,
    architectures, weight files, and what relaxspec can do with it."""
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file() or any(f.claims_folder(path) for f in file_families()):
        return None  # a file family's folder (LANTERN's LlamaGen layout): described as its checkpoint
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(config, dict) or "model_type" not in config or "kind" in config:
        return None
    kind = config["model_type"]
    return {"path": str(path), "layout": "transformers (save_pretrained)", "model_type": kind,
            "architectures": config.get("architectures"), "hidden_size": config.get("d_model", config.get("hidden_size")),
            "safetensors": sorted(p.name for p in path.glob("*.safetensors")),
            "pickled (not read)": sorted(p.name for p in path.glob("*.bin")),
            "relaxspec reads it as": transformers_use(kind, path)}


def families_record() -> list[dict]:
    """Every registered family: how a model of it is opened, what it draws from, its own inputs."""
    types = {entry: model_type for model_type, entries in folder_entries().items() for entry in entries}
    records = []
    for family in all_families():
        entry = f"{family.__module__}:{family.__qualname__}"
        opened = family.opened_with + (f" (config.json model_type {types[entry]!r})" if entry in types else "")
        takes = family.takes or "classes or prompts (its files say)"
        records.append({"family": family.family, "opened_with": opened, "takes": takes, "pipeline": entry,
                        "inputs": [{"flag": i.flag, "keyword": i.name, "kind": i.kind, "help": i.help, "needs": i.needs}
                                   for i in family.inputs]})
    return records


def cmd_info(args: argparse.Namespace) -> int:
    if args.families:
        if args.ckpt is not None:
            raise RelaxspecError("give a checkpoint or --families, not both")
        records = families_record()
        if args.json:
            print(json.dumps(records, indent=2))
            return 0
        for record in records:
            print(f"{record['family']}: {record['opened_with']}, {record['takes']} ({record['pipeline']})")
            for given in record["inputs"]:
                needs = f"; needs {given['needs']}" if given["needs"] else ""
                print(f"    {given['flag']} / {given['keyword']}= ({given['kind']}{needs}): {given['help']}")
        return 0
    if args.ckpt is None:
        raise RelaxspecError("give a checkpoint (or 'embedded'), or --families")
    if args.ckpt == EMBEDDED and not Path(args.ckpt).exists():
        return _info_embedded(args)
    folder = transformers_folder(Path(args.ckpt))
    info = folder or describe(args.ckpt)
    if args.json:
        print(json.dumps(info, indent=2))
    elif folder is not None:
        for key, value in folder.items():
            print(f"{key + ':':22s} {', '.join(value) if isinstance(value, list) else value}")
    else:
        print("\n".join(describe_lines(info)))
    return 0


def _info_embedded(args: argparse.Namespace) -> int:
    """``relaxspec info embedded``: every shipped part, the defaults and where the model card is."""
    parts = {part: describe(folder) for part, folder in embedded.PARTS.items() if embedded.available(part)}
    if not parts:
        raise RelaxspecError("the embedded model is not in this installation")
    card = embedded.ROOT / "MODEL_CARD.md"
    if args.json:
        print(json.dumps({"parts": parts, "defaults": embedded.defaults(), "model_card": str(card)}, indent=2))
        return 0
    for part, info in parts.items():
        print(f"== {part}")
        print("\n".join(describe_lines(info)))
    defaults = embedded.defaults()
    print("== defaults (relaxspec generate / bench / relaxspec.generate with no checkpoint options)")
    for key in ("sampling", "method"):
        if key in defaults:
            print(f"{key + ':':11s} " + ", ".join(f"{k}={v}" for k, v in defaults[key].items()))
    for name, fields in defaults.get("presets", {}).items():
        print(f"{'preset:':11s} {name}: " + ", ".join(f"{k}={v}" for k, v in fields.items()))
    if "bench" in defaults:
        print(f"{'bench:':11s} " + ", ".join(f"{k}={v}" for k, v in defaults["bench"].items()))
    if "classes" in defaults:
        print(f"classes:    {defaults['classes']}")
    print(f"model card: {card}")
    return 0


def cmd_make_test_checkpoints(args: argparse.Namespace) -> int:
    print(write_test_checkpoints(args.out, preset=args.preset, gpt_size=args.gpt_size, vq_size=args.vq_size,
                                 model_type=args.model_type, image_size=args.image_size, seed=args.seed))
    return 0
