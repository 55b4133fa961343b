"""Official LANTERN's released Anole EAGLE drafter (``jadohu/anole_drafter``, issue 29, item 2)
opens with ``--drafter-ckpt DIR`` on an Anole target (``--model-path``) and ``train-drafter
--init-from DIR``, through ``load_drafter``: relaxspec's family drafter of Chameleon decoder
layers, every name mapped to itself, its own token table, reading the prompt's pairs first.

The golden data (tests/data/anole/drafter_golden.npz, drafter_golden.json) are official LANTERN's
own drafter code (cnets_anole.py) and ``EaModel.generate`` run on CPU in fp32 with a tiny random
drafter in the released layout (tests/helpers/anole.py ``DRAFTER_CONFIG``, ``drafter_state``),
attached to the tiny Anole folder (make_drafter_golden.py says how and what it patches: the
tokenizer's device and the neighbour table's size, nothing in the computation). The tests write
the drafter folder (pytorch_model.bin, or model.safetensors) themselves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaxspec import methods
from relaxspec.decoding import decode
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig

pytest.importorskip("transformers", reason="Anole needs transformers (pip install -e '.[test]')")

from helpers import anole as af  # noqa: E402
from relaxspec.drafting.eagle import EagleDrafter, load_drafter  # noqa: E402
from relaxspec.models import anole  # noqa: E402

DATA = Path(__file__).parent / "data"
GREEDY = SamplingConfig(cfg_scale=3.0, temperature=0.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def golden() -> dict:
    record = json.loads((DATA / "anole" / "drafter_golden.json").read_text())
    with np.load(DATA / "anole" / "drafter_golden.npz") as arrays:
        record.update({key: torch.from_numpy(arrays[key]) for key in arrays.files})
    record["ar"] = json.loads((DATA / "anole" / "golden.json").read_text())["runs"]
    return record


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """The tiny Anole folder and, beside it, the drafter in the released layout (.bin)."""
    root = tmp_path_factory.mktemp("anole-drafter")
    made = af.anole_folder(root)
    made["drafter"] = af.write_drafter_folder(root / "anole-drafter")
    np.save(root / "top_511_indices.npy", af.neighbour_table())
    made["neighbours"] = str(root / "top_511_indices.npy")
    return made


@pytest.fixture(scope="module")
def opened(files):
    """Prompt 0 alone, as the official generation decoded it."""
    return anole.open_folder(files["model_path"], [af.PROMPTS[0]])


def image_tokens(golden, index: int) -> torch.Tensor:
    """Prompt ``index``'s greedy CFG-3 codes (official LANTERN's, golden.json)."""
    return torch.tensor(golden["ar"][f"prompt{index}"]["tokens"][0]) - af.FIRST_IMAGE_ID


def rows_of(target, cond: torch.Tensor) -> torch.Tensor:
    """``[cond; null]``: the rows a guided decode runs."""
    return torch.cat([cond, target.null_condition(cond)])


def copy_drafter(files, tmp_path: Path, weights: str = "pytorch_model.bin", **changes) -> Path:
    folder = tmp_path / "edited"
    config = {key: value for key, value in {**af.DRAFTER_CONFIG, **changes}.items() if value is not None}
    af.write_drafter_folder(folder, config, af.drafter_state(), weights)
    return folder


# ------------------------------------------------------------------------------ the forward


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.safetensors"])
def test_teacher_forced_logits_equal_officials(golden, files, opened, weights, tmp_path):
    """(a) Given official LANTERN's inputs (its target's features over prompt 0 and 63 image tokens,
    batch [cond; uncond], the prompt's tokens), the loaded drafter's features and logits at the 64
    image pairs are the official drafter's, from either weights file; without the prompt's
    hidden states or tokens it refuses, never drafts without them."""
    folder = files["drafter"] if weights == "pytorch_model.bin" else copy_drafter(files, tmp_path, weights)
    drafter = load_drafter(folder, opened.target)
    features = golden["features_prompt0"]
    prompt = features.shape[1] - 63  # L = 6: <s> a red fox <reserved08706> <racm3:break>
    tokens = image_tokens(golden, 0)[None].repeat(2, 1)
    positions = torch.arange(64)[None].repeat(2, 1)
    prompt_tokens = rows_of(opened.target, opened.cond)[:, 0]  # its padding is -1 (LANTERN's <pad> 1)
    with torch.no_grad():
        ours, logits = drafter(features[:, prompt - 1:], tokens, positions, condition=features[:, :prompt],
                               condition_tokens=prompt_tokens)
        with pytest.raises(RelaxspecError, match="reads the prompt's tokens: give them"):
            drafter(features[:, prompt - 1:], tokens, positions, condition=features[:, :prompt])
        with pytest.raises(RelaxspecError, match="reads the condition: give the target's hidden states"):
            drafter(features[:, prompt - 1:], tokens, positions)
    columns = torch.tensor(golden["logit_ids"]) - af.FIRST_IMAGE_ID
    torch.testing.assert_close(ours, golden["drafter_features_prompt0"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[..., columns], golden["drafter_logits_prompt0"], atol=1e-5, rtol=1e-5)


def test_it_reads_the_prompt_as_official_lantern_does(golden, files):
    """End to end, three left-padded prompts in one batch: relaxspec's target computes the features,
    the prompt's pairs sit at the target's positions (padding skipped and masked, the
    unconditional <s> at 0), and each row's drafter features are official LANTERN's for that
    prompt alone; the cached path (the prompt written by setup_caches as the engine hands it over,
    pairs fed one by one) agrees."""
    from relaxspec.training.drafter import teacher_forced

    opened = anole.open_folder(files["model_path"], af.PROMPTS)
    target = opened.target
    drafter = load_drafter(files["drafter"], target)
    cond = rows_of(target, opened.cond)
    tokens = torch.stack([image_tokens(golden, i) for i in range(3)]).repeat(2, 1)
    positions = torch.arange(64)[None].repeat(6, 1)
    with torch.no_grad():
        _, features, condition = teacher_forced(target, cond, tokens, with_condition=True)
        prompt_tokens = target.condition_tokens(cond)
        assert (prompt_tokens < 0).any()  # padded rows: prompts 0 and 2, every unconditional row
        ours, _ = drafter(features, tokens, positions, condition=condition, condition_tokens=prompt_tokens)
        drafter.setup_caches(6, 80, condition=condition, condition_tokens=prompt_tokens)
        cached = torch.cat([drafter(features[:, j : j + 1], tokens[:, j : j + 1], positions[:, j : j + 1],
                                    cache_slots=positions[:, j : j + 1])[0] for j in range(64)], dim=1)
    for index in range(3):
        official = golden[f"drafter_features_prompt{index}"]
        torch.testing.assert_close(ours[[index, index + 3]], official, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cached[[index, index + 3]], official, atol=1e-5, rtol=1e-5)


def test_the_layout_maps_onto_relaxspecs_family_drafter(files, opened):
    """Chameleon's own decoder layer from the drafter's config (its heads, width, eps: not the
    target's), every tensor under its own name, its own frozen token table over the whole
    vocabulary (not the target's), the prompt read first; relaxspec's own drafters are untouched."""
    from transformers.models.chameleon.modeling_chameleon import ChameleonDecoderLayer

    target = opened.target
    drafter = load_drafter(files["drafter"], target)
    config = drafter.config
    assert (config.family, config.own_embedding, config.first_attention_norm) == ("chameleon", True, True)
    assert config.condition_pairs == 256 - 64 - 1  # max_position_embeddings less the image and one
    layer = drafter.layers[0]
    assert isinstance(layer, ChameleonDecoderLayer) and layer.self_attn.num_heads == 2
    assert layer.mlp.gate_proj.weight.shape == (96, 32) and layer.input_layernorm.variance_epsilon == 1e-5
    assert drafter.rope.shape == (256, 2, 16)
    state = af.drafter_state()
    ours = drafter.state_dict()
    assert set(ours) == set(state)
    assert all(torch.equal(ours[name], state[name].float()) for name in state)
    assert layer.self_attn.q_norm.weight.shape == (2, 16) and not drafter.embed_tokens.weight.requires_grad
    assert not torch.equal(drafter.embed_tokens.weight[:8], target.hf.get_input_embeddings().weight[:8])
    own = EagleDrafter.for_target(target)
    assert not own.config.lantern_layout and "embed_tokens" not in dict(own.named_modules())
    assert own.rope.shape[0] == 64 and "condition_pairs" not in own.config.to_dict()


# ------------------------------------------------------------------------------ decoding


@pytest.mark.slow  # whole commands on the tiny models (the full suite runs it)
def test_greedy_exact_sd_equals_greedy_ar(golden, files, tmp_path, capsys):
    """(b) ``generate --model-path ANOLE --drafter-ckpt DIR`` (the released layout, .bin) with exact
    SD at temperature 0 commits greedy AR's tokens, official LANTERN's greedy tokens (its base
    generate and its EaModel with this drafter alike), for two left-padded prompts."""
    from relaxspec.cli import main

    common = ["generate", "--model-path", str(files["model_path"]), "--prompt", af.PROMPTS[0], "--prompt",
              af.PROMPTS[2], "--temperature", "0", "--cfg-scale", "3", "--batch-size", "2", "--no-progress"]
    assert main([*common, "--method", "ar", "--out", str(tmp_path / "ar")]) == 0, capsys.readouterr().err
    ar = np.load(tmp_path / "ar" / "tokens.npy")
    assert ar.tolist() == [image_tokens(golden, 0).tolist(), image_tokens(golden, 2).tolist()]
    assert ar[0].tolist() == golden["runs"]["eagle"]["codes"]
    for draft in (["--draft", "dynamic"], ["--draft", "chain", "--depth", "3"]):
        out = tmp_path / draft[1]
        assert main([*common, "--method", "sd", *draft, "--drafter-ckpt", str(files["drafter"]),
                     "--out", str(out)]) == 0, capsys.readouterr().err
        assert np.array_equal(np.load(out / "tokens.npy"), ar), draft


def test_greedy_lantern_drafts_and_decodes_as_official_lantern(golden, files, opened, monkeypatch):
    """(c) On EAGLE-2's tree (59 nodes, depth 5, top-10), greedy, CFG 3, with the fixed neighbour
    table: the first draft tree (after the prompt's pairs and image token 0) is official EaModel's,
    path for path, and the tokens of EAGLE and of LANTERN (delta 0.3 with k 64, lam 3 with k 128,
    which differ from greedy AR) are official's."""
    from relaxspec.drafting.dynamic_tree import DynamicTree

    drafter = load_drafter(files["drafter"], opened.target)
    trees = []
    draft = DynamicTree.draft
    monkeypatch.setattr(DynamicTree, "draft", lambda self, *a, **k: trees.append(draft(self, *a, **k)) or trees[-1])
    ar = image_tokens(golden, 0)
    for name, options in (("eagle", None), ("lantern_delta", {"k": 64, "delta": 0.3}),
                          ("lantern_lam", {"k": 128, "lam": 3.0})):
        trees.clear()
        method = methods.resolve("eagle2") if options is None else \
            methods.resolve("lantern", {"draft": "dynamic", "neighbours": files["neighbours"], **options})
        tokens = decode(opened.target, opened.cond, GREEDY, method, drafter=drafter, vq=opened.tokenizer).tokens[0]
        official = golden["runs"][name]
        assert tokens.tolist() == official["codes"], name
        assert (tokens != ar).any() == (name != "eagle"), name
        parents, nodes = trees[0].parents[0].tolist(), trees[0].tokens[0].tolist()
        leaves = []
        for node in range(1, len(nodes)):
            if node not in parents:
                path = []
                while node > 0:
                    path, node = [nodes[node]] + path, parents[node]
                leaves.append(path)
        assert sorted(leaves) == official["first_tree_paths"], name


PARITY = {"eagle": ("sd", {"draft": "dynamic"}),
          "lantern_delta": ("lantern", {"draft": "dynamic", "k": 64, "delta": 0.2}),
          "lantern_lam": ("lantern", {"draft": "dynamic", "k": 128, "lam": 3.0}),
          "lantern_pp": ("lantern++", {"k": 128, "lam": 3.0}),
          "static": ("sd-static", {})}


@pytest.mark.parametrize("run", list(PARITY))
def test_every_prompt_gives_official_lanterns_tokens(golden, files, run):
    """(issue 43) Each of the three prompts alone, greedy at CFG 3: exact SD and LANTERN on the
    dynamic tree, and exact SD and LANTERN++ on the official static tree (naive_extend_57, the
    static presets' default), give official EaModel.generate's codes."""
    method, options = PARITY[run]
    if method.startswith("lantern"):
        options = {**options, "neighbours": files["neighbours"]}
    for index in range(3):
        official = golden["parity"][f"prompt{index}_{run}"]
        opened = anole.open_folder(files["model_path"], official["prompts"])
        drafter = load_drafter(files["drafter"], opened.target)
        tokens = decode(opened.target, opened.cond, GREEDY, methods.resolve(method, options), drafter=drafter,
                        vq=opened.tokenizer).tokens[0]
        assert tokens.tolist() == official["codes"], (run, index)


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=64), "the drafter is 64 wide (hidden_size), the target 32"),
    (dict(vocab_size=32000), "the drafter's vocabulary is 32000 tokens (vocab_size), the target's 65536"),
    (dict(max_position_embeddings=70), "the drafter reads prompts of at most 6 tokens; this target's are 9"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "relaxspec reads LANTERN's Anole drafter with plain RoPE"),
    (dict(num_hidden_layers=2), "the weights are not a 2-layer LANTERN Anole drafter's (missing: "
                                "layers.1.input_layernorm.weight"),
])
def test_a_drafter_for_another_target_is_refused_in_one_line(changes, message, files, tmp_path, refused):
    """(d) Through ``generate --drafter-ckpt``: exit 2, one line naming the mismatch."""
    refused(["generate", "--model-path", str(files["model_path"]), "--prompt", af.PROMPTS[1], "--method", "sd",
             "--drafter-ckpt", str(copy_drafter(files, tmp_path, **changes)), "--out", str(tmp_path / "o"),
             "--no-progress"], message)


