"""The ``relaxspec`` command line: the application layer over the library.

Subcommands (one module each; every module only calls library functions):

* ``generate`` (:mod:`.generate`): condition -> image tokens (any decoding method) -> VQ decode ->
  PNGs, ``grid.png``, ``tokens.npy`` and ``stats.json``; resumable.
* ``info``, ``build-tree``, ``make-test-checkpoints`` (:mod:`.tools`).
* ``data``, ``train-vq``, ``train-gpt``, ``train-drafter``, ``train-classifier`` (:mod:`.train`).
* ``bench`` (:mod:`.bench`), ``tune`` (:mod:`.tune`) and ``eval`` (:mod:`.eval`).
* ``demo`` (:mod:`.demo`): the web page of :mod:`relaxspec.demo`.

Every mistake a user can make ends in one line ``relaxspec: error: ...`` on stderr and exit code 2.
An unexpected exception still shows its traceback: that is a bug to fix, not to hide. Nothing in
the library imports this package (``tests/test_layers.py`` holds that).
"""

from __future__ import annotations

import os
import sys
import warnings

from relaxspec import __version__
from relaxspec.cli.options import Parser, UsageError, require_extras
from relaxspec.errors import PeerLost, RelaxspecError, SaidByRankZero

COMMANDS = "generate,info,data,train-vq,train-gpt,train-drafter,train-classifier,build-tree,bench,tune,eval,demo,make-test-checkpoints"


def build_parser() -> Parser:
    from relaxspec.cli import bench, demo, eval, generate, tools, train, tune

    parser = Parser(prog="relaxspec", description="Exact and relaxed speculative decoding for autoregressive image generators: "
                                                         "LlamaGen files, and transformers folders of the registered families (relaxspec info --families).")
    parser.add_argument("--version", action="version", version=f"relaxspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{" + COMMANDS + "}")
    generate.add_generate_parser(commands)
    tools.add_info_parser(commands)
    train.add_data_parser(commands)
    train.add_train_vq_parser(commands)
    train.add_train_gpt_parser(commands)
    train.add_train_drafter_parser(commands)
    bench.add_bench_parser(commands)
    tune.add_tune_parser(commands)
    eval.add_eval_parser(commands)
    demo.add_demo_parser(commands)
    train.add_train_classifier_parser(commands)
    tools.add_build_tree_parser(commands)
    tools.add_make_test_checkpoints_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 for any user error)."""
    try:
        args = build_parser().parse_args(argv)
        require_extras(args)
        with warnings.catch_warnings():
            # torch warns about the pickle protocol of non-torch pickles before refusing them; the
            # refusal itself is the message.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return args.handler(args)
    except SystemExit as done:  # --help / --version
        return done.code if isinstance(done.code, int) else 0
    except SaidByRankZero:  # a multi-process run's rank > 0: rank 0 prints the line
        return 2
    except PeerLost as err:  # the process group is broken: say it and leave before it is torn down
        _fail(str(err))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except (UsageError, RelaxspecError) as err:
        return _fail(str(err))
    except OSError as err:  # missing, unreadable or unwritable paths
        where = f"{err.filename}: " if err.filename else ""
        return _fail(f"{where}{err.strerror or err}")
    except KeyboardInterrupt:
        print("relaxspec: interrupted (finished images are kept; run again to resume)", file=sys.stderr)
        return 130


#: The longest error line printed: our messages quote user values cut short (errors.shown); this
#: is the backstop for messages that quote what they were given whole.
MAX_MESSAGE = 1000


def _fail(message: str) -> int:
    line = " ".join(message.split())
    if len(line) > MAX_MESSAGE:
        line = f"{line[:MAX_MESSAGE]}... ({len(line) - MAX_MESSAGE:,} characters cut)"
    print("relaxspec: error: " + line, file=sys.stderr)
    return 2


__all__ = ["Parser", "UsageError", "build_parser", "main"]
