"""Official LANTERN's LlamaGen text-to-image folders (issue 29, item 1): ``jadohu/LlamaGen-T2I``
(Stage I) and ``jadohu/LlamaGen-T2I-2`` (Stage II) hold LlamaGen's network under HF-Llama names
(``config.json`` of ``LlamaForCausalLM`` with ``input_type``, ``model.safetensors``). relaxspec
opens one as LlamaGen weights (``--gpt-ckpt DIR``, with the VQ and the captions as for upstream's
files). The golden data (tests/data/lantern/) is official LANTERN's own model code run greedily
on a tiny random folder in that layout (make_llamagen_golden.py says how)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relaxspec.cli import main
from relaxspec.errors import RelaxspecError

DATA = Path(__file__).resolve().parent / "data" / "lantern"
FOLDER = DATA / "llamagen-t2i"


@pytest.fixture(scope="module")
def golden() -> dict:
    return dict(np.load(DATA / "llamagen_golden.npz"))


@pytest.fixture(scope="module")
def captions(golden, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("captions") / "captions.npz"
    np.savez(path, features=golden["features"].astype(np.float32), mask=golden["mask"])
    return path


def vq_args(tiny_ckpts) -> list[str]:
    files = tiny_ckpts["t2i"]  # the tiny t2i files' VQ: 64 codes, 4x downsampling (16 px = the 4x4 grid)
    return ["--vq-ckpt", files["vq"], "--vq-model", files["vq_json"]]


@pytest.mark.parametrize("scale", [4.0, 1.5])
def test_greedy_tokens_equal_official_lanterns(golden, captions, tiny_ckpts, tmp_path, scale, capsys):
    out = tmp_path / "out"
    argv = ["generate", "--gpt-ckpt", str(FOLDER), *vq_args(tiny_ckpts), "--caption-features", str(captions),
            "--method", "ar", "--temperature", "0", "--cfg-scale", str(scale), "--batch-size", "2", "--out", str(out),
            "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert np.array_equal(np.load(out / "tokens.npy"), golden[f"tokens_cfg{scale:g}"])


def test_the_first_guided_law_equals_official_lanterns(golden):
    """Not only the argmax: the guided law of the first image token, from the prefill over the 120
    left-padded caption tokens (fp16-rounded weights, fp32 arithmetic on both sides)."""
    from relaxspec.decoding.target import GuidedTarget
    from relaxspec.models.llamagen.checkpoints import load_gpt
    from relaxspec.sampling import SamplingConfig

    target = load_gpt(FOLDER)
    features = torch.from_numpy(golden["features"].astype(np.float32))
    mask = torch.from_numpy(golden["mask"]).bool()
    for scale in (4.0, 1.5):
        with torch.no_grad():
            probs, _ = GuidedTarget(target, features, SamplingConfig(cfg_scale=scale, top_k=0), cond_mask=mask).prefill()
        official = torch.from_numpy(golden[f"first_logits_cfg{scale:g}"]).softmax(-1)
        torch.testing.assert_close(probs, official, atol=1e-5, rtol=1e-4)


def test_the_folder_maps_onto_upstream_names_and_back(tmp_path):
    from safetensors.torch import load_file

    from relaxspec.models.llamagen.checkpoints import read_llamagen_state
    from relaxspec.models.llamagen.hf_layout import from_upstream

    loaded = read_llamagen_state(FOLDER)
    assert loaded.layout == "lantern" and loaded.kind == "gpt"
    assert loaded.config["model_type"] == "t2i" and loaded.config["cls_token_num"] == 120
    hf = load_file(str(FOLDER / "model.safetensors"))
    back = from_upstream(loaded.state_dict)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_info_describes_the_folder(capsys):
    assert main(["info", str(FOLDER)]) == 0
    out = capsys.readouterr().out
    assert "official LANTERN's LlamaGen folder" in out and "gpt (t2i)" in out and "cls_token_num=120" in out


def test_greedy_exact_sd_with_a_drafter_equals_greedy_ar(captions, tiny_ckpts, tmp_path, capsys):
    """The folder's target drafts like any LlamaGen target: exact SD, greedy, with a (random)
    EAGLE drafter built for it commits AR's tokens."""
    from relaxspec.drafting.eagle import EagleDrafter
    from relaxspec.models.llamagen.checkpoints import load_gpt
    from relaxspec.models.weights import save_model

    torch.manual_seed(0)
    save_model(EagleDrafter.for_target(load_gpt(FOLDER)), tmp_path / "drafter", kind="drafter")
    common = ["generate", "--gpt-ckpt", str(FOLDER), *vq_args(tiny_ckpts), "--caption-features", str(captions),
              "--temperature", "0", "--batch-size", "2", "--no-progress"]
    assert main([*common, "--method", "ar", "--out", str(tmp_path / "ar")]) == 0
    assert main([*common, "--method", "sd", "--draft", "chain", "--depth", "3", "--drafter-ckpt",
                 str(tmp_path / "drafter"), "--out", str(tmp_path / "sd")]) == 0, capsys.readouterr().err
    assert np.array_equal(np.load(tmp_path / "ar" / "tokens.npy"), np.load(tmp_path / "sd" / "tokens.npy"))