def test_a_drafter_of_the_other_family_is_refused_in_one_line(files, tmp_path, refused):
    """(d) LANTERN's LlamaGen drafter on an Anole target, its Anole drafter on a LlamaGen target, and
    the Anole folder itself given as a drafter."""
    from relaxspec.models.llamagen.checkpoints import load_gpt

    refused(["generate", "--model-path", str(files["model_path"]), "--prompt", af.PROMPTS[0], "--method", "sd",
             "--drafter-ckpt", str(DATA / "lantern" / "llamagen-t2i-drafter"), "--out", str(tmp_path / "o"),
             "--no-progress"], "a LANTERN LlamaGen drafter drafts for a LlamaGen text-to-image target; this one is "
                               "AnoleTarget")
    refused(["generate", "--model-path", str(files["model_path"]), "--prompt", af.PROMPTS[0], "--method", "sd",
             "--drafter-ckpt", str(files["model_path"]), "--out", str(tmp_path / "o"), "--no-progress"],
            "this is a Chameleon model, not a drafter: open an Anole folder with --model-path")
    with pytest.raises(RelaxspecError, match="a LANTERN Anole drafter .* drafts for an Anole target .*; this one is "
                                             "LlamaGen t2i") as refusal:
        load_drafter(files["drafter"], load_gpt(DATA / "lantern" / "llamagen-t2i"))
    assert "\n" not in str(refusal.value)


