"""``relaxspec`` command line: every user error as one line on stderr with exit code 2, every
command's help, refused inputs and what a run records of the values it used. The happy path and
resumption: ``test_cli.py``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from relaxspec.models.weights import read_state
from relaxspec.cli import main
from relaxspec.models.llamagen.gpt import rope_table_2d
from relaxspec.models.llamagen.vq import VQConfig, VQModel
from relaxspec.errors import RelaxspecError

from conftest import TINY_VQ
from helpers.cli import assert_one_line_error, generate_args
from helpers.cli import outcome as run


# --------------------------------------------------------------------------------- user errors


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_ckpts):
    folder = tmp_path_factory.mktemp("bad")
    state = read_state(tiny_ckpts["c2i"]["gpt"]).state_dict
    files = {"folder": folder}
    files["text"] = folder / "notes.pt"
    files["text"].write_text("hello\n")
    files["unsafe"] = folder / "train_state.pt"
    torch.save({"model": dict(state), "args": argparse.Namespace(lr=1)}, files["unsafe"])
    files["freqs"] = folder / "freqs.pt"
    torch.save({"model": {**state, "freqs_cis": rope_table_2d(8, 16, cls_token_num=1)}}, files["freqs"])
    files["a_file"] = folder / "a_file"
    files["a_file"].write_text("")
    files["empty_dir"] = folder / "empty_dir"
    files["empty_dir"].mkdir()
    small_vq = VQConfig(**dict(TINY_VQ, codebook_size=32))
    files["vq32"] = folder / "vq32.pt"
    torch.save({"model": VQModel(small_vq).state_dict()}, files["vq32"])
    files["vq32_json"] = folder / "vq32.json"
    files["vq32_json"].write_text(json.dumps(dataclasses.asdict(small_vq)))
    files["bad_json"] = folder / "bad.json"
    files["bad_json"].write_text("{not json")
    files["objects"] = folder / "objects.npy"
    np.save(files["objects"], np.array([{"a": 1}], dtype=object), allow_pickle=True)
    files["wrong_shape"] = folder / "wrong_shape.npy"
    np.save(files["wrong_shape"], np.zeros((2, 5, 32), dtype=np.float32))
    return files


def option(argv, flag, value):
    """Replace (or, with value None, drop) ``flag`` and its value in ``argv``."""
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        del argv[i : i + 2]
    return argv + ([flag, value] if value is not None else [])


ERRORS = {
    "missing gpt file": (lambda a, f: option(a, "--gpt-ckpt", f["folder"] / "missing.pt"), "no such file"),
    "missing vq file": (lambda a, f: option(a, "--vq-ckpt", f["folder"] / "missing.pt"), "no such file"),
    "folder without weights": (lambda a, f: option(a, "--gpt-ckpt", f["empty_dir"]), "config.json"),
    "not a checkpoint": (lambda a, f: option(a, "--gpt-ckpt", f["text"]), "not a readable"),
    "vq file as gpt": (lambda a, f: option(a, "--gpt-ckpt", a[a.index("--vq-ckpt") + 1]), "not a LlamaGen GPT"),
    "gpt file as vq": (lambda a, f: option(a, "--vq-ckpt", a[a.index("--gpt-ckpt") + 1]), "not a LlamaGen VQ"),
    "unsafe pickle": (lambda a, f: option(a, "--gpt-ckpt", f["unsafe"]), "refusing"),
    "tree without a static draft": (lambda a, f: a + ["--method", "sd", "--drafter-ckpt", "x", "--tree", "eagle25"],
                                    "--tree is not used by --method sd --draft chain (it belongs to --draft static)"),
    "lam with ar": (lambda a, f: a + ["--method", "ar", "--lam", "5"], "--lam is not used by --method ar"),
    "window with a drafter method": (lambda a, f: a + ["--method", "lantern", "--window", "8"],
                                     "--window is not used by --method lantern --draft dynamic"),
    "no tv record with an exact method": (lambda a, f: a + ["--method", "sjd", "--no-tv-record"],
                                          "--no-tv-record is not used by --method sjd"),
    "no neighbours": (lambda a, f: a + ["--method", "lantern", "--k", "0"], "k (latent neighbours) must be >= 1"),
    "class id out of range": (lambda a, f: option(a, "--classes", "3,10"), "class id 10 is out of range"),
    "negative class id": (lambda a, f: option(a, "--classes", "-1"), "out of range"),
    "class ids not numbers": (lambda a, f: option(a, "--classes", "cat,dog"), "class ids"),
    "image size not a multiple": (lambda a, f: option(a, "--image-size", "18"), "not a multiple"),
    "image size off the grid": (lambda a, f: option(a, "--image-size", "32"), "token grid"),
    "image size vs freqs_cis": (lambda a, f: option(a, "--gpt-ckpt", f["freqs"]), "made for 8x8"),
    "negative cfg": (lambda a, f: a + ["--cfg-scale", "-1"], "cfg scale"),
    "top-p zero": (lambda a, f: a + ["--top-p", "0"], "top-p"),
    "top-p above one": (lambda a, f: a + ["--top-p", "1.5"], "top-p"),
    "unknown gpt model": (lambda a, f: option(a, "--gpt-model", "GPT-Q"), "unknown GPT model"),
    "unknown vq model": (lambda a, f: option(a, "--vq-model", "VQ-3"), "unknown VQ model"),
    "bad json config": (lambda a, f: option(a, "--gpt-model", f["bad_json"]), "not valid JSON"),
    "no gpt model for an official file": (lambda a, f: option(a, "--gpt-model", None), "needs --gpt-model"),
    "wrong named size": (lambda a, f: option(a, "--gpt-model", "GPT-B"), "not GPT-B"),
    "vocabulary mismatch": (lambda a, f: option(option(a, "--vq-ckpt", f["vq32"]), "--vq-model", f["vq32_json"]), "vocabulary"),
    "unknown method": (lambda a, f: a + ["--method", "magic"], "invalid choice"),
    "drafter missing": (lambda a, f: a + ["--method", "lantern"], "--drafter-ckpt"),
    "bad precision": (lambda a, f: a + ["--precision", "fp8"], "invalid choice"),
    "not a number": (lambda a, f: a + ["--top-k", "many"], "invalid int"),
    "unknown option": (lambda a, f: a + ["--bogus"], "unrecognized arguments"),
    "missing --out": (lambda a, f: option(a, "--out", None), "required: --out"),
    "out is a file": (lambda a, f: option(a, "--out", f["a_file"]), "not a folder"),
    "captions for c2i": (lambda a, f: a + ["--caption-features", f["wrong_shape"]], "class-conditional"),
    "zero batch size": (lambda a, f: a + ["--batch-size", "0"], "batch size must be a whole number >= 1"),
    "unknown device": (lambda a, f: a + ["--device", "abacus"], "device"),
}
T2I_ERRORS = {
    "t2i without captions": (lambda a, f: a, "--caption-features"),
    "t2i with classes": (lambda a, f: a + ["--classes", "1"], "text-to-image"),
    "caption shape": (lambda a, f: a + ["--caption-features", f["wrong_shape"]], "shape"),
    "caption pickle": (lambda a, f: a + ["--caption-features", f["objects"]], "refusing"),
    "caption not an array": (lambda a, f: a + ["--caption-features", f["text"]], "not a .npy"),
    "caption missing": (lambda a, f: a + ["--caption-features", f["folder"] / "nope.npy"], "no such file"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_c2i_user_errors(case, tiny_ckpts, bad_files, tmp_path, capsys):
    base = generate_args(tiny_ckpts["c2i"], tmp_path / "out", "--classes", "1,2")
    edit, expected = ERRORS[case]
    assert_one_line_error(*run(edit([str(a) for a in base], bad_files), capsys), expected)


@pytest.mark.parametrize("case", list(T2I_ERRORS))
def test_t2i_user_errors(case, tiny_ckpts, bad_files, tmp_path, capsys):
    base = generate_args(tiny_ckpts["t2i"], tmp_path / "out")
    edit, expected = T2I_ERRORS[case]
    assert_one_line_error(*run(edit([str(a) for a in base], bad_files), capsys), expected)


def test_other_commands_errors_and_help(tiny_ckpts, bad_files, tmp_path, capsys):
    assert_one_line_error(*run(["info", bad_files["unsafe"]], capsys), "refusing")
    assert_one_line_error(*run(["info", tmp_path / "nothing.pt"], capsys), "no such file")
    assert_one_line_error(*run([], capsys), "required")
    assert_one_line_error(*run(["paint"], capsys), "invalid choice")
    assert_one_line_error(*run(["make-test-checkpoints", "--out", bad_files["a_file"]], capsys), "not a folder")
    code, stdout, _ = run(["generate", "--help"], capsys)
    assert code == 0 and "--drafter-ckpt" in stdout and "--caption-features" in stdout


@pytest.mark.parametrize("command", __import__("relaxspec.cli", fromlist=["COMMANDS"]).COMMANDS.split(","))
def test_every_command_prints_its_help(command, capsys):
    """argparse formats help texts with %: a bare one in any help breaks --help."""
    code, stdout, _ = run([command, "--help"], capsys)
    assert code == 0 and stdout.startswith(f"usage: relaxspec {command}")


@pytest.mark.slow
@pytest.mark.parametrize("argv,expected", [
    (["generate", "--gpt-ckpt", "g.pt", "--vq-ckpt", "v.pt", "--out", "o", "--bogus"], "unrecognized arguments"),
    (["info", "/nonexistent/ckpt.pt"], "no such file"),
])
def test_console_errors_in_a_real_process(argv, expected, bad_files):
    """The same, through a fresh interpreter: exit status 2, one stderr line, no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "relaxspec.cli", *argv], capture_output=True, text=True, env=env,
                          timeout=120)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, expected)


