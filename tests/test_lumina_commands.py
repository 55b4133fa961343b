"""Lumina-mGPT from the commands and the Python API, on the tiny format-identical folders of
``tests/helpers/lumina.py``: ``generate``, ``bench``, ``eval`` and ``demo`` take ``--model-path``
with ``--tokenizer-path``, ``relaxspec.generate(model_path=..., tokenizer_path=...)`` gives the
command's tokens, lossless methods give greedy AR's, and bad inputs are one line (exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers", reason="Lumina-mGPT needs transformers (pip install -e '.[test]')")

from helpers import lumina as lf  # noqa: E402
from relaxspec.cli import main  # noqa: E402

PROMPTS = ["a red fox", "a lighthouse"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return lf.lumina_folders(tmp_path_factory.mktemp("lumina-commands"))


def folder_args(files) -> list[str]:
    return ["--model-path", str(files["model_path"]), "--tokenizer-path", str(files["tokenizer_path"]),
            "--image-size", str(lf.IMAGE_SIZE)]


@pytest.mark.slow
def test_generate_writes_codes_and_official_pixels_and_the_api_agrees(files, tmp_path, capsys):
    """Greedy AR and SJD from the command give the same codes (row-major, no new lines); the PNGs
    are the official pixel conversion of those codes; relaxspec.generate gives the same tokens."""
    import relaxspec
    from relaxspec.models import lumina

    prompts = [arg for p in PROMPTS for arg in ("--prompt", p)]
    tokens = {}
    for method in ("ar", "sjd"):
        out = tmp_path / method
        code = main(["generate", *folder_args(files), *prompts, "--temperature", "0", "--method", method,
                     "--batch-size", "2", "--no-progress", "--out", str(out)])
        assert code == 0, capsys.readouterr().err
        tokens[method] = np.load(out / "tokens.npy")
    assert np.array_equal(tokens["ar"], tokens["sjd"])
    side = lf.IMAGE_SIZE // 16
    assert tokens["ar"].shape == (2, side * side) and 0 <= tokens["ar"].min() and tokens["ar"].max() < lf.CODES
    stats = json.loads((tmp_path / "ar" / "stats.json").read_text())
    settings = stats["settings"]
    assert settings["model_type"] == "chameleon" and settings["sampling"]["top_k"] == 2000
    assert settings["tokenizer_path"] == str(files["tokenizer_path"].resolve())
    assert [image["prompt"] for image in stats["images"]] == PROMPTS
    _, tokenizer = lumina.load_lumina(files["model_path"], files["tokenizer_path"], 4, lf.IMAGE_SIZE)
    pixels = np.asarray(lumina.to_uint8(tokenizer.decode(torch.from_numpy(tokens["ar"]))))
    assert np.array_equal(np.asarray(Image.open(tmp_path / "ar" / "0001.png")), pixels[1])
    images, result = relaxspec.generate(prompts=PROMPTS, model_path=str(files["model_path"]),
                                        tokenizer_path=str(files["tokenizer_path"]), image_size=lf.IMAGE_SIZE,
                                        method="ar", sampling={"temperature": 0.0})
    assert np.array_equal(result.tokens.numpy(), tokens["ar"])
    assert np.array_equal(np.asarray(images[0]), pixels[0])


@pytest.mark.slow
def test_bench_and_eval_take_a_lumina_folder(files, tmp_path, capsys):
    code = main(["bench", *folder_args(files), "--prompt", PROMPTS[0], "--num-images", "2", "--methods", "ar,sjd,gsd",
                 "--no-plots", "--no-progress", "--warmup", "0", "--out", str(tmp_path / "bench")])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert {row["label"] for row in summary["methods"]} == {"ar", "sjd", "gsd"}
    code = main(["eval", "--images-per-class", "1", "--", *folder_args(files), "--prompt", PROMPTS[0], "--prompt",
                 PROMPTS[1], "--method", "sjd", "--no-progress", "--out", str(tmp_path / "eval")])
    assert code == 0, capsys.readouterr().err
    shards = sorted((tmp_path / "eval").glob("shard-*"))
    prompts = [image["prompt"] for shard in shards for image in json.loads((shard / "stats.json").read_text())["images"]]
    assert sorted(prompts) == sorted(PROMPTS)


def test_the_demo_races_a_prompt_on_a_lumina_folder(files, tmp_path):
    import threading

    from relaxspec.cli import build_parser
    from relaxspec.cli.demo import load_demo_model
    from relaxspec.demo.app import race_handler

    args = build_parser().parse_args(["demo", *folder_args(files), "--prompt", PROMPTS[0]])
    model = load_demo_model(args)
    assert model.prompts and model.pipeline.family == "Lumina-mGPT" and model.default_method == "gsd"
    updates = list(race_handler(model, tmp_path, [], threading.Lock(), PROMPTS[1], "sjd", None, 0, None))
    assert updates[-1][-1].startswith("done: sjd"), updates[-1][-1]


@pytest.mark.parametrize("extra, message", [
    (["--image-size", "48"], "positive multiple of 32"),
    (["--tokenizer-path", None], "give --tokenizer-path DIR"),
    (["--tokenizer-path", "model"], "no text_tokenizer.json"),
    (["--negative-prompt", "blurry"], "--negative-prompt goes with --model-path (Emu3); this model is Lumina-mGPT"),
    (["--classes", "1"], "this Lumina-mGPT model takes text prompts"),
])
def test_bad_inputs_are_one_line(files, tmp_path, refused, extra, message):
    args = folder_args(files) + ["--prompt", "a fox"]
    if extra[:1] == ["--tokenizer-path"]:
        at = args.index("--tokenizer-path")
        del args[at : at + 2]
        extra = [] if extra[1] is None else ["--tokenizer-path", str(files["model_path"])]
    refused(["generate", *args, *extra, "--out", str(tmp_path / "o")], message)


def test_a_folder_that_is_not_chameleon_and_a_tokenizer_without_a_folder(files, tmp_path, refused):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llava"}')
    refused(["generate", "--model-path", str(other), "--tokenizer-path", str(files["tokenizer_path"]), "--prompt",
             "a fox", "--out", str(tmp_path / "o")], "model type 'llava' is not supported")
    refused(["generate", "--tokenizer-path", str(files["tokenizer_path"]), "--out", str(tmp_path / "o")],
            "--tokenizer-path goes with --model-path")
    mismatched = lf.write_tokenizer_folder(tmp_path / "tok", *_smaller_vocabulary())
    refused(["generate", *folder_args(files)[:2], "--tokenizer-path", str(mismatched), "--prompt", "a fox",
             "--image-size", str(lf.IMAGE_SIZE), "--out", str(tmp_path / "o")], "not its Chameleon tokenizer")


def _smaller_vocabulary():
    """Meta's layout with one text token fewer: the model's vocabulary size no longer matches."""
    vocab, merges, _ = lf.vocabulary()
    last = max(vocab, key=vocab.get)
    del vocab[last]
    return vocab, [m for m in merges if "".join(m) != last]
