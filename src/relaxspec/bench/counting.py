"""Counting what a decode asks of the device: ops, host syncs and host->device copies per step.

:class:`StepCounter` is a ``TorchFunctionMode``: every torch call made inside it is seen once.
It treats every tensor as if it lived on an accelerator (the test machine has none), so a call
that would make the host wait for the device counts as a **sync** wherever it runs:

* reading a value: ``.item()``, ``.tolist()``, ``bool()`` / ``int()`` / ``float()`` /
  ``__index__`` of a tensor, ``.numpy()``, printing;
* copies to the host: ``.cpu()`` (``.to(device)`` is not counted: on this machine it can only
  name the device a tensor is already on, a no-op);
* ops whose output size depends on the data: ``nonzero``, ``argwhere``, ``unique``,
  ``masked_select``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``;
* ``torch.multinomial`` (it reads its input's validity back on CUDA).

A read of tensors made on the host (below) is host work, not a sync. A copy of a device tensor
into a host tensor (``host.copy_(device_tensor)``) is a read: a **lagged read** with
``non_blocking=True`` (the host does not wait; the decoding loops read their count so, one step
late on a GPU: :mod:`relaxspec.decoding.loop`), a sync without.

A tensor made without ``device=`` -- by a factory (``torch.arange(n)``, ``torch.zeros(...)``)
or from host data (``torch.tensor``, ``as_tensor``, ``from_numpy``) -- lives on the host on an
accelerator, and so does a ``.cpu()`` copy and what ops make of host tensors alone. Every use of
a host tensor next to device tensors counts as a **host->device copy** (indexing or combining
device tensors with it is a pageable copy and a stream sync), and so do ``.to(device)`` of one
and host data given ``device=``. Every other call is an **op** (metadata queries such as ``size`` or
``dim`` excepted), attributed to the target's forward, the drafter's forward or the engine.

Calls are grouped into **windows** that each start when the target model's forward is entered:
window 0 holds the prefill and the first draft, window ``i`` step ``i``'s verification forward,
the walk, the commit, the drafter's catch-up and the next draft. The decode's final read-out
lands in the last window.
"""

from __future__ import annotations

import os
import traceback
import weakref
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.autograd import DeviceType

SYNC_CALLS = frozenset({
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "cpu",
    "__repr__", "__format__", "__str__", "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
    "multinomial", "equal", "allclose",
})
HOST_DATA_CALLS = frozenset({"tensor", "as_tensor", "from_numpy"})
#: Factories that make a tensor on the default device (the host) unless given ``device=``.
HOST_FACTORIES = frozenset({"arange", "zeros", "ones", "full", "empty", "eye", "linspace", "logspace", "rand",
                            "randn", "randint", "randperm", "tril_indices", "triu_indices"})
METADATA_CALLS = frozenset({
    "__get__", "size", "dim", "numel", "__len__", "stride", "is_floating_point", "is_complex", "data_ptr",
    "element_size", "is_contiguous", "storage_offset", "get_device", "__hash__",
})


