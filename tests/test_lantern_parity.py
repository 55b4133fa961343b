"""LANTERN's artefacts to the last token (issue 43): with its released-layout drafter on captions
of different padded lengths, greedy AR, exact SD and LANTERN (additive and multiplicative on the
dynamic tree, LANTERN++ on the official static tree) give official LANTERN's own tokens.

The golden data (tests/data/lantern/parity_golden.npz) are official ``EaModel.generate``'s greedy
tokens at CFG 4 on three captions (120, 37 and 7 valid tokens of 120) with the tiny target and
drafter of tests/test_lantern_drafter.py, and its target's caption hidden states with the weights
in fp32, bf16 and fp16 (make_parity_golden.py says how they were made and what it patched).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaxspec import methods
from relaxspec.cli import main
from relaxspec.decoding import decode
from relaxspec.drafting.dynamic_tree import best_candidates
from relaxspec.drafting.eagle import EagleDrafter, load_drafter
from relaxspec.drafting.trees import load_tree
from relaxspec.errors import RelaxspecError
from relaxspec.models.base import condition_states
from relaxspec.models.llamagen.checkpoints import load_gpt, resolve_vq_model
from relaxspec.models.llamagen.lantern_rows import lantern_caption_bias
from relaxspec.models.llamagen.vq import VQ_CONFIGS
from relaxspec.sampling import SamplingConfig
from helpers.engine import fake_vq

DATA = Path(__file__).resolve().parent / "data" / "lantern"
TARGET, DRAFTER = DATA / "llamagen-t2i", DATA / "llamagen-t2i-drafter"
GREEDY_CFG4 = SamplingConfig(cfg_scale=4.0, temperature=0.0, top_k=0)
#: Official runs -> relaxspec's method and options (official depth 4 is relaxspec's depth 5, the
#: dynamic tree's default; LANTERN++'s tree is the static presets' default).
RUNS = {"ar": ("sd", {"draft": "dynamic"}),
        "add": ("lantern", {"draft": "dynamic", "k": 10, "delta": 0.2}),
        "mul": ("lantern", {"draft": "dynamic", "k": 5, "lam": 5.0}),
        "pp": ("lantern++", {"k": 10, "lam": 5.0}),
        "static": ("sd-static", {})}


@pytest.fixture(scope="module")
def golden() -> dict:
    return dict(np.load(DATA / "parity_golden.npz"))


@pytest.fixture(scope="module")
def target():
    return load_gpt(TARGET)


@pytest.fixture(scope="module")
def neighbours(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("neighbours") / "top_63_indices.npy"
    np.save(path, np.load(DATA / "drafter_golden.npz")["neighbours"].astype(np.int64))
    return str(path)


def captions(golden) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(golden["features"].astype(np.float32)), torch.from_numpy(golden["mask"]).bool()


def cfg_rows(target, features: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[cond; uncond] rows and their mask, as decoding builds them."""
    return torch.cat([features, target.null_condition(features)]), torch.cat([mask, mask])


# ------------------------------------------------------------------------------ the caption rows
@pytest.mark.parametrize("dtype, tolerance", [("fp32", 1e-5), ("bf16", 0.06), ("fp16", 5e-3)])
def test_caption_rows_are_lantern_targets_in_each_precision(golden, target, dtype, tolerance):
    """LANTERN's converted target computes padded caption rows by its HF mask, whose outcome
    depends on the weights' dtype: relaxspec's rows equal its rows at every caption position in
    fp32, bf16 and fp16 -- and differ from upstream's (the prefill's own) at the padded ones, and
    from the other precisions' rule there."""
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = copy.deepcopy(target).to(torch_dtype)
    features, mask = captions(golden)
    for index, valid in enumerate(golden["valid"].tolist()):
        cond, rows_valid = cfg_rows(model, features[index : index + 1].to(torch_dtype), mask[index : index + 1])
        with torch.no_grad():
            ours = model.lantern_condition_states(cond, rows_valid).float()
        official = torch.from_numpy(golden[f"condition_{dtype}"][index])
        torch.testing.assert_close(ours, official, atol=tolerance, rtol=tolerance)
        if valid < 120:  # fp32's rule sees the valid keys too; bf16's and fp16's the padded ones only (the
            # same rows here: a caption position's RoPE row is zero, so its scores are all 0 and fp16's weights equal)
            padded = ~rows_valid
            other = golden["condition_bf16" if dtype == "fp32" else "condition_fp32"][index]
            assert (torch.from_numpy(other)[padded] - official[padded]).abs().max() > 0.5


