"""Official LANTERN's released EAGLE drafters for LlamaGen text-to-image (issue 29, item 2):
``jadohu/llamagen_drafter`` (Stage I) and ``jadohu/llamagen2_drafter`` (Stage II) open with
``--drafter-ckpt DIR`` (and ``train-drafter --init-from DIR``) through ``load_drafter``.

The golden data (tests/data/lantern/drafter_golden.npz, the drafter folder
llamagen-t2i-drafter/) is official LANTERN's own drafter code (cnets_llamagen.py) and its
``EaModel.generate``, run on CPU in fp32 on a tiny random drafter in its released layout attached to
the tiny LANTERN-layout target llamagen-t2i/ (make_drafter_golden.py says how and what it patches:
the tiny grid's RoPE table, nothing in the computation). The folder holds model.safetensors; the
tests write the pytorch_model.bin variant (a plain state dict) themselves.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from relaxspec import methods
from relaxspec.cli import main
from relaxspec.decoding import decode
from relaxspec.drafting.eagle import EagleDrafter, load_drafter
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.checkpoints import load_gpt
from relaxspec.sampling import SamplingConfig

DATA = Path(__file__).resolve().parent / "data" / "lantern"
TARGET = DATA / "llamagen-t2i"
DRAFTER = DATA / "llamagen-t2i-drafter"
PAIRS = 119  # the drafter's condition pairs: the target's 120 caption tokens but the last
GREEDY_CFG4 = SamplingConfig(cfg_scale=4.0, temperature=0.0, top_k=0)


@pytest.fixture(scope="module")
def golden() -> dict:
    return dict(np.load(DATA / "drafter_golden.npz"))


@pytest.fixture(scope="module")
def target():
    return load_gpt(TARGET)


@pytest.fixture(scope="module")
def full_caption(golden) -> torch.Tensor:
    """``[1, 120, 16]``: the unpadded caption official EaModel decoded."""
    return torch.from_numpy(golden["full_caption"].astype(np.float32))[None]


def folder_with_bin(tmp_path: Path) -> Path:
    """The released layout: config.json + pytorch_model.bin (torch.save of a plain state dict)."""
    folder = tmp_path / "bin"
    folder.mkdir(parents=True)
    shutil.copy(DRAFTER / "config.json", folder / "config.json")
    torch.save(load_file(str(DRAFTER / "model.safetensors")), folder / "pytorch_model.bin")
    return folder


def pairs_of(tokens: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Image pairs 0..N-1 of ``tokens [N]`` on ``rows`` rows: tokens and their RoPE rows."""
    return tokens[None].repeat(rows, 1), torch.arange(tokens.shape[0])[None].repeat(rows, 1)


# ------------------------------------------------------------------------------ the forward


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_teacher_forced_logits_equal_officials(golden, target, weights, tmp_path):
    """(a) Given official LANTERN's inputs (the target's features at the 119 condition positions,
    then at the 16 image pairs, batch [cond; uncond]), the loaded drafter's logits are the official
    drafter's, from either weights file."""
    drafter = load_drafter(DRAFTER if weights == "model.safetensors" else folder_with_bin(tmp_path), target)
    features = torch.from_numpy(golden["features"].astype(np.float32))
    tokens, positions = pairs_of(torch.from_numpy(golden["tokens"]), 2)
    with torch.no_grad():
        _, logits = drafter(features[:, PAIRS:], tokens, positions, condition=features[:, :PAIRS])
        with pytest.raises(RelaxspecError, match="reads the condition: give the target's hidden states"):
            drafter(features[:, PAIRS:], tokens, positions)  # never silently without it
    official = torch.from_numpy(golden["logits"])
    torch.testing.assert_close(logits, official, atol=1e-5, rtol=1e-5)


def test_it_reads_the_targets_condition_features_as_official_lantern_does(golden, target, full_caption):
    """End to end: relaxspec's target computes the features (post-norm, as its head sees them), the
    drafter takes the first 119 condition positions' from the target's pass over the caption, and
    the logits are official LANTERN's over its own target's features; the cached path (the
    condition written by setup_caches, pairs fed as decoding feeds them) agrees."""
    from relaxspec.training.drafter import teacher_forced

    drafter = load_drafter(DRAFTER, target)
    tokens = torch.from_numpy(golden["full_tokens"])
    cond = torch.cat([full_caption, target.null_condition(full_caption)])
    mask = torch.ones(2, 120, dtype=torch.bool)
    official = torch.from_numpy(golden["full_logits"])
    with torch.no_grad():
        _, features, condition = teacher_forced(target, cond, tokens[None].repeat(2, 1), mask, with_condition=True)
        assert condition.shape == (2, 120, 32)  # every condition position; the drafter reads the first 119
        image_tokens, positions = pairs_of(tokens, 2)
        _, logits = drafter(features, image_tokens, positions, condition=condition)
        torch.testing.assert_close(logits, official, atol=1e-4, rtol=1e-4)
        drafter.setup_caches(2, 32, condition=condition)  # as the engine hands the prefill's over
        cached = [drafter(features[:, j : j + 1], image_tokens[:, j : j + 1], positions[:, j : j + 1],
                          cache_slots=positions[:, j : j + 1])[1] for j in range(16)]
    torch.testing.assert_close(torch.cat(cached, 1), official, atol=1e-4, rtol=1e-4)


