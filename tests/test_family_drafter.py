"""EAGLE drafters of the transformers families (relaxspec.drafting.family): built of the target's
own decoder layers and rotary embedding, the same function trained and decoding, trained by
``relaxspec train-drafter --model-path`` on each tiny family folder and lossless with it; older
LlamaGen-block drafters still load; a drafter is refused by a target of another family or shape."""

from __future__ import annotations

import json

import pytest
import torch

from relaxspec import methods
from relaxspec.decoding import decode
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig

pytest.importorskip("transformers", reason="the families need transformers (pip install -e '.[test]')")

FAMILIES = ["emu3", "janus", "lumina"]
MODEL_TYPES = {"emu3": "emu3", "janus": "janus", "lumina": "chameleon"}
PROMPTS = ["a red fox", "the blue cat under the rain"]
SCALES = {"emu3": 3.0, "janus": 5.0, "lumina": 3.0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> what ``open_pipeline`` takes to open the tiny family folder (tests/helpers)."""
    from helpers import emu3, janus, lumina

    root = tmp_path_factory.mktemp("families")
    (root / "emu3").mkdir()
    emu3.emu3_folder_at(root / "emu3")
    (root / "janus").mkdir()
    janus.janus_folder_at(root / "janus")
    chameleon = lumina.lumina_folders(root / "lumina")
    return {"emu3": {"model_path": str(root / "emu3"), "image_size": 32},
            "janus": {"model_path": str(root / "janus")},
            "lumina": {"model_path": str(chameleon["model_path"]), "tokenizer_path": str(chameleon["tokenizer_path"]),
                       "image_size": lumina.IMAGE_SIZE}}


@pytest.fixture(scope="module")
def pipelines(folders):
    from relaxspec.pipelines import open_pipeline

    return {name: open_pipeline(prompts=PROMPTS, **folder) for name, folder in folders.items()}


def folder_options(folder: dict) -> list[str]:
    """What the commands take besides ``--model-path`` to open the tiny family folder."""
    return [arg for key in ("tokenizer_path", "image_size") if key in folder
            for arg in (f"--{key.replace('_', '-')}", str(folder[key]))]


def train_args(folder: dict, tmp_path, out, *options: str) -> list[str]:
    """``train-drafter`` on the folder's own samples of PROMPTS (two a step) into ``out``."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return ["train-drafter", "--model-path", folder["model_path"], "--prompts-file", str(prompts),
            *folder_options(folder), "--batch-size", "2", "--out", str(out), "--no-progress", *options]