@pytest.mark.slow
def test_compile_flag_gives_the_eager_tokens(tiny_ckpts, tmp_path, capsys):
    """``--compile`` (the compiled AR baseline here) commits the tokens eager decoding commits."""
    tokens = {}
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        code, _, err = run(generate_args(tiny_ckpts["c2i"], tmp_path / name, "--classes", "1,2", "--method", "ar",
                                         "--top-k", "0", *extra), capsys)
        assert code == 0, err
        tokens[name] = np.load(tmp_path / name / "tokens.npy")
        settings = json.loads((tmp_path / name / "stats.json").read_text())["settings"]
        assert settings["method"]["compile"] is bool(extra)
    assert np.array_equal(tokens["compiled"], tokens["eager"])


def test_no_tv_record_reports_no_certificate(tmp_path, capsys):
    """A relaxed method without its TV record keeps its tokens and reports no certificate (not a
    zero that would read as lossless)."""
    stats, tokens = {}, {}
    for name, extra in (("on", []), ("off", ["--no-tv-record"])):
        code, _, err = run(["generate", "--out", tmp_path / name, "--classes", "heart", "--no-progress", *extra], capsys)
        assert code == 0, err
        stats[name] = json.loads((tmp_path / name / "stats.json").read_text())
        tokens[name] = np.load(tmp_path / name / "tokens.npy")
    assert stats["on"]["settings"]["method"]["method"] == "lantern"
    assert np.array_equal(tokens["on"], tokens["off"])
    assert stats["on"]["totals"]["tv_sum_mean"] > 0
    assert stats["off"]["totals"]["tv_certified"] is None and stats["off"]["images"][0]["tv_sum"] is None