def _tensors(values) -> list[torch.Tensor]:
    """The tensors among ``values``, one level into tuples and lists (indices, shapes)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


#: The installed package's own folder (``.../relaxspec/``): a site is a frame in a file under it.
#: A substring test ("relaxspec" in the path) took the caller's own file for the package's when
#: the checkout itself is called ``relaxspec`` (what ``git clone`` names it).
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_COUNTING_FILE = os.path.abspath(__file__)


def _site(name: str) -> str:
    """``name at relaxspec/<file>:<line>``: the innermost frame in the package's own files (this
    module excepted) that made the call."""
    frame = next((f for f in reversed(traceback.extract_stack()[:-2])
                  if os.path.abspath(f.filename).startswith(PACKAGE_DIR)
                  and os.path.abspath(f.filename) != _COUNTING_FILE), None)
    if frame is None:
        return name
    where = os.path.relpath(os.path.abspath(frame.filename), os.path.dirname(PACKAGE_DIR.rstrip(os.sep)))
    return f"{name} at {where}:{frame.lineno}"


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


def is_sync(name: str, args, kwargs) -> bool:
    """Whether a call would make the host wait for the device (see the module docstring)."""
    if name in SYNC_CALLS:
        return True
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if name == "where" and len(args) == 1 and not kwargs:  # torch.where(cond) is nonzero
        return True
    if name == "repeat_interleave":
        return "output_size" not in kwargs and any(isinstance(a, torch.Tensor) for a in args[1:2])
    return False


@dataclass
class Window:
    """One target forward and everything up to the next: counts and where the syncs came from."""

    syncs: int = 0
    lagged_reads: int = 0
    host_copies: int = 0
    target_ops: int = 0
    drafter_ops: int = 0
    engine_ops: int = 0
    sync_sites: list[str] = field(default_factory=list)
    copy_sites: list[str] = field(default_factory=list)


class StepCounter(TorchFunctionMode):
    """``with StepCounter(model, drafter) as counter: decode(...)`` -> ``counter.windows``.

    ``model``'s forward starts a new window; ops inside it (and inside ``drafter``'s forward)
    are counted apart from the engine's. ``sites=True`` keeps a short stack line per sync.
    """

    def __init__(self, model: torch.nn.Module, drafter: torch.nn.Module | None = None, sites: bool = True):
        super().__init__()
        self.windows: list[Window] = [Window()]
        self._host: dict[int, weakref.ref] = {}  # tensors made on the host, by id (see the module docstring)
        self.sites = sites
        self._in_target = self._in_drafter = 0
        self._hooks = []
        self._started = False
        for module, flag in ((model, "_in_target"), (drafter, "_in_drafter")):
            if module is None:
                continue
            self._hooks.append(module.register_forward_pre_hook(self._enter(flag)))
            self._hooks.append(module.register_forward_hook(self._leave(flag)))

    def _enter(self, flag: str):
        def hook(module, args):
            if flag == "_in_target" and self._in_target == 0:
                if self._started:
                    self.windows.append(Window())
                self._started = True
            setattr(self, flag, getattr(self, flag) + 1)
        return hook

    def _leave(self, flag: str):
        def hook(module, args, output):
            setattr(self, flag, getattr(self, flag) - 1)
        return hook

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        window = self.windows[-1]
        if name == "copy_" and len(args) > 1 and self._is_host_tensor(args[0]) and not self._is_host_tensor(args[1]):
            # device -> host: a read, which blocks unless asked not to
            if kwargs.get("non_blocking", False) or (len(args) > 2 and args[2]):
                window.lagged_reads += 1
            else:
                window.syncs += 1
                if self.sites:
                    window.sync_sites.append(_site(name))
            return func(*args, **kwargs)
        if is_sync(name, args, kwargs) and not self._on_host(args):
            window.syncs += 1
            if self.sites:
                window.sync_sites.append(_site(name))
        elif name in HOST_DATA_CALLS:
            if "device" in kwargs:  # host data sent to the device at once
                window.host_copies += 1
        elif name not in METADATA_CALLS:
            if self._in_target:
                window.target_ops += 1
            elif self._in_drafter:
                window.drafter_ops += 1
            else:
                window.engine_ops += 1
        result = func(*args, **kwargs)
        if name in ("cpu", "numpy") and isinstance(result, torch.Tensor) and args and result is args[0]:
            # On this machine .cpu() hands back the tensor itself; on an accelerator it is a new
            # host tensor, which only the copy must stand for.
            result = result.view_as(result)
        if name not in METADATA_CALLS:
            self._track_host(name, args, kwargs, result, window)
        return result

    # ------------------------------------------------------------------ host tensors
    def _on_host(self, args) -> bool:
        """A read of host tensors alone (set-up work on the host) makes nothing wait for the device."""
        tensors = _tensors(args)
        return bool(tensors) and all(self._is_host(t) for t in tensors)

    def _is_host_tensor(self, value) -> bool:
        return isinstance(value, torch.Tensor) and self._is_host(value)

    def _is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _mark_host(self, value) -> None:
        if isinstance(value, torch.Tensor):
            ident = id(value)
            self._host[ident] = weakref.ref(value, lambda _, ident=ident: self._host.pop(ident, None))

    def _track_host(self, name: str, args, kwargs, result, window: Window) -> None:
        """Host tensors: made by a factory without ``device=``, or by ops on host tensors alone;
        one mixed into a call with device tensors, or moved with ``.to``, is a host->device copy."""
        if name in HOST_FACTORIES or name in HOST_DATA_CALLS:
            if "device" not in kwargs:
                self._mark_host(result)
            return
        if name in ("cpu", "numpy"):  # a copy to the host: what follows is host work
            self._mark_host(result)
            return
        tensors = [t for t in _tensors(args) + _tensors(tuple(kwargs.values()))]
        if not tensors:
            return
        host = [t for t in tensors if self._is_host(t)]
        if not host:
            return
        if name in ("to", "cuda"):  # moved to the device: one copy, and the result is a device tensor
            window.host_copies += 1
            if self.sites:
                window.copy_sites.append(_site(name))
            self._host.pop(id(result), None)
            return
        if len(host) < len(tensors):
            window.host_copies += len(host)
            if self.sites:
                window.copy_sites.append(_site(name))
            return
        for out in _tensors(result if isinstance(result, (tuple, list)) else (result,)):
            self._mark_host(out)

    # ------------------------------------------------------------------ summaries
    @property
    def steps(self) -> list[Window]:
        """The windows of the speculative (or AR) steps: all but the prefill's and the last,
        which also holds the decode's final read-out."""
        return self.windows[1:-1]

    def per_step(self) -> dict[str, float]:
        """Mean counts per step (over :attr:`steps`) and the largest sync count of any step."""
        steps = self.steps or self.windows
        n = len(steps)
        mean = lambda attr: sum(getattr(w, attr) for w in steps) / n  # noqa: E731
        return {"steps": n, "syncs": mean("syncs"), "max_syncs": max(w.syncs for w in steps),
                "lagged_reads": mean("lagged_reads"), "host_copies": mean("host_copies"), "engine_ops": mean("engine_ops"),
                "drafter_ops": mean("drafter_ops"), "target_ops": mean("target_ops")}


