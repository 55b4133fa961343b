"""Inputs a new user (or a hostile one) gives, each ending in one line and exit 2 (issue 33): sizes
bounded by what the model and the machine allow, nonsense refused instead of silently decoded,
files that are not what they claim, and the same refusals from the Python API as from the
commands. Every case here was a traceback, a crash, a memory kill or a wrong answer before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import relaxspec
from relaxspec.cli import main
from relaxspec.errors import RelaxspecError


def refused(argv, message, capsys) -> str:
    """``relaxspec ARGV`` exits 2 with ``message`` on one line of stderr and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------- sizes: the model and the machine
@pytest.mark.parametrize("flags, message", [
    (["--threads", "100000"], "--threads must be a whole number >= 1 and at most"),  # was a segfault (exit 139)
    (["--threads", "20000"], "the CPUs this process may use"),  # was a bare libgomp line
    (["--method", "sd", "--draft", "chain", "--depth", "100000"], "--depth 100,000 is deeper than this model's images "
                                                                  "(64 tokens)"),  # was ~20 GB
    (["--method", "sjd", "--window", "1000000"], "--window 1,000,000 is wider than this model's images"),
    # sjd-pac cuts a window past the image to it, but not one past what a step verifies (was ~40 GB of paths)
    (["--method", "sjd-pac", "--window", "1000000000"], "a Jacobi window of 1,000,000,000 drafts"),
    (["--method", "sjd-pac", "--tree-depth", "1000000000"], "depth 1,000,000,000 drafts more than 1024 tokens"),
    (["--method", "sjd-pac", "--tree-width", "1000000000"], "width 1,000,000,000 and depth 3 drafts more than 1024"),
    (["--method", "sjd-pac", "--window", "5"], "--window 5 holds fewer drafts than the proactive tree of width 3 and "
                                               "depth 3: at least 12"),
    (["--method", "eagle2", "--dynamic-top-k", "100000"], "--dynamic-top-k 100,000 is more children per beam"),
    (["--method", "eagle2", "--total-tokens", "100000"], "a step verifies at most 1024"),
    (["--method", "eagle2", "--depth", "30", "--dynamic-top-k", "59"], "EAGLE-2's expansion (--depth 30 x "
                                                                        "--dynamic-top-k 59)"),
    (["--method", "sd", "--draft", "static", "--tree", "chain5000"], "a chain of 5,000 drafts 5,000 tokens per step"),
    (["--method", "sd", "--draft", "static", "--tree", "probe100x100"], "probe100x100 drafts 10,000 tokens"),
    (["--method", "gsd", "--group-ranks", "99999999"], "--group-ranks 99,999,999: this model has 1024 image tokens"),
    (["--cfg-scale", "inf"], "cfg scale must be in [0, 1000], got inf"),  # was all-zero tokens, exit 0
    (["--cfg-scale", "1e300"], "cfg scale must be in [0, 1000]"),
    (["--temperature", "inf"], "temperature must be in [0, 1000]"),
])
def test_sizes_past_what_the_model_or_machine_allow_are_one_line(flags, message, tmp_path, capsys):
    refused(["generate", "--classes", "heart", "--out", str(tmp_path / "out"), "--no-progress", *flags], message,
            capsys)
    assert not list((tmp_path / "out").glob("*.png"))


@pytest.mark.slow  # whole commands on the tiny models (the full suite runs it)
def test_the_largest_sizes_still_decode(tmp_path, capsys):
    """The bounds refuse only what cannot be used: a window as wide as the image and the largest
    guidance scale decode (greedy tokens are not the all-zero tokens of nan laws)."""
    import numpy as np

    argv = ["generate", "--classes", "heart", "--out", str(tmp_path / "w"), "--no-progress", "--method", "sjd",
            "--window", "64", "--cfg-scale", "1000", "--temperature", "0"]
    assert main(argv) == 0, capsys.readouterr().err
    tokens = np.load(tmp_path / "w" / "tokens.npy")
    assert (tokens >= 0).all() and len(set(tokens.ravel().tolist())) > 4