def test_a_run_written_with_the_old_tv_field_names_resumes_with_its_sums(tmp_path, capsys):
    """Issue 20: per-image records name the TV record's sum ``tv_sum`` only (no capped
    ``tv_bound``); a stats.json written before (``tv_bound`` as the uncapped sum, or as the cap
    next to ``tv_sum``) is still read: its images are kept and its sums enter the totals."""
    out = tmp_path / "old"
    argv = ["generate", "--out", out, "--classes", "heart,time", "--no-progress"]
    code, _, err = run(argv, capsys)
    assert code == 0, err
    stats = json.loads((out / "stats.json").read_text())
    sums = [r["tv_sum"] for r in stats["images"]]
    assert all("tv_bound" not in r for r in stats["images"]) and sum(sums) > 0
    first, second = stats["images"]
    first["tv_bound"] = first.pop("tv_sum")                # the oldest layout: the sum under the old name
    second["tv_bound"] = min(1.0, second["tv_sum"])        # a later one: the cap next to the sum
    stats["complete"] = False
    (out / "stats.json").write_text(json.dumps(stats))
    code, stdout, err = run(argv, capsys)
    assert code == 0 and "0 generated now, 2 kept" in stdout, err
    totals = json.loads((out / "stats.json").read_text())["totals"]
    assert totals["tv_sum_mean"] == pytest.approx(sum(sums) / 2)