def greedy(family: str) -> SamplingConfig:
    return SamplingConfig(cfg_scale=SCALES[family], temperature=0.0, top_k=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_drafter_is_built_of_the_targets_own_layers(pipelines, family):
    """Its layers are the target's decoder-layer class from a layer config read off the target's
    (plain JSON, dropout off), and a layer given the target's weights computes what the target's
    layer computes at the same 1D positions: the recorded fields are all the layer reads."""
    from relaxspec.drafting.eagle import EagleDrafter
    from relaxspec.models import hf

    target = pipelines[family].target
    text_model = hf.text_model_of(target)
    drafter = EagleDrafter.for_target(target, n_layer=2)
    assert drafter.config.family == MODEL_TYPES[family]
    assert len(drafter.layers) == 2 and all(type(layer) is type(text_model.layers[0]) for layer in drafter.layers)
    assert json.loads(json.dumps(drafter.config.to_dict())) == drafter.config.to_dict()
    assert drafter.layers.text_config.attention_dropout == 0.0
    head_dim = target.config.dim // text_model.config.num_attention_heads
    assert drafter.rope.shape == (target.config.block_size, 2, head_dim)

    one = EagleDrafter.for_target(target)
    one.layers[0].load_state_dict(text_model.layers[0].state_dict())
    torch.manual_seed(0)
    h = torch.randn(2, 5, target.config.dim)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    with torch.no_grad():
        theirs = hf.run_decoder_layers(text_model.layers[:1], h, positions, text_model.rotary_emb(h, positions),
                                       hf.additive_mask(causal, h.dtype))[0]
        ours = one.layers.run(h, one.rope[positions], positions, None, None, None)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_steps_compute_the_training_pass(pipelines, family):
    """Decoding's cached forwards (a catch-up in pieces, then a draft written to a scratch slot
    that attends by an explicit mask) give what training's single causal pass gives at every
    pair: positions and masks mean the same in both."""
    from relaxspec.drafting.eagle import EagleDrafter

    target = pipelines[family].target
    torch.manual_seed(1)
    drafter = EagleDrafter.for_target(target, n_layer=2).eval()
    rows, count = 2, 9
    features = torch.randn(rows, count, target.config.dim)
    tokens = torch.randint(target.config.vocab_size, (rows, count))
    positions = torch.arange(count).expand(rows, -1)
    with torch.no_grad():
        whole_features, whole_logits = drafter(features, tokens, positions)
        drafter.setup_caches(rows, 24)
        assert drafter.cache_length == 24
        pieces = []
        for start, stop in ((0, 4), (4, 5), (5, 8)):
            slots = positions[:, start:stop]
            pieces.append(drafter(features[:, start:stop], tokens[:, start:stop], slots, cache_slots=slots)[0])
        # pair 8 as a draft node: scratch slot 20, attending slots 0..7 and itself
        mask = torch.zeros(rows, 1, 24, dtype=torch.bool)
        mask[:, :, :8] = mask[:, :, 20] = True
        draft, logits = drafter(features[:, 8:], tokens[:, 8:], positions[:, 8:], cache_slots=torch.full((rows, 1), 20),
                                attn_mask=mask)
        drafter.clear_caches()
    torch.testing.assert_close(torch.cat(pieces + [draft], 1), whole_features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, whole_logits[:, 8:], atol=1e-4, rtol=1e-5)
    assert drafter.cache_length == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_unrolled_depths_are_the_chains_decoding_drafts(pipelines, family):
    """Distillation's parallel pass over draft depths (training.drafter.unrolled, with its
    attention mask) gives, at every depth and pair, what the drafter computes fed its own guesses
    one at a time, in the family's own layers too."""
    from helpers.engine import explicit_chain
    from relaxspec.drafting.eagle import EagleDrafter
    from relaxspec.training.drafter import unrolled

    target = pipelines[family].target
    torch.manual_seed(2)
    drafter = EagleDrafter.for_target(target, n_layer=2).eval()
    rows, count, depths = 2, 8, 3
    features = torch.randn(rows, count, target.config.dim)
    tokens = torch.randint(target.config.vocab_size, (rows, count))
    with torch.no_grad():
        _, logits = unrolled(drafter, features, tokens, depths)
        for depth in range(1, depths + 1):
            for pair in range(depth - 1, count - 1):
                want = explicit_chain(drafter, features, tokens, pair - depth + 1, depth)
                torch.testing.assert_close(logits[:, depth - 1, pair], want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_deeper_drafter_grows_from_a_trained_one(pipelines, family):
    """Growth (train-drafter --init-from a shallower drafter): the family's new layer starts as
    the identity, so the two-layer drafter computes what the one-layer one does."""
    from relaxspec.drafting.eagle import EagleDrafter
    from relaxspec.training.drafter import grow_drafter

    target = pipelines[family].target
    torch.manual_seed(3)
    one, two = EagleDrafter.for_target(target, n_layer=1).eval(), EagleDrafter.for_target(target, n_layer=2).eval()
    grow_drafter(two, one)
    features = torch.randn(2, 6, target.config.dim)
    tokens = torch.randint(target.config.vocab_size, (2, 6))
    positions = torch.arange(6).expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(two(features, tokens, positions)[1], one(features, tokens, positions)[1],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_train_drafter_on_a_folder_then_decode(folders, pipelines, family, tmp_path, capsys, monkeypatch):
    """``train-drafter --model-path`` (distilling the guided law over two depths) writes a drafter
    of the family's layers and logs 1 - TV per depth; loaded for the
    folder it drives exact SD (chain, static and dynamic tree) and LANTERN at delta 0 to greedy
    AR's tokens, and relaxed LANTERN, sampled, paints whole images."""
    from relaxspec.cli import main
    from relaxspec.pipelines import open_pipeline

    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path / "cache"))  # LANTERN's neighbour table
    folder = folders[family]
    out, extra = tmp_path / "drafter", folder_options(folder)
    args = train_args(folder, tmp_path, out, "--self-samples", "4", "--steps", "3", "--law-loss", "kl+tv",
                      "--train-depths", "2", "--eval-depths", "3")  # distilled, on its guided laws
    assert main(args) == 0, capsys.readouterr().err
    evaluations = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [len(e["accept"]) for e in evaluations] == [3, 3] and all(0 <= a <= 1 for a in evaluations[-1]["accept"])
    assert (out / "best" / "model.safetensors").is_file()
    saved = json.loads((out / "config.json").read_text())["config"]
    assert saved["family"] == MODEL_TYPES[family] and saved["layer"]["config"]["num_hidden_layers"] == 1

    pipeline = open_pipeline(prompts=PROMPTS, drafter_ckpt=str(out), **folder)
    text_layer = type(pipeline.target.hf.get_decoder().layers[0]) if family == "janus" \
        else type(pipeline.target.text_model.layers[0])
    assert type(pipeline.drafter.layers[0]) is text_layer
    condition = pipeline.conditions(prompts=PROMPTS)
    ar = pipeline.generate(condition, methods.resolve("ar"), greedy(family)).tokens
    for name, given in [("sd", {"draft": "chain", "depth": 3}), ("sd-static", {"tree": "eagle25"}), ("eagle2", {}),
                        ("lantern", {"draft": "chain", "delta": 0.0, "k": 8})]:
        assert torch.equal(pipeline.generate(condition, methods.resolve(name, given), greedy(family)).tokens, ar), name
    sampled = pipeline.generate(condition, methods.resolve("lantern", {"draft": "chain", "k": 8, "delta": 0.3}),
                                SamplingConfig(cfg_scale=SCALES[family], top_k=20),
                                generator=torch.Generator().manual_seed(0))
    assert [sum(a) for a in sampled.accept_lengths] == [pipeline.target.config.block_size] * len(PROMPTS)
    # build-tree --budget auto reopens such a run's model through the pipelines and times it here.
    run = tmp_path / "run"
    prompts_args = [arg for p in PROMPTS for arg in ("--prompt", p)]
    assert main(["generate", "--model-path", folder["model_path"], *extra, *prompts_args, "--drafter-ckpt", str(out),
                 "--method", "sd", "--draft", "static", "--tree", "probe3x3", "--no-progress", "--out", str(run)]) == 0
    assert main(["build-tree", "--stats", str(run / "stats.json"), "--budget", "auto", "--max-budget", "4",
                 "--threads", "1", "--out", str(tmp_path / "tree.json")]) == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "tree.json").read_text())["costs"]["target_seconds"]


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_steps_need_no_host_sync(pipelines, family, tmp_path, monkeypatch):
    """The family drafter adds no host sync and no host->device copy to a speculative step:
    at most the engine's one per step, with the drafter's forwards counted."""
    from relaxspec.bench.counting import StepCounter
    from relaxspec.drafting.eagle import EagleDrafter
    from relaxspec.models import hf

    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    pipeline = pipelines[family]
    target, layer = pipeline.target, hf.text_model_of(pipeline.target).layers[0]
    condition = pipeline.conditions(prompts=PROMPTS)
    torch.manual_seed(2)
    drafter = EagleDrafter.for_target(target)
    for name, given, sampling in [("eagle2", {}, greedy(family)),
                                  ("lantern", {"draft": "chain", "k": 8}, SamplingConfig(cfg_scale=2.0, top_k=20))]:
        with StepCounter(layer, drafter) as counter:
            result = decode(target, condition.cond, sampling, methods.resolve(name, given), drafter=drafter,
                            vq=pipeline.tokenizer, cond_mask=condition.mask, generator=torch.Generator().manual_seed(0))
        steps = counter.steps
        assert len(steps) == int(result.target_forwards.max()) - 2 and len(steps) >= 2
        assert all(window.drafter_ops > 0 for window in steps)
        for index, window in enumerate(steps, start=1):
            assert window.syncs <= 1, f"{name} step {index}: {window.sync_sites}"
            assert window.host_copies == 0, f"{name} step {index}"


