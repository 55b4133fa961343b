"""Fused-feature (EAGLE-3) drafters on LlamaGen targets: the target hands over the streams entering
the layers asked for, the drafter reads them (and its own outputs at later depths) the same way in
decoding and in training, it stays lossless, the training-time test's gradient flows through the
depths when asked, its config is written only when set and refused in one line when it cannot
work, and ``train-drafter --fused`` trains, saves, resumes and decodes."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.engine import explicit_chain, markov_pair, scaled_
from helpers.fused import LayerInputs, check_capture
from relaxspec.cli.train import add_train_drafter_parser
from relaxspec.decoding import decode
from relaxspec.drafting.eagle import DrafterConfig, EagleDrafter, drafter_config, load_drafter
from relaxspec.drafting.eagle_source import EagleSource
from relaxspec.drafting.static_tree import StaticTree
from relaxspec.drafting.trees import TreeSpec
from relaxspec.errors import RelaxspecError
from relaxspec.methods import MethodOptions
from relaxspec.models.base import fused_layers, run_capturing
from relaxspec.models.weights import save_model
from relaxspec.sampling import SamplingConfig
from relaxspec.training.drafter import (TRAIN_STATE, DrafterTrainConfig, drafter_loss, sample_from_target,
                                        target_features, train_drafter, unrolled)
from relaxspec.training.drafter.maths import depth_weights
from relaxspec.training.drafter.passes import teacher_forced

GREEDY = SamplingConfig(cfg_scale=4.0, temperature=0.0, top_k=0)


@pytest.fixture(scope="module")
def pair():
    model, _ = markov_pair(n_layer=3)
    return model


def fused_drafter(model, seed: int = 3, scale: float = 4.0) -> EagleDrafter:
    torch.manual_seed(seed)
    drafter = EagleDrafter.for_target(model, fused_layers=True).eval()
    scaled_(drafter, scale)  # far from uniform: the tests see real drafts
    return drafter


def test_fused_layers_are_eagle3_s_and_legal_for_shallow_targets():
    assert fused_layers(32) == (2, 16, 29) and fused_layers(12) == (2, 6, 9)
    assert fused_layers(2) == (2, 1, 0) and fused_layers(1) == (1, 0, 0)
    out, captured = run_capturing([lambda x: x + 1, lambda x: 2 * x], torch.zeros(1), lambda f, x: f(x), (2, 0, 1))
    assert out.item() == 2 and captured.tolist() == [2.0, 0.0, 1.0]
    assert run_capturing([lambda x: x + 1], torch.zeros(1), lambda f, x: f(x), None)[1] is None


def test_the_target_hands_over_the_streams_entering_its_blocks(pair):
    """``capture`` returns, side by side, the blocks' inputs (index ``L``: the last block's output
    before the norm) in every path training and decoding take: the uncached forward, the cached
    prefill and step (teacher_forced) and forward_train; the logits never change."""
    model = pair
    capture = (3, 0, 2)
    cond, tokens = torch.tensor([1, 4]), torch.randint(32, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), LayerInputs(model.layers) as hooks:
        logits, hidden = model.forward_train(cond, tokens, return_hidden=True)
        want = torch.cat([hooks.seen[i][0] for i in capture], -1)
        plain_logits, captured = model.forward_train(cond, tokens, return_hidden=True, capture=capture)
    assert captured.shape == (2, 16, 3 * model.config.dim)
    torch.testing.assert_close(captured, want[:, model.config.cls_token_num - 1:], atol=0, rtol=0)
    assert torch.equal(plain_logits, logits)
    torch.testing.assert_close(model.norm(captured[..., :32]), hidden, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        _, forced = teacher_forced(model, cond, tokens, capture=capture)
    torch.testing.assert_close(forced, captured, atol=1e-5, rtol=1e-5)  # the cache's path, the same streams
    check_capture(model, model.layers, model.norm, cond, tokens)


def test_cached_steps_and_tree_nodes_compute_the_training_pass(pair):
    """Decoding feeds committed pairs with the target's fused streams (``k * d`` wide) and tree
    nodes with the drafter's own outputs (``d`` wide); both give what the uncached pass gives, and
    the depths unrolled in training are the chains decoding drafts."""
    model = pair
    drafter = fused_drafter(model)
    rows, count = 2, 9
    torch.manual_seed(1)
    features = torch.randn(rows, count, 3 * model.config.dim)
    tokens = torch.randint(model.config.vocab_size, (rows, count))
    positions = torch.arange(count).expand(rows, -1)
    with torch.no_grad():
        whole_features, whole_logits = drafter(features, tokens, positions)
        drafter.setup_caches(rows, 24)
        pieces = [drafter(features[:, a:b], tokens[:, a:b], positions[:, a:b], cache_slots=positions[:, a:b])[0]
                  for a, b in ((0, 4), (4, 8))]
        mask = torch.zeros(rows, 1, 24, dtype=torch.bool)
        mask[:, :, :8] = mask[:, :, 20] = True  # a draft node: its own feature, the guess at pair 7
        node, node_logits = drafter(pieces[1][:, -1:], tokens[:, 8:], positions[:, 8:],
                                    cache_slots=torch.full((rows, 1), 20), attn_mask=mask)
        drafter.clear_caches()
        chain = drafter(torch.cat([drafter.lift(features[:, :8]), pieces[1][:, -1:]], 1), tokens, positions)
    torch.testing.assert_close(torch.cat(pieces, 1), whole_features[:, :8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(node_logits, chain[1][:, 8:], atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        _, logits = unrolled(drafter, features, tokens, 3)
        for depth in (1, 2, 3):
            for at in range(depth - 1, count - 1):
                want = explicit_chain(drafter, features, tokens, at - depth + 1, depth)
                torch.testing.assert_close(logits[:, depth - 1, at], want, atol=1e-4, rtol=1e-4)


def test_through_depths_is_the_gradient_of_the_chain_decoding_drafts(pair):
    """With ``through_depths`` the last depth's gradient is that of the explicit chain (its own
    guesses not detached, EAGLE-3's training-time test); without, it is not (the guesses it read
    are constants)."""
    model = pair
    drafter = fused_drafter(model, scale=1.0).train()
    torch.manual_seed(2)
    features = torch.randn(1, 6, 3 * model.config.dim)
    tokens = torch.randint(model.config.vocab_size, (1, 6))

    def gradient(loss):
        drafter.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in drafter.parameters() if p.grad is not None])

    want = gradient(explicit_chain(drafter, features, tokens, 1, 3).logsumexp(-1).sum())
    through = gradient(unrolled(drafter, features, tokens, 3, through_depths=True)[1][:, 2, 3].logsumexp(-1).sum())
    detached = gradient(unrolled(drafter, features, tokens, 3)[1][:, 2, 3].logsumexp(-1).sum())
    torch.testing.assert_close(through, want, atol=1e-5, rtol=1e-4)
    assert (detached - want).abs().max() > 1e-3


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_a_fused_drafter_is_lossless(pair, cfg):
    """Greedy exact SD on a chain and EAGLE-2's dynamic tree with a fused drafter commits greedy
    AR's tokens, eager, compiled, and with rows in parallel where they never overlap (a row opens
    once the row above is whole: raster order)."""
    model = pair
    drafter = fused_drafter(model)
    sampling = SamplingConfig(cfg_scale=cfg, temperature=0.0, top_k=0)
    cond = torch.arange(3)
    ar = decode(model, cond, sampling).tokens
    for options in (MethodOptions(method="sd", draft="chain", depth=3), MethodOptions(method="eagle2"),
                    MethodOptions(method="sd", draft="chain", depth=3, compile=True),
                    MethodOptions(method="sd", draft="chain", depth=2, rows=2, row_lead=4)):
        result = decode(model, cond, sampling, options, drafter=drafter)
        assert torch.equal(result.tokens, ar), options
    assert result.accept_lengths and max(max(a) for a in result.accept_lengths) > 1  # it does accept drafts


def test_the_source_refuses_final_states_for_a_fused_drafter(pair):
    """A fused drafter handed the target's final states (``d`` wide, a target driven without the
    source's layers) says so in one line instead of drafting from them."""
    model = pair
    drafter = fused_drafter(model)
    source = EagleSource(drafter, StaticTree(TreeSpec.chain(2)), GREEDY)
    assert source.target_layers == (2, 1, 0)
    with pytest.raises(RelaxspecError, match="reads target features 96 wide"):
        source.start(torch.zeros(1, dtype=torch.long), torch.full((1, 32), 1 / 32), torch.zeros(2, 1, 32), 2, 16,
                     None, True)