@pytest.mark.parametrize("flags, keywords", [
    (["--seed", "-5"], dict(seed=-5)),
    (["--seed", str(2 ** 40)], dict(seed=2 ** 40)),
    (["--upscale", "0"], dict(upscale=0)),
    (["--upscale", "100000"], dict(upscale=100000)),   # was a numpy traceback: "Unable to allocate 27.9 TiB"
    (["--upscale", "257"], dict(upscale=257)),          # 257 x 32 px > 8192: one past the cap
])
def test_the_api_and_the_command_refuse_an_input_with_the_same_line(flags, keywords, tmp_path, capsys):
    """Issue 20: one validation path. ``relaxspec.generate`` accepted ``seed=-1`` and died on
    ``upscale=10**6`` with "image has wrong mode"; the command refused ``--seed -5`` and died on
    ``--upscale 100000`` with a numpy traceback. Both now give the same one line (exit 2)."""
    import relaxspec

    code, _, err = run(["generate", "--out", tmp_path / "out", "--classes", "heart", "--no-progress", *flags], capsys)
    assert code == 2 and err.count("\n") == 1, err
    with pytest.raises(RelaxspecError) as raised:
        relaxspec.generate("heart", "ar", **keywords)
    assert str(raised.value) in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.png"))


@pytest.mark.slow
def test_the_output_side_cap_admits_the_largest_upscale(tmp_path, capsys):
    import relaxspec

    images, _ = relaxspec.generate("heart", "ar", upscale=256)   # 32 px x 256 = 8192 px, the cap itself
    assert images[0].size == (8192, 8192)