def test_llamagen_drafters_still_load_and_serve(pipelines, tmp_path):
    """A drafter of LlamaGen blocks (what train-drafter made for these families before) is
    written as before (no family field), loads as one, and stays lossless; so does the embedded
    model's shipped drafter, whose config reads back as its file has it."""
    from relaxspec import embedded
    from relaxspec.drafting.eagle import LLAMAGEN, EagleDrafter, load_drafter
    from relaxspec.models.weights import save_model
    from relaxspec.models.llamagen.gpt import TransformerBlock

    pipeline = pipelines["emu3"]
    torch.manual_seed(3)
    old = EagleDrafter.for_target(pipeline.target, family=LLAMAGEN)
    save_model(old, tmp_path / "old", kind="drafter")
    config = json.loads((tmp_path / "old" / "config.json").read_text())["config"]
    assert sorted(config) == ["n_layer", "target"]
    loaded = load_drafter(tmp_path / "old", pipeline.target)
    assert loaded.config.family == LLAMAGEN and isinstance(loaded.layers[0], TransformerBlock)
    condition = pipeline.conditions(prompts=PROMPTS)
    ar = pipeline.generate(condition, methods.resolve("ar"), greedy("emu3")).tokens
    result = decode(pipeline.target, condition.cond, greedy("emu3"), methods.resolve("eagle2"), drafter=loaded)
    assert torch.equal(result.tokens, ar)

    if embedded.available("drafter"):
        _, _, shipped = embedded.load()
        on_file = json.loads((embedded.path("drafter") / "config.json").read_text())["config"]
        assert shipped.config.family == LLAMAGEN and shipped.config.to_dict() == on_file


