"""What an image is conditioned on, as one object, and the one check of a class list.

A :class:`Condition` carries the tensors the engine reads (``cond`` and, where the model masks
padding, ``mask``) together with what a run records about each image (its class, or its
prompt), so the three never travel apart. Pipelines make them
(:meth:`relaxspec.pipelines.ImagePipeline.conditions`); commands, the API, the demo and bench
take them as they are.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from relaxspec.errors import SHOWN_CHARS, RelaxspecError, shown


@dataclass
class Condition:
    """``cond [N, ...]`` (class ids ``[N]``, prompt features or token ids), ``mask [N, S]`` or
    ``None``, and per image what a run records (``{"class": 3}``, ``{"prompt": "a fox"}``);
    ``settings``: what the whole set is, for a run's settings (``{"classes": [...]}``)."""

    cond: Tensor
    mask: Tensor | None = None
    records: list[dict] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.records:
            self.records = [{} for _ in range(self.cond.shape[0])]
        if len(self.records) != self.cond.shape[0]:
            raise ValueError(f"{len(self.records)} records for {self.cond.shape[0]} conditions")

    def __len__(self) -> int:
        return self.cond.shape[0]

    def select(self, index: Sequence[int]) -> "Condition":
        """The conditions of images ``index`` (their records too)."""
        index = list(index)
        rows = torch.tensor(index, dtype=torch.long)
        return Condition(self.cond[rows], None if self.mask is None else self.mask[rows],
                         [self.records[i] for i in index], self.settings)

    def to(self, device) -> "Condition":
        return Condition(self.cond.to(device), None if self.mask is None else self.mask.to(device), self.records,
                         self.settings)


def _normal(name: str) -> str:
    return re.sub(r"[\s_-]+", "-", str(name).strip().lower())


def class_ids(classes: str | int | Sequence[int | str], num_classes: int, names: Sequence[str] | None = None) -> list[int]:
    """The one reading of a class list: ids, or names when the model names its classes, given as
    ``"animal-mammal, 3"`` or a list; every id checked against ``0 .. num_classes - 1``.

    Names match case-insensitively with ``-``, ``_`` and spaces interchangeable (``sky & weather``
    = ``sky-&-weather``); an unknown one is refused naming the closest."""
    if isinstance(classes, bool):
        raise RelaxspecError(f"classes must be ids or names, got {shown(classes)}")
    parts = [classes] if isinstance(classes, int) else \
        str(classes).split(",") if isinstance(classes, str) else list(classes)
    lookup = {_normal(n): i for i, n in enumerate(names)} if names is not None else {}
    ids = []
    for part in parts:
        text = str(part).strip()
        if not text:
            continue
        if isinstance(part, int) and not isinstance(part, bool) or re.fullmatch(r"-?\d+", text):
            if len(text) > 18:  # int() refuses over 4300 digits; no model has 10^18 classes
                raise RelaxspecError(f"class id {shown(text)} is out of range: this model has classes "
                                     f"0..{num_classes - 1}")
            ids.append(int(text))
        elif names is None:
            raise RelaxspecError(f"this model does not name its classes: give class ids, got {shown(text)}")
        elif _normal(text) in lookup:
            ids.append(lookup[_normal(text)])
        else:
            close = difflib.get_close_matches(text[:SHOWN_CHARS], list(names), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known classes: {', '.join(names[:8])}, ..."
            raise RelaxspecError(f"unknown class {shown(text)}{hint}")
    if not ids:
        raise RelaxspecError("no classes given")
    bad = [c for c in ids if not 0 <= c < num_classes]
    if bad:
        raise RelaxspecError(f"class id {bad[0]} is out of range: this model has classes 0..{num_classes - 1}")
    return ids


def class_condition(classes, num_classes: int, names: Sequence[str] | None = None) -> Condition:
    """Class ids (checked by :func:`class_ids`) as a :class:`Condition`."""
    ids = class_ids(classes, num_classes, names)
    return Condition(torch.tensor(ids, dtype=torch.long), None, [{"class": c} for c in ids], {"classes": ids})


def check_prompts(prompts) -> list[str]:
    """A list of non-empty prompts (a lone string is refused: it would be read letter by letter)."""
    if isinstance(prompts, str) or not prompts:
        raise RelaxspecError("give prompts as a list of texts")
    prompts = [str(p) for p in prompts]
    empty = [i for i, p in enumerate(prompts) if not p.strip()]
    if empty:
        raise RelaxspecError(f"prompt {empty[0] + 1} is empty")
    return prompts
