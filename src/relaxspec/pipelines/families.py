"""The model families relaxspec opens, and the inputs each opens its model with.

A family is a pipeline class (:class:`~relaxspec.pipelines.base.ImagePipeline`). What it needs
beyond its weights (Lumina-mGPT's Chameleon tokenizer folder, Emu3's negative prompt, a LlamaGen
t2i checkpoint's Flan-T5 folder) it declares as :class:`OpeningInput` s in its ``inputs``; the
commands' flags, their help, ``relaxspec info`` and :func:`~relaxspec.pipelines.open_pipeline`'s
checks all come from these declarations, so a new family touches no command.

Folder families (a transformers ``save_pretrained`` folder, ``--model-path``) are found by their
``config.json`` ``model_type``: the built-in ones in :data:`FOLDER_PIPELINES`, and any installed
package's in its ``relaxspec.families`` entry points (name: the model type, value:
``module:Class``), e.g. in ``pyproject.toml``::

    [project.entry-points."relaxspec.families"]
    palette = "palette_relaxspec.pipeline:PalettePipeline"
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points

from relaxspec.errors import RelaxspecError

#: The entry-point group through which installed packages add folder families.
ENTRY_POINT_GROUP = "relaxspec.families"

#: ``config.json``'s ``model_type`` -> ``module:class`` of its pipeline (imported when used).
#: Families that share a model type are listed together: each but the last takes the folders its
#: ``claims(path)`` recognises (by their files), the last takes the rest.
FOLDER_PIPELINES: dict[str, str | tuple[str, ...]] = {
    "janus": "relaxspec.pipelines.janus:JanusPipeline",
    "emu3": "relaxspec.pipelines.emu3:Emu3Pipeline",
    "chameleon": ("relaxspec.pipelines.anole:AnolePipeline", "relaxspec.pipelines.lumina:LuminaPipeline"),
}

#: The families opened from LlamaGen files (``--gpt-ckpt``), not from a folder's model type.
LLAMAGEN_PIPELINES = ("relaxspec.pipelines.llamagen:LlamaGenC2I", "relaxspec.pipelines.llamagen:LlamaGenT2I")

KINDS = ("path", "text")

#: Keywords ``open_pipeline`` and ``relaxspec.generate`` take themselves (and every method setting's
#: name): a family input of one of these names would be read as the other, so its family is skipped.
RESERVED = frozenset({"gpt_ckpt", "gpt_model", "vq_ckpt", "vq_model", "model_path", "drafter_ckpt", "device",
                      "precision", "image_size", "prompts", "prompt_length", "with_drafter", "classes", "method",
                      "model", "sampling", "seed", "upscale", "progress", "preset", "out", "threads", "batch_size"})

_warned: set[str] = set()


def _warn(message: str) -> None:
    """One stderr line per problem of an installed family, said once per process."""
    if message not in _warned:
        _warned.add(message)
        print(f"relaxspec: warning: {message}", file=sys.stderr)


@dataclass(frozen=True)
class OpeningInput:
    """One input a family opens its model with, besides the weights.

    Args:
        name: the keyword (``open_pipeline(tokenizer_path=...)``); the flag is ``--tokenizer-path``.
        help: what it is, for the flag's help (the families that take it are added).
        kind: ``"path"`` (a file or folder: a run records it resolved and its file identity) or
            ``"text"``.
        metavar: the flag's placeholder.
        needs: the optional package reading it needs (:mod:`relaxspec.extras`), checked before any work.
    """

    name: str
    help: str
    kind: str = "path"
    metavar: str = "DIR"
    needs: str | None = None

    def __post_init__(self):
        if not self.name.isidentifier() or self.name.startswith("_"):
            raise ValueError(f"an opening input's name is a keyword, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"an opening input's kind is one of {KINDS}, got {self.kind!r}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _load(entry: str):
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)


def _plugin_entries() -> dict[str, list[str]]:
    """Model type -> ``module:Class`` from installed packages' entry points."""
    found: dict[str, list[str]] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(point.name, []).append(point.value)
    return found


def folder_entries() -> dict[str, list[str]]:
    """Every folder family, built-in and installed: model type -> its pipelines' ``module:Class``
    (a plugin's family for a built-in model type is tried before the built-in ones)."""
    entries = {t: [e] if isinstance(e, str) else list(e) for t, e in FOLDER_PIPELINES.items()}
    for model_type, plugins in _plugin_entries().items():
        entries[model_type] = plugins + entries.get(model_type, [])
    return entries


