"""The transformers families on the fast engine's terms (issue 11's guarantees, issue 12's
families): at most one host sync per speculative step and none per AR step, no host->device
copies, and compiled steps without graph breaks that commit the eager tokens.

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
def families(tmp_path_factory):
    """name -> (target, cond, cond_mask, first decoder layer, CFG scale)."""
    import test_emu3
    import test_janus
    from relaxspec.models.janus import load_janus

    folder = tmp_path_factory.mktemp("emu3")
    test_emu3.tiny_processor().save_pretrained(folder)
    test_emu3.tiny_emu3().save_pretrained(folder)
    emu3, _, cond = test_emu3.adapter(folder)
    folder = tmp_path_factory.mktemp("janus")
    test_janus.tiny_janus().save_pretrained(folder)
    janus, _ = load_janus(folder, prompt_length=7)
    ids = test_janus.PROMPTS
    return {"emu3": (emu3, cond, None, emu3.hf.model.text_model.layers[0], 3.0),
            "janus": (janus, ids, ids != test_janus.PAD, janus.hf.model.language_model.layers[0], 5.0)}


CASES = [("ar", {}, 0), ("sjd", {"window": 4}, 1), ("gsd", {"window": 4}, 1)]


@pytest.mark.parametrize("family", ["emu3", "janus"])
@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("name, given, budget", CASES, ids=[case[0] for case in CASES])
def test_host_syncs_per_step(families, family, temperature, name, given, budget):
    target, cond, mask, layer, scale = families[family]
    sampling = SamplingConfig(cfg_scale=scale, temperature=temperature, top_k=0)
    with StepCounter(layer) as counter:
        result = decode(target, cond, sampling, methods.resolve(name, given), cond_mask=mask,
                        generator=torch.Generator().manual_seed(0))
    steps = counter.steps
    assert len(steps) == int(result.target_forwards.max()) - 2 and len(steps) >= 2
    for index, window in enumerate(steps, start=1):
        assert window.syncs <= budget, f"step {index}: {window.sync_sites}"
        assert window.host_copies == 0, f"step {index}: {window.host_copies} host->device copies"


@pytest.mark.parametrize("family", ["emu3", "janus"])
def test_compiled_steps_have_no_graph_breaks(families, family):
    target, cond, mask, _, scale = families[family]
    guided = GuidedTarget(target, cond, SamplingConfig(cfg_scale=scale), cond_mask=mask, scratch=8)
    guided.prefill()
    batch, cls = cond.shape[0], target.config.cls_token_num
    tokens = torch.randint(target.config.vocab_size, (batch, 5))
    positions = cls + 2 + torch.arange(5).expand(batch, 5)  # across a row end of the 4-token rows
    explain = torch._dynamo.explain
    for count in (1, 5):
        report = explain(guided_step)(target, tokens[:, :count], positions[:, :count], positions[:, :count], None,
                                      guided.key_valid, guided.sampling, 2)
        assert report.graph_break_count == 0, report.break_reasons
        assert report.graph_count == 1


@pytest.mark.parametrize("family", ["emu3"])
def test_compiled_equals_eager(families, family):
    """Compiling costs ~10 s per graph on this CPU: one family, AR and Jacobi (a T > 1 step)."""
    target, cond, mask, _, scale = families[family]
    greedy = SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0)
    for name, given, _ in CASES[:2]:
        eager = decode(target, cond, greedy, methods.resolve(name, given), cond_mask=mask).tokens
        compiled = decode(target, cond, greedy, methods.resolve(name, {**given, "compile": True}), cond_mask=mask)
        assert torch.equal(compiled.tokens, eager), name
