"""Target (c2i GPT) training: augmented tokenisation, the loss falls, train and val NLL are both
reported, the best-val weights are kept and early stopping fires, exact resume, the CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import interrupted_at
from safetensors.torch import load_file
from helpers.data import build_fake_dataset

from relaxspec.cli.train import add_train_gpt_parser
from relaxspec.models.llamagen.checkpoints import load_gpt
from relaxspec.models.weights import save_model
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.vq import VQConfig, VQModel
from relaxspec.runs.folder import TRAIN_STATE
from relaxspec.training.llamagen import gpt as gpt_recipe
from relaxspec.training.llamagen.gpt import (
    GPTTrainConfig,
    evaluate_nll,
    load_images,
    tokenise,
    train_gpt,
)

#: 32-d, 1 layer, 2 heads (head dim 16) on a 4x4 grid of 32 codes; milliseconds per step.
TINY = dict(dim=32, n_layer=1, n_head=2, copies=3, batch_size=16, lr=3e-3, warmup_steps=2, eval_interval=5,
            checkpoint_interval=5, progress=False, threads=1, bf16=False)



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_fake_dataset(tmp_path_factory.mktemp("emoji"))


@pytest.fixture(scope="module")
def vq(tmp_path_factory):
    """A random tokenizer saved as our format (8 px -> 4x4 tokens); its path goes in the config."""
    torch.manual_seed(0)
    model = VQModel(VQConfig(codebook_size=32, codebook_embed_dim=4, z_channels=8, ch=16, ch_mult=(1, 2),
                             num_res_blocks=1, norm_groups=8)).eval()
    folder = tmp_path_factory.mktemp("vq") / "vq"
    save_model(model, folder)
    return folder


def quick(out, data, vq, **overrides) -> GPTTrainConfig:
    return GPTTrainConfig(**{**TINY, "out": str(out), "data": str(data), "vq_ckpt": str(vq), **overrides})


def test_tokenise_keeps_copy_zero_clean_and_augments_the_rest(data, vq) -> None:
    from relaxspec.models.llamagen.checkpoints import load_vq

    model = load_vq(vq)
    train, val = load_images(data, "train"), load_images(data, "val")
    tokens = tokenise(model, train, val, GPTTrainConfig(copies=3))
    n = len(train)
    assert tokens.train.tokens.shape == (3 * n, 16) and tokens.train.labels.tolist() == train.labels.tolist() * 3
    assert torch.equal(tokens.train.tokens[:n], tokens.train_clean.tokens)
    assert torch.equal(tokens.train_clean.tokens, model.encode(train.images.permute(0, 3, 1, 2).float() / 127.5 - 1))
    assert not torch.equal(tokens.train.tokens[n : 2 * n], tokens.train_clean.tokens)  # augmented copies differ
    assert tokens.val.tokens.shape == (len(val), 16)
    again = tokenise(model, train, val, GPTTrainConfig(copies=3))
    assert torch.equal(again.train.tokens, tokens.train.tokens)


def test_loss_falls_and_the_best_val_weights_are_kept(tmp_path, data, vq) -> None:
    result = train_gpt(quick(tmp_path / "run", data, vq, steps=30, patience=0, export=str(tmp_path / "ship")))
    history = result.history
    assert history[-1]["train_nll"] < history[0]["train_nll"] - 0.3
    assert all("val_nll" in r and "train_nll" in r for r in history)  # both, at every evaluation
    best = min(history, key=lambda r: r["val_nll"])
    assert result.best["step"] == best["step"] and result.best["val_nll"] == best["val_nll"]
    # out/best and the export hold the best-val weights (the export in fp16), and they measure so
    saved = load_gpt(tmp_path / "run" / "best")
    val = gpt_recipe.read_tokens(tmp_path / "run")[1].val
    assert evaluate_nll(saved, val, bf16=False) == pytest.approx(best["val_nll"], rel=1e-5)
    assert evaluate_nll(result.model, val, bf16=False) == pytest.approx(best["val_nll"], rel=1e-5)
    weights = load_file(str(tmp_path / "ship" / "model.safetensors"))
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float16}
    shipped = load_gpt(tmp_path / "ship")
    assert shipped.config.num_classes == 3 and shipped.config.vocab_size == 32 and shipped.config.block_size == 16
    meta = json.loads((tmp_path / "ship" / "config.json").read_text())
    assert meta["training"]["best"]["step"] == best["step"]
    # the shipped (fp16-rounded) weights are measured as they will be run
    assert meta["training"]["fp16_fp32"]["val_nll"] == pytest.approx(best["val_nll"], rel=1e-2)


def test_early_stopping_after_patience(tmp_path, data, vq, monkeypatch) -> None:
    # scripted NLLs (train, val per evaluation): val is best at the 2nd evaluation, then worsens
    script = iter([5.0, 5.0, 4.0, 4.0, 3.0, 4.5, 2.0, 4.6, 1.0, 4.7, 0.5, 4.8])
    monkeypatch.setattr(gpt_recipe, "evaluate_nll", lambda *args, **kwargs: next(script))
    result = train_gpt(quick(tmp_path / "run", data, vq, steps=100, patience=2))
    assert result.stopped_early and result.step == 15 and result.best["step"] == 5
    assert [r["best"] for r in result.history] == [True, True, False, False]
    # resuming a stopped run trains no further
    again = train_gpt(quick(tmp_path / "run", data, vq, steps=100, patience=2), resume=True)
    assert again.step == 15 and again.stopped_early
    # more patience (0 = none) lets the stopped run go on along the same schedule
    monkeypatch.setattr(gpt_recipe, "evaluate_nll", lambda *args, **kwargs: 4.9)
    more = train_gpt(quick(tmp_path / "run", data, vq, steps=100, patience=0), resume=True)
    assert more.step == 100 and not more.stopped_early and more.best["step"] == 5


def test_interrupted_run_resumes_bit_for_bit(tmp_path, data, vq, monkeypatch) -> None:
    # evaluations (every 4) and checkpoints (every 5) interleave: the running train loss is state too
    whole = train_gpt(quick(tmp_path / "whole", data, vq, steps=12, patience=0, eval_interval=4))
    with interrupted_at(monkeypatch, 7):
        train_gpt(quick(tmp_path / "split", data, vq, steps=12, patience=0, eval_interval=4))
    assert torch.load(tmp_path / "split" / TRAIN_STATE, weights_only=True)["step"] == 5
    resumed = train_gpt(quick(tmp_path / "split", data, vq, steps=12, patience=0, eval_interval=4), resume=True)
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    assert resumed.history == whole.history and resumed.best == whole.best
    with pytest.raises(RelaxspecError, match="different recipe: copies"):
        train_gpt(quick(tmp_path / "split", data, vq, steps=12, patience=0, eval_interval=4, copies=2), resume=True)


def test_cli_trains_and_resumes(tmp_path, data, vq, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_train_gpt_parser(parser.add_subparsers(dest="command"))
    common_args = ["train-gpt", "--data", str(data), "--vq-ckpt", str(vq), "--out", str(tmp_path / "run"),
                   "--no-progress", "--threads", "1"]
    tiny = ["--dim", "32", "--n-layer", "1", "--n-head", "2", "--copies", "2", "--batch-size", "8", "--steps", "4",
            "--eval-interval", "2", "--no-bf16"]
    args = parser.parse_args(common_args + tiny)
    assert args.handler(args) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["step"] == 4 and {"train_nll", "val_nll", "step", "epoch"} <= set(summary["best"])
    args = parser.parse_args(common_args + ["--resume", "--n-layer", "2"])
    with pytest.raises(RelaxspecError, match="different recipe: n_layer"):
        args.handler(args)


def test_bad_inputs_raise_clear_errors(tmp_path, data, vq) -> None:
    for bad in (dict(lr=0), dict(copies=0), dict(class_dropout=1.0), dict(dim=30), dict(n_head=3)):
        with pytest.raises(RelaxspecError):
            quick(tmp_path / "x", data, vq, **bad)
    with pytest.raises(RelaxspecError, match="no training state"):
        train_gpt(quick(tmp_path / "y", data, vq), resume=True)
    with pytest.raises(RelaxspecError, match="no such file"):
        train_gpt(quick(tmp_path / "z", data, tmp_path / "no-vq"))


def test_growing_a_trained_target_preserves_its_function_then_trains_on(tmp_path, data, vq) -> None:
    shallow = train_gpt(quick(tmp_path / "one", data, vq, steps=10, patience=0))
    deep = train_gpt(quick(tmp_path / "three", data, vq, steps=10, patience=0, n_layer=3,
                           init_from=str(tmp_path / "one" / "best")))
    # step 0 of the grown run is the shallow model: same NLLs to float precision
    assert deep.history[0]["val_nll"] == pytest.approx(shallow.best["val_nll"], rel=1e-5)
    assert deep.history[0]["train_nll"] == pytest.approx(shallow.best["train_nll"], rel=1e-5)
    assert deep.model.config.n_layer == 3 and deep.best["val_nll"] <= deep.history[0]["val_nll"]
    # the grown blocks were woken up by training (their zeroed output projections moved)
    assert deep.model.layers[1].attention.wo.weight.abs().sum() > 0
    assert json.loads((tmp_path / "three" / "best" / "config.json").read_text())["training"]["init_from_sha256"]
    model = gpt_recipe.Transformer(quick(tmp_path / "x", data, vq, n_layer=3).model_config(32, 3, 16))
    source = load_gpt(tmp_path / "one" / "best")
    assert gpt_recipe.grow(model, source) == [0]
    tokens, labels = torch.randint(0, 32, (4, 16)), torch.tensor([0, 1, 2, 0])
    with torch.no_grad():
        assert torch.allclose(model.forward_train(labels, tokens), source.forward_train(labels, tokens), atol=1e-5)
    wider = quick(tmp_path / "x", data, vq, n_layer=3, dim=64, n_head=4).model_config(32, 3, 16)
    with pytest.raises(RelaxspecError, match="dim=32"):
        gpt_recipe.grow(gpt_recipe.Transformer(wider), source)
    with pytest.raises(RelaxspecError, match="more than"):
        gpt_recipe.grow(source, model)


def test_a_target_past_the_free_memory_is_refused_before_its_tokens_are_made(tmp_path, data, vq, monkeypatch) -> None:
    """--n-layer 1000000 allocated for minutes before failing; now one line with both sizes."""
    from relaxspec import devices

    monkeypatch.setattr(devices, "free_memory", lambda device="cpu": 10 ** 9)
    with pytest.raises(RelaxspecError, match=r"--dim 32 x --n-layer 1,000,000 \(a target of .* parameters; .*\) needs "
                                             r"about 459\.8 GB and this machine has 1\.0 GB free"):
        train_gpt(quick(tmp_path / "big", data, vq, n_layer=1_000_000))
    assert not (tmp_path / "big").exists()