class Marker:
    """An object whose unpickling would run code (touch a file)."""

    path = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_weights_that_are_not_a_plain_state_dict_are_refused_unrun(files, opened, tmp_path):
    """(d) A pytorch_model.bin holding an object is refused under weights_only, nothing run; a
    container and a key too many are one-line errors under LANTERN's names."""
    folder = copy_drafter(files, tmp_path)
    marker = tmp_path / "ran"
    Marker.path = str(marker)
    torch.save({"fc.weight": torch.zeros(32, 64), "hook": Marker()}, folder / "pytorch_model.bin")
    with pytest.raises(RelaxspecError, match="refusing to load: .* only an unsafe unpickling"):
        load_drafter(folder, opened.target)
    assert not marker.exists()
    state = af.drafter_state()
    torch.save({"state_dict": state}, folder / "pytorch_model.bin")
    with pytest.raises(RelaxspecError, match="a LANTERN drafter file is a plain state dict"):
        load_drafter(folder, opened.target)
    torch.save({**state, "layers.0.self_attn.q_proj.bias": torch.zeros(32)}, folder / "pytorch_model.bin")
    with pytest.raises(RelaxspecError, match=r"Anole drafter's \(unexpected: layers\.0\.self_attn\.q_proj\.bias\)"):
        load_drafter(folder, opened.target)