def pipeline_classes(model_type: str) -> list:
    """The pipeline classes registered for ``model_type``, in the order they claim folders (one
    that does not load is refused in one line: the folder needs it)."""
    classes = [_usable(entry) for entry in folder_entries()[model_type]]
    if not all(classes):
        raise RelaxspecError(f"the model family of {model_type!r} folders does not load here (see the warning above)")
    return classes


def pipeline_class(model_type: str):
    """The pipeline class of ``model_type``; where families share it, the one that takes the
    folders no other claims."""
    return pipeline_classes(model_type)[-1]


def _usable(entry: str):
    """The pipeline class ``entry`` names, or ``None`` (with a one-line warning) when an installed
    package's family does not import or declares an input it may not."""
    try:
        family = _load(entry)
    except Exception as err:  # noqa: BLE001 - another package's code: any failure skips its family
        _warn(f"the model family {entry} (a relaxspec.families entry point) does not load "
              f"({type(err).__name__}: {err}); it is skipped")
        return None
    from relaxspec import methods

    taken = sorted({i.name for i in getattr(family, "inputs", ())} & (RESERVED | set(methods.settings())))
    if taken:
        _warn(f"the model family {entry} declares the input(s) {', '.join(taken)}, which relaxspec's own options "
              "use; it is skipped")
        return None
    return family


def all_families() -> list:
    """Every pipeline class: LlamaGen's, then each folder family's (imports the pipeline modules,
    which are light: a family's model module is imported when a folder is opened). An installed
    family that does not load is left out with a warning, so it breaks no command."""
    classes = [_load(entry) for entry in LLAMAGEN_PIPELINES]
    for entries in folder_entries().values():
        classes += [family for family in map(_usable, entries) if family is not None]
    return classes


def opening_inputs() -> dict[str, tuple[OpeningInput, list]]:
    """Every declared opening input by name, with the families that take it. Two families may
    declare the same name only as the same kind of input."""
    found: dict[str, tuple[OpeningInput, list]] = {}
    for family in all_families():
        for declared in family.inputs:
            if declared.name in found:
                first, takers = found[declared.name]
                if first.kind != declared.kind:
                    raise RelaxspecError(f"{family.family} declares the input {declared.name} as {declared.kind}, "
                                         f"{takers[0].family} as {first.kind}: one name, one kind")
                if family not in takers:
                    takers.append(family)
            else:
                found[declared.name] = (declared, [family])
    return found


def takers_text(families: list) -> str:
    """``"Emu3"``, ``"Anole or Lumina-mGPT"``: the families that take an input, for messages."""
    names = list(dict.fromkeys(f.family for f in families))
    return " or ".join(names)


def known_inputs(given: dict) -> dict:
    """``given`` (input name -> value) as inputs some family declares: ``None`` values left out, an
    unknown name or a value of the wrong kind refused in one line, paths as text."""
    known = opening_inputs()
    checked = {}
    for name, value in given.items():
        if value is None:
            continue
        if name not in known:
            raise RelaxspecError(f"{name} is not an input of any model family (they take: "
                                 f"{', '.join(sorted(known)) or 'none'})")
        opening = known[name][0]
        if opening.kind == "path" and hasattr(value, "__fspath__"):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise RelaxspecError(f"{opening.flag} is {'a path' if opening.kind == 'path' else 'text'}, "
                                 f"got {type(value).__name__}")
        checked[name] = value
    return checked


def check_inputs(family, given: dict, this: str | None = None) -> dict:
    """``given`` (input name -> value; :func:`known_inputs`) checked against what ``family``
    declares: an input of another family is refused in one line (``this``: what the message calls
    the model, by default its family's name)."""
    given = known_inputs(given)
    declared = {i.name for i in family.inputs}
    for name in given:
        if name not in declared:
            opening, takers = opening_inputs()[name]
            where = " or ".join(dict.fromkeys(t.opened_with for t in takers))
            raise RelaxspecError(f"{opening.flag} goes with {where} ({takers_text(takers)}); this model is "
                                 f"{this or family.family}")
    return given


__all__ = ["ENTRY_POINT_GROUP", "FOLDER_PIPELINES", "LLAMAGEN_PIPELINES", "OpeningInput", "RESERVED", "all_families",
           "check_inputs", "folder_entries", "known_inputs", "opening_inputs", "pipeline_class", "pipeline_classes", "takers_text"]
