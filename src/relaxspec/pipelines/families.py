"""The model families relaxspec opens, and the inputs each opens its model with.

A family is a pipeline class (:class:`~relaxspec.pipelines.base.ImagePipeline`) that says how its
models are opened: what it reads them from (its :class:`OpeningInput` s: LlamaGen's weights and
VQ files and Flan-T5 folder, Lumina-mGPT's tokenizer folder, Emu3's negative prompt), which folders
it claims, and ``open``. The commands' flags, their help, ``relaxspec info`` and
:func:`~relaxspec.pipelines.open_pipeline`'s checks all come from these declarations, so a new
family touches no command.

Two kinds of family:

* a **folder family** (:class:`~relaxspec.pipelines.folders.FolderPipeline`): a transformers
  ``save_pretrained`` folder given as ``--model-path``, found by its ``config.json``
  ``model_type``;
* a **file family** (LlamaGen, or a plugin's): opened from its own files, named by an input it
  declares with ``opens=True`` (LlamaGen's weights file); it may also claim folders given as
  ``--model-path`` (``claims_folder``: LlamaGen takes its own model folders and official
  LANTERN's).

Built-in families are listed in :data:`FAMILIES`; installed packages add theirs through the
``relaxspec.families`` entry points (a folder family's name is its model type; a file family's
any name), e.g. in ``pyproject.toml``::

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
from relaxspec import methods

#: The entry-point group through which installed packages add families.
ENTRY_POINT_GROUP = "relaxspec.families"

#: The built-in file families (opened from their own files, not by a folder's model type).
FAMILIES: tuple[str, ...] = ("relaxspec.pipelines.llamagen:LlamaGenPipeline",)

#: ``config.json``'s ``model_type`` -> ``module:class`` of its pipeline (imported when used).
#: Families that share a model type are listed together: each but the last takes the folders its
#: ``claims(path)`` recognises (by their files), the last takes the rest.
FOLDER_PIPELINES: dict[str, str | tuple[str, ...]] = {
    "janus": "relaxspec.pipelines.janus:JanusPipeline",
    "emu3": "relaxspec.pipelines.emu3:Emu3Pipeline",
    "chameleon": ("relaxspec.pipelines.anole:AnolePipeline", "relaxspec.pipelines.lumina:LuminaPipeline"),
}

KINDS = ("path", "text", "int")

#: Keywords ``open_pipeline`` and ``relaxspec.generate`` take themselves (and every method setting's
#: name): a family input of one of these names would be read as the other, so its family is skipped.
RESERVED = frozenset({"model_path", "drafter_ckpt", "device", "precision", "image_size", "prompts", "prompt_length",
                      "with_drafter", "with_tokenizer", "classes", "method", "model", "sampling", "seed", "upscale",
                      "progress", "preset", "out", "threads", "batch_size"})

_warned: set[str] = set()


def _warn(message: str) -> None:
    """One stderr line per problem of an installed family, said once per process."""
    if message not in _warned:
        _warned.add(message)
        print(f"relaxspec: warning: {message}", file=sys.stderr)


@dataclass(frozen=True)
class OpeningInput:
    """One input a family opens its model with.

    Args:
        name: the keyword (``open_pipeline(tokenizer_path=...)``); the flag is ``--tokenizer-path``.
        help: what it is, for the flag's help (the families that take it are added).
        kind: ``"path"`` (a file or folder: a run records it resolved and its file identity),
            ``"text"`` or ``"int"``.
        metavar: the flag's placeholder.
        needs: the optional package reading it needs (:mod:`relaxspec.extras`), checked before any work.
        opens: given, it names a model of this family (a file family's weights file); the
            family's other inputs go with it.
        default: what the family uses when it is not given (for the help and older runs' records;
            the family applies it).
    """

    name: str
    help: str
    kind: str = "path"
    metavar: str = "DIR"
    needs: str | None = None
    opens: bool = False
    default: str | int | None = None

    def __post_init__(self):
        if not self.name.isidentifier() or self.name.startswith("_"):
            raise ValueError(f"an opening input's name is a keyword, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"an opening input's kind is one of {KINDS}, got {self.kind!r}")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Opening:
    """What every family is opened with, whatever its files (:func:`~relaxspec.pipelines.open_pipeline`).

    Args:
        model_path: a model folder (``--model-path``), or ``None`` for a file family's files.
        drafter_ckpt: an EAGLE drafter trained for the target, or ``None``.
        device: a resolved :class:`torch.device`.
        precision: the target weights' dtype name (:data:`relaxspec.models.weights.PRECISIONS`).
        image_size: pixels per side asked for, or ``None`` (the model's own).
        prompts: the prompts a folder family is opened for (its target is made for a prompt length).
        prompt_length: without prompts, the prompt tokens it is opened for.
        with_drafter: ``False`` leaves a model's own drafter out (the embedded one's).
        with_tokenizer: ``False`` when no pixels are needed (train-drafter): a family whose image
            tokenizer is a file of its own may leave it out.
    """

    model_path: str | None = None
    drafter_ckpt: str | None = None
    device: object = "cpu"
    precision: str = "fp32"
    image_size: int | None = None
    prompts: list | None = None
    prompt_length: int | None = None
    with_drafter: bool = True
    with_tokenizer: bool = True


def _load(entry: str):
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)


def _plugin_entries() -> dict[str, list[str]]:
    """Entry-point name -> ``module:Class`` from installed packages' entry points."""
    found: dict[str, list[str]] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(point.name, []).append(point.value)
    return found


def is_folder_family(family) -> bool:
    """Whether ``family`` is opened from a transformers folder found by its model type."""
    return bool(family.FOLDER)


def folder_entries() -> dict[str, list[str]]:
    """Every folder family, built-in and installed: model type -> its pipelines' ``module:Class``
    (a plugin's family for a built-in model type is tried before the built-in ones). An installed
    file family is left out (its entry-point name is no model type)."""
    entries = {t: [e] if isinstance(e, str) else list(e) for t, e in FOLDER_PIPELINES.items()}
    for model_type, plugins in _plugin_entries().items():
        plugins = [entry for entry in plugins if (family := _usable(entry)) is None or is_folder_family(family)]
        if plugins:
            entries[model_type] = plugins + entries.get(model_type, [])
    return entries


def file_families() -> list:
    """The file families (LlamaGen's, then installed packages' that load), in the order they are asked."""
    found = [_load(entry) for entry in FAMILIES]
    for plugins in _plugin_entries().values():
        found += [f for f in map(_usable, plugins) if f is not None and not is_folder_family(f)]
    return found


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

    taken = sorted({i.name for i in family.inputs} & (RESERVED | set(methods.settings())))
    if taken:
        _warn(f"the model family {entry} declares the input(s) {', '.join(taken)}, which relaxspec's own options "
              "use; it is skipped")
        return None
    return family


def all_families() -> list:
    """Every family: the file families (LlamaGen's first), then each folder family (imports the
    pipeline modules, which are light: a family's model module is imported when a model is
    opened). An installed family that does not load is left out with a warning, so it breaks no
    command."""
    classes = file_families()
    for entries in folder_entries().values():
        classes += [family for family in map(_usable, entries) if family is not None and family not in classes]
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
        if opening.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise RelaxspecError(f"{opening.flag} is a whole number, got {type(value).__name__}")
        elif not isinstance(value, str):
            raise RelaxspecError(f"{opening.flag} is {'a path' if opening.kind == 'path' else 'text'}, "
                                 f"got {type(value).__name__}")
        checked[name] = value
    return checked


def refuse_other(name: str, this: str) -> None:
    """Refuse, in one line, the input ``name`` for a model it does not go with (``this``: what the
    message calls the model)."""
    opening, takers = opening_inputs()[name]
    where = " or ".join(dict.fromkeys(t.opened_with for t in takers))
    raise RelaxspecError(f"{opening.flag} goes with {where} ({takers_text(takers)}); this model is {this}")


def check_inputs(family, given: dict, this: str | None = None) -> dict:
    """``given`` (input name -> value; :func:`known_inputs`) checked against what ``family``
    declares: an input of another family is refused in one line (``this``: what the message calls
    the model, by default its family's name)."""
    given = known_inputs(given)
    declared = {i.name for i in family.inputs}
    for name in given:
        if name not in declared:
            refuse_other(name, this or family.called or family.family)
    return given


__all__ = ["ENTRY_POINT_GROUP", "FAMILIES", "FOLDER_PIPELINES", "Opening", "OpeningInput", "RESERVED", "all_families",
           "check_inputs", "file_families", "folder_entries", "is_folder_family", "known_inputs", "opening_inputs",
           "pipeline_class", "pipeline_classes", "refuse_other", "takers_text"]
