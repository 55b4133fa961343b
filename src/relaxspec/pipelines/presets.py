"""Preset files: the setting ``relaxspec tune`` chose for one model on one kind of machine.

A preset file (``tune.json``) names a method and every setting it reads, the sampling it was tuned
under, what it measured (speed-up with its interval on held-out images, TV or quality figures),
and the identities it holds for: the model's weights (target and drafter, by content, so a copied
checkpoint keeps its presets) and the machine (device type and name). ``generate``, ``bench``,
``demo`` and :func:`relaxspec.generate` take one with ``--preset FILE`` / ``preset=``; a preset
made for another model, drafter or machine kind is refused with one line, because a timing
result says nothing about another machine and a tree says nothing about another drafter.

A tree the preset drafts with is a JSON file beside it (``trees/NAME.json``), named relative to
the preset's folder, so the folder can be moved or copied as a whole.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path


from relaxspec import __version__, methods
from relaxspec.devices import machine_identity, machine_kind
from relaxspec.errors import RelaxspecError, shown
from relaxspec.files import missing_file
from relaxspec.models.weights import PRECISIONS
from relaxspec.sampling import SamplingConfig

#: What a preset file says it is, and the format version this code writes and reads.
PRESET_KIND, PRESET_VERSION = "relaxspec-preset", 1
#: The --precision that opens weights in a dtype (``"bfloat16"`` -> ``"bf16"``).
PRECISION_OF = {str(dtype).replace("torch.", ""): name for name, dtype in PRECISIONS.items()}


def preset_record(options, sampling, *, pipeline, threads: int | None, batch_size: int, measured: dict,
                  budget: dict, command: str, tree_root: Path | None = None) -> dict:
    """The dictionary a preset file holds (:func:`write_preset`). ``options``: the chosen
    :class:`~relaxspec.methods.MethodOptions`; a JSON tree file it drafts with is recorded
    relative to ``tree_root`` (the preset's folder)."""
    fields = options.to_dict()
    draft = fields.get("draft")
    if tree_root is not None and isinstance(draft, str) and draft.endswith(".json"):
        try:
            fields["draft"] = Path(draft).resolve().relative_to(Path(tree_root).resolve()).as_posix()
        except ValueError:
            pass  # a tree outside the preset's folder keeps its path
    return {"kind": PRESET_KIND, "version": PRESET_VERSION, "relaxspec_version": __version__,
            "method": fields, "sampling": sampling.to_dict(), "budget": budget, "measured": measured,
            "model": pipeline.fingerprint(), "machine": machine_identity(pipeline.device),
            "threads": threads, "batch_size": batch_size, "command": command}


#: The identity fields a preset holds, each a string (``drafter`` and ``dtype`` may be null).
MODEL_FIELDS = {"family": False, "target": False, "tokenizer": True, "drafter": True, "dtype": True}
MACHINE_FIELDS = ("device_type", "name")


def read_preset(path) -> dict:
    """A preset file, checked (one-line errors): what it is, its method and settings (a tree file
    it names is resolved against the file's folder and must exist). The model and machine it was
    tuned for are checked against the model it is used with (:func:`check_preset`)."""
    if isinstance(path, bool) or not isinstance(path, (str, Path)) and not hasattr(path, "__fspath__"):
        raise RelaxspecError(f"a preset is the path of a tune.json file (relaxspec tune writes one), got {shown(path)}")
    path = Path(path)
    if missing_file(path):
        raise RelaxspecError(f"--preset {path}: {missing_file(path)}")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise RelaxspecError(f"--preset {path}: not JSON ({err})") from None
    except RecursionError:
        raise RelaxspecError(f"--preset {path}: not a relaxspec preset file (nested too deeply to read)") from None
    if not isinstance(data, dict) or data.get("kind") != PRESET_KIND:
        raise RelaxspecError(f"--preset {path}: not a relaxspec preset file (write one with relaxspec tune)")
    if data.get("version") != PRESET_VERSION:
        raise RelaxspecError(f"--preset {path}: preset format version {shown(data.get('version'))}; this relaxspec "
                             f"reads version {PRESET_VERSION}")
    fields = data.get("method")
    if not isinstance(fields, dict) or not isinstance(fields.get("method"), str):
        raise RelaxspecError(f"--preset {path}: it names no method")
    fields = dict(fields)
    draft = fields.get("draft")
    if isinstance(draft, str) and draft.endswith(".json"):
        tree = Path(draft) if Path(draft).is_absolute() else path.parent / draft
        if not tree.is_file():
            raise RelaxspecError(f"--preset {path}: its tree {draft} is missing (keep the trees/ folder beside it)")
        fields["draft"] = str(tree.resolve())
    name = fields.pop("method")
    try:
        methods.resolve(name, fields)
        SamplingConfig.from_dict(data.get("sampling") or {})
    except (RelaxspecError, TypeError, ValueError) as err:
        raise RelaxspecError(f"--preset {path}: {err}") from None
    for key in ("threads", "batch_size"):
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RelaxspecError(f"--preset {path}: {key} must be a whole number >= 1, got {shown(value)}")
    return {**data, "method": {"method": name, **fields}, "path": str(path)}


def _check_identity(path, data: dict) -> None:
    """The ``model`` and ``machine`` records every preset holds: objects of strings (a hand-edited
    file that breaks them is refused here, not half-read later)."""
    model, machine = data.get("model"), data.get("machine")
    if not isinstance(model, dict):
        raise RelaxspecError(f"--preset {path}: its \"model\" must be the model record relaxspec tune writes, got "
                             f"{shown(model)}")
    for key, nullable in MODEL_FIELDS.items():
        value = model.get(key)
        if not (isinstance(value, str) or value is None and nullable):
            raise RelaxspecError(f"--preset {path}: model.{key} must be a string, got {shown(value)}")
    if not isinstance(model.get("image_tokens"), int) or isinstance(model.get("image_tokens"), bool):
        raise RelaxspecError(f"--preset {path}: model.image_tokens must be a whole number, got "
                             f"{shown(model.get('image_tokens'))}")
    if not isinstance(machine, dict) or not all(isinstance(machine.get(key), str) for key in MACHINE_FIELDS):
        raise RelaxspecError(f"--preset {path}: its \"machine\" must name the device type and the machine it was "
                             f"tuned on ({', '.join(MACHINE_FIELDS)}), got {shown(machine)}")


def check_preset(preset: dict, pipeline) -> None:
    """Refuse, with one line, a preset made for another model, tokenizer, drafter, precision or
    machine kind."""
    where = f"--preset {preset.get('path', 'file')}"
    _check_identity(preset.get("path", "file"), preset)
    made, here = preset.get("model") or {}, pipeline.fingerprint()
    # The precision first: weights opened in another dtype have other values, hence another
    # fingerprint, and "another model" would send the user to tune what they already tuned.
    if made.get("dtype") != here["dtype"]:
        raise RelaxspecError(f"{where} was tuned with the weights in {made.get('dtype')}; they are in {here['dtype']} "
                             f"now: open the model with --precision {PRECISION_OF.get(made.get('dtype'), '...')}, or "
                             "tune again")
    if made.get("family") != here["family"] or made.get("target") != here["target"] or \
            made.get("image_tokens") != here["image_tokens"] or made.get("tokenizer") != here["tokenizer"]:
        raise RelaxspecError(f"{where} was tuned for another model ({made.get('family')}, weights "
                             f"{made.get('target')}); this is {here['family']}, weights {here['target']}: tune this "
                             "model with relaxspec tune")
    name = preset["method"]["method"]
    needs = methods.resolve(name, {k: v for k, v in preset["method"].items() if k != "method"}).needs_drafter
    if needs and here["drafter"] is None:
        raise RelaxspecError(f"{where} drafts with an EAGLE drafter and none is loaded: give the drafter it was tuned "
                             "with (--drafter-ckpt)")
    if needs and made.get("drafter") != here["drafter"]:
        raise RelaxspecError(f"{where} was tuned with another drafter (weights {made.get('drafter')}; this model's "
                             f"is {here['drafter']}): its trees and settings belong to that drafter")
    machine = preset.get("machine") or {}
    current = machine_identity(pipeline.device)
    if machine.get("device_type") != current["device_type"]:
        raise RelaxspecError(f"{where} was tuned on {machine_kind(machine)}; this model is on "
                             f"{current['device_type']} (open it with --device {machine.get('device_type')}, or tune "
                             "here)")
    if machine.get("name") != current["name"]:
        raise RelaxspecError(f"{where} was tuned on another kind of machine ({machine_kind(machine)}); this is "
                             f"{machine_kind(current)}: timings do not carry over, tune here with relaxspec tune")


def with_preset(pipeline, preset):
    """A copy of ``pipeline`` whose default method is the preset's setting (its own preset of
    that method name) and whose sampling defaults are the ones it was tuned under; ``preset``: a
    path or what :func:`read_preset` returned. The pipeline itself is left alone (the Python API
    caches the embedded one)."""
    if not isinstance(preset, dict):
        preset = read_preset(preset)
    check_preset(preset, pipeline)
    tuned = copy.copy(pipeline)
    fields = dict(preset["method"])
    name = fields.pop("method")
    tuned.presets = {**pipeline.presets, name: fields}
    tuned.default_method = name
    tuned.sampling_defaults = {**pipeline.sampling_defaults, **(preset.get("sampling") or {})}
    tuned.preset = preset
    return tuned


__all__ = ["PRESET_KIND", "PRESET_VERSION", "check_preset", "preset_record", "read_preset", "with_preset"]
