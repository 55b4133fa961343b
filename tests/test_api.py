"""``relaxspec.generate``: the embedded model's defaults, relaxspec generate's seeding (tokens and
pixels equal the CLI's for the same classes, batch and seed), upscaling, and its input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import relaxspec
from relaxspec.cli import main
from relaxspec.methods import MethodOptions
from relaxspec.errors import RelaxspecError

CLASSES = "heart,animal-mammal,time"


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "ar"])
def test_generate_equals_the_command_line(method, tmp_path, capsys):
    got = relaxspec.generate(CLASSES, method, seed=4)
    argv = ["generate", "--classes", CLASSES, "--batch-size", "3", "--seed", "4", "--out", str(tmp_path),
            "--no-progress"] + (["--method", method] if method else [])
    assert main(argv) == 0, capsys.readouterr().err
    assert torch.equal(got.result.tokens, torch.from_numpy(np.load(tmp_path / "tokens.npy")))
    for i, image in enumerate(got.images):
        assert image.size == (32, 32)
        assert np.array_equal(np.asarray(image), np.asarray(Image.open(tmp_path / f"{i:04d}.png")))
    defaults = relaxspec.embedded.defaults()["method"]
    expected = defaults["method"] if method is None else "ar"
    assert got.result.mean_accepted_length.shape == (3,)
    assert (got.result.mean_accepted_length > 1).all() == (expected != "ar")


@pytest.mark.slow
def test_upscale_ids_options_and_sampling(tmp_path):
    small = relaxspec.generate([50, 3], "ar", seed=1, sampling={"temperature": 0})
    big = relaxspec.generate([50, 3], MethodOptions("ar"), seed=1, sampling={"temperature": 0}, upscale=4)
    assert torch.equal(small.result.tokens, big.result.tokens)
    assert big.images[0].size == (128, 128)
    assert np.array_equal(np.asarray(big.images[1])[::4, ::4], np.asarray(small.images[1]))
    greedy_lantern = relaxspec.generate([50, 3], "lantern", seed=9, sampling={"temperature": 0}, delta=0.0)
    assert torch.equal(greedy_lantern.result.tokens, small.result.tokens)  # lossless at delta 0, greedy


@pytest.mark.parametrize("kwargs, message", [
    (dict(classes="hearts-and-flowers"), "unknown class"),
    (dict(classes=[99]), "out of range"),
    (dict(classes="heart", upscale=0), "upscale must be a whole number >= 1"),
    (dict(classes="heart", method="sd", model="embedded"), "model must be"),
    (dict(classes="heart", method=MethodOptions("lantern"), delta=0.1), "not both"),
    (dict(classes="heart", method="lantern", delta=-1.0), "delta"),
    (dict(classes="heart", method="ar", tree="eagle25"), "--tree is not used by --method ar"),
    (dict(classes="heart", model=(None, None, None), device="cpu"), "apply to the embedded model"),
])
def test_bad_inputs_are_one_clear_error(kwargs, message):
    with pytest.raises(RelaxspecError, match=message):
        relaxspec.generate(**kwargs)


def test_a_drafter_method_needs_a_drafter():
    target, vq, _ = relaxspec.embedded.load(with_drafter=False)
    with pytest.raises(RelaxspecError, match="drafts with an EAGLE drafter"):
        relaxspec.generate("heart", "sd", model=(target, vq, None))
    plain = relaxspec.generate([1], "sjd", model=(target, vq, None), seed=0)  # drafter-free: fine
    assert plain.result.tokens.shape == (1, 64)
