"""Set-up kept across decodes: values derived from a live object, kept while that object lives
(:class:`PerObject`), or derived from content alone, kept by that content (:class:`ByContent`).

Set-up that depends only on a model (GSD's closeness table, tree tables, neighbour tables) is
worth keeping across decodes, but a key made of an address, a shape and a dtype is not an
identity: a new tensor can land at a freed tensor's address and read the old tensor's table
(issue 20 found GSD laws shifted by up to 0.072 that way). :class:`PerObject` keys on the
object itself, through a weak reference: an entry is dropped when its object is collected, and
a lookup checks that the object found is the very one asked about.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

import torch


class PerObject:
    """``get(owner, key, build)``: ``build()`` once per live ``owner`` and ``key``.

    At most ``kept`` owners are held (the oldest is dropped first); each owner keeps every key it
    was asked for. Owners must support weak references (tensors, modules and ordinary objects do).
    """

    def __init__(self, kept: int = 4) -> None:
        self.kept = kept
        self._entries: dict[int, tuple[weakref.ref, dict[Hashable, Any]]] = {}

    def get(self, owner: object, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``'s value for ``owner`` and ``key``, built once while ``owner`` lives (an
        owner that cannot be weakly referenced is never cached: ``build()`` every time)."""
        try:
            weakref.ref(owner)
        except TypeError:
            return build()
        ident = id(owner)
        entry = self._entries.get(ident)
        if entry is None or entry[0]() is not owner:
            # A dead owner's id can be reused by a new object: its entry is never read.
            entry = (weakref.ref(owner, self._forget(ident)), {})
            self._entries.pop(ident, None)
            while len(self._entries) >= self.kept:
                self._entries.pop(next(iter(self._entries)))
            self._entries[ident] = entry
        values = entry[1]
        if key not in values:
            values[key] = build()
        return values[key]

    def _forget(self, ident: int) -> Callable[[weakref.ref], None]:
        entries = self._entries

        def forget(ref: weakref.ref) -> None:
            entry = entries.get(ident)
            if entry is not None and entry[0] is ref:
                del entries[ident]

        return forget

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()


class ByContent:
    """``get(key, build)``: ``build()`` once per ``key``, a hashable description of the content
    the value depends on (a tree's paths and a device, a weight schedule and a device). At most
    ``kept`` values are held; the oldest is dropped first."""

    def __init__(self, kept: int = 16) -> None:
        self.kept = kept
        self._values: dict[Hashable, Any] = {}

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        if key not in self._values:
            while len(self._values) >= self.kept:
                self._values.pop(next(iter(self._values)))
            self._values[key] = build()
        return self._values[key]


_BUFFERS = PerObject(kept=8)
_SIZES = PerObject(kept=8)
#: Buffers kept per owner, and their bytes (the least recently asked go first past either): enough
#: for every method of a run on one model (bench's nine alternate image by image, each with its
#: loop state, random numbers and tables), so none is made again at a new address, which a captured
#: CUDA graph would record again.
KEPT_PER_OWNER = 1024
KEPT_BYTES_PER_OWNER = 1 << 30


def kept_buffer(owner: object, name: str, shape, dtype: torch.dtype, device) -> "torch.Tensor":
    """A buffer ``shape`` of ``dtype`` on ``device`` named ``name``, the same tensor for every call
    with the same ``owner`` (a model) and the same name, shape, dtype and device: a decode's state
    kept across decodes as the KV caches are, so a compiled step reads and updates it at the same
    address every time (:func:`relaxspec.compiling.fixed_addresses`). Its contents are whatever the
    last user left: the caller sets them. An owner keeps its most recently asked buffers, up to
    :data:`KEPT_PER_OWNER` of them and :data:`KEPT_BYTES_PER_OWNER` bytes."""
    key = (name, tuple(int(s) for s in shape), dtype, str(device))
    kept = _BUFFERS.get(owner, "buffers", OrderedDict)
    if key in kept:
        kept.move_to_end(key)
        return kept[key]
    buffer = torch.zeros(key[1], dtype=dtype, device=device)
    size = buffer.numel() * buffer.element_size()
    held = sum(t.numel() * t.element_size() for t in kept.values())
    while kept and (len(kept) >= KEPT_PER_OWNER or held + size > KEPT_BYTES_PER_OWNER):
        _, dropped = kept.popitem(last=False)
        held -= dropped.numel() * dropped.element_size()
    kept[key] = buffer
    return buffer


def kept_copy(owner: object, name: str, value: "torch.Tensor") -> "torch.Tensor":
    """``value`` copied into the :func:`kept_buffer` of its shape named ``name``: a decode's
    constant (row indices, a condition's key mask) at the address every earlier decode of that
    shape used, so a captured CUDA graph that reads it need not be recorded again."""
    return kept_buffer(owner, name, value.shape, value.dtype, value.device).copy_(value)


def grown(owner: object, name: str, size: int) -> int:
    """The largest ``size`` asked for under ``name`` for ``owner`` so far, this one included: a
    size that only grows (a KV cache's slots). Decodes that need less -- plain AR beside a
    speculative method's scratch slots, a chain beside a tree -- then run on the same cache, so a
    compiled graph keeps one shape and a CUDA graph one address (issue 51)."""
    sizes = _SIZES.get(owner, "sizes", dict)
    sizes[name] = max(sizes.get(name, 0), int(size))
    return sizes[name]


_decode_locks: "weakref.WeakKeyDictionary[object, threading.RLock]" = weakref.WeakKeyDictionary()
_decode_locks_guard = threading.Lock()


def decode_lock(model: object) -> threading.RLock:
    """The lock a decode on ``model`` holds while it runs (issue 52): the decoding state kept with
    a model -- its KV cache, the loop's buffers and noise slots (:func:`kept_buffer`) -- serves
    one decode at a time, so a second decode on the same model, from another thread, waits for
    the first instead of writing into its state. Re-entrant (a decode's callback may decode);
    dropped with the model."""
    with _decode_locks_guard:
        lock = _decode_locks.get(model)
        if lock is None:
            lock = _decode_locks[model] = threading.RLock()
        return lock