def test_mismatched_drafters_are_refused(pipelines, tmp_path):
    """One line each: a drafter for another family, for a LlamaGen target, for another grid, of
    a layer class the family lacks, or a family built for a target not of it."""
    from relaxspec.drafting.eagle import EagleDrafter, load_drafter
    from relaxspec.models.weights import save_model
    from relaxspec.models.llamagen.gpt import GPTConfig, Transformer

    def refused(call, message):
        with pytest.raises(RelaxspecError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)

    emu3, janus = pipelines["emu3"].target, pipelines["janus"].target
    folder = save_model(EagleDrafter.for_target(emu3), tmp_path / "emu3", kind="drafter")
    refused(lambda: load_drafter(folder, janus), "of the emu3 family .its target.s layers.; this target is janus")
    gpt = Transformer(GPTConfig(dim=32, n_layer=1, n_head=4, vocab_size=48, num_classes=2, block_size=16))
    refused(lambda: load_drafter(folder, gpt), "this target is not a transformers model")
    refused(lambda: EagleDrafter.for_target(janus, family="emu3"), "this target is janus")

    meta = json.loads((folder / "config.json").read_text())
    for change, message in [(lambda c: c["target"].update(block_size=64), "different target"),
                            (lambda c: c["layer"].update({"class": "NoSuchLayer"}), "NoSuchLayer"),
                            (lambda c: c.update(colour="blue"), "unknown fields colour"),
                            (lambda c: c.pop("layer"), "needs 'layer'")]:
        bad = json.loads(json.dumps(meta))
        change(bad["config"])
        (folder / "config.json").write_text(json.dumps(bad))
        refused(lambda: load_drafter(folder, emu3), message)
    (folder / "config.json").write_text(json.dumps(meta))
    assert load_drafter(folder, emu3).config.family == "emu3"