# ------------------------------------------------------------------------------ training


def test_train_drafter_continues_from_the_anole_folder(golden, files, opened, tmp_path, capsys):
    """(e) ``--init-from DIR``: the run starts at the loaded drafter (its step-0 evaluation is the
    loaded drafter's, the prompt's pairs included), keeps LANTERN's layout and frozen table, trains,
    and writes a relaxspec drafter folder that loads back; the command takes the folder."""
    from relaxspec.cli import main
    from relaxspec.training.drafter import DrafterDataset, DrafterTrainConfig, evaluate_drafter, train_drafter

    batch = anole.open_folder(files["model_path"], af.PROMPTS)
    dataset = DrafterDataset(torch.stack([image_tokens(golden, i) for i in range(3)]), batch.cond)
    config = DrafterTrainConfig(out=str(tmp_path / "run"), init_from=str(files["drafter"]), steps=2, batch_size=2,
                                lr=1e-3, warmup_steps=0, val_fraction=0.0, progress=False, eval_interval=1000,
                                checkpoint_interval=1000, eval_depths=2, cfg_scale=3.0)
    result = train_drafter(config, target=batch.target, dataset=dataset)
    start = load_drafter(files["drafter"], batch.target, dtype=torch.float32)
    baseline = evaluate_drafter(start, dataset.split(0.0, config.seed)[0], config)
    assert result.history[0]["step"] == 0
    assert result.history[0]["loss"] == pytest.approx(baseline["loss"], rel=1e-5)
    assert result.history[0]["accept"] == pytest.approx(baseline["accept"], rel=1e-5)
    trained = load_drafter(tmp_path / "run", batch.target)
    assert trained.config.to_dict() == start.config.to_dict()
    assert torch.equal(trained.embed_tokens.weight, start.embed_tokens.weight)
    assert not torch.equal(trained.fc.weight, start.fc.weight)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(af.PROMPTS) + "\n")
    out = tmp_path / "cli"
    assert main(["train-drafter", "--model-path", str(files["model_path"]), "--prompts-file", str(prompts),
                 "--self-samples", "2", "--steps", "1", "--batch-size", "2", "--init-from", str(files["drafter"]),
                 "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    saved = json.loads((out / "config.json").read_text())["config"]
    assert (saved["family"], saved["own_embedding"], saved["condition_pairs"]) == ("chameleon", True, 191)


def test_a_fused_drafter_reads_anole_s_layers(golden, files):
    """Anole's target (one query a token, no row ends) hands over the streams entering its
    decoder layers too (helpers.fused), left-padded prompts included, and a fused (EAGLE-3)
    drafter of its layers decodes greedy exact SD to greedy AR's tokens. (Official LANTERN's
    layout, which reads the prompt, is not a fused one: refused together.)"""
    from helpers.engine import scaled_
    from helpers.fused import check_capture
    from relaxspec.drafting.eagle import DrafterConfig

    opened = anole.open_folder(files["model_path"], af.PROMPTS)
    target = opened.target
    cond = rows_of(target, opened.cond)
    tokens = torch.stack([image_tokens(golden, i) for i in range(3)]).repeat(2, 1)
    check_capture(target, target.text_model.layers, target.text_model.norm, cond, tokens)
    torch.manual_seed(3)
    drafter = EagleDrafter.for_target(target, fused_layers=True).eval()
    scaled_(drafter, 4.0)
    sampling = SamplingConfig(cfg_scale=3.0, temperature=0.0, top_k=0)
    ar = decode(target, opened.cond, sampling).tokens
    assert torch.equal(decode(target, opened.cond, sampling, methods.resolve("sd", {}), drafter=drafter).tokens, ar)
    lantern = load_drafter(files["drafter"], target).config
    with pytest.raises(RelaxspecError, match="official LANTERN"):
        DrafterConfig(**{**lantern.to_dict(), "fused_layers": [0, 1]})