def test_the_layout_maps_onto_relaxspecs_drafter(target):
    drafter = load_drafter(DRAFTER, target)
    config = drafter.config
    assert (config.first_attention_norm, config.own_embedding, config.condition_pairs) == (False, True, PAIRS)
    assert isinstance(drafter.layers[0].attention_norm, torch.nn.Identity)
    assert drafter.layers[0].ffn_norm.eps == 1e-6 and drafter.layers[0].feed_forward.w1.weight.shape == (96, 32)
    assert not drafter.embed_tokens.weight.requires_grad
    lantern = load_file(str(DRAFTER / "model.safetensors"))
    assert torch.equal(drafter.embed_tokens.weight, lantern["embed_tokens.weight"].float())
    qkv = torch.cat([lantern[f"layers.0.self_attn.{x}_proj.weight"] for x in "qkv"]).float()
    assert torch.equal(drafter.layers[0].attention.wqkv.weight, qkv)
    # relaxspec's own drafters are untouched: an attention norm, the target's embedding, no condition
    own = EagleDrafter.for_target(target)
    assert not own.config.lantern_layout and "embed_tokens" not in dict(own.named_modules())
    assert set(own.config.to_dict()) == {"target", "n_layer"}


# ------------------------------------------------------------------------------ decoding


def test_greedy_exact_sd_equals_greedy_ar(golden, tmp_path, capsys, tiny_ckpts):
    """(b) ``generate --drafter-ckpt DIR`` (the released layout, .bin) with exact SD at temperature
    0 commits greedy AR's tokens, which are official LANTERN's greedy tokens; also with two
    left-padded captions."""
    captions = tmp_path / "captions.npz"
    llamagen = np.load(DATA / "llamagen_golden.npz")
    features = np.concatenate([golden["full_caption"][None], llamagen["features"]]).astype(np.float32)
    mask = np.concatenate([np.ones((1, 120), np.int64), llamagen["mask"]])
    np.savez(captions, features=features, mask=mask)
    files = tiny_ckpts["t2i"]
    common = ["generate", "--gpt-ckpt", str(TARGET), "--vq-ckpt", files["vq"], "--vq-model", files["vq_json"],
              "--caption-features", str(captions), "--temperature", "0", "--cfg-scale", "4", "--batch-size", "3",
              "--no-progress"]
    assert main([*common, "--method", "ar", "--out", str(tmp_path / "ar")]) == 0, capsys.readouterr().err
    ar = np.load(tmp_path / "ar" / "tokens.npy")
    assert np.array_equal(ar[0], golden["full_tokens"]) and np.array_equal(ar[1], llamagen["tokens_cfg4"][0])
    for draft in (["--draft", "dynamic"], ["--draft", "chain", "--depth", "3"]):
        out = tmp_path / draft[1]
        assert main([*common, "--method", "sd", *draft, "--drafter-ckpt", str(folder_with_bin(tmp_path / draft[1])),
                     "--out", str(out)]) == 0, capsys.readouterr().err
        assert np.array_equal(np.load(out / "tokens.npy"), ar), draft


