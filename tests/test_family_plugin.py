"""A model family added from outside: the toy Palette family (:mod:`helpers.palette`, its model
module, and :mod:`helpers.palette_pipeline`, its pipeline file) is installed the way a package
adds one, a ``relaxspec.families`` entry point, and brings an opening input of its own,
``--palette-path``. Every command takes it with no relaxspec file naming it: the flags, their
checks and the records come from the family's declaration."""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import pytest
from PIL import Image

from helpers import palette
from helpers.cli import install_family, refused, run
from relaxspec.cli import build_parser, main

pytest.importorskip("transformers")  # --model-path needs it, for every family

PROMPTS = ["a red fox", "the blue sky at night", "green hills", "a small boat"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A distribution on sys.path whose entry point registers the family (as ``pip install`` of a
    package that declares ``[project.entry-points."relaxspec.families"] palette = ...`` does)."""
    site = install_family(tmp_path_factory.mktemp("site"), "palette-family",
                          "palette = helpers.palette_pipeline:PalettePipeline")
    yield site
    sys.path.remove(str(site))


@pytest.fixture(scope="module")
def files(installed, tmp_path_factory):
    root = tmp_path_factory.mktemp("palette")
    folder = palette.make_folder(root / "model")
    colours = palette.make_palette(root / "palette.json")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return {"model": ["--model-path", str(folder), "--palette-path", str(colours)], "folder": folder,
            "palette": colours, "prompts": prompts}


def test_the_family_brings_its_flag_help_and_info(files, capsys):
    assert main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--palette-path FILE Palette: the JSON list of RGB colours" in text
    assert "a supported family: Janus, Emu3, Anole, Lumina-mGPT, Palette" in text  # what --model-path opens
    assert main(["info", "--families"]) == 0
    listed = capsys.readouterr().out
    assert ("Palette: --model-path (config.json model_type 'palette'), prompts (helpers.palette_pipeline:PalettePipeline)"
            in listed and "    --palette-path / palette_path= (path): the JSON list of RGB colours" in listed)
    assert "--tokenizer-path / tokenizer_path= (path; needs pyyaml)" in listed  # the built-in ones too
    code = main(["info", str(files["folder"])])
    assert code == 0 and "a Palette target: relaxspec generate --model-path DIR --palette-path FILE" in \
        capsys.readouterr().out


def test_a_broken_or_clashing_family_is_skipped_with_a_warning(installed, tmp_path, capsys):
    """An installed family that does not import, or declares an input relaxspec's own options use,
    costs one warning line; every command and the API still work, the other families too."""
    import relaxspec
    from relaxspec.pipelines import families

    site = tmp_path / "site"
    info = site / "bad_families-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-families\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[relaxspec.families]\nmissing = no_such_module:Nothing\n"
                                           "clash = helpers.clashing_family:ClashingPipeline\n")
    sys.path.insert(0, str(site))
    families._warned.clear()
    try:
        assert main(["generate", "--help"]) == 0
        captured = capsys.readouterr()
        warnings = [line for line in captured.err.splitlines() if line.startswith("relaxspec: warning:")]
        assert len(warnings) == 2 and "no_such_module:Nothing" in warnings[0] + warnings[1]
        assert any("declares the input(s) device" in w for w in warnings)
        assert "--palette-path" in captured.out  # the working plugin is still there
        images, _ = relaxspec.generate(["heart"], "ar")
        assert len(images) == 1
        with pytest.raises(relaxspec.RelaxspecError, match="'missing' folders does not load here"):
            families.pipeline_classes("missing")
    finally:
        sys.path.remove(str(site))
        families._warned.clear()


def test_its_input_is_checked_like_a_built_in_one(files, tmp_path, capsys):
    out = ["--out", tmp_path / "g", "--no-progress"]
    assert "give --palette-path FILE" in refused(["generate", "--model-path", files["folder"], "--prompt", "x", *out],
                                                 capsys)
    assert refused(["generate", "--palette-path", files["palette"], *out], capsys).endswith(
        "--palette-path goes with --model-path (Palette); this model is the embedded model (class-conditional)")
    bad = tmp_path / "bad.json"
    bad.write_text("[[1, 2, 3]]")
    assert "(1, 3) colours, the model paints 16" in refused(
        ["generate", "--model-path", files["folder"], "--palette-path", bad, "--prompt", "x", *out], capsys)


def test_generate_records_the_input_and_paints_with_it(files, tmp_path, capsys):
    out = tmp_path / "gen"
    run(["generate", *files["model"], "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--method", "sjd",
         "--no-progress", "--out", out], capsys)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["settings"]["palette_path"] == str(files["palette"].resolve())
    assert "palette_path" in stats["settings"]["files"]
    colours = {tuple(c) for c in json.loads(files["palette"].read_text())}
    pixels = np.asarray(Image.open(out / "0000.png")).reshape(-1, 3)
    assert {tuple(int(v) for v in p) for p in pixels} <= colours
    run(["generate", *files["model"], "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--method", "sjd",
         "--no-progress", "--out", out], capsys)  # resumes: the same settings
    other = palette.make_palette(tmp_path / "other.json", seed=1)
    message = refused(["generate", "--model-path", files["folder"], "--palette-path", other, "--prompt", PROMPTS[0],
                       "--prompt", PROMPTS[1], "--method", "sjd", "--no-progress", "--out", out], capsys)
    assert "different settings" in message and "palette_path" in message


def test_the_python_api_takes_the_input_as_a_keyword(files):
    import relaxspec

    images, result = relaxspec.generate(model_path=str(files["folder"]), palette_path=str(files["palette"]),
                                        prompts=PROMPTS[:2], method="gsd")
    assert len(images) == 2 and result.tokens.shape == (2, 16)


@pytest.mark.slow
def test_bench_eval_tune_train_drafter_and_demo_run_it(files, tmp_path, capsys, fixed_forward_costs):
    from relaxspec.cli.demo import load_demo_model
    from relaxspec.demo.app import race_handler

    model = files["model"]
    run(["bench", *model, "--prompt", PROMPTS[0], "--num-images", "2", "--methods", "ar,sjd", "--no-plots",
         "--no-progress", "--warmup", "0", "--out", tmp_path / "bench"], capsys)
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert {row["label"] for row in summary["methods"]} == {"ar", "sjd"}

    run(["eval", "--images-per-class", "1", "--", *model, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
         "--method", "sjd", "--no-progress", "--out", tmp_path / "eval"], capsys)
    shards = sorted((tmp_path / "eval").glob("shard-*"))
    assert sorted(image["prompt"] for shard in shards
                  for image in json.loads((shard / "stats.json").read_text())["images"]) == sorted(PROMPTS[:2])

    tune = tmp_path / "tune"
    code = main([str(a) for a in ["tune", *model, "--prompts-file", files["prompts"], "--lossless", "--minutes", "0.2",
                                  "--no-compile", "--no-progress", "--out", tune]])
    assert code in (0, 1), capsys.readouterr().err  # 1: nothing beat AR in the budget, said in one line
    state = json.loads((tune / "state.json").read_text())
    assert state["settings"]["tune"] == PROMPTS[0::2] and state["settings"]["heldout"] == PROMPTS[1::2]

    drafter = tmp_path / "drafter"
    run(["train-drafter", *model, "--prompts-file", files["prompts"], "--self-samples", "4", "--steps", "2",
         "--batch-size", "2", "--no-progress", "--out", drafter], capsys)
    greedy = ["--temperature", "0", "--batch-size", "2", "--no-progress"]
    run(["generate", *model, "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--method", "ar", *greedy,
         "--out", tmp_path / "ar"], capsys)
    run(["generate", *model, "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--method", "sd", "--drafter-ckpt",
         drafter, *greedy, "--out", tmp_path / "sd"], capsys)
    assert np.array_equal(np.load(tmp_path / "sd" / "tokens.npy"), np.load(tmp_path / "ar" / "tokens.npy"))

    demo = load_demo_model(build_parser().parse_args(["demo", *map(str, model), "--prompt", PROMPTS[0]]))
    assert demo.pipeline.family == "Palette" and demo.prompts
    updates = list(race_handler(demo, tmp_path / "race", [], threading.Lock(), PROMPTS[1], "sjd", None, 0, None))
    assert updates[-1][-1].startswith("done: sjd"), updates[-1][-1]
