"""A checkpoint-file family added from outside: the toy Swatch family (:mod:`helpers.swatch`: its
own weights file and colours file, class conditions) is installed the way a package adds one, a
``relaxspec.families`` entry point. The front door asks it whether it opens what it is given, so
every command and the Python API take its files with no relaxspec file naming it, as they take
LlamaGen's."""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import pytest
from PIL import Image

from helpers import swatch
from helpers.cli import install_family, refused, run
from relaxspec.cli import build_parser, main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    site = install_family(tmp_path_factory.mktemp("site"), "swatch-family", "swatch = helpers.swatch:SwatchPipeline")
    made = swatch.make_files(tmp_path_factory.mktemp("swatch"))
    yield {**made, "model": ["--swatch-ckpt", str(made["ckpt"]), "--swatch-colours", str(made["colours"])]}
    sys.path.remove(str(site))


def test_its_flags_and_info_come_from_its_declaration(files, capsys):
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--swatch-ckpt FILE Swatch: a Swatch weights file" in text and "--swatch-colours FILE" in text
    assert main(["info", "--families"]) == 0
    listed = capsys.readouterr().out
    assert "Swatch: --swatch-ckpt, classes (helpers.swatch:SwatchPipeline)" in listed
    assert "LlamaGen: --gpt-ckpt" in listed and "--vq-ckpt / vq_ckpt= (path)" in listed  # LlamaGen: a family too


def test_generate_opens_it_records_it_and_refuses_what_does_not_go(files, tmp_path, capsys):
    out = tmp_path / "gen"
    run(["generate", *files["model"], "--classes", "1,3", "--method", "sjd", "--no-progress", "--out", out], capsys)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["settings"]["swatch_ckpt"] == str(files["ckpt"].resolve())
    assert {"swatch_ckpt", "swatch_colours"} <= set(stats["settings"]["files"])
    colours = {tuple(c) for c in json.loads(files["colours"].read_text())}
    pixels = np.asarray(Image.open(out / "0000.png")).reshape(-1, 3)
    assert {tuple(int(v) for v in p) for p in pixels} <= colours
    run(["generate", *files["model"], "--classes", "1,3", "--method", "sjd", "--no-progress", "--out", out], capsys)
    assert refused(["generate", "--swatch-colours", files["colours"], "--out", tmp_path / "x"], capsys).endswith(
        "--swatch-colours goes with --swatch-ckpt (Swatch); this model is the embedded model (class-conditional)")
    assert "--vq-ckpt goes with --gpt-ckpt (LlamaGen); this model is Swatch" in refused(
        ["generate", *files["model"], "--vq-ckpt", "vq.pt", "--out", tmp_path / "x"], capsys)
    assert "give --swatch-colours FILE" in refused(["generate", "--swatch-ckpt", files["ckpt"], "--out",
                                                    tmp_path / "x"], capsys)
    assert "name models of two families" in refused(["generate", *files["model"], "--gpt-ckpt", "gpt.pt", "--out",
                                                     tmp_path / "x"], capsys)


def test_the_python_api_opens_it_by_its_inputs(files):
    import relaxspec
    from relaxspec.pipelines import open_pipeline

    images, result = relaxspec.generate(swatch_ckpt=str(files["ckpt"]), swatch_colours=files["colours"],
                                        classes=[0, 4], method="gsd")
    assert len(images) == 2 and result.tokens.shape == (2, 16)
    pipeline = open_pipeline(swatch_ckpt=files["ckpt"], swatch_colours=files["colours"])
    assert type(pipeline).__name__ == "SwatchPipeline" and pipeline.image_size == 4


@pytest.mark.slow
def test_bench_eval_tune_train_drafter_and_demo_run_it(files, tmp_path, capsys, fixed_forward_costs):
    from relaxspec.cli.demo import load_demo_model
    from relaxspec.demo.app import race_handler

    model = files["model"]
    run(["bench", *model, "--classes", "0,1", "--methods", "ar,sjd", "--no-plots", "--no-progress", "--warmup", "0",
         "--out", tmp_path / "bench"], capsys)
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert {row["label"] for row in summary["methods"]} == {"ar", "sjd"}

    run(["eval", "--images-per-class", "1", "--", *model, "--classes", "0,2", "--method", "sjd", "--no-progress",
         "--out", tmp_path / "eval"], capsys)
    shards = sorted((tmp_path / "eval").glob("shard-*"))
    assert sorted(image["class"] for shard in shards
                  for image in json.loads((shard / "stats.json").read_text())["images"]) == [0, 2]

    tune = tmp_path / "tune"
    code = main([str(a) for a in ["tune", *model, "--classes", "0,1,2,3", "--lossless", "--minutes", "0.2",
                                  "--no-compile", "--no-progress", "--out", tune]])
    assert code in (0, 1), capsys.readouterr().err  # 1: nothing beat AR in the budget, said in one line
    assert (tune / "state.json").is_file()

    drafter = tmp_path / "drafter"
    run(["train-drafter", *model, "--self-samples", "4", "--steps", "2", "--batch-size", "2", "--no-progress",
         "--out", drafter], capsys)
    greedy = ["--temperature", "0", "--batch-size", "2", "--no-progress"]
    run(["generate", *model, "--classes", "0,4", "--method", "ar", *greedy, "--out", tmp_path / "ar"], capsys)
    run(["generate", *model, "--classes", "0,4", "--method", "sd", "--drafter-ckpt", drafter, *greedy,
         "--out", tmp_path / "sd"], capsys)
    assert np.array_equal(np.load(tmp_path / "sd" / "tokens.npy"), np.load(tmp_path / "ar" / "tokens.npy"))

    demo = load_demo_model(build_parser().parse_args(["demo", *map(str, model)]))
    assert demo.pipeline.family == "Swatch"
    updates = list(race_handler(demo, tmp_path / "race", [], threading.Lock(), "1", "sjd", None, 0, None))
    assert updates[-1][-1].startswith("done: sjd"), updates[-1][-1]
