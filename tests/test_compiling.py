"""The compiled steps' CPU linear layers (relaxspec.compiling.pack_linears): a graph of
``compiled`` multiplies by oneDNN-packed weights, everything else keeps ``nn.Linear``."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from relaxspec.compiling import PACKING_VARIABLE, PackedLinear, compiled, pack_linears, packing_enabled, unpack_linears

pytestmark = pytest.mark.skipif(not packing_enabled(), reason="packing needs oneDNN on an x86-64 CPU")


class Net(nn.Module):
    """Two linear layers (one with a bias) around a GELU, and two the step does not run: one in
    bfloat16 (packed where the CPU multiplies bf16) and one in float16 (never packed)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 48, bias=False)
        self.down = nn.Linear(48, 16)
        self.bf16 = nn.Linear(16, 16).to(torch.bfloat16)
        self.fp16 = nn.Linear(16, 16).to(torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


def net_step(net: Net, x: torch.Tensor) -> torch.Tensor:
    return net(x)


def packed_calls(fn, *args) -> int:
    """How many ``relaxspec::packed_linear`` calls one run of ``fn(*args)`` makes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(event.count for event in prof.key_averages() if event.key == "relaxspec::packed_linear")


def reference(net: Net, x: torch.Tensor) -> torch.Tensor:
    hidden = nn.functional.gelu(x @ net.up.weight.T)
    return hidden @ net.down.weight.T + net.down.bias


@torch.no_grad()
def test_a_compiled_cpu_step_multiplies_by_packed_weights():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 7, 16)
    step = compiled(net_step, torch.device("cpu"), net)
    assert type(net.up) is PackedLinear and type(net.down) is PackedLinear
    assert type(net.fp16) is nn.Linear  # aten's own kernels
    assert (type(net.bf16) is PackedLinear) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert net.up.packed_weight.layout == torch._mkldnn
    torch.testing.assert_close(step(net, x), reference(net, x), rtol=1e-5, atol=1e-5)
    assert packed_calls(step, net, x) == 2


@torch.no_grad()
def test_eager_calls_and_a_users_own_compile_keep_nn_linear():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 16)
    plain = net(x)
    pack_linears(net)
    assert torch.equal(net(x), plain)  # eager: F.linear, to the bit
    assert packed_calls(net, x) == 0
    theirs = torch.compile(net_step, fullgraph=True, dynamic=False)
    torch.testing.assert_close(theirs(net, x), plain)
    assert packed_calls(theirs, net, x) == 0


def test_a_changed_weight_is_packed_again():
    """An optimiser step (an in-place change) or a loaded state (new tensors) between two compiled
    decodes: the next ``compiled`` call packs the new weights, so the graph never multiplies by
    stale ones."""
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 16)
    with torch.no_grad():
        compiled(net_step, torch.device("cpu"), net)(net, x)
        net.up.weight.mul_(-2.0)
        torch.testing.assert_close(compiled(net_step, torch.device("cpu"), net)(net, x), reference(net, x))
    net.load_state_dict(Net().state_dict())
    with torch.no_grad():
        torch.testing.assert_close(compiled(net_step, torch.device("cpu"), net)(net, x), reference(net, x))


def test_training_through_a_compiled_step_uses_the_parameters():
    """With gradients on, the packed copy (which autograd cannot see) is never used."""
    torch.manual_seed(0)
    net, x = Net(), torch.randn(2, 16)
    compiled(net_step, torch.device("cpu"), net)(net, x).sum().backward()
    assert net.up.weight.grad is not None and net.up.weight.grad.abs().sum() > 0


def test_a_packed_model_copies_and_pickles_without_its_packed_weights():
    net = Net()
    pack_linears(net)
    for twin in (copy.deepcopy(net), pickle.loads(pickle.dumps(net))):
        assert type(twin.up) is PackedLinear and twin.up.packed_weight is None
        x = torch.randn(2, 16)
        torch.testing.assert_close(twin(x), net(x))
        pack_linears(twin)
        assert twin.up.packed_weight is not None


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU does not multiply bf16")
@torch.no_grad()
def test_a_bf16_step_multiplies_by_packed_bf16_weights():
    torch.manual_seed(0)
    net, x = Net().to(torch.bfloat16), torch.randn(2, 5, 16, dtype=torch.bfloat16)
    step = compiled(net_step, torch.device("cpu"), net)
    assert net.up.packed_weight.dtype == torch.bfloat16
    torch.testing.assert_close(step(net, x).float(), net(x).float(), rtol=2e-2, atol=2e-2)
    assert packed_calls(step, net, x) == 2


def test_graphs_running_in_two_threads_keep_packing_on_until_both_end():
    """A graph that ends must not switch packing off under another thread's graph (which would
    then fail its guard and compile again, unpacked)."""
    import relaxspec.compiling as compiling
    first, second = compiling._packed_graphs(), compiling._packed_graphs()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert compiling._packing
    second.__exit__(None, None, None)
    assert not compiling._packing


@torch.no_grad()
def test_a_weight_that_can_no_longer_be_packed_goes_back_to_f_linear():
    """A dtype or device the packing does not cover (here float64) after a packed decode: the
    stale packed copy is dropped, not multiplied by."""
    torch.manual_seed(0)
    net = Net()
    compiled(net_step, torch.device("cpu"), net)(net, torch.randn(2, 16))
    net.to(torch.float64)
    x = torch.randn(2, 16, dtype=torch.float64)
    step = compiled(net_step, torch.device("cpu"), net)
    assert type(net.up) is nn.Linear and "packed_weight" not in net.up.__dict__
    torch.testing.assert_close(step(net, x), reference(net, x))


def test_a_model_made_under_inference_mode_is_packed():
    """Inference tensors keep no version count; their packing is keyed without one."""
    with torch.inference_mode():
        torch.manual_seed(0)
        net, x = Net(), torch.randn(2, 16)
        step = compiled(net_step, torch.device("cpu"), net)
        assert type(net.up) is PackedLinear
        torch.testing.assert_close(step(net, x), reference(net, x))
        assert packed_calls(step, net, x) == 2


def test_packing_can_be_turned_off(monkeypatch):
    net = Net()
    pack_linears(net)
    monkeypatch.setenv(PACKING_VARIABLE, "0")
    pack_linears(net)  # what the next compiled decode does
    assert type(net.up) is nn.Linear and "packed_weight" not in net.up.__dict__
    monkeypatch.delenv(PACKING_VARIABLE)
    pack_linears(net)
    unpack_linears(net)
    assert type(net.down) is nn.Linear


@pytest.mark.slow  # compiles a target and a drafter step
@torch.no_grad()
def test_a_compiled_decode_packs_the_target_and_the_drafter(monkeypatch):
    """The two callers of ``compiled`` that run models (the target's step, the drafter's) hand
    them over: after a compiled decode both multiply by packed weights, and the tokens are eager's.
    (Packed under either backend; aot_eager here, inductor's kernels in tests/test_fast_engine.py.)"""
    import relaxspec.compiling
    from relaxspec.decoding import decode
    from relaxspec.methods import MethodOptions

    monkeypatch.setattr(relaxspec.compiling, "BACKEND", "aot_eager")
    from relaxspec.sampling import SamplingConfig
    from helpers.engine import markov_pair

    model, drafter = markov_pair()
    cond, sampling = torch.arange(2), SamplingConfig(cfg_scale=4.0, temperature=0.0)

    def run(compile):
        return decode(model, cond, sampling, MethodOptions(method="sd", draft="chain", depth=2, compile=compile),
                      drafter=drafter, generator=torch.Generator().manual_seed(0))

    eager = run(False)
    run(True)
    assert type(model.layers[0].feed_forward.w1) is PackedLinear and type(model.output) is PackedLinear
    assert type(drafter.fc) is PackedLinear
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        again = run(True)
    calls = sum(event.count for event in prof.key_averages() if event.key == "relaxspec::packed_linear")
    assert calls > 0
    assert torch.equal(again.tokens, eager.tokens)