@pytest.fixture(scope="module")
def neighbours(golden, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("neighbours") / "top_63_indices.npy"
    np.save(path, golden["neighbours"].astype(np.int64))
    return str(path)


def lantern(options: dict, neighbours: str):
    return methods.resolve("lantern", {"draft": "dynamic", "neighbours": neighbours, **options})


def test_greedy_lantern_drafts_and_decodes_as_official_lantern(golden, target, full_caption, neighbours,
                                                                tiny_vq, monkeypatch):
    """(c) On EAGLE-2's tree (59 nodes, depth 5, top-10), greedy, CFG 4, official LANTERN's random
    neighbour table: the first draft tree is official EaModel's, path for path; with lam=3 (k=5)
    the tokens are official's, and with delta=0.3 (k=10) too: where two accepted paths of equal
    length pass, both commit the first longest in EAGLE-2's node order."""
    from relaxspec.drafting.dynamic_tree import DynamicTree

    drafter = load_drafter(DRAFTER, target)
    trees = []
    draft = DynamicTree.draft
    monkeypatch.setattr(DynamicTree, "draft", lambda self, *a, **k: trees.append(draft(self, *a, **k)) or trees[-1])
    tokens = {}
    for name, options in (("delta", {"k": 10, "delta": 0.3}), ("lam", {"k": 5, "lam": 3.0})):
        trees.clear()
        tokens[name] = decode(target, full_caption, GREEDY_CFG4, lantern(options, neighbours), drafter=drafter,
                              vq=tiny_vq).tokens[0]
        tree = trees[0]
        parents, nodes = tree.parents[0].tolist(), tree.tokens[0].tolist()
        leaves = []
        for node in range(1, len(nodes)):
            if node in parents:
                continue
            path = []
            while node > 0:
                path, node = [nodes[node]] + path, parents[node]
            leaves.append(tuple(path))
        official = sorted(tuple(t for t in row if t >= 0) for row in golden["lantern_delta_tree"].tolist())
        assert sorted(leaves) == official, name
    assert torch.equal(tokens["lam"], torch.from_numpy(golden["lantern_lam_tokens"]))
    assert torch.equal(tokens["delta"], torch.from_numpy(golden["lantern_delta_tokens"]))


def test_additive_and_multiplicative_lantern_run_from_the_cli(golden, tmp_path, capsys, tiny_ckpts, neighbours):
    captions = tmp_path / "captions.npz"
    np.savez(captions, features=golden["full_caption"][None].astype(np.float32), mask=np.ones((1, 120), np.int64))
    files = tiny_ckpts["t2i"]
    common = ["generate", "--gpt-ckpt", str(TARGET), "--vq-ckpt", files["vq"], "--vq-model", files["vq_json"],
              "--caption-features", str(captions), "--temperature", "0", "--cfg-scale", "4", "--no-progress",
              "--method", "lantern", "--neighbours", neighbours, "--drafter-ckpt", str(DRAFTER)]
    for rule, key in ((["--lam", "3", "--k", "5"], "lantern_lam_tokens"), (["--delta", "0.3", "--k", "10"], None)):
        out = tmp_path / rule[0].strip("-")
        assert main([*common, *rule, "--out", str(out)]) == 0, capsys.readouterr().err
        if key:
            assert np.array_equal(np.load(out / "tokens.npy")[0], golden[key])


# ------------------------------------------------------------------------------ refusals


def edited(tmp_path: Path, weights: bool = True, **changes) -> Path:
    from helpers.folders import edited_folder

    return edited_folder(DRAFTER, tmp_path / "edited", files=("model.safetensors",) if weights else (), **changes)


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=64), "the drafter is 64 wide (hidden_size), the target 32"),
    (dict(vocab_size=16384), "the drafter's vocabulary is 16384 codes (vocab_size), the target's 64"),
    (dict(block_size=None), "made for a 16x16 token grid (256 image tokens, input_type t2i), the target's is 4x4"),
    (dict(block_size=None, input_type="t2i2"), "a 32x32 token grid (1024 image tokens, input_type t2i2)"),
    (dict(cls_token_num=5), "the drafter reads a 6-token caption, the target's is 120 tokens"),
    (dict(model_type="chameleon", architectures=["ChameleonForConditionalGeneration"]),
     "a LANTERN Anole drafter (model_type chameleon) drafts for an Anole target (--model-path ANOLE_DIR); this one "
     "is LlamaGen t2i"),
    (dict(input_type="c2i"), "input_type 'c2i' is not a LANTERN LlamaGen text-to-image drafter's (t2i or t2i2)"),
    (dict(num_hidden_layers=2), "the weights are not a 2-layer LANTERN LlamaGen drafter's (missing: "
                                "layers.1.input_layernorm.weight"),
])
def test_a_drafter_for_another_target_is_refused_in_one_line(changes, message, tmp_path, tiny_ckpts, golden,
                                                             capsys):
    """(d) Through ``generate --drafter-ckpt``: exit 2, one line naming the mismatch."""
    captions = tmp_path / "captions.npz"
    np.savez(captions, features=golden["full_caption"][None].astype(np.float32), mask=np.ones((1, 120), np.int64))
    files = tiny_ckpts["t2i"]
    argv = ["generate", "--gpt-ckpt", str(TARGET), "--vq-ckpt", files["vq"], "--vq-model", files["vq_json"],
            "--caption-features", str(captions), "--method", "sd", "--drafter-ckpt", str(edited(tmp_path, **changes)),
            "--out", str(tmp_path / "out"), "--no-progress"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


class Marker:
    """An object whose unpickling would run code (touch a file)."""

    path = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def test_weights_that_are_not_a_plain_state_dict_are_refused_unrun(target, tmp_path):
    """(d) A pytorch_model.bin holding an object is refused under weights_only, nothing run; a
    container, missing weights, a key too many and the LANTERN target folder are one-line errors."""
    folder = edited(tmp_path, weights=False)
    marker = tmp_path / "ran"
    Marker.path = str(marker)
    torch.save({"embed_tokens.weight": torch.zeros(64, 32), "hook": Marker()}, folder / "pytorch_model.bin")
    with pytest.raises(RelaxspecError, match="refusing to load: .* only an unsafe unpickling"):
        load_drafter(folder, target)
    assert not marker.exists()
    state = load_file(str(DRAFTER / "model.safetensors"))
    torch.save({"model": state}, folder / "pytorch_model.bin")
    with pytest.raises(RelaxspecError, match="holds a 'model' container; a LANTERN drafter file is a plain state dict"):
        load_drafter(folder, target)
    torch.save({**state, "layers.0.input_layernorm.weight": torch.ones(32)}, folder / "pytorch_model.bin")
    with pytest.raises(RelaxspecError, match=r"unexpected: layers\.0\.input_layernorm\.weight"):
        load_drafter(folder, target)
    (folder / "pytorch_model.bin").unlink()
    with pytest.raises(RelaxspecError, match="needs pytorch_model.bin or model.safetensors beside config.json"):
        load_drafter(folder, target)
    with pytest.raises(RelaxspecError, match="a LlamaGen model in LANTERN's layout, not a drafter"):
        load_drafter(TARGET, target)


def test_a_class_conditional_target_is_refused(tiny_c2i_models):
    with pytest.raises(RelaxspecError, match="drafts for a LlamaGen text-to-image target; this one is LlamaGen c2i"):
        load_drafter(DRAFTER, tiny_c2i_models["target"])


# ------------------------------------------------------------------------------ training


def test_train_drafter_continues_from_a_lantern_folder(golden, target, full_caption, tmp_path):
    """(e) ``--init-from DIR``: the run starts at the loaded drafter (its step-0 evaluation is the
    loaded drafter's, condition pairs included), keeps LANTERN's layout and frozen table, trains,
    and writes a relaxspec drafter folder that loads back."""
    from relaxspec.training.drafter import DrafterDataset, DrafterTrainConfig, evaluate_drafter, train_drafter

    llamagen = np.load(DATA / "llamagen_golden.npz")
    captions = torch.cat([full_caption, torch.from_numpy(llamagen["features"].astype(np.float32))])
    masks = torch.cat([torch.ones(1, 120, dtype=torch.bool), torch.from_numpy(llamagen["mask"]).bool()])
    tokens = torch.stack([torch.from_numpy(golden["full_tokens"]), *torch.from_numpy(llamagen["tokens_cfg4"])])
    dataset = DrafterDataset(tokens, captions, masks)
    config = DrafterTrainConfig(out=str(tmp_path / "run"), init_from=str(folder_with_bin(tmp_path)), steps=2,
                                batch_size=2, lr=1e-3, warmup_steps=0, val_fraction=0.0, progress=False,
                                eval_interval=1000, checkpoint_interval=1000, eval_depths=2)
    result = train_drafter(config, target=target, dataset=dataset)
    start = load_drafter(DRAFTER, target, dtype=torch.float32)
    baseline = evaluate_drafter(start, dataset.split(0.0, config.seed)[0], config)
    assert result.history[0]["step"] == 0
    assert result.history[0]["loss"] == pytest.approx(baseline["loss"], rel=1e-5)
    assert result.history[0]["accept"] == pytest.approx(baseline["accept"], rel=1e-5)
    trained = load_drafter(tmp_path / "run", target)
    assert trained.config.to_dict() == {**start.config.to_dict(), "n_layer": 1}
    assert torch.equal(trained.embed_tokens.weight, start.embed_tokens.weight)
    assert not torch.equal(trained.fc.weight, start.fc.weight)


def test_the_train_drafter_command_takes_the_folder(tmp_path, capsys):
    """``relaxspec train-drafter --gpt-ckpt TARGET --t5-path T5 --prompts-file F --init-from DIR``
    (the released layout, .bin) trains on and writes a relaxspec drafter of LANTERN's layout."""
    from helpers.t5 import make_t5

    t5 = make_t5(tmp_path / "t5", d_model=16)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na small blue dog on a heart\n")
    out = tmp_path / "run"
    assert main(["train-drafter", "--gpt-ckpt", str(TARGET), "--t5-path", str(t5), "--prompts-file", str(prompts),
                 "--self-samples", "2", "--steps", "1", "--batch-size", "2", "--init-from",
                 str(folder_with_bin(tmp_path)), "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())["config"]
    assert (config["first_attention_norm"], config["own_embedding"], config["condition_pairs"]) == (False, True, PAIRS)