def test_a_family_run_resumes_exactly_and_warm_starts_only_from_its_family(pipelines, tmp_path):
    """The train state records the drafter it trains, so a resumed run rebuilds it and ends
    where an uninterrupted one does; --init-from a LlamaGen-block drafter is refused."""
    from relaxspec.drafting.eagle import LLAMAGEN, EagleDrafter
    from relaxspec.models.weights import save_model
    from relaxspec.training.drafter import DrafterDataset, DrafterTrainConfig, train_drafter

    pipeline = pipelines["janus"]
    condition = pipeline.conditions(prompts=PROMPTS)
    tokens = pipeline.generate(condition, methods.resolve("ar"), greedy("janus")).tokens
    dataset = DrafterDataset(tokens.repeat(2, 1), condition.cond.repeat(2, 1), condition.mask.repeat(2, 1))

    def config(out, steps, **extra):
        return DrafterTrainConfig(out=str(tmp_path / out), steps=steps, batch_size=2, lr=3e-3, warmup_steps=1,
                                  val_fraction=0.0, progress=False, **extra)

    straight = train_drafter(config("a", 4), target=pipeline.target, dataset=dataset)
    assert straight.drafter.config.family == "janus"
    train_drafter(config("b", 2), target=pipeline.target, dataset=dataset)
    resumed = train_drafter(config("b", 4), target=pipeline.target, dataset=dataset, resume=True)
    for name, value in straight.drafter.state_dict().items():
        assert torch.equal(value, resumed.drafter.state_dict()[name]), name

    save_model(EagleDrafter.for_target(pipeline.target, family=LLAMAGEN), tmp_path / "old", kind="drafter")
    with pytest.raises(RelaxspecError, match="of the llamagen family, this run trains one of the janus family"):
        train_drafter(config("c", 0, init_from=str(tmp_path / "old")), target=pipeline.target, dataset=dataset)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_the_compiled_drafter_step_has_no_graph_breaks(pipelines, family):
    """What ``--compile`` compiles for the drafter (``drafter_step``) is one graph for a catch-up
    (default mask) and for a tree level (explicit mask)."""
    from relaxspec.drafting.eagle import EagleDrafter
    from relaxspec.drafting.eagle_source import drafter_step

    target = pipelines[family].target
    drafter = EagleDrafter.for_target(target)
    rows, count = 2, 3
    drafter.setup_caches(2 * rows, 24)
    features = torch.randn(2 * rows, count, target.config.dim)
    tokens = torch.randint(target.config.vocab_size, (rows, count))
    slots = 4 + torch.arange(count).expand(rows, -1)
    mask = torch.ones(rows, count, 24, dtype=torch.bool).tril(4)
    for given in (None, mask):
        sampling = greedy(family).on(features.device)  # as a compiled step reads it: numbers as tensors
        report = torch._dynamo.explain(drafter_step)(drafter, features, tokens, slots, slots, given, sampling)
        assert report.graph_break_count == 0, report.break_reasons
        assert report.graph_count == 1
    drafter.clear_caches()


