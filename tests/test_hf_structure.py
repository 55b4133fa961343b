"""Every method on every transformers family, on the fast engine's terms: each lossless method
commits greedy AR's tokens and each relaxed one runs on the family's own codebook; at most one
host sync per speculative step and none per AR step, no host->device copies, and compiled steps
without graph breaks that commit the eager tokens.

Windows are cut at the first decoder layer (each prefill or step runs it once); syncs are counted
over everything, the adapters' mask and position arithmetic included."""

from __future__ import annotations

import pytest
import torch

from relaxspec import methods
from relaxspec.bench.counting import StepCounter
from relaxspec.decoding import decode
from relaxspec.decoding.target import GuidedTarget, guided_step
from relaxspec.sampling import SamplingConfig

pytest.importorskip("transformers", reason="the families need transformers (pip install -e '.[test]')")


@pytest.fixture(scope="module")
def lumina_files(tmp_path_factory):
    """A tiny Lumina-mGPT model folder and Chameleon tokenizer folder (tests/helpers/lumina.py)."""
    from helpers import lumina as lumina_fixtures

    return lumina_fixtures.lumina_folders(tmp_path_factory.mktemp("lumina"))


@pytest.fixture(scope="module")
def families(tmp_path_factory, lumina_files):
    """name -> (target, cond, cond_mask, first decoder layer, CFG scale, image tokenizer)."""
    from helpers import emu3 as test_emu3
    from helpers import janus as test_janus
    from helpers import lumina as lumina_fixtures
    from relaxspec.models import lumina
    from relaxspec.models.janus import load_janus

    folder = tmp_path_factory.mktemp("emu3")
    test_emu3.tiny_processor().save_pretrained(folder)
    test_emu3.tiny_emu3().save_pretrained(folder)
    emu3, emu3_vq, cond = test_emu3.adapter(folder)
    folder = tmp_path_factory.mktemp("janus")
    test_janus.tiny_janus().save_pretrained(folder)
    janus, janus_vq = load_janus(folder, prompt_length=7)
    ids = test_janus.PROMPTS
    chameleon = lumina.open_folder(lumina_files["model_path"], lumina_fixtures.PROMPTS,
                                   image_size=lumina_fixtures.IMAGE_SIZE, tokenizer_path=lumina_files["tokenizer_path"])
    return {"emu3": (emu3, cond, None, emu3.hf.model.text_model.layers[0], 3.0, emu3_vq),
            "janus": (janus, ids, ids != test_janus.PAD, janus.hf.model.language_model.layers[0], 5.0, janus_vq),
            "lumina": (chameleon.target, chameleon.cond, None, chameleon.target.hf.model.layers[0], 3.0,
                       chameleon.tokenizer)}


@pytest.mark.parametrize("family", ["emu3", "janus", "lumina"])
def test_every_method_on_every_family(families, family, tmp_path, monkeypatch):
    """Drafter-free methods, and exact SD / LANTERN at delta 0 with an EAGLE drafter of the
    family's own decoder layer (random weights: acceptance is rare, exactness is the point), give greedy AR's
    tokens; trees put drafts in scratch slots, so the adapters' KV compaction (Emu3's end-of-line
    companions too) is exercised. Relaxed methods, sampled, paint whole images with neighbour
    tables and groups from the family's own codebook and embeddings."""
    from relaxspec.drafting.eagle import EagleDrafter

    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    target, cond, mask, _, scale, tokenizer = families[family]
    greedy = SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0)
    ar = decode(target, cond, greedy, methods.resolve("ar"), cond_mask=mask).tokens
    torch.manual_seed(1)
    drafter = EagleDrafter.for_target(target)
    lossless = [("sjd", {"window": 4}), ("scd", {"window": 3}), ("gsd", {"window": 6, "group_p_gap": 0.0}),
                ("sjd-pac", {"window": 16}),
                ("sd", {"draft": "chain", "depth": 3}), ("sd-static", {"tree": "eagle25"}), ("eagle2", {}),
                ("lantern", {"draft": "chain", "delta": 0.0, "k": 8})]
    for name, given in lossless:
        result = decode(target, cond, greedy, methods.resolve(name, given), drafter=drafter, vq=tokenizer,
                        cond_mask=mask)
        assert torch.equal(result.tokens, ar), name
    sampling = SamplingConfig(cfg_scale=scale, top_k=20)
    relaxed = [("gsd", {"window": 4}), ("lantern", {"draft": "chain", "k": 8, "delta": 0.3}),
               ("lantern++", {"tree": "eagle25", "k": 8}), ("cool", {"draft": "chain"})]
    for name, given in relaxed:
        sampled = decode(target, cond, sampling, methods.resolve(name, given), drafter=drafter, vq=tokenizer,
                         cond_mask=mask, generator=torch.Generator().manual_seed(0))
        assert [sum(a) for a in sampled.accept_lengths] == [16] * 3, name
        assert int(sampled.tokens.min()) >= 0 and int(sampled.tokens.max()) < target.config.vocab_size


