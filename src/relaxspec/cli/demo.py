"""``relaxspec demo``: a local web page racing plain and speculative decoding (optional extra:
``pip install "relaxspec[demo]"``, gradio)."""

from __future__ import annotations

import argparse
import errno
import os
import socket
from pathlib import Path

from relaxspec.cli.options import add_model_options, device_option, model_family, open_from_args
from relaxspec.errors import RelaxspecError, shown
from relaxspec.extras import require
from relaxspec.pipelines.folders import DEFAULT_PROMPT_TOKENS
from relaxspec.demo.race import DemoModel
from relaxspec.pipelines.presets import read_preset, with_preset
from relaxspec.threads import DEFAULT_HELP, set_threads


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    demo = subparsers.add_parser("demo", help="a local web page racing plain and speculative decoding", description=(
        "Serve a web page (gradio) where one press decodes the same image plainly and with a chosen method, "
        "streaming both as tokens are committed, with wall time, target forwards, MAL, speed-up, the sum "
        "of one-step TVs and a heat map of accepted lengths. Binds to 127.0.0.1 unless --host says otherwise."))
    demo.set_defaults(handler=cmd_demo)
    models = demo.add_argument_group("models (default: the embedded emoji model, its drafter and presets)")
    add_model_options(models, drafter_help="EAGLE drafter (without one: sjd, scd and gsd only)")
    models.add_argument("--prompt", metavar="TEXT", help="a text-to-image model: the prompt the page starts with")
    models.add_argument("--threads", type=int, help=f"CPU threads for torch ({DEFAULT_HELP})")
    models.add_argument("--preset", metavar="TUNE_JSON", help="a preset file from relaxspec tune for this model on "
                                                             "this kind of machine: the page races its setting")
    page = demo.add_argument_group("page")
    page.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    page.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    page.add_argument("--out", default="demo-out", metavar="DIR",
                      help="where the page keeps its runs' images (and gradio its temporary files); default demo-out")
    return demo


#: Prompt tokens the page's model is opened for: any prompt up to this length races.
PAGE_PROMPT_TOKENS = DEFAULT_PROMPT_TOKENS
#: The prompt the page starts with, unless --prompt says.
DEFAULT_PROMPT = "a red fox in the snow"


def load_demo_model(args: argparse.Namespace):
    """The pipeline ``args`` name (as every command opens it), with the method and class or
    prompt the page starts with."""
    family = model_family(args)
    embedded = family is None
    if embedded and args.prompt is not None:
        raise RelaxspecError("--prompt goes with a text-to-image model; the embedded model is class-conditional "
                             "(the page picks a class)")
    preset = None
    if getattr(args, "preset", None) is not None:
        preset = read_preset(args.preset)  # checked before any weights load
        if args.threads is None and preset.get("threads"):
            args.threads = int(preset["threads"])
    args.threads = set_threads(args.threads, device_option(args.device), small=embedded)
    prompt = None
    if family is not None and family.takes == "prompts":  # a folder family: opened for the page's prompts
        prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        pipeline = open_from_args(args, prompts=[prompt], prompt_length=PAGE_PROMPT_TOKENS)
    else:
        pipeline = open_from_args(args)
        if pipeline.takes == "prompts":
            prompt = args.prompt if args.prompt is not None else DEFAULT_PROMPT
            pipeline.conditions(prompts=[prompt])  # what encodes prompts is read (and checked) now
        elif args.prompt is not None:
            raise RelaxspecError(f"--prompt goes with a text-to-image model; this {pipeline.family} model is "
                                 "class-conditional (the page picks a class)")
    if preset is not None:
        pipeline = with_preset(pipeline, preset)
    has_drafter = pipeline.drafter is not None
    if pipeline.default_method not in (None, "ar"):
        default = pipeline.default_method
    else:
        default = "lantern" if has_drafter else "gsd"
    if prompt is None and pipeline.default_classes:
        first = pipeline.default_classes
        prompt = first.split(",")[0].strip() if isinstance(first, str) else str(first[0])
    return DemoModel(pipeline, default, prompt)


def check_host(host: str, port: int) -> None:
    """``--host`` / ``--port`` as the page will bind them, tried before the model loads: an address
    that is no address of this machine, or a port in use, is one line (gradio says "Cannot find
    empty port" for both)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError, ValueError) as err:
        raise RelaxspecError(f"--host {shown(host)}: not an address or a name this machine resolves "
                             f"({getattr(err, 'strerror', None) or err})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as err:
            why = "the port is in use" if err.errno == errno.EADDRINUSE else \
                "not an address of this machine" if err.errno == errno.EADDRNOTAVAIL else err.strerror
            raise RelaxspecError(f"cannot serve on {host}:{port}: {why}") from None


def cmd_demo(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise RelaxspecError(f"--port must be 1..65535, got {args.port}")
    require("gradio", "relaxspec demo")
    check_host(args.host, args.port)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RelaxspecError(f"--out {out}: exists and is not a folder")
    model = load_demo_model(args)
    out.mkdir(parents=True, exist_ok=True)
    # gradio keeps the images it serves in its temporary folder: inside --out, not in /tmp.
    os.environ["GRADIO_TEMP_DIR"] = str((out / "gradio-tmp").resolve())
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from relaxspec.demo.app import build_app, launch

    app = build_app(model, out)
    print(f"relaxspec demo: http://{args.host}:{args.port} (Ctrl-C stops it; runs are kept in {out})")
    launch(app, args.host, args.port, block=True, quiet=True, out=out)
    return 0