@pytest.mark.slow
def test_compiled_decoding_commits_the_eager_tokens(pipelines, monkeypatch):
    """``--compile`` with a family drafter (one family, a chain): exact SD still commits greedy AR's
    tokens. (The step traced whole by dynamo and run by aot_eager; inductor's kernels for this
    family's step are tests/test_hf_structure.py's, without a drafter.)"""
    import relaxspec.compiling
    from relaxspec.drafting.eagle import EagleDrafter

    monkeypatch.setattr(relaxspec.compiling, "BACKEND", "aot_eager")
    pipeline = pipelines["emu3"]
    condition = pipeline.conditions(prompts=PROMPTS)
    torch.manual_seed(4)
    drafter = EagleDrafter.for_target(pipeline.target)
    ar = pipeline.generate(condition, methods.resolve("ar"), greedy("emu3")).tokens
    compiled = decode(pipeline.target, condition.cond, greedy("emu3"),
                      methods.resolve("sd", {"draft": "chain", "depth": 3, "compile": True}), drafter=drafter)
    assert torch.equal(compiled.tokens, ar)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_fused_drafter_reads_the_streams_entering_the_family_s_layers(pipelines, family):
    """The family's target hands over the streams entering its decoder layers (helpers.fused:
    what hooks on the layers saw, and the last one's output is the final state before the norm,
    row ends included), and a fused (EAGLE-3) drafter of the family's layers, reading them,
    decodes greedy exact SD and EAGLE-2 to greedy AR's tokens."""
    from helpers.engine import scaled_
    from helpers.fused import check_capture
    from relaxspec.drafting.eagle import EagleDrafter
    from relaxspec.models import hf

    pipeline = pipelines[family]
    target = pipeline.target
    text_model = hf.text_model_of(target)
    condition = pipeline.conditions(prompts=PROMPTS)
    rows = torch.cat([condition.cond, target.null_condition(condition.cond)])
    mask = None if condition.mask is None else condition.mask.repeat(2, 1)
    tokens = torch.randint(target.config.vocab_size, (rows.shape[0], target.config.block_size),
                           generator=torch.Generator().manual_seed(0))
    check_capture(target, text_model.layers, text_model.norm, rows, tokens, mask)

    torch.manual_seed(3)
    drafter = EagleDrafter.for_target(target, fused_layers=True).eval()
    scaled_(drafter, 4.0)
    assert drafter.config.fused_layers == [min(2, len(text_model.layers)), len(text_model.layers) // 2, 0]
    ar = decode(target, condition.cond, greedy(family), cond_mask=condition.mask).tokens
    for name in ("sd", "eagle2"):
        result = decode(target, condition.cond, greedy(family), methods.resolve(name, {}), drafter=drafter,
                        cond_mask=condition.mask)
        assert torch.equal(result.tokens, ar), name


@pytest.mark.parametrize("family", FAMILIES)
def test_train_drafter_fused_on_a_folder_then_decode(folders, pipelines, family, tmp_path, capsys):
    """``train-drafter --model-path --fused`` trains a fused (EAGLE-3) drafter of the family's
    layers on its own samples (teacher-forced through the decoding interface, which hands over
    the layers' streams), saves it with its layers, and it decodes greedy exact SD to AR's tokens."""
    from relaxspec.cli import main
    from relaxspec.pipelines import open_pipeline

    folder, out = folders[family], tmp_path / "drafter"
    args = train_args(folder, tmp_path, out, "--self-samples", "2", "--steps", "2", "--fused", "--law-loss", "kl",
                      "--train-depths", "2", "--through-depths", "--depth-decay", "0.8")
    assert main(args) == 0, capsys.readouterr().err
    saved = json.loads((out / "config.json").read_text())["config"]
    assert saved["family"] == MODEL_TYPES[family] and saved["fused_layers"] == [2, 1, 0]
    pipeline = open_pipeline(prompts=PROMPTS, drafter_ckpt=str(out), **folder)
    assert pipeline.drafter.config.fused
    condition = pipeline.conditions(prompts=PROMPTS)
    ar = pipeline.generate(condition, methods.resolve("ar"), greedy(family)).tokens
    assert torch.equal(pipeline.generate(condition, methods.resolve("sd", {}), greedy(family)).tokens, ar)