def test_the_config_is_written_only_when_fused_and_refused_when_it_cannot_work(pair, tmp_path):
    model = pair
    plain = drafter_config(model)
    assert "fused_layers" not in plain.to_dict()  # every drafter before fused ones reads as written
    fused = drafter_config(model, fused_layers=True)
    assert fused.to_dict()["fused_layers"] == [2, 1, 0] and fused.fused
    drafter = fused_drafter(model)
    save_model(drafter, tmp_path / "d", kind="drafter")
    assert json.loads((tmp_path / "d" / "config.json").read_text())["config"]["fused_layers"] == [2, 1, 0]
    loaded = load_drafter(tmp_path / "d", model)
    inputs = (torch.randn(1, 4, 96), torch.randint(32, (1, 4)), torch.arange(4)[None])
    with torch.no_grad():
        assert torch.equal(loaded(*inputs)[1], drafter(*inputs)[1])
    for bad, message in [([2], "at least two"), ([1, -1], "at least two"), ([0, True], "at least two")]:
        with pytest.raises(RelaxspecError, match=message):
            DrafterConfig(target=plain.target, fused_layers=bad)
    with pytest.raises(RelaxspecError, match="official LANTERN"):
        DrafterConfig(target=plain.target, fused_layers=[0, 1], condition_pairs=0, own_embedding=True)
    with pytest.raises(RelaxspecError, match="this target has 3"):
        drafter_config(model, fused_layers=[0, 4])
    opaque = SimpleNamespace(config=model.config)  # a target known only by the protocol: no layers to hand over
    with pytest.raises(RelaxspecError, match="num_layers"):
        drafter_config(opaque, fused_layers=True)