@pytest.mark.slow
def test_the_default_grid_has_no_empty_cell(tmp_path, capsys):
    """Issue 20: ``relaxspec generate --out out`` laid its 8 images in a 3 x 3 grid whose ninth cell
    was black; now 2 rows of 4, every cell a picture. Layouts where some cell must stay empty
    show the background there; grids past the 8192-px cap take every n-th pixel."""
    from relaxspec.files import grid_shape, write_grid

    code, _, err = run(["generate", "--out", tmp_path / "out", "--no-progress"], capsys)
    assert code == 0, err
    grid = np.asarray(Image.open(tmp_path / "out" / "grid.png"))
    side, pad = 32, 2
    assert grid.shape == (2 * (side + pad) + pad, 4 * (side + pad) + pad, 3)
    for r in range(2):
        for c in range(4):
            top, left = pad + r * (side + pad), pad + c * (side + pad)
            cell = grid[top : top + side, left : left + side]
            assert cell.std() > 5, (r, c)  # a picture, not an empty cell
    assert [grid_shape(n) for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 64)] == [
        (1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (2, 3), (2, 4), (2, 4), (3, 3), (8, 8)]
    big = tmp_path / "big"
    big.mkdir()
    for i in range(3):
        Image.fromarray(np.full((3000, 3000, 3), 50 * i, dtype=np.uint8)).save(big / f"{i}.png")
    write_grid(big, ["0.png", "1.png", "2.png"])
    width, height = Image.open(big / "grid.png").size
    assert width <= 8192 and height <= 8192 and width > 3 * 1400


def test_values_past_what_the_model_uses_are_recorded_as_used_and_said(tmp_path, capsys):
    """Issue 45: ``--k 5000`` over a 1024-code table ran and recorded k = 5000, ``--rows 100000``
    recorded 100000 open rows where 4 can be. The run records what it used, and says so once."""
    for args, field, used, said in (
            (["--method", "lantern", "--k", "5000"], "k", 1023, "--k 5,000: the codebook has 1,024 codes"),
            (["--method", "zipar", "--rows", "100000"], "rows", 4, "--rows 100,000: at a lead of 3 this model's "
                                                                    "8-row grid keeps at most 4 rows open"),
            # the tree's 12 drafts, then a chain of 64 (it reaches the image's last token)
            (["--method", "sjd-pac", "--window", "500"], "window", 74, "--window 500: this model's images have 64 "
                                                                       "tokens, so the chain past the tree is cut")):
        out = tmp_path / field
        assert main(["generate", "--classes", "heart", "--no-progress", "--out", str(out), *args]) == 0
        err = capsys.readouterr().err
        assert err.count(said) == 1, err
        assert json.loads((out / "stats.json").read_text())["settings"]["method"][field] == used
    # a preset's value stays as it names itself: zipar's "every row" (the engine opens those it can)
    assert main(["generate", "--classes", "heart", "--no-progress", "--method", "zipar", "--out",
                 str(tmp_path / "preset")]) == 0
    assert "note:" not in capsys.readouterr().err
    assert json.loads((tmp_path / "preset" / "stats.json").read_text())["settings"]["method"]["rows"] == 4096


def test_eval_says_when_it_has_fewer_prompts_than_asked(capsys):
    """Issue 45: ``eval --num-prompts 1000000`` on 3 captions used 3 without a word."""
    import argparse

    from relaxspec.cli.eval import eval_prompts

    args = argparse.Namespace(num_prompts=1_000_000)
    gen = argparse.Namespace(prompt=["a red fox", "a dog", "the sea"], prompts_file=None)
    eval_prompts(args, gen)
    assert gen.prompt == ["a red fox", "a dog", "the sea"] and args.num_prompts == 3
    assert "--num-prompts 1,000,000: the run has 3 prompts; all 3 are used" in capsys.readouterr().err
    args.num_prompts = 2
    eval_prompts(args, gen)
    assert gen.prompt == ["a red fox", "a dog"] and capsys.readouterr().err == ""


def test_a_ctrl_c_while_the_command_line_loads_is_one_line(monkeypatch, capsys):
    """Issue 45: a Ctrl-C while ``relaxspec`` imported torch printed a 24-line KeyboardInterrupt
    traceback. The script (relaxspec.launch, also ``python -m relaxspec``) ends it in one line."""
    import builtins
    import sys as system

    from relaxspec import launch

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "relaxspec.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(system.modules, "relaxspec.cli")
    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert launch.main() == 130
    assert capsys.readouterr().err == "relaxspec: interrupted while starting\n"


@pytest.mark.parametrize("command", [
    ["generate", "--classes", "heart", "--no-progress"],
    ["bench", "--methods", "ar", "--num-images", "1", "--no-progress", "--no-plots"],
    ["tune", "--lossless", "--minutes", "1", "--no-progress"],
], ids=["generate", "bench", "tune"])
def test_a_folder_another_run_is_writing_is_refused(tmp_path, command, capsys):
    """Issue 45: two generate runs with different settings into one --out at once both exited 0 and
    mixed the folder (stats.json of one, PNGs of the other). Every command that writes a folder
    holds it (relaxspec.runs.folder.hold_folder, the OS's lock on OUT/.lock) for the whole run: a
    second run is refused in one line and writes nothing; once the holder is gone the folder is free."""
    import subprocess
    import sys as system

    out = tmp_path / "out"
    holder = subprocess.Popen([system.executable, "-c", "import sys, time; from relaxspec.runs.folder import hold_folder\n"
                               "with hold_folder(sys.argv[1], 'generate'):\n    print('held', flush=True); "
                               "time.sleep(60)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main([*command, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is in use by another run (relaxspec generate, pid {holder.pid})" in err
        assert err.count("error") == 1 and sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()
