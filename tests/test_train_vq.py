"""VQ tokenizer training: the training-time quantiser agrees with inference, dead codes restart,
the loss falls on a tiny set, an interrupted run resumes bit for bit, the CLI and bad input."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import interrupted_at
from safetensors.torch import load_file
from helpers.data import build_fake_dataset

from relaxspec.cli.train import add_train_vq_parser
from relaxspec.models.llamagen.checkpoints import load_vq
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.vq import VQModel
from relaxspec.runs.folder import TRAIN_STATE
from relaxspec.training.llamagen.vq import (
    VQTrainConfig,
    evaluate_vq,
    load_images,
    quantise,
    restart_dead_codes,
    to_pixels,
    train_vq,
)

#: 8 px images, one 2x downsampling: a 4x4 grid of 32 codes; milliseconds per step.
TINY = dict(codebook_size=32, codebook_embed_dim=4, z_channels=8, ch=16, ch_mult=(1, 2), num_res_blocks=1,
            norm_groups=8, batch_size=8, warmup_steps=2, eval_interval=10, checkpoint_interval=5,
            restart_interval=5, progress=False, threads=1)



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_fake_dataset(tmp_path_factory.mktemp("emoji"))


def quick(out, data, **overrides) -> VQTrainConfig:
    return VQTrainConfig(**{**TINY, "out": str(out), "data": str(data), **overrides})


def test_training_quantiser_matches_inference() -> None:
    torch.manual_seed(0)
    vq = VQModel(quick("x", "y").model_config())
    images = torch.randint(0, 256, (3, 8, 8, 3), dtype=torch.uint8)
    latents = vq.quant_conv(vq.encoder(to_pixels(images))).detach().requires_grad_(True)
    q = quantise(vq, latents)
    assert torch.equal(q["indices"].flatten(1), vq.encode(to_pixels(images)))
    # forward: the (normalised) code vectors the decoder gets at inference
    assert torch.allclose(q["quantised"], vq.codes_to_latents(q["indices"]), atol=1e-6)
    # backward: straight through the quantiser, into the normalisation
    q["quantised"].sum().backward()
    z = latents.detach().clone().requires_grad_(True)
    torch.nn.functional.normalize(z, dim=1).sum().backward()
    assert torch.allclose(latents.grad, z.grad, atol=1e-6)
    assert q["commit_loss"] > 0 and torch.isclose(q["codebook_loss"], q["commit_loss"])


def test_dead_codes_move_onto_encoder_outputs() -> None:
    torch.manual_seed(0)
    vq = VQModel(quick("x", "y").model_config())
    optimizer = torch.optim.AdamW(vq.parameters())
    vq.quantize.embedding.weight.sum().backward()
    optimizer.step()
    usage = torch.ones(32, dtype=torch.long)
    usage[[3, 7]] = 0
    z = torch.nn.functional.normalize(torch.randn(5, 4), dim=1)
    before = vq.quantize.embedding.weight.detach().clone()
    assert restart_dead_codes(vq, optimizer, usage, z, torch.Generator().manual_seed(0)) == 2
    after = vq.quantize.embedding.weight.detach()
    assert torch.equal(after[usage > 0], before[usage > 0])
    for code in (3, 7):
        assert any(torch.equal(after[code], row) for row in z)
    assert optimizer.state[vq.quantize.embedding.weight]["exp_avg"][[3, 7]].abs().sum() == 0


def test_loss_falls_and_the_run_is_saved(tmp_path, data) -> None:
    result = train_vq(quick(tmp_path / "run", data, steps=30, lr=3e-3))
    first, last = result.history[0], result.history[-1]
    assert last["val"]["psnr"] > first["val"]["psnr"] + 2 and last["train"]["l1"] < first["train"]["l1"]
    assert 0 < last["val"]["usage"] <= 1 and last["val"]["perplexity"] >= 1
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 10, 20, 30]
    loaded = load_vq(tmp_path / "run")  # our format: model.safetensors + config.json
    val = load_images(data, "val").images
    assert evaluate_vq(loaded, val) == pytest.approx(evaluate_vq(result.vq, val))


def test_interrupted_run_resumes_bit_for_bit(tmp_path, data, monkeypatch) -> None:
    # evaluations (every 4) and checkpoints (every 5) interleave; a restart happens every 5 steps
    whole = train_vq(quick(tmp_path / "whole", data, steps=12, eval_interval=4))
    with interrupted_at(monkeypatch, 7):
        train_vq(quick(tmp_path / "split", data, steps=12, eval_interval=4))
    assert torch.load(tmp_path / "split" / TRAIN_STATE, weights_only=True)["step"] == 5
    resumed = train_vq(quick(tmp_path / "split", data, steps=12, eval_interval=4), resume=True)
    for name, value in whole.vq.state_dict().items():
        assert torch.equal(value, resumed.vq.state_dict()[name]), name
    assert resumed.history == whole.history
    assert (tmp_path / "split" / "metrics.jsonl").read_text() == (tmp_path / "whole" / "metrics.jsonl").read_text()


def test_cli_trains_resumes_and_exports(tmp_path, data, capsys) -> None:
    parser = argparse.ArgumentParser()
    add_train_vq_parser(parser.add_subparsers(dest="command"))
    common_args = ["train-vq", "--data", str(data), "--out", str(tmp_path / "run"), "--no-progress", "--threads", "1"]
    tiny = ["--codebook-size", "32", "--codebook-embed-dim", "4", "--z-channels", "8", "--ch", "16", "--ch-mult", "1,2",
            "--num-res-blocks", "1", "--norm-groups", "8", "--batch-size", "8", "--steps", "3", "--eval-interval", "3"]
    args = parser.parse_args(common_args + tiny + ["--export", str(tmp_path / "ship")])
    assert args.handler(args) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 3
    shipped = load_vq(tmp_path / "ship")
    weights = load_file(str(tmp_path / "ship" / "model.safetensors"))
    assert {v.dtype for v in weights.values() if v.is_floating_point()} == {torch.float16}
    assert json.loads((tmp_path / "ship" / "config.json").read_text())["training"]["val_fp16"]["psnr"] > 0
    assert shipped.config.ch_mult == (1, 2)
    # resuming takes the recipe from the saved state and may not change it
    args = parser.parse_args(common_args + ["--resume", "--lr", "1e-2"])
    with pytest.raises(RelaxspecError, match="different recipe: lr"):
        args.handler(args)
    args = parser.parse_args(common_args + ["--resume"])
    assert args.handler(args) == 0  # already at the end: nothing to train, still fine


def test_bad_inputs_raise_clear_errors(tmp_path, data) -> None:
    for bad in (dict(lr=0), dict(ch_mult=()), dict(norm_groups=5), dict(batch_size=0), dict(commit_weight=-1)):
        with pytest.raises(RelaxspecError):
            quick(tmp_path / "x", data, **bad)
    with pytest.raises(RelaxspecError, match="relaxspec data"):
        train_vq(quick(tmp_path / "x", tmp_path / "no-data"))
    with pytest.raises(RelaxspecError, match="no training state"):
        train_vq(quick(tmp_path / "y", data), resume=True)
    train_vq(quick(tmp_path / "z", data, steps=1))
    with pytest.raises(RelaxspecError, match="already holds a training run"):
        train_vq(quick(tmp_path / "z", data, steps=1))