CASES = [("ar", {}, 0), ("sjd", {"window": 4}, 1), ("gsd", {"window": 4}, 1)]


@pytest.mark.parametrize("family", ["emu3", "janus", "lumina"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("name, given, budget", CASES, ids=[case[0] for case in CASES])
def test_host_syncs_per_step(families, family, temperature, name, given, budget):
    target, cond, mask, layer, scale, _ = families[family]
    sampling = SamplingConfig(cfg_scale=scale, temperature=temperature, top_k=0)
    with StepCounter(layer) as counter:
        result = decode(target, cond, sampling, methods.resolve(name, given), cond_mask=mask,
                        generator=torch.Generator().manual_seed(0))
    steps = counter.steps
    assert len(steps) == int(result.target_forwards.max()) - 2 and len(steps) >= 2
    for index, window in enumerate(steps, start=1):
        assert window.syncs <= budget, f"step {index}: {window.sync_sites}"
        assert window.host_copies == 0, f"step {index}: {window.host_copies} host->device copies"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["emu3", "janus", "lumina"])
def test_compiled_steps_have_no_graph_breaks(families, family):
    target, cond, mask, _, scale, _ = families[family]
    guided = GuidedTarget(target, cond, SamplingConfig(cfg_scale=scale), cond_mask=mask, scratch=8)
    guided.prefill()
    batch, cls = cond.shape[0], target.config.condition_length
    tokens = torch.randint(target.config.vocab_size, (batch, 5))
    positions = cls + 2 + torch.arange(5).expand(batch, 5)  # across a row end of the 4-token rows
    explain = torch._dynamo.explain
    for count in (1, 5):
        report = explain(guided_step)(target, tokens[:, :count], positions[:, :count], positions[:, :count], None,
                                      guided.key_valid, guided.device_sampling)
        assert report.graph_break_count == 0, report.break_reasons
        assert report.graph_count == 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["janus", "lumina"])
def test_a_family_s_whole_step_is_one_graph(families, family, tmp_path, monkeypatch):
    """Issue 41 on the other families' adapters (Emu3's with inductor below): a sampled SJD step --
    the family's forward, its KV compaction, the walk -- traced as one graph (aot_eager: dynamo's
    graph run by aten, seconds to compile) commits the eager tokens, and a second decode compiles
    nothing."""
    import relaxspec.compiling

    monkeypatch.setattr(relaxspec.compiling, "BACKEND", "aot_eager")
    target, cond, mask, _, scale, _ = families[family]
    sampling = SamplingConfig(cfg_scale=scale, temperature=1.0, top_k=0)

    def run(compile: bool, seed: int = 0):
        return decode(target, cond, sampling, methods.resolve("sjd", {"window": 4, "compile": compile}),
                      cond_mask=mask, generator=torch.Generator().manual_seed(seed))

    counters = torch._dynamo.utils.counters
    eager, first = run(False), run(True)
    assert torch.equal(first.tokens, eager.tokens) and first.accept_lengths == eager.accept_lengths
    graphs = counters["stats"]["unique_graphs"]
    run(True, seed=1)
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
@pytest.mark.parametrize("family", ["emu3"])
def test_compiled_equals_eager(families, family, monkeypatch):
    """Compiling costs ~15-20 s per graph with inductor on a cold CPU machine: one family, Jacobi (a
    T > 1 step) and AR, both with inductor's kernels. Each gives its eager tokens, and (issue 51)
    no graph of either -- the prefill, the step -- allocates a buffer the size of one layer's
    keys: the cache is written and compacted in place (a ``scatter_`` into it compiled as a copy
    of every layer's K and V, AR's steps included). (What transformers' attention allocates
    itself is left: with grouped heads, as this Emu3's, its masked attention expands a layer's K
    and V to every head, ``heads / kv_heads`` times their size.)"""
    import relaxspec.compiling

    from helpers.compiled import allocations, generated_code

    target, cond, mask, _, scale, _ = families[family]
    greedy = SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0)
    monkeypatch.setattr(relaxspec.compiling, "BACKEND", "inductor")
    for name, given, _ in reversed(CASES[:2]):  # Jacobi first: AR then finds the cache at its size
        eager = decode(target, cond, greedy, methods.resolve(name, given), cond_mask=mask).tokens
        compiled, codes = generated_code(decode, target, cond, greedy, methods.resolve(name, {**given, "compile": True}),
                                         cond_mask=mask)
        assert torch.equal(compiled.tokens, eager), name
        keys = target._kv.store[0][0]
        text = target.text_config
        grouped = keys.numel() * text.num_attention_heads // text.num_key_value_heads  # repeat_kv's expansion
        sizes = [size for code in codes for size in allocations(code)]
        assert codes and sizes and all(size < keys.numel() or size == grouped for size in sizes), (name, keys.shape)


