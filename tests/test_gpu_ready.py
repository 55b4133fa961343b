"""The compiled step as a GPU runs it (issue 51), checked on the CPU by what is exact here: the
code inductor generates (no copy of a KV cache), dynamo's graph counts (no graph for a new
setting), the storages every graph reads at each call (one address from decode to decode and
method to method, what a CUDA graph replays on), what a warm compiled decode runs outside its
graphs (no matrix product: the prefill is compiled too), and the generator a decode leaves
behind (nothing drawn past the last commit, whatever the device's lag)."""

from __future__ import annotations

import pytest
import torch

import relaxspec.compiling
import relaxspec.decoding.loop
from relaxspec.bench.counting import top_level_events
from relaxspec.decoding import decode, reserve
from relaxspec.methods import MethodOptions
from relaxspec.methods import BuildContext
from relaxspec.models import hf
from relaxspec.models.llamagen.gpt import kv_index, move_kv
from relaxspec.sampling import SamplingConfig
from helpers.compiled import generated_code, largest_allocation
from helpers.engine import fake_vq, markov_pair


@pytest.fixture(scope="module")
def pair():
    return markov_pair(n_layer=1)


def inductor_code(fn, *args) -> list[str]:
    """``fn(*args)`` compiled by inductor, and the code it generated."""
    torch._dynamo.reset()
    return generated_code(torch.compile(fn, fullgraph=True, dynamic=False), *args)[1]


# --------------------------------------------------------------------------- the KV cache in place
@pytest.mark.slow
def test_kv_writes_and_moves_compile_in_place():
    """LlamaGen's compaction of all layers and the transformers families' per-layer writes and
    moves are ``index_put_`` on the cache a step receives, which inductor performs in place: the
    generated code allocates nothing the size of the store (or of one layer's K), only the values
    moved. The check has teeth: the ``scatter_`` they replace allocates a whole copy."""
    store = torch.randn(3, 2, 4, 2, 40, 16)
    src, dst = torch.tensor([[5, 6], [7, 8], [1, 2], [3, 4]]), torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
    expected = store.clone()
    move_kv(expected, src, dst)
    codes = inductor_code(lambda s, a, b, i: move_kv(s, a, b, i), store, src, dst, kv_index(store))
    assert torch.equal(store, expected)
    assert largest_allocation(codes) < store.numel() // 10

    def scattered(s, a, b):  # what move_kv was before issue 51
        index = a[None, None, :, None, :, None].expand(3, 2, -1, 2, -1, 16)
        s.scatter_(4, b[None, None, :, None, :, None].expand_as(index), s.gather(4, index))

    assert largest_allocation(inductor_code(scattered, store, src, dst)) >= store.numel()

    config = type("Text", (), dict(num_key_value_heads=2, num_attention_heads=2, hidden_size=32, num_hidden_layers=2,
                                   head_dim=16))()
    kv = hf.KVStore()
    kv.setup(config, 4, 40, torch.float32, "cpu")

    def write_and_move(store, index, slots, key, a, b):
        cache = hf.SlotCache(store, slots, index)
        cache.update(key, key, 0)
        cache.update(key, key, 1)
        moved = hf.KVStore()
        moved.store, moved.index = store, index
        moved.move(a, b)

    key = torch.randn(4, 2, 3, 16)
    slots = torch.tensor([[9, 10, 11]] * 4)
    codes = inductor_code(write_and_move, kv.store, kv.index, slots, key, src, dst)
    assert torch.equal(kv.store[0][0][:, :, 9:12], key) and torch.equal(kv.store[1][1][:, :, 9:12], key)
    assert largest_allocation(codes) < kv.store[0][0].numel() // 10