#: What ``torch.profiler`` names a call into a graph compiled by ``torch.compile``.
COMPILED_REGION = "Torch-Compiled Region"
#: Profiler events that read a value back (on a GPU: wait for the device).
VALUE_READS = ("aten::item", "aten::_local_scalar_dense")


def top_level_events(prof) -> list[tuple[str, int]]:
    """``(name, start)`` of every CPU event of a ``torch.profiler.profile`` that no other CPU event
    of its thread encloses, in time order, read from the profiler's raw results: what
    ``prof.events()`` marks ``cpu_parent is None``, without building its tree (seconds for a
    decode whose compiled graph runs op by op)."""
    # (start + duration: torch before 2.5 has no end_ns)
    raw = sorted(((e.start_thread_id(), e.start_ns(), -(e.start_ns() + e.duration_ns()), e.name())
                  for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CPU))
    top, thread, end = [], None, 0
    for tid, start, neg_end, name in raw:
        if tid != thread or start >= end:
            top.append((name, start))
            thread, end = tid, -neg_end
    return sorted(top, key=lambda event: event[1])


def host_calls(events, steady: bool = True) -> dict:
    """What the host did in a decode profiled by ``torch.profiler`` (the profile itself, or its
    ``events()``), per step of a compiled decode: ``calls`` into compiled regions, ``ops`` (aten
    ops run outside them: eager dispatches, on a GPU kernel launches between the graphs) and
    ``reads`` of a value, counted over the top-level events. ``steady``: from the step's first
    call to its last (the step: the compiled region called most often; an image's first graphs --
    the prefill, a drafter's first catch-up -- and the eager set-up around them are left out, as
    is the read-out), over the ``steps`` between; else every event, and ``steps`` is left to the
    caller (``None``). ``names``: the aten ops counted."""
    if hasattr(events, "profiler"):  # the profile: its raw events (:func:`top_level_events`)
        top = [name for name, _ in top_level_events(events)]
    else:
        top = [e.name for e in sorted((e for e in events if e.cpu_parent is None), key=lambda e: e.time_range.start)]
    steps = None
    if steady:
        calls = _step_calls(top)
        top = top[calls[0] : calls[-1]] if len(calls) > 1 else []
        steps = max(len(calls) - 1, 0)
    counted = {"calls": sum(name.startswith(COMPILED_REGION) for name in top),
               "ops": sum(name.startswith("aten::") for name in top),
               "reads": sum(name in VALUE_READS for name in top)}
    return {**counted, "steps": steps, "names": sorted({name for name in top if name.startswith("aten::")})}


def _step_calls(top: list[str]) -> list[int]:
    """Where in ``top`` (top-level event names) the step's compiled calls are. The profiler names
    a call by its graph's frame (``Torch-Compiled Region: 3/0``): the step's is the name called
    most often. Torch before 2.5 names every call alike; there the steps are the calls after the
    last gap of eager ops much longer than a step's gap (an image's set-up between its first
    graphs and its first step), the median gap being a step's."""
    calls = [i for i, name in enumerate(top) if name.startswith(COMPILED_REGION)]
    names = [top[i] for i in calls]
    if len(set(names)) > 1:
        step = max(set(names), key=names.count)
        return [i for i in calls if top[i] == step]
    gaps = [b - a for a, b in zip(calls, calls[1:])]
    if len(gaps) < 3:
        return calls
    usual = sorted(gaps)[len(gaps) // 2]
    long = [index for index, gap in enumerate(gaps) if gap > 3 * usual + 4]
    return calls[long[-1] + 1 :] if long else calls