def test_depths_weigh_by_the_decay_and_a_fused_drafter_has_no_feature_loss(pair):
    """The loss over depths is ``sum_d decay^(d-1) L_d / sum_d decay^(d-1)`` (1: the plain mean),
    with each depth's ``L_d`` read from the means over the first ``d`` depths; a fused drafter's
    batch has no feature term and its config refuses one."""
    assert torch.allclose(depth_weights(3, 0.8), torch.tensor([1, 0.8, 0.64]) / 2.44)
    torch.manual_seed(4)
    pred_logits, next_logits = torch.randn(2, 3, 7, 16), torch.randn(2, 7, 16)
    features = torch.randn(2, 3, 7, 8), torch.randn(2, 7, 8)
    sampling = SamplingConfig(cfg_scale=1.0)

    def kl(depths, decay=1.0):
        return drafter_loss(features[0], pred_logits, features[1], next_logits, law_loss="kl", sampling=sampling,
                            train_depths=depths, depth_decay=decay)["kl"]

    means = [kl(d) for d in (1, 2, 3)]
    each = [means[0], 2 * means[1] - means[0], 3 * means[2] - 2 * means[1]]
    want = sum(w * value for w, value in zip(depth_weights(3, 0.8), each))
    torch.testing.assert_close(kl(3, 0.8), want, atol=1e-5, rtol=1e-5)
    no_feature = drafter_loss(features[0], pred_logits, None, next_logits, law_loss="kl", sampling=sampling,
                              feature_weight=0.0)
    assert "feature_loss" not in no_feature and torch.equal(no_feature["loss"], no_feature["kl"])
    with pytest.raises(RelaxspecError, match="no feature loss"):
        DrafterTrainConfig(fused=True)
    with pytest.raises(RelaxspecError, match="give fused too"):
        DrafterTrainConfig(fused_layers=[0, 1])
    with pytest.raises(RelaxspecError, match="depth_decay"):
        DrafterTrainConfig(depth_decay=0.0)