# --------------------------------------------------------------------------- settings as data
#: Every kind of step (AR, a drafter's chain, a Jacobi window, rows), sampled, with the sampling's
#: numbers and each rule's changed in turn (top-k and top-p on from the start: turning a filter on
#: or off is a change of ops, one graph): the method, the samplings tried, the rule fields tried.
BASE = dict(cfg_scale=4.0, temperature=1.0, top_k=20, top_p=0.95)
SAMPLINGS = [dict(BASE, cfg_scale=2.5), dict(BASE, temperature=0.7), dict(BASE, top_k=10), dict(BASE, top_p=0.8)]
SETTINGS = {
    "ar": (dict(method="ar"), SAMPLINGS, []),
    "lantern": (dict(method="lantern", draft="chain", depth=3, k=8, delta=0.3), SAMPLINGS, [{"delta": 0.1}]),
    "lantern++": (dict(method="lantern", draft="chain", depth=3, k=8, lam=5.0), [], [{"lam": 2.0}]),
    "lantern annealed": (dict(method="lantern", draft="chain", depth=3, k=8, delta=0.3, anneal=True), [],
                         [{"delta": 0.2}]),
    "cool": (dict(method="cool", draft="chain", depth=3, cool_delta=2.0), [], [{"cool_delta": 1.5}, {"nu": 0.4}]),
    "gsd": (dict(method="gsd", window=4, group_p_gap=0.15), SAMPLINGS[:2],
            [{"group_p_gap": 0.05}, {"group_distance": 0.3}]),
    "rows": (dict(method="sd", draft="chain", depth=2, rows=4, row_lead=2), SAMPLINGS[:2], []),
}


@pytest.mark.slow
def test_a_new_setting_compiles_nothing(pair, monkeypatch, tmp_path):
    """Issue 51: cfg scale, temperature, top-k, top-p and every rule's numbers (LANTERN's delta,
    LANTERN++'s lam, an annealed schedule, COOL-SD's weights, GSD's gap and distance) reach the
    compiled graphs as device tensors: after one warm-up decode, decoding with each changed
    setting makes no new graph (dynamo's counter) and gives what eager decoding with that setting
    gives (so the new value is read, not a stale constant). Graphs traced by aot_eager."""
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(relaxspec.compiling, "BACKEND", "aot_eager")
    model, drafter = pair
    counters = torch._dynamo.utils.counters

    def run(options: dict, sampling: dict, compile: bool):
        return decode(model, torch.arange(2), SamplingConfig(**sampling), MethodOptions(**options, compile=compile),
                      drafter=drafter, vq=fake_vq(model.config.vocab_size),
                      generator=torch.Generator().manual_seed(3))

    failures = []
    for name, (options, samplings, changes) in SETTINGS.items():
        run(options, BASE, compile=True)  # the warm-up: this method's graphs
        graphs = counters["stats"]["unique_graphs"]
        for sampling, fields in [(s, {}) for s in samplings] + [(BASE, change) for change in changes]:
            changed = {**options, **fields}
            compiled, eager = run(changed, sampling, True), run(changed, sampling, False)
            if counters["stats"]["unique_graphs"] != graphs:
                failures.append(f"{name} with {sampling} {fields}: {counters['stats']['unique_graphs'] - graphs} new graphs")
                graphs = counters["stats"]["unique_graphs"]
            if not torch.equal(compiled.tokens, eager.tokens):
                failures.append(f"{name} with {sampling} {fields}: compiled tokens are not eager's")
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------- stable addresses
def _storage(value) -> object:
    try:
        return value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # an opaque tensor (a oneDNN-packed weight): its identity
        return ("opaque", id(value))


@pytest.mark.slow
def test_every_graph_reads_the_same_storages_across_decodes_and_methods(pair, monkeypatch, tmp_path):
    """Issue 51, what CUDA graphs need to replay instead of recording again: with the caches sized
    for every method of a run first (:func:`relaxspec.decoding.reserve`, as bench does), two rounds
    of five methods (AR, an EAGLE chain exact and with LANTERN, rows in parallel with the drafter,
    GSD's Jacobi window) on one model, seeds changing, compile every graph in the first round and none in the second, and
    every graph -- an image's prefill, its drafter's first pair, each step -- reads and writes
    exactly the same storages (weights, caches, tables, settings, state, random numbers, the
    condition) at every call."""
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    calls: list[list[list]] = []
    held: list[list[torch.Tensor]] = []  # each graph's first inputs, held: a new tensor cannot take their memory

    def recording(graph, example_inputs):
        index = len(calls)
        calls.append([])

        def run(*args):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if not calls[index]:
                held.append(tensors)
            calls[index].append([_storage(t) for t in tensors])
            return graph(*args)

        return run

    monkeypatch.setattr(relaxspec.compiling, "BACKEND", recording)
    model, drafter = pair
    vq = fake_vq(model.config.vocab_size)
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0)
    options = [MethodOptions(method="ar", compile=True),
               MethodOptions(method="sd", draft="chain", depth=3, compile=True),
               MethodOptions(method="lantern", draft="chain", depth=2, k=8, delta=0.2, compile=True),
               MethodOptions(method="sd", draft="chain", depth=2, rows=4, row_lead=2, compile=True),
               MethodOptions(method="gsd", window=4, compile=True)]
    parts = [(None, None) if o.method == "ar" else
             o.family.parts(o, BuildContext(target=model, tokenizer=vq, drafter=drafter, sampling=sampling))
             for o in options]
    for chosen, (source, _) in zip(options, parts):
        reserve(model, chosen, source)
    counters = torch._dynamo.utils.counters
    for round_ in range(2):
        graphs = counters["stats"]["unique_graphs"]
        for seed, (chosen, (source, rule)) in enumerate(zip(options, parts)):
            decode(model, torch.arange(2), sampling, chosen, drafter=drafter, vq=vq, source=source, rule=rule,
                   generator=torch.Generator().manual_seed(10 * round_ + seed))
        if round_ == 1:
            assert counters["stats"]["unique_graphs"] == graphs, "a graph was compiled again in the second round"
    assert len(calls) >= 8  # five steps; the prefill and the first pairs (raster, rows), one graph each: the caches sized for all
    for index, graph_calls in enumerate(calls):
        assert len(graph_calls) >= 2, f"graph {index} ran once"
        moved = [i for i, storage in enumerate(graph_calls[0]) if any(call[i] != storage for call in graph_calls)]
        assert not moved, f"graph {index}: inputs {moved} of {len(graph_calls[0])} moved between calls"