def edited(tmp_path: Path, **changes) -> Path:
    from helpers.folders import edited_folder

    return edited_folder(FOLDER, tmp_path / "edited", **changes)


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_size=None), "config.json needs whole-number hidden_size"),
    (dict(block_size="16"), "config.json needs whole-number block_size"),
    (dict(input_type="t2v"), "input_type 't2v' is not LlamaGen's t2i or c2i"),
    (dict(intermediate_size=100), "intermediate_size 100 is not LlamaGen's SwiGLU width 256"),
    (dict(num_hidden_layers=3), "weights do not fit the model; missing keys: layers.2."),
])
def test_bad_folders_are_one_line(changes, message, tmp_path, tiny_ckpts, captions, capsys):
    folder = edited(tmp_path, **changes)
    argv = ["generate", "--gpt-ckpt", str(folder), *vq_args(tiny_ckpts), "--caption-features", str(captions),
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_model_path_opens_the_folder_with_its_vq_and_text_inputs(tmp_path, tiny_ckpts, captions, capsys):
    """The front door asks every family: --model-path DIR opens LANTERN's folder as --gpt-ckpt DIR
    does (same tokens), and without its VQ says which family and which input is missing."""
    assert main(["generate", "--model-path", str(FOLDER), "--prompt", "a cat", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--model-path {FOLDER} is a LlamaGen model: give --vq-ckpt PATH" in err and err.count("\n") == 1, err
    common = [*vq_args(tiny_ckpts), "--caption-features", str(captions), "--temperature", "0", "--no-progress"]
    assert main(["generate", "--gpt-ckpt", str(FOLDER), *common, "--out", str(tmp_path / "files")]) == 0
    assert main(["generate", "--model-path", str(FOLDER), *common, "--out", str(tmp_path / "folder")]) == 0
    assert np.array_equal(np.load(tmp_path / "files" / "tokens.npy"), np.load(tmp_path / "folder" / "tokens.npy"))
    assert main(["generate", "--model-path", str(FOLDER), "--gpt-ckpt", str(FOLDER), *common,
                 "--out", str(tmp_path / "both")]) == 2
    assert "--model-path is a whole model: leave out --gpt-ckpt" in capsys.readouterr().err


def test_other_ways_in_are_named(tmp_path, tiny_ckpts, captions, capsys):
    # a Stage II (1024-token) folder given a Stage I grid: one line
    argv = ["generate", "--gpt-ckpt", str(FOLDER), *vq_args(tiny_ckpts), "--caption-features", str(captions),
            "--image-size", "32", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "gives a 8x8 token grid but the model was trained on 4x4" in capsys.readouterr().err
    # weights only as a pickle: refused, never unpickled
    folder = edited(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(RelaxspecError, match="needs model.safetensors \\(found pytorch_model.bin; relaxspec does not "
                                             "unpickle .bin files\\)"):
        from relaxspec.models.llamagen.checkpoints import load_gpt

        load_gpt(folder)
    # a drafter folder given as the target: named (its config looks like a small target's)
    drafter = DATA / "llamagen-t2i-drafter"
    assert main(["info", str(drafter)]) == 2
    assert "official LANTERN's EAGLE drafter, not a LlamaGen model: give it as --drafter-ckpt" in \
        capsys.readouterr().err