@pytest.mark.parametrize("family", ["emu3", "janus", "lumina"])
def test_the_kv_store_only_grows(families, family):
    """A decode that needs fewer slots (AR after a speculative method, as bench alternates them)
    runs on the very tensors the larger one made (issue 51: no reallocation, no view, so a compiled
    graph sees one address), with the same tokens."""
    target, cond, mask, _, scale, _ = families[family]
    greedy = SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0)
    first = decode(target, cond, greedy, methods.resolve("sjd", {"window": 6}), cond_mask=mask).tokens
    keys = target._kv.store[0][0]
    again = decode(target, cond, greedy, methods.resolve("ar"), cond_mask=mask).tokens
    assert target._kv.store[0][0] is keys and keys._base is None
    assert keys.shape[2] >= 2 * (target.config.condition_length + target.config.block_size + 6) or family == "janus"
    assert torch.equal(again, first)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, lumina_files):
    """name -> a tiny model folder with its processor (Lumina-mGPT: with its tokenizer folder), as
    a user downloads it, and what opening it takes."""
    from helpers import emu3 as test_emu3
    from helpers import janus as test_janus

    emu3 = tmp_path_factory.mktemp("emu3-folder")
    test_emu3.tiny_processor().save_pretrained(emu3)
    test_emu3.tiny_emu3().save_pretrained(emu3)
    janus = tmp_path_factory.mktemp("janus-folder")
    test_janus.janus_folder_at(janus)
    return {"emu3": (emu3, {"image_size": 32}), "janus": (janus, {}),
            "lumina": (lumina_files["model_path"],
                       {"image_size": 64, "tokenizer_path": lumina_files["tokenizer_path"]})}


@pytest.mark.parametrize("family", ["emu3", "janus", "lumina"])
def test_padding_prompts_longer_keeps_their_law(folders, family):
    """A folder opened for a longer prompt length (as the demo opens one for any prompt) decodes
    each prompt to the tokens it gets alone: the extra left padding is masked and skipped by the
    positions. ``format`` pads further prompts to that length and refuses longer ones."""
    from relaxspec.errors import RelaxspecError
    from relaxspec.pipelines.open import model_module

    folder, extra = folders[family]
    module = model_module(folder)
    greedy = SamplingConfig(cfg_scale=3.0, temperature=0.0, top_k=0)
    alone = {}
    for prompt in ("a red fox", "the blue cat under the rain"):
        opened = module.open_folder(folder, [prompt], **extra)
        alone[prompt] = decode(opened.target, opened.cond, greedy, methods.resolve("ar"),
                               cond_mask=opened.cond_mask).tokens
    wide = module.open_folder(folder, ["a red fox"], prompt_length=60, **extra)
    assert wide.target.config.condition_length == 60
    for prompt, tokens in alone.items():
        cond, mask = wide.format([prompt])
        assert cond.shape[-1] == 60
        assert torch.equal(decode(wide.target, cond, greedy, methods.resolve("ar"), cond_mask=mask).tokens, tokens)
    with pytest.raises(RelaxspecError, match="at most 60 fit here"):
        wide.format(["a red fox " * 40])


@pytest.mark.parametrize("family", ["emu3", "janus", "lumina"])
def test_forward_costs_of_a_text_to_image_target(families, family):
    """bench.cost times a prompt-conditioned target's forwards given its condition (what the GPU
    script measures at the real shapes); without one it says what is missing."""
    from relaxspec.bench.cost import measure_forward_costs
    from relaxspec.errors import RelaxspecError

    target, cond, mask, _, scale, _ = families[family]
    costs = measure_forward_costs(target, sampling=SamplingConfig(cfg_scale=scale), target_sizes=(1, 3), reps=1,
                                  warmup=0, cond=cond[:1], cond_mask=None if mask is None else mask[:1])
    assert sorted(costs.target) == [1, 3] and all(v > 0 for v in costs.target.values())
    with pytest.raises(RelaxspecError, match="need its condition"):
        measure_forward_costs(target, target_sizes=(1,), reps=1)