# --------------------------------------------------------------------------- the prefill compiled
MATRIX_PRODUCTS = ("aten::linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::baddbmm",
                   "aten::scaled_dot_product_attention", "relaxspec::packed_linear")


@pytest.mark.slow
@pytest.mark.parametrize("method", [dict(method="ar"), dict(method="sd", draft="chain", depth=3),
                                    dict(method="sd", draft="chain", depth=2, rows=4, row_lead=2)])
def test_a_warm_compiled_decode_runs_every_forward_in_a_graph(pair, monkeypatch, tmp_path, method):
    """Issue 51: an image's first forwards -- the target's prefill with its first token, the
    drafter's first pair -- are compiled too, so a warm compiled decode runs no matrix product
    outside a compiled region (before: 71 for AR to 93 for an EAGLE chain on a 4-layer model)."""
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(relaxspec.compiling, "BACKEND", "aot_eager")
    model, drafter = pair

    def run(seed):
        return decode(model, torch.arange(2), SamplingConfig(cfg_scale=4.0), MethodOptions(**method, compile=True),
                      drafter=drafter, vq=fake_vq(model.config.vocab_size),
                      generator=torch.Generator().manual_seed(seed))

    run(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(1)
    top = [name for name, _ in top_level_events(prof)]
    assert sum(name.startswith("Torch-Compiled Region") for name in top) >= 3
    eager = [name for name in top if name in MATRIX_PRODUCTS]
    assert not eager, eager


# --------------------------------------------------------------------------- the generator left behind
@pytest.mark.parametrize("method", [dict(method="sd", draft="chain", depth=3), dict(method="sjd", window=4),
                                    dict(method="sd", draft="chain", depth=2, rows=4, row_lead=2)])
def test_no_number_is_drawn_after_the_last_commit(pair, monkeypatch, tmp_path, method):
    """Issue 51: on a GPU the loop reads its count one step late, so it runs a step past the last
    commit; that step's numbers are drawn and never used, and the generator is set back to where
    it was before them. A generator reused for a second image then gives that image the tokens it
    gets without the lag (and the default generator, for a decode given none, too)."""
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    model, drafter = pair

    def two_images(generator):
        run = lambda: decode(model, torch.arange(2), SamplingConfig(cfg_scale=4.0),  # noqa: E731
                             MethodOptions(**method), drafter=drafter, vq=fake_vq(model.config.vocab_size),
                             generator=generator)
        return run().tokens, run().tokens, None if generator is None else generator.get_state()

    now = two_images(torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    now_default = two_images(None)[:2]
    monkeypatch.setattr(relaxspec.decoding.loop, "read_lag", lambda device: 1)
    late = two_images(torch.Generator().manual_seed(0))
    torch.manual_seed(5)
    late_default = two_images(None)[:2]
    assert all(torch.equal(a, b) for a, b in zip(now, late))
    assert all(torch.equal(a, b) for a, b in zip(now_default, late_default))
