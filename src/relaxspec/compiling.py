"""``torch.compile`` for the decoding hot path, in one place.

The functions compiled are the model steps (the target's single-token and tree-verification
forwards with their logits processing, the drafter's step): ``fullgraph=True`` so a graph break
is an error, ``dynamic=False`` so every tensor shape is a constant of its graph (the engine keeps
shapes static: one graph per shape, compiled on first use and reused for every later step and
image). On CUDA the graphs are captured as CUDA graphs (``mode="reduce-overhead"``): a step then
costs one graph launch instead of hundreds of kernel launches.

On the CPU the forwards are matrix products over a handful of rows (one token a stream, or a
tree's few nodes), bound by reading the weights, and aten's ``linear`` reads them at a third of
the memory's speed there (MKL's small-row sgemm). A compiled step on the CPU therefore multiplies by
a copy of each float32 ``nn.Linear`` weight (bfloat16 too, where the CPU multiplies it) that oneDNN
has laid out in its blocked order once (:func:`pack_linears`, what inductor's ``freezing`` does
for weights it may treat as constants; ours are a step's inputs): 1.3-1.6x faster products at 2
to 28 rows on this project's CPU, in float32 and in bfloat16. Eager calls keep ``F.linear`` and its
exact numbers; ``RELAXSPEC_PACK_WEIGHTS=0`` keeps it in compiled steps too (:func:`packing_enabled`).
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

#: Graphs one process may compile of one function (a decoding step: one per method, draft shape,
#: rule and batch size in use); dynamo's default of 8 would fall back to eager.
RECOMPILE_LIMIT = 256

#: The compiler backend: inductor (kernels generated for the device; CUDA graphs on a GPU). A test
#: that checks what dynamo traces -- whole steps, no graph breaks, no recompiles, the same tokens --
#: and not what inductor generates may set ``"aot_eager"`` (the traced graphs run by aten), which
#: compiles in a fraction of the time.
BACKEND = "inductor"

_compiled: dict[tuple[Callable, str, str], Callable] = {}
# True while a graph of `compiled` runs on the CPU (in any thread): its linear layers use packed
# weights. A guard of those graphs, so a user's own torch.compile of the same model keeps F.linear.
_packing = False
_running = 0
_running_lock = threading.Lock()


@contextlib.contextmanager
def _packed_graphs():
    global _packing, _running
    with _running_lock:
        _running += 1
        _packing = True
    try:
        yield
    finally:
        with _running_lock:
            _running -= 1
            _packing = _running > 0  # another thread's graph may still be starting


def compiled(fn: Callable, device: torch.device, *modules: nn.Module) -> Callable:
    """``fn`` compiled for ``device`` (once per process; later calls reuse the same graphs).
    ``modules``: the models ``fn`` runs, whose linear layers are packed on the CPU
    (:func:`pack_linears`).

    On CUDA each call marks a new CUDA-graph step and returns tensors cloned out of the graph's
    static memory, so an output stays valid after the next replay. A function that returns
    nothing (a decoding step that updates its state in place, :mod:`relaxspec.decoding.loop`)
    costs one graph replay and no copy; the tensors it updates should keep their addresses
    (:func:`fixed_addresses`)."""
    if torch.device(device).type == "cpu":
        for module in modules:
            if isinstance(module, nn.Module):  # a family's target need only follow TargetModel
                pack_linears(module)
    key = (fn, torch.device(device).type, BACKEND)
    if key not in _compiled:
        config = torch._dynamo.config
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # older torch
        setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))
        if BACKEND != "inductor":
            graph = torch.compile(fn, fullgraph=True, dynamic=False, backend=BACKEND)

            def run(*args, **kwargs):
                with _packed_graphs():
                    return graph(*args, **kwargs)

            _compiled[key] = run
        elif key[1] == "cuda":
            graph = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")

            def run(*args, **kwargs):
                torch.compiler.cudagraph_mark_step_begin()
                out = graph(*args, **kwargs)
                if out is None:
                    return None
                return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

            _compiled[key] = run
        else:
            graph = torch.compile(fn, fullgraph=True, dynamic=False)

            def run(*args, **kwargs):
                with _packed_graphs():
                    return graph(*args, **kwargs)

            _compiled[key] = run
    return _compiled[key]


def fixed_addresses(tensors) -> None:
    """Tell the compiler that ``tensors`` (a decode's state, its random-number buffers, the KV
    caches, a rule's tables) keep their storage from one call of a compiled step to the next: a
    CUDA graph then reads and updates them where they are instead of copying each one into its own
    memory before every replay (and skipping the graph where a step updates one in place). A
    tensor whose storage does change anyway costs a re-recording, never a wrong result. Nothing
    to do off CUDA."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "cuda":
            torch._dynamo.mark_static_address(tensor, guard=False)


def tensors_of(*objects, depth: int = 6) -> list[torch.Tensor]:
    """The tensors held by ``objects``' attributes (and their dicts, lists, tuples and attributes'
    attributes, ``depth`` levels down; modules' parameters are the compiler's already): what
    :func:`fixed_addresses` is given for the parts of a step (a rule's neighbour table, a draft
    source's buffers)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(value, level: int) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
            return
        if level > depth or id(value) in seen or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(value))
        if isinstance(value, dict):
            items = list(value.values())
        elif isinstance(value, (list, tuple)):
            items = list(value)
        elif isinstance(value, nn.Module):
            items = list(value.buffers()) + [v for k, v in vars(value).items() if not k.startswith("_modules")
                                             and not k.startswith("_parameters") and not k.startswith("_buffers")]
        elif hasattr(value, "__dict__"):
            items = list(vars(value).values())
        else:
            return
        for item in items:
            visit(item, level + 1)

    for obj in objects:
        visit(obj, 0)
    return list(found.values())


# ``F.linear`` with a weight oneDNN has packed (``torch.ops.mkldnn._reorder_linear_weight``), an
# opaque op to the compiler (inductor lowers oneDNN's linear only for weights it froze itself).
# Declared with ``torch.library.Library`` rather than ``custom_op``: 2 us of dispatch a call
# instead of 12, on some sixty calls a forward.
_LIBRARY = torch.library.Library("relaxspec", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("relaxspec::packed_linear", _packed_linear_shape, lib=_LIBRARY)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that, in an inference graph of :func:`compiled` on the CPU, multiplies by
    its packed weight (``packed_weight``, kept by :func:`pack_linears`); anywhere else (eager, a
    user's own ``torch.compile``, training) it is ``nn.Linear``. The parameters, the state dict and
    eager results are unchanged; a copy or a pickle leaves the packed weight behind."""

    packed_weight: torch.Tensor | None = None
    _packed_from: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = _packing and self.packed_weight is not None and self.packed_weight.dtype == x.dtype
        if packed and torch.compiler.is_compiling() and not torch.is_grad_enabled():
            return torch.ops.relaxspec.packed_linear(x, self.packed_weight, self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)

    def __getstate__(self):
        state = dict(self.__dict__)  # oneDNN's opaque tensor can be neither copied nor pickled
        state.pop("packed_weight", None)
        state.pop("_packed_from", None)
        return state


#: Set to 0 to keep aten's ``linear`` in compiled CPU steps (no packed copies).
PACKING_VARIABLE = "RELAXSPEC_PACK_WEIGHTS"


def packing_enabled() -> bool:
    """Whether compiled CPU steps pack their weights: oneDNN present and on
    (``torch.backends.mkldnn``), an x86-64 CPU (where it was measured) and
    ``RELAXSPEC_PACK_WEIGHTS`` not 0."""
    return (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
            and platform.machine().lower() in ("x86_64", "amd64")
            and os.environ.get(PACKING_VARIABLE, "1").strip() != "0")


def pack_linears(module: nn.Module) -> None:
    """Give every float32 CPU ``nn.Linear`` of ``module`` (bfloat16 too, where the CPU multiplies
    it) a oneDNN-packed copy of its weight for compiled graphs (the class becomes
    :class:`PackedLinear`; nothing else changes). A weight changed since its packing (an optimiser
    step, a loaded state, another tensor, dtype or device) is packed again or, when it can no
    longer be packed, left to ``F.linear``. A change made through ``.data``, which torch does not
    count, is not seen: call :func:`unpack_linears` after one. Costs a second copy of those
    weights in memory; :func:`packing_enabled` says where it is done."""
    if not packing_enabled():
        unpack_linears(module)
        return
    packable = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():  # bf16 products in hardware (AVX512-BF16, AMX)
        packable.add(torch.bfloat16)
    for layer in module.modules():
        if type(layer) not in (nn.Linear, PackedLinear):
            continue  # a subclass (quantised, LoRA, ...) keeps its own forward
        weight = layer.weight
        if weight.device.type != "cpu" or weight.dtype not in packable:
            _unpack(layer)
            continue
        # an inference tensor (made under torch.inference_mode) keeps no version count
        version = None if weight.is_inference() else weight._version
        source = layer.__dict__.get("_packed_from")
        if source is None or source[0]() is not weight or source[1:] != (weight.data_ptr(), version):
            with torch.no_grad():
                layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            layer._packed_from = (weakref.ref(weight), weight.data_ptr(), version)
        layer.__class__ = PackedLinear


def unpack_linears(module: nn.Module) -> None:
    """Undo :func:`pack_linears`: every :class:`PackedLinear` of ``module`` is an ``nn.Linear``
    again, its packed copy freed (the next compiled CPU decode packs afresh)."""
    for layer in module.modules():
        _unpack(layer)


def _unpack(layer: nn.Module) -> None:
    if type(layer) is PackedLinear:
        layer.__dict__.pop("packed_weight", None)
        layer.__dict__.pop("_packed_from", None)
        layer.__class__ = nn.Linear
