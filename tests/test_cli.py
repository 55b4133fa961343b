"""``relaxspec`` command line: generate end to end on tiny official-layout files, resumption and
``info``. Every user error as one line on stderr with exit code 2: ``test_cli_errors.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq
from relaxspec.models.weights import read_state
from relaxspec.sampling import batch_seed
from relaxspec.decoding import decode
from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.models.llamagen.vq import VQConfig, to_uint8
from relaxspec.pipelines import ImagePipeline
from relaxspec.sampling import SamplingConfig

from helpers.cli import assert_one_line_error, generate_args
from helpers.cli import outcome as run


def load_pair(ckpts):
    model = load_gpt(ckpts["gpt"], config=GPTConfig(**ckpts["config"]))
    vq = load_vq(ckpts["vq"], config=VQConfig(**json.loads(Path(ckpts["vq_json"]).read_text())))
    return model, vq


# ----------------------------------------------------------------------------------- happy path


def test_make_test_checkpoints_writes_official_layout(tiny_ckpts):
    for model_type, ckpts in tiny_ckpts.items():
        state = read_state(ckpts["gpt"])
        assert state.layout == "model"
        config = GPTConfig(**ckpts["config"])
        assert config.model_type == model_type and config.block_size == 16
        assert set(state.state_dict) == set(Transformer(config).state_dict())
        vq_state = read_state(ckpts["vq"])
        assert vq_state.layout == "model" and "quantize.codebook_used" in vq_state.state_dict


def test_generate_end_to_end(tiny_ckpts, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = run(generate_args(
        tiny_ckpts["c2i"], out, "--classes", "1,2,3", "--batch-size", "2", "--cfg-scale", "4.0", "--temperature", "1.0",
        "--top-k", "20", "--top-p", "0.9", "--seed", "0", "--method", "ar"), capsys)
    assert code == 0, err
    assert "3 images" in stdout
    assert sorted(p.name for p in out.iterdir()) == [".lock", "0000.png", "0001.png", "0002.png", "grid.png", "stats.json",
                                                     "tokens.npy"]
    tokens = np.load(out / "tokens.npy")
    assert tokens.dtype == np.int64 and tokens.shape == (3, 16)
    assert tokens.min() >= 0 and tokens.max() < 64
    # Each PNG is the VQ decoding of its tokens, saved with upstream's rounding.
    _, vq = load_pair(tiny_ckpts["c2i"])
    with torch.no_grad():
        expected = to_uint8(vq.decode(torch.from_numpy(tokens))).numpy()
    for i in range(3):
        image = Image.open(out / f"{i:04d}.png")
        assert image.size == (16, 16) and image.mode == "RGB"
        assert np.array_equal(np.asarray(image), expected[i])
    assert Image.open(out / "grid.png").size == (3 * 18 + 2, 18 + 2)  # three in a row: no empty cell

    stats = json.loads((out / "stats.json").read_text())
    assert stats["complete"] is True and len(stats["settings_hash"]) == 16
    settings = stats["settings"]
    assert settings["sampling"] == {"cfg_scale": 4.0, "temperature": 1.0, "top_k": 20, "top_p": 0.9}
    assert settings["method"]["method"] == "ar"
    assert settings["classes"] == [1, 2, 3] and settings["seed"] == 0 and settings["batch_size"] == 2
    for key in ("gpt_ckpt", "gpt_model", "vq_ckpt", "vq_model", "image_size", "precision", "device", "gpt_config"):
        assert key in settings
    assert [r["class"] for r in stats["images"]] == [1, 2, 3]
    for record in stats["images"]:
        assert record["target_forwards"] == 16 and record["mean_accepted_length"] == 1.0 and record["tv_sum"] == 0.0
        assert "tv_bound" not in record  # per image: the sum, named for what it is (issue 20)
        # the parts are timed apart in profile mode only (--profile): a plain step has no parts to time
        assert record["seconds"] > 0 and record["target_forward_seconds"] is None
        assert record["drafter_forward_seconds"] is None
    totals = stats["totals"]
    assert totals["images"] == 3 and totals["target_forwards_per_image"] == 16 and totals["mean_accepted_length"] == 1.0
    assert totals["seconds_per_image"] > 0
    assert totals["target_forward_share"] is None and totals["drafter_forward_share"] is None

    profiled = tmp_path / "profiled"
    code, said, err = run(generate_args(tiny_ckpts["c2i"], profiled, "--classes", "1,2", "--method", "ar", "--profile"),
                          capsys)
    assert code == 0, err
    stats = json.loads((profiled / "stats.json").read_text())
    # issue 54: the split was only in stats.json; the run's line says it (a plain run's does not)
    share = f"{stats['totals']['target_forward_share']:.0%}"
    assert f"decoding time (--profile): target forwards {share}, drafter forwards 0%" in said.strip().splitlines()[-1]
    assert stats["settings"]["method"]["profile"] is True
    for record in stats["images"]:
        assert 0 < record["target_forward_seconds"] < record["seconds"] and record["drafter_forward_seconds"] == 0
    assert 0 < stats["totals"]["target_forward_share"] < 1 and stats["totals"]["drafter_forward_share"] == 0


def test_cli_tokens_equal_api_tokens(tiny_ckpts, tmp_path, capsys):
    ckpts = tiny_ckpts["c2i"]
    model, _ = load_pair(ckpts)
    classes = torch.tensor([4, 0, 9])
    greedy = SamplingConfig(cfg_scale=4.0, temperature=0.0, top_k=2000)
    code, _, err = run(generate_args(ckpts, tmp_path / "greedy", "--classes", "4,0,9", "--temperature", "0",
                                     "--batch-size", "3"), capsys)
    assert code == 0, err
    cli_tokens = torch.from_numpy(np.load(tmp_path / "greedy" / "tokens.npy"))
    assert torch.equal(cli_tokens, decode(model, classes, greedy).tokens)
    # Sampled: batch b draws from a generator seeded batch_seed(seed, b), as stats.json says.
    code, _, err = run(generate_args(ckpts, tmp_path / "sampled", "--classes", "4,0,9", "--seed", "5",
                                     "--batch-size", "2"), capsys)
    assert code == 0, err
    sampling = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=2000)
    api = torch.cat([decode(model, classes[s : s + 2], sampling, generator=torch.Generator().manual_seed(batch_seed(5, b))).tokens
                     for b, s in enumerate((0, 2))])
    assert torch.equal(torch.from_numpy(np.load(tmp_path / "sampled" / "tokens.npy")), api)


def test_generate_t2i(tiny_ckpts, tmp_path, capsys):
    features = np.random.default_rng(0).standard_normal((2, 6, 32)).astype(np.float32)
    mask = np.ones((2, 6), dtype=bool)
    mask[0, :2] = False
    np.savez(tmp_path / "captions.npz", features=features, mask=mask)
    code, _, err = run(generate_args(tiny_ckpts["t2i"], tmp_path / "out", "--caption-features",
                                     tmp_path / "captions.npz", "--cfg-scale", "7.5", "--temperature", "0"), capsys)
    assert code == 0, err
    assert np.load(tmp_path / "out" / "tokens.npy").shape == (2, 16)
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["settings"]["caption_mask"] is True and [r["caption"] for r in stats["images"]] == [0, 1]
    model, _ = load_pair(tiny_ckpts["t2i"])
    expected = decode(model, torch.from_numpy(features)[:1], SamplingConfig(cfg_scale=7.5, temperature=0, top_k=2000),
                      cond_mask=torch.from_numpy(mask)[:1]).tokens
    assert np.array_equal(np.load(tmp_path / "out" / "tokens.npy")[:1], expected.numpy())


def test_sjd_method_runs_through_the_cli(tiny_ckpts, tmp_path, capsys):
    pytest.importorskip("relaxspec.decoding.raster")
    code, _, err = run(generate_args(tiny_ckpts["c2i"], tmp_path / "out", "--classes", "1", "--method", "sjd",
                                     "--window", "4", "--temperature", "0"), capsys)
    assert code == 0, err
    model, _ = load_pair(tiny_ckpts["c2i"])
    ar = decode(model, torch.tensor([1]), SamplingConfig(cfg_scale=4.0, temperature=0.0, top_k=2000)).tokens
    assert np.array_equal(np.load(tmp_path / "out" / "tokens.npy"), ar.numpy())  # lossless greedy


def test_info(tiny_ckpts, capsys):
    code, out, err = run(["info", tiny_ckpts["c2i"]["gpt"]], capsys)
    assert code == 0, err
    assert "official LlamaGen file" in out and "kind:       gpt (c2i)" in out and "parameters:" in out
    code, out, _ = run(["info", tiny_ckpts["c2i"]["vq"], "--json"], capsys)
    info = json.loads(out)
    assert info["kind"] == "vq" and info["layout"] == "model" and info["parameters"] > 0


def test_only_the_settings_a_method_reads_are_printed_and_recorded(tiny_ckpts, tmp_path, capsys):
    code, _, err = run(generate_args(tiny_ckpts["c2i"], tmp_path / "ar", "--classes", "1", "--method", "ar"), capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "ar" / "stats.json").read_text())["settings"]["method"] == {"method": "ar", "compile": False}
    assert "relaxspec: ar compile=False" in err
    code, _, err = run(generate_args(tiny_ckpts["c2i"], tmp_path / "sjd", "--classes", "1", "--method", "sjd",
                                     "--window", "3"), capsys)
    assert code == 0, err
    recorded = json.loads((tmp_path / "sjd" / "stats.json").read_text())["settings"]["method"]
    assert recorded == {"method": "sjd", "window": 3, "compile": False} and "relaxspec: sjd window=3 compile=False" in err


def test_info_embedded(capsys):
    code, out, err = run(["info", "embedded"], capsys)
    assert code == 0, err
    for part in ("gpt", "vq", "drafter", "classifier"):
        assert f"== {part}" in out
    assert "class_names=[99 items]" in out and "method:     method=" in out and "MODEL_CARD.md" in out
    code, out, _ = run(["info", "embedded", "--json"], capsys)
    info = json.loads(out)
    assert info["parts"]["gpt"]["config"]["n_layer"] == 12 and info["defaults"]["method"]["method"]


def test_upscale(tiny_ckpts, tmp_path, capsys):
    small, big = tmp_path / "small", tmp_path / "big"
    for out, extra in ((small, []), (big, ["--upscale", "3"])):
        code, _, err = run(generate_args(tiny_ckpts["c2i"], out, "--classes", "1,2", *extra), capsys)
        assert code == 0, err
    assert np.array_equal(np.load(small / "tokens.npy"), np.load(big / "tokens.npy"))
    pixels, bigger = (np.asarray(Image.open(folder / "0001.png")) for folder in (small, big))
    assert bigger.shape == (3 * pixels.shape[0], 3 * pixels.shape[1], 3)
    assert np.array_equal(bigger[1::3, 2::3], pixels)
    assert Image.open(big / "grid.png").size[0] > 2 * Image.open(small / "grid.png").size[0]
    settings = [json.loads((folder / "stats.json").read_text())["settings"] for folder in (small, big)]
    assert "upscale" not in settings[0] and settings[1]["upscale"] == 3  # runs from before the flag resume
    assert_one_line_error(*run(generate_args(tiny_ckpts["c2i"], tmp_path / "x", "--upscale", "0"), capsys),
                          "upscale must be a whole number >= 1")


# ------------------------------------------------------------------------------------ resuming


def test_resume_after_interruption_and_deletion(tiny_ckpts, tmp_path, capsys, monkeypatch):
    ckpts = tiny_ckpts["c2i"]
    extra = ("--classes", "1,2,3,4", "--seed", "3")
    assert run(generate_args(ckpts, tmp_path / "full", *extra), capsys)[0] == 0
    reference = np.load(tmp_path / "full" / "tokens.npy")

    out = tmp_path / "resumed"
    calls = {"n": 0}
    real_generate = ImagePipeline.generate

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_generate(self, *args, **kwargs)

    monkeypatch.setattr(ImagePipeline, "generate", interrupted)
    code, _, err = run(generate_args(ckpts, out, *extra), capsys)
    assert code == 130 and "interrupted" in err
    monkeypatch.setattr(ImagePipeline, "generate", real_generate)
    assert sorted(p.name for p in out.glob("*.png")) == ["0000.png", "0001.png"]
    partial = json.loads((out / "stats.json").read_text())
    batches = [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]
    assert partial["complete"] is False and partial["images"] == []  # a batch appends its line, nothing more
    assert [r["index"] for b in batches for r in b["images"]] == [0, 1]
    assert [p.name for p in out.glob(".*")] == [".lock"]  # no temp files left behind (the lock file stays)
    first_png = (out / "0000.png").stat().st_mtime_ns

    code, stdout, err = run(generate_args(ckpts, out, *extra), capsys)
    assert code == 0, err
    assert "2 generated now, 2 kept" in stdout
    assert np.array_equal(np.load(out / "tokens.npy"), reference)
    assert (out / "0000.png").stat().st_mtime_ns == first_png

    (out / "0002.png").unlink()
    code, stdout, _ = run(generate_args(ckpts, out, *extra), capsys)
    assert code == 0 and "1 generated now, 3 kept" in stdout
    assert np.array_equal(np.load(out / "tokens.npy"), reference)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["complete"] and stats["totals"]["generated_this_run"] == 1 and len(stats["images"]) == 4
    assert not (out / "progress.jsonl").exists()  # a finished run's images are all in stats.json

    # Issue 45: a PNG cut short (a crash, a full disk) was kept and every resume failed on it with
    # "image file is truncated", naming no file; it is drawn again. A folder where a PNG goes is named.
    whole = (out / "0001.png").read_bytes()
    (out / "0001.png").write_bytes(whole[: len(whole) // 2])
    code, stdout, _ = run(generate_args(ckpts, out, *extra), capsys)
    assert code == 0 and "1 generated now, 3 kept" in stdout and (out / "0001.png").read_bytes() == whole
    (out / "0001.png").unlink()
    (out / "0001.png").mkdir()
    code, _, err = run(generate_args(ckpts, out, *extra), capsys)
    assert code == 2 and f"{out / '0001.png'}: is a folder where a file is written" in err and err.count("error") == 1
    (out / "0001.png").rmdir()

    # Other settings in the same folder: refused unless --overwrite.
    code, _, err = run(generate_args(ckpts, out, *extra, "--cfg-scale", "2"), capsys)
    assert code == 2 and "different settings" in err and "sampling" in err
    code, stdout, _ = run(generate_args(ckpts, out, "--classes", "1,2", "--cfg-scale", "2", "--overwrite"), capsys)
    assert code == 0 and "2 generated now" in stdout
    assert sorted(p.name for p in out.glob("*.png")) == ["0000.png", "0001.png", "grid.png"]



def test_a_batch_writes_its_own_rows_and_records_not_the_whole_run_again(tiny_ckpts, tmp_path, capsys, monkeypatch):
    """Every batch used to rewrite the whole tokens.npy and stats.json: quadratic in the run's
    images (a 50,000-image FID run wrote terabytes). Now stats.json is written at the start and
    the end, tokens.npy is made once at its final shape, and a batch appends one line."""
    from relaxspec.runs import images

    written = []
    for name in ("write_json", "write_atomic"):
        real = getattr(images, name)
        monkeypatch.setattr(images, name, lambda path, *a, real=real, **k: (written.append(Path(path).name),
                                                                              real(path, *a, **k))[1])
    appended = []
    real_open = open

    def spying_open(path, mode="r", *args, **kwargs):
        if "a" in mode:
            appended.append(Path(path).name)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spying_open)
    classes = ",".join(str(c) for c in range(6))
    code, _, err = run(generate_args(tiny_ckpts["c2i"], str(tmp_path / "out"), "--classes", classes), capsys)
    assert code == 0, err
    assert written.count("stats.json") == 2 and written.count("tokens.npy") == 0, written
    assert [name for name in appended if name != ".lock"] == ["progress.jsonl"] * 6
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert [r["index"] for r in stats["images"]] == list(range(6))
    assert (np.load(tmp_path / "out" / "tokens.npy") >= 0).all()