def test_train_drafter_fused_trains_resumes_and_decodes(pair, tmp_path):
    """``train-drafter --fused`` (EAGLE-3's training-time test: three depths, decay 0.8, through
    the depths) writes a fused drafter that greedy exact SD decodes to AR's tokens; the loss it
    reports has no feature term, and a resumed run ends where a straight one does."""
    model = pair
    dataset = sample_from_target(model, 12, sampling=SamplingConfig(cfg_scale=1.0), seed=0)
    save_model(model, tmp_path / "target")
    np.savez(tmp_path / "data.npz", tokens=dataset.tokens.numpy(), labels=dataset.labels.numpy())
    parser = argparse.ArgumentParser()
    add_train_drafter_parser(parser.add_subparsers(dest="command"))

    def run(out, *extra):
        args = parser.parse_args(["train-drafter", "--gpt-ckpt", str(tmp_path / "target"), "--out", str(out),
                                  "--no-progress", "--data", str(tmp_path / "data.npz"), "--batch-size", "4",
                                  "--lr", "1e-3", "--val-fraction", "0", "--fused", "--train-depths", "3",
                                  "--depth-decay", "0.8", "--through-depths", "--eval-interval", "2", *extra])
        assert args.handler(args) == 0

    run(tmp_path / "straight", "--steps", "4")
    run(tmp_path / "split", "--steps", "2")
    args = parser.parse_args(["train-drafter", "--gpt-ckpt", str(tmp_path / "target"), "--out",
                              str(tmp_path / "split"), "--no-progress", "--resume", "--steps", "4"])
    assert args.handler(args) == 0
    state = torch.load(tmp_path / "split" / TRAIN_STATE, weights_only=True)
    config = state["config"]
    assert (config["fused"], config["feature_weight"], config["noise"], config["through_depths"]) == (True, 0, 0, True)
    straight = torch.load(tmp_path / "straight" / TRAIN_STATE, weights_only=True)["model"]
    for key, value in straight.items():
        assert torch.equal(value, state["model"][key]), key
    evaluations = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert all("feature_loss" not in e for e in evaluations) and evaluations[-1]["step"] == 4
    drafter = load_drafter(tmp_path / "straight", model)
    assert drafter.config.fused_layers == [2, 1, 0]
    cond = torch.arange(3)
    ar = decode(model, cond, GREEDY).tokens
    assert torch.equal(decode(model, cond, GREEDY, MethodOptions(method="sd"), drafter=drafter).tokens, ar)
    # a fused drafter warm-starts from an EAGLE-1/2 one (fc and layers carry over, fuse starts fresh)
    plain = train_drafter(DrafterTrainConfig(out=str(tmp_path / "plain"), steps=1, batch_size=4, val_fraction=0.0,
                                             progress=False), target=model, dataset=dataset)
    warm = train_drafter(DrafterTrainConfig(out=str(tmp_path / "warm"), steps=0, batch_size=4, val_fraction=0.0,
                                            progress=False, fused=True, feature_weight=0.0,
                                            init_from=str(tmp_path / "plain")), target=model, dataset=dataset)
    assert torch.equal(warm.drafter.fc.weight, plain.drafter.fc.weight) and warm.drafter.config.fused
    with pytest.raises(RelaxspecError, match="reads target layers"):
        train_drafter(DrafterTrainConfig(out=str(tmp_path / "back"), steps=0, batch_size=4, val_fraction=0.0,
                                         progress=False, init_from=str(tmp_path / "straight")),
                      target=model, dataset=dataset)
    features, _ = target_features(model, dataset.tokens[:2], dataset.labels[:2], null_rows=0, capture=(2, 1, 0))
    assert features.shape[-1] == 96


@pytest.mark.parametrize("extra, expected", [
    (["--fused", "--fused-layers", "0", "99"], "this target has 3"),
    (["--fused", "--fused-layers", "2"], "at least two target layers"),
    (["--fused-layers", "0", "1"], "give fused too"),
    (["--fused", "--feature-weight", "1"], "no feature loss"),
    (["--depth-decay", "1.5"], "depth_decay must lie in (0, 1]"),
])
def test_train_drafter_refuses_a_fused_run_that_cannot_work_in_one_line(pair, tmp_path, capsys, extra, expected):
    from helpers.cli import assert_one_line_error, outcome

    save_model(pair, tmp_path / "target")
    argv = ["train-drafter", "--gpt-ckpt", tmp_path / "target", "--self-samples", "4", "--steps", "1",
            "--out", tmp_path / "run", "--no-progress", *extra]
    assert_one_line_error(*outcome(argv, capsys), expected)
