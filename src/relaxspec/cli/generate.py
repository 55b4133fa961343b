"""``relaxspec generate``: condition -> image tokens (any decoding method) -> VQ decode -> PNGs,
``grid.png``, ``tokens.npy`` and ``stats.json``; resumable (finished batches of the same settings
are kept). Its options are :mod:`.imagerun`'s; the run is :mod:`relaxspec.runs.images`'s."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from relaxspec.cli.imagerun import add_image_run_options, prepare, run_settings
from relaxspec.runs.images import summary, write_image_run


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    gen = subparsers.add_parser("generate", help="generate images", description=(
        "Generate images with a LlamaGen checkpoint (or, with --model-path, a transformers folder of a registered "
        "family; the embedded emoji model without either). "
        "Writes NNNN.png per image, grid.png, tokens.npy "
        "and stats.json into --out; an interrupted run resumes when started again with the same settings."))
    gen.set_defaults(handler=cmd_generate)
    add_image_run_options(gen)
    return gen



def cmd_generate(args: argparse.Namespace) -> int:
    wall = time.perf_counter()
    pipeline, condition, prepared = prepare(args)
    settings = run_settings(args, pipeline, prepared, condition)
    out = Path(args.out)
    stats = write_image_run(pipeline, condition, prepared, out, settings, seed=args.seed,
                            batch_size=args.batch_size, overwrite=args.overwrite, progress=not args.no_progress,
                            grid_max=args.grid_max, upscale_by=args.upscale, started=wall)
    print(summary(out, stats))
    return 0
