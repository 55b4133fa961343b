"""``relaxspec demo``: a local web page racing plain and speculative decoding (optional extra:
``pip install "relaxspec[demo]"``, gradio)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from relaxspec.api import UPSTREAM_SAMPLING
from relaxspec.cli.options import add_model_options, device_option
from relaxspec.errors import RelaxspecError


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    demo = subparsers.add_parser("demo", help="a local web page racing plain and speculative decoding", description=(
        "Serve a web page (gradio) where one press decodes the same image plainly and with a chosen method, "
        "streaming both as tokens are committed, with wall time, target forwards, MAL, speed-up, the sum "
        "of one-step TVs and a heat map of accepted lengths. Binds to 127.0.0.1 unless --host says otherwise."))
    demo.set_defaults(handler=cmd_demo)
    models = demo.add_argument_group("models (default: the embedded emoji model, its drafter and presets)")
    add_model_options(models, drafter_help="EAGLE drafter (without one: sjd, scd and gsd only)")
    models.add_argument("--model-path", metavar="DIR", help="a transformers model folder (Janus / Janus-Pro, Emu3): "
                                                           "the page takes prompts")
    models.add_argument("--prompt", metavar="TEXT", help="--model-path: the prompt the page starts with")
    models.add_argument("--negative-prompt", metavar="TEXT", help="Emu3: the guidance's negative prompt "
                                                                  "(default: its family's)")
    models.add_argument("--threads", type=int, help="CPU threads for torch (default 1 for the embedded model)")
    page = demo.add_argument_group("page")
    page.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    page.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    page.add_argument("--out", default="demo-out", metavar="DIR",
                      help="where the page keeps its runs' images (and gradio its temporary files); default demo-out")
    return demo


#: Prompt tokens the page's model is opened for: any prompt up to this length races.
PAGE_PROMPT_TOKENS = 128
#: The prompt the page starts with, unless --prompt says.
DEFAULT_PROMPT = "a red fox in the snow"


def load_demo_model(args: argparse.Namespace):
    """The models ``args`` name, as ``relaxspec generate`` loads them, with their presets."""
    from relaxspec.cli.generate import use_embedded_defaults
    from relaxspec.demo.race import DemoModel
    from relaxspec.drafting.eagle import load_drafter
    from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq

    for name in ("cfg_scale", "temperature", "top_k", "top_p", "method", "classes"):
        setattr(args, name, None)
    if args.model_path is None and (args.prompt is not None or args.negative_prompt is not None):
        raise RelaxspecError("--prompt / --negative-prompt go with --model-path")
    embedded = use_embedded_defaults(args)
    device = device_option(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise RelaxspecError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.model_path is not None:
        from relaxspec.models import hf
        from relaxspec.models.llamagen.checkpoints import PRECISIONS

        family = hf.family(args.model_path)
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        opened = family.open_folder(args.model_path, [prompt], device=device, dtype=PRECISIONS[args.precision],
                                    image_size=args.image_size, negative_prompt=args.negative_prompt,
                                    prompt_length=PAGE_PROMPT_TOKENS)
        drafter = load_drafter(args.drafter_ckpt, opened.target) if args.drafter_ckpt else None
        sampling = {**UPSTREAM_SAMPLING, **family.sampling_defaults(args.model_path)}
        return DemoModel(opened.target, opened.tokenizer, drafter, {}, sampling, "lantern" if drafter else "gsd",
                         prompt, opened.format)
    vq = load_vq(args.vq_ckpt, args.vq_model, device=device)
    target = load_gpt(args.gpt_ckpt, args.gpt_model, image_size=args.image_size,
                      downsample=vq.config.downsample_factor, precision=args.precision, device=device)
    if target.config.model_type != "c2i":
        raise RelaxspecError("relaxspec demo takes class-conditional LlamaGen checkpoints, or a Janus / Emu3 folder with "
                             "--model-path: a LlamaGen t2i checkpoint is not served yet")
    if target.config.vocab_size != vq.config.codebook_size:
        raise RelaxspecError(f"the GPT's vocabulary ({target.config.vocab_size}) does not match the VQ codebook "
                             f"({vq.config.codebook_size}): they are not a pair")
    drafter = load_drafter(args.drafter_ckpt, target) if args.drafter_ckpt else None
    sampling = {key: getattr(args, key) if getattr(args, key) is not None else value
                for key, value in UPSTREAM_SAMPLING.items()}
    default = args.method if embedded and args.method not in (None, "ar") else ("lantern" if drafter else "gsd")
    first_class = args.classes.split(",")[0].strip() if args.classes else None
    return DemoModel(target, vq, drafter, getattr(args, "model_presets", {}) or {}, sampling, default, first_class)


def cmd_demo(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise RelaxspecError(f"--port must be 1..65535, got {args.port}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")
    model = load_demo_model(args)
    out.mkdir(parents=True, exist_ok=True)
    # gradio keeps the images it serves in its temporary folder: inside --out, not in /tmp.
    os.environ["GRADIO_TEMP_DIR"] = str((out / "gradio-tmp").resolve())
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        from relaxspec.demo.app import build_app, launch
    except ImportError as err:
        raise RelaxspecError(f"relaxspec demo needs gradio: pip install \"relaxspec[demo]\" ({err})") from None
    app = build_app(model, out)
    print(f"relaxspec demo: http://{args.host}:{args.port} (Ctrl-C stops it; runs are kept in {out})")
    launch(app, args.host, args.port, block=True, quiet=True, out=out)
    return 0