def test_only_padded_rows_change_and_only_for_a_lantern_drafter(golden, target):
    """``condition_states``: the prefill's rows for ``upstream`` (and wherever nothing is padded);
    LANTERN's at padded positions for ``lantern``, the valid ones the prefill's own."""
    features, mask = captions(golden)
    cond, valid = cfg_rows(target, features[1:2], mask[1:2])
    prefill = torch.randn(2, 120, 32)
    assert condition_states(target, cond, valid, prefill, "upstream") is prefill
    assert condition_states(target, cond, None, prefill, "lantern") is prefill
    rows = condition_states(target, cond, valid, prefill, "lantern")
    assert torch.equal(rows[valid], prefill[valid])
    torch.testing.assert_close(rows[~valid], torch.from_numpy(golden["condition_fp32"][1])[~valid], atol=1e-5, rtol=1e-5)
    with pytest.raises(RelaxspecError, match="caption rows must be one of upstream, lantern"):
        condition_states(target, cond, valid, prefill, "official")


def test_the_bias_follows_lanterns_mask_for_any_padding():
    """Beyond left padding: a padded position after a valid token (right padding) sees, as under
    LANTERN's mask, the valid keys before it by their scores in every precision."""
    valid = torch.tensor([[False, False, True, True, False]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        bias = lantern_caption_bias(valid, dtype).float()[0]
        assert bias.dtype == torch.float32 and (bias[2:4] > -1).sum().item() == 3  # rows 2, 3: keys 2 | 2, 3
        assert torch.equal(bias[4] == 0, torch.tensor([False, False, True, True, False]))
    rows = {dtype: (lantern_caption_bias(valid, dtype).float()[0, 1] > float("-inf")).tolist()
            for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    assert rows == {torch.float32: [True, True, True, True, False], torch.bfloat16: [True, True, False, False, False],
                    torch.float16: [True, True, False, False, False]}
    with pytest.raises(RelaxspecError, match="fp32, bf16 and fp16"):
        lantern_caption_bias(valid, torch.float64)


# ------------------------------------------------------------------------------ the tokens
@pytest.mark.parametrize("run", list(RUNS))
def test_greedy_runs_give_official_lanterns_tokens_on_every_caption(golden, target, neighbours, run):
    """(issue 43, done when) greedy AR / exact SD and LANTERN -- additive and multiplicative on
    the dynamic tree, LANTERN++ on the official static tree -- give the official code's tokens on
    every caption, padded or not."""
    method, options = RUNS[run]
    if method.startswith("lantern"):
        options = {**options, "neighbours": neighbours}
    drafter = load_drafter(DRAFTER, target)
    features, mask = captions(golden)
    for index in range(len(golden["valid"])):
        tokens = decode(target, features[index : index + 1], GREEDY_CFG4, methods.resolve(method, options),
                        drafter=drafter, vq=fake_vq(64), cond_mask=mask[index : index + 1]).tokens[0]
        assert tokens.tolist() == golden[f"tokens_{run}"][index].tolist(), (run, index)


def test_the_rows_upstream_computes_would_not(golden, target, neighbours):
    """The test above can fail: a drafter that reads upstream's padded rows (what relaxspec gave
    LANTERN's drafters before) commits other tokens on the padded captions."""
    drafter = load_drafter(DRAFTER, target)
    drafter.config = dataclasses.replace(drafter.config, caption_rows="upstream")
    features, mask = captions(golden)
    options = methods.resolve("lantern", {"draft": "dynamic", "k": 10, "delta": 0.2, "neighbours": neighbours})
    differs = [decode(target, features[i : i + 1], GREEDY_CFG4, options, drafter=drafter, vq=fake_vq(64),
                      cond_mask=mask[i : i + 1]).tokens[0].tolist() != golden["tokens_add"][i].tolist()
               for i in range(3)]
    assert differs == [False, True, True]


def test_lantern_pp_from_the_cli_in_one_batch(golden, tmp_path, capsys, tiny_ckpts, neighbours):
    """``generate --method lantern++`` with its defaults (the official tree) on the three captions
    in one batch: each image is the official code's."""
    path = tmp_path / "captions.npz"
    np.savez(path, features=golden["features"].astype(np.float32), mask=golden["mask"])
    files = tiny_ckpts["t2i"]
    assert main(["generate", "--gpt-ckpt", str(TARGET), "--vq-ckpt", files["vq"], "--vq-model", files["vq_json"],
                 "--caption-features", str(path), "--temperature", "0", "--cfg-scale", "4", "--batch-size", "3",
                 "--method", "lantern++", "--k", "10", "--lam", "5", "--neighbours", neighbours,
                 "--drafter-ckpt", str(DRAFTER), "--out", str(tmp_path / "out"), "--no-progress"]) == 0, \
        capsys.readouterr().err
    assert np.array_equal(np.load(tmp_path / "out" / "tokens.npy"), golden["tokens_pp"])
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["settings"]["method"]["tree"] == "naive_extend_57"


# ------------------------------------------------------------------------------ the drafter's record
def test_the_drafter_says_which_rows_it_reads(target, tmp_path):
    """LANTERN's released drafter reads LANTERN's rows; relaxspec's own the upstream ones and its
    config.json says nothing new; a config that names them keeps them; nonsense is one line."""
    assert load_drafter(DRAFTER, target).config.caption_rows == "lantern"
    own = EagleDrafter.for_target(target)
    assert own.config.caption_rows == "upstream" and "caption_rows" not in own.config.to_dict()
    lantern = load_drafter(DRAFTER, target).config
    assert lantern.to_dict()["caption_rows"] == "lantern"
    with pytest.raises(RelaxspecError, match="caption_rows must be one of upstream, lantern, got 'both'"):
        dataclasses.replace(lantern, caption_rows="both")
    with pytest.raises(RelaxspecError, match="caption_rows is for LlamaGen blocks that read a caption"):
        dataclasses.replace(own.config, caption_rows="lantern")


def test_training_reads_the_drafters_own_rows(golden, target):
    """train-drafter hands a drafter the rows decoding hands it: LANTERN's for a LANTERN drafter
    (so one trained from it keeps them, its config saying so), upstream's for relaxspec's own."""
    from relaxspec.training.drafter.passes import target_features_with_condition

    features, mask = captions(golden)
    tokens = torch.from_numpy(golden["tokens_ar"][2:3])
    _, _, lantern, _ = target_features_with_condition(target, tokens, features[2:3], 1, mask[2:3], "lantern")
    _, _, upstream, _ = target_features_with_condition(target, tokens, features[2:3], 1, mask[2:3])
    official = torch.from_numpy(golden["condition_fp32"][2])
    torch.testing.assert_close(lantern, official, atol=1e-5, rtol=1e-5)
    assert (upstream - official).abs().max() > 0.1


# ------------------------------------------------------------------------------ the trees
def test_the_official_trees_by_name():
    tree = load_tree("naive_extend_57")
    assert tree.num_nodes == 58 and tree.level_sizes() == [5, 13, 16, 14, 9]
    assert methods.resolve("lantern++").tree == "naive_extend_57" == methods.resolve("sd-static").tree
    # EAGLE-1's default, official LANTERN's mc_sim_7b_63, is eagle25
    assert load_tree("eagle25").level_sizes() == [4, 8, 8, 3, 2]


def test_the_dynamic_tree_keeps_candidates_by_score_as_the_official_top_k():
    """Near ties are decided by the scores alone (a nudge by index, as before, flipped these two);
    exact ties keep the earlier -- shallower -- candidate, so a child never displaces its parent."""
    near = torch.tensor([[-0.5, -1.0, -1.0 + 1e-7, -2.0]])
    assert best_candidates(near, 2).tolist() == [[0, 2]]
    assert torch.topk(near, 2).indices.tolist() == [[0, 2]]
    exact = torch.tensor([[-1.0, -0.3, -0.3, -0.3]])  # candidate 1 and its q = 1 children 2, 3
    assert best_candidates(exact, 2).tolist() == [[1, 2]]


# ------------------------------------------------------------------------------ files as they are
def upstream_model_args(**changes) -> dict:
    """Upstream LlamaGen's ``ModelArgs`` (tokenizer/tokenizer_image/vq_model.py) as ``asdict``
    writes it."""
    return {"codebook_size": 16384, "codebook_embed_dim": 8, "codebook_l2_norm": True, "codebook_show_usage": True,
            "commit_loss_beta": 0.25, "entropy_loss_ratio": 0.0, "encoder_ch_mult": [1, 1, 2, 2, 4],
            "decoder_ch_mult": [1, 1, 2, 2, 4], "z_channels": 256, "dropout_p": 0.0, **changes}


def test_vq_model_reads_upstreams_model_args(tmp_path):
    path = tmp_path / "vq.json"
    path.write_text(json.dumps(upstream_model_args()))
    assert resolve_vq_model(str(path)) == (None, VQ_CONFIGS["VQ-16"])
    assert resolve_vq_model(json.dumps(upstream_model_args(codebook_size=64)))[1] == dataclasses.replace(
        VQ_CONFIGS["VQ-16"], codebook_size=64)
    for spec, message in ((json.dumps(upstream_model_args(decoder_ch_mult=[1, 2])), "differ; relaxspec's VQ model"),
                          ('{"codebook_size": 16', "--vq-model: not valid JSON"),
                          ('{"codebook_sise": 16}', "--vq-model: unknown VQConfig fields: codebook_sise"),
                          ('{"codebook_size": 0}', "--vq-model: VQConfig.codebook_size must be a positive integer")):
        with pytest.raises(RelaxspecError, match=message):
            resolve_vq_model(spec)


def test_generate_takes_upstreams_vq_json_and_inline_json(tmp_path, capsys, tiny_ckpts):
    """The tiny VQ's fields written with upstream's names (plus the fields upstream hard-codes),
    as a file and inline: the same pixels as relaxspec's own JSON."""
    files = tiny_ckpts["c2i"]
    ours = json.loads(Path(files["vq_json"]).read_text())
    ours = ours.get("config", ours)
    theirs = {**{k: v for k, v in ours.items() if k not in ("ch_mult", "dropout")},
              "encoder_ch_mult": list(ours["ch_mult"]), "decoder_ch_mult": list(ours["ch_mult"]),
              "dropout_p": ours.get("dropout", 0.0), "commit_loss_beta": 0.25, "entropy_loss_ratio": 0.0}
    (tmp_path / "upstream.json").write_text(json.dumps(theirs))
    grids = []
    for spec in (files["vq_json"], str(tmp_path / "upstream.json"), json.dumps(theirs)):
        out = tmp_path / f"out{len(grids)}"
        args = [a if a != files["vq_json"] else spec for a in tiny_ckpts["c2i"]["args"]]
        assert main(["generate", *args, "--method", "ar", "--classes", "1", "--out", str(out),
                     "--no-progress"]) == 0, capsys.readouterr().err
        grids.append((out / "0000.png").read_bytes())
    assert grids[0] == grids[1] == grids[2]