def test_a_huge_class_name_is_not_echoed_whole(tmp_path, capsys):
    name = "x" * 100_000
    err = refused(["generate", "--classes", name, "--out", str(tmp_path / "o")], "unknown class 'xxxx", capsys)
    assert len(err) < 500 and "100,002 characters" in err
    err = refused(["generate", "--classes", "9" * 5000, "--out", str(tmp_path / "o")], "is out of range", capsys)
    assert len(err) < 500  # int() of 5000 digits was a ValueError traceback


# ---------------------------------------------------------------- files that are not what they claim
def test_build_tree_stats_that_are_not_json_text(tmp_path, capsys):
    binary = tmp_path / "stats.json"
    binary.write_bytes(bytes(range(256)) * 8)
    refused(["build-tree", "--stats", str(binary), "--out", str(tmp_path / "t.json")], "not JSON (not UTF-8 text)",
            capsys)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000)
    refused(["build-tree", "--stats", str(deep), "--out", str(tmp_path / "t.json")], "nested too deeply", capsys)
    refused(["generate", "--method", "sd", "--draft", str(deep), "--out", str(tmp_path / "g")], "nested too deeply",
            capsys)
    (tmp_path / "list.json").write_text(json.dumps({"acceptance_counts": [1, 2]}))
    refused(["build-tree", "--stats", str(tmp_path / "list.json"), "--out", str(tmp_path / "t.json")],
            "no acceptance_counts", capsys)


@pytest.fixture(scope="module")
def embedded_preset(tmp_path_factory) -> Path:
    """A preset of the embedded model made here (fp32, this machine)."""
    from relaxspec import methods
    from relaxspec.pipelines import open_pipeline
    from relaxspec.pipelines.presets import preset_record

    out = tmp_path_factory.mktemp("preset")
    pipeline = open_pipeline()
    record = preset_record(methods.resolve("sd", {"draft": "chain", "depth": 2}), pipeline.sampling(),
                           pipeline=pipeline, threads=1, batch_size=1, measured={}, budget={"kind": "lossless"},
                           command="test")
    (out / "tune.json").write_text(json.dumps(record))
    return out / "tune.json"


def edited(preset: Path, folder: Path, **changes) -> str:
    data = json.loads(preset.read_text())
    data.update(changes)
    path = folder / "edited.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_hand_edited_presets_are_one_line(embedded_preset, tmp_path, capsys):
    argv = ["generate", "--classes", "heart", "--out", str(tmp_path / "g"), "--no-progress", "--preset"]
    assert main([*argv, str(embedded_preset)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    refused([*argv, edited(embedded_preset, tmp_path, model="abc")], "its \"model\" must be the model record",
            capsys)  # was an AttributeError
    refused([*argv, edited(embedded_preset, tmp_path, model={"family": 3})], "model.family must be a string", capsys)
    err = refused([*argv, edited(embedded_preset, tmp_path, machine=None)], "its \"machine\" must name the device type",
                  capsys)
    assert "?" not in err and "--device None" not in err  # was "tuned on ?: ? ... --device None"
    refused([*argv, edited(embedded_preset, tmp_path, sampling={"temperature": 1, "hot": 2})],
            "unknown sampling field 'hot'", capsys)
    nested = tmp_path / "nested.json"
    nested.write_text("[" * 200_000)
    refused([*argv, str(nested)], "nested too deeply", capsys)  # was a RecursionError
    # A preset tuned in fp32, used in bf16: the precision is what differs, not the model.
    refused([*argv, str(embedded_preset), "--precision", "bf16"], "was tuned with the weights in float32; they are in "
                                                                  "bfloat16 now: open the model with --precision fp32",
            capsys)


# ---------------------------------------------------------------- the Python API refuses as the CLI does
@pytest.mark.parametrize("kwargs, message", [
    (dict(sampling={"bogus": 1}), "unknown sampling field 'bogus': the fields are cfg_scale, temperature, top_k, top_p"),
    (dict(sampling="hot"), "sampling must be a SamplingConfig or a dict of its fields"),
    (dict(sampling={"cfg_scale": "4"}), "cfg scale must be a number, got '4'"),
    (dict(sampling={"top_k": float("inf")}), "top-k must be a whole number"),
    (dict(preset=5), "a preset is the path of a tune.json file"),
    (dict(model=(1, 2, 3)), "model=(target, vq, drafter) takes a LlamaGen-format Transformer, its VQModel"),
    (dict(method="gsd", group_ranks=5000), "--group-ranks 5,000: this model has 1024 image tokens"),
])
def test_the_api_raises_one_line_errors_not_python_ones(kwargs, message):
    with pytest.raises(RelaxspecError) as err:
        relaxspec.generate("heart", **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------- commands that checked too late or not at all
def test_bench_refuses_a_baseline_it_does_not_run_before_decoding(tmp_path, capsys):
    out = tmp_path / "bench"
    refused(["bench", "--methods", "ar,sjd", "--baseline", "nope", "--num-images", "1", "--out", str(out),
             "--no-plots", "--no-progress"], "--baseline 'nope' is not one of the benchmarked methods (ar, sjd)",
            capsys)  # was a note after the decodes
    assert not out.exists() or not any(out.iterdir())


def test_eval_checks_its_scores_packages_before_generating(tmp_path, capsys, monkeypatch):
    """Issue 33: ``eval --fid-ref`` without clean-fid generated every image, then said so."""
    from relaxspec import extras

    real = extras.available
    monkeypatch.setattr(extras, "available", lambda name: False if name == "clean-fid" else real(name))
    (tmp_path / "real").mkdir()
    out = tmp_path / "eval"
    refused(["eval", "--fid-ref", str(tmp_path / "real"), "--", "--classes", "heart", "--out", str(out),
             "--no-progress"], "--fid-ref needs clean-fid, which is not installed: pip install clean-fid", capsys)
    assert not out.exists()
    monkeypatch.setattr(extras, "available", lambda name: True if name == "clean-fid" else real(name))
    refused(["eval", "--fid-ref", str(tmp_path / "nope"), "--", "--classes", "heart", "--out", str(out)],
            "no such folder", capsys)
    assert not out.exists()


@pytest.mark.parametrize("command, extra, message", [
    (["demo"], "gradio", "relaxspec demo needs gradio, which is not installed: pip install \"relaxspec[demo]\""),
    (["bench", "--methods", "ar", "--num-images", "1", "--out", "OUT"], "matplotlib",
     "relaxspec bench draws its plots with matplotlib, which is not installed: pip install \"relaxspec[plots]\", or "
     "pass --no-plots"),
    (["generate", "--model-path", "FOLDER", "--prompt", "a fox", "--out", "OUT"], "transformers",
     "--model-path needs transformers, which is not installed: pip install \"relaxspec[transformers]\""),
])
def test_a_missing_optional_package_is_said_before_any_work(command, extra, message, tmp_path, capsys, monkeypatch):
    from relaxspec import extras

    real = extras.available
    monkeypatch.setattr(extras, "available", lambda name: False if name == extra else real(name))
    (tmp_path / "FOLDER").mkdir()
    argv = [str(tmp_path / part) if part in ("OUT", "FOLDER") else part for part in command]
    refused(argv, message, capsys)
    assert not (tmp_path / "OUT").exists()


def test_extras_find_packages_without_importing_them(monkeypatch):
    import sys

    from relaxspec import extras

    assert set(extras.EXTRAS) >= {"transformers", "gradio", "matplotlib", "clean-fid", "pyyaml"}
    assert extras.available("matplotlib")  # the test extra installs it
    monkeypatch.delitem(sys.modules, "gradio", raising=False)
    assert extras.available("gradio") and "gradio" not in sys.modules  # found, not imported
    monkeypatch.setitem(extras.EXTRAS, "no-such-thing", extras.Extra("no_such_module_anywhere", "pip install it"))
    assert not extras.available("no-such-thing")
    with pytest.raises(RelaxspecError, match="^--x needs no-such-thing, which is not installed: pip install it$"):
        extras.require("no-such-thing", "--x")


def test_a_lumina_index_naming_a_shard_outside_its_folder_is_refused(tmp_path):
    from relaxspec.models.lumina import safetensors_files

    folder = tmp_path / "model"
    folder.mkdir()
    (tmp_path / "evil.safetensors").write_bytes(b"")
    (folder / "a.safetensors").write_bytes(b"")
    for outside in ("../evil.safetensors", str(tmp_path / "evil.safetensors")):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors",
                                                                                        "v": outside}}))
        with pytest.raises(RelaxspecError, match="outside its folder"):
            safetensors_files(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors"}}))
    assert safetensors_files(folder) == [folder / "a.safetensors"]


def test_demo_host_and_port_are_checked_before_the_model_loads(capsys):
    import socket

    refused(["demo", "--host", "999.1.1.1"], "--host '999.1.1.1': not an address or a name this machine resolves",
            capsys)  # was gradio's "Cannot find empty port"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused(["demo", "--port", str(port)], f"cannot serve on 127.0.0.1:{port}: the port is in use", capsys)


def test_the_command_line_cuts_a_message_it_did_not_write(capsys, monkeypatch):
    """A backstop for the messages of libraries (an OSError naming a path, a config's own error):
    one line of at most a few hundred characters."""
    from relaxspec import cli

    def handler(args):
        raise RelaxspecError("word " * 10_000)

    monkeypatch.setattr(cli, "build_parser", lambda: _Parser(handler))
    assert cli.main(["x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 1200 and "characters cut" in err


class _Parser:
    def __init__(self, handler):
        self.handler = handler

    def parse_args(self, argv):
        import argparse

        return argparse.Namespace(handler=self.handler)


def test_plots_that_cannot_be_drawn_are_said_at_the_start(tmp_path, capsys, monkeypatch):
    """tune's frontier.png and train-drafter's accept.png need matplotlib: without it the run still
    does its work, and says at the start (not at the end) which picture it will not draw."""
    from relaxspec import extras
    from relaxspec.cli import train

    real = extras.available
    monkeypatch.setattr(extras, "available", lambda name: False if name == "matplotlib" else real(name))
    assert main(["tune", "--lossless", "--seed", "-1", "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert err.index("note: no ") < err.index("error: seed must be") and "frontier.png (matplotlib is not installed" in err

    def stop(config, resume=False):
        raise RelaxspecError("stopped before any work")

    monkeypatch.setattr(train, "train_drafter", stop)
    assert main(["train-drafter", "--self-samples", "8", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.index("note: no accept.png") < err.index("error: stopped before any work")


@pytest.mark.parametrize("config", ["gpt", "vq", "drafter"])
def test_every_recipe_refuses_an_infinite_setting(config):
    """``--lr inf`` passed the recipes' ``> 0`` checks and trained on nan; every recipe's config
    refuses a non-finite number (one check, common.need_finite)."""
    from relaxspec.training.drafter import DrafterTrainConfig
    from relaxspec.training.llamagen.gpt import GPTTrainConfig
    from relaxspec.training.llamagen.vq import VQTrainConfig

    cls = {"gpt": GPTTrainConfig, "vq": VQTrainConfig, "drafter": DrafterTrainConfig}[config]
    with pytest.raises(RelaxspecError, match="lr must be a finite number, got inf"):
        cls(lr=float("inf"))
