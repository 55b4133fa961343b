"""Text prompts for LlamaGen t2i checkpoints: a local T5 folder (a tiny random T5 and a tokenizer
built here, saved with save_pretrained) encodes them as upstream's sample_t2i.py does, and
``generate --prompt --t5-path`` decodes exactly what the same features given as a file decode."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaxspec.cli import main
from relaxspec.models.llamagen.prompts import encode_prompts, left_pad

transformers = pytest.importorskip("transformers", reason="prompts need transformers (pip install -e '.[test]')")

from helpers.t5 import make_t5  # noqa: E402


@pytest.fixture(scope="module")
def t5(tmp_path_factory, tiny_ckpts) -> Path:
    return make_t5(tmp_path_factory.mktemp("t5"), d_model=tiny_ckpts["t2i"]["config"]["caption_dim"])


PROMPTS = ["A red cat", "  the big blue dog on a small heart .  ", "green"]


def test_prompts_are_encoded_as_upstream_does(t5):
    """Upstream (sample_t2i.py with T5Embedder): pad to max_length with the mask, encode, then move
    each row's valid tokens to the end and flip the mask."""
    from transformers import AutoTokenizer, T5EncoderModel

    features, mask, lengths = encode_prompts(PROMPTS, t5, max_length=6)
    tokenizer, encoder = AutoTokenizer.from_pretrained(t5), T5EncoderModel.from_pretrained(t5).eval()
    texts = [p.lower().strip() for p in PROMPTS]
    batch = tokenizer(texts, max_length=6, padding="max_length", truncation=True, return_attention_mask=True,
                      add_special_tokens=True, return_tensors="pt")
    with torch.no_grad():
        embs = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    expected = []
    for emb, emb_mask in zip(embs, batch["attention_mask"]):
        valid = int(emb_mask.sum())
        expected.append(torch.cat([emb[valid:], emb[:valid]]))
    torch.testing.assert_close(features, torch.stack(expected))
    assert torch.equal(mask, torch.flip(batch["attention_mask"], dims=[-1]).bool())
    assert lengths == [4, 10, 2]  # words + </s>; the second is cut to 6
    assert mask.sum(1).tolist() == [4, 6, 2] and not mask[0, :2].any()


def test_left_pad_moves_valid_tokens_last():
    x = torch.arange(8.0).view(2, 4, 1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]).bool()
    assert left_pad(x, mask)[:, :, 0].tolist() == [[2, 3, 0, 1], [4, 5, 6, 7]]


def test_generate_with_prompts_equals_generate_with_their_features(t5, tiny_ckpts, tmp_path, capsys):
    args = ["generate", *tiny_ckpts["t2i"]["args"], "--no-progress", "--seed", "3", "--batch-size", "2"]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("the big blue dog on a small heart .\n\n")
    assert main(args + ["--out", str(tmp_path / "text"), "--prompt", PROMPTS[0], "--prompts-file", str(prompts_file),
                        "--prompt", PROMPTS[2], "--t5-path", str(t5)]) == 0
    assert "prompt 3 has 10 tokens" in capsys.readouterr().err  # --prompt values first, then the file
    features, mask, _ = encode_prompts([PROMPTS[0], PROMPTS[2], "the big blue dog on a small heart ."], t5, max_length=6)
    np.savez(tmp_path / "captions.npz", features=features.numpy(), mask=mask.numpy())
    assert main(args + ["--out", str(tmp_path / "file"), "--caption-features", str(tmp_path / "captions.npz")]) == 0
    assert np.array_equal(np.load(tmp_path / "text" / "tokens.npy"), np.load(tmp_path / "file" / "tokens.npy"))
    stats = json.loads((tmp_path / "text" / "stats.json").read_text())
    assert stats["settings"]["prompts"] == [PROMPTS[0], PROMPTS[2], "the big blue dog on a small heart ."]
    assert [image["prompt"] for image in stats["images"]] == stats["settings"]["prompts"]


@pytest.mark.parametrize("extra, message", [
    (["--prompt", "a cat"], "needs --t5-path DIR"),
    (["--prompt", "   ", "--t5-path", "T5"], "prompt 1 is empty"),
    (["--t5-path", "T5"], "--t5-path encodes prompts"),
    (["--prompt", "a cat", "--t5-path", "NOWHERE"], "not a folder"),
    (["--prompt", "a cat", "--t5-path", "PICKLED"], "no .safetensors weights"),
    (["--prompt", "a cat", "--t5-path", "NARROW"], "its features have 16 dimensions, but this model reads 32"),
    (["--prompts-file", "NOWHERE"], "--prompts-file"),
    (["--prompt", "a cat", "--caption-features", "NOWHERE"], "not both"),
])
def test_prompt_errors_are_one_line(t5, tiny_ckpts, tmp_path, capsys, extra, message):
    paths = {"T5": t5, "NOWHERE": tmp_path / "nowhere",
             "PICKLED": make_t5(tmp_path / "pickled", 32, safetensors=False),
             "NARROW": make_t5(tmp_path / "narrow", 16)}
    argv = ["generate", *tiny_ckpts["t2i"]["args"], "--out", str(tmp_path / "out"), "--no-progress",
            *[str(paths.get(item, item)) for item in extra]]
    capsys.readouterr()  # what writing the folders printed (transformers' progress bars) is not the error
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_class_model_refuses_prompts(tiny_ckpts, t5, tmp_path, capsys):
    argv = ["generate", *tiny_ckpts["c2i"]["args"], "--out", str(tmp_path), "--prompt", "a cat", "--t5-path", str(t5)]
    assert main(argv) == 2 and "class-conditional (c2i) model: give --classes, not prompts" in capsys.readouterr().err


def test_the_python_api_takes_prompts(t5, tiny_ckpts, tmp_path):
    import relaxspec
    from relaxspec.errors import RelaxspecError
    from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq

    files = tiny_ckpts["t2i"]
    target = load_gpt(files["gpt"], files["gpt_json"], image_size=16, downsample=4)
    vq = load_vq(files["vq"], files["vq_json"])
    got = relaxspec.generate(prompts=[PROMPTS[0], PROMPTS[2]], t5_path=str(t5), model=(target, vq, None), method="ar",
                             seed=2, sampling={"temperature": 0})
    args = ["generate", *files["args"], "--no-progress", "--seed", "2", "--batch-size", "2", "--temperature", "0",
            "--out", str(tmp_path / "cli"), "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--t5-path", str(t5)]
    assert main(args) == 0
    assert torch.equal(got.result.tokens, torch.from_numpy(np.load(tmp_path / "cli" / "tokens.npy")))
    with pytest.raises(RelaxspecError, match="give prompts, not classes"):
        relaxspec.generate([1], t5_path=str(t5), model=(target, vq, None), method="ar")
    with pytest.raises(RelaxspecError, match="needs --t5-path DIR / t5_path"):
        relaxspec.generate(prompts=["a cat"], model=(target, vq, None), method="ar")


def test_info_recognises_a_t5_folder(t5, tmp_path, capsys):
    assert main(["info", str(t5)]) == 0
    out = capsys.readouterr().out
    assert "model_type:            t5" in out and "--t5-path" in out and "model.safetensors" in out
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llava"}')
    assert main(["info", str(other)]) == 0 and "not supported" in capsys.readouterr().out


def test_bench_and_eval_take_prompts(t5, tiny_ckpts, tmp_path, capsys, monkeypatch):
    """A LlamaGen t2i checkpoint is benchmarked and evaluated on prompts encoded with --t5-path:
    the AR bench images are ``generate``'s, and eval's shards together hold every prompt
    ``--images-per-class`` times, in order."""
    from relaxspec.bench.run import read_records

    t2i = tiny_ckpts["t2i"]["args"]
    prompts = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--t5-path", str(t5)]
    assert main(["bench", *t2i, *prompts, "--methods", "ar,sjd", "--warmup", "0", "--no-plots", "--no-progress",
                 "--out", str(tmp_path / "bench")]) == 0, capsys.readouterr().err
    records = read_records(tmp_path / "bench")
    assert [r["prompt"] for r in records if r["method"] == "ar"] == [PROMPTS[0], PROMPTS[2]]
    assert main(["generate", *t2i, *prompts, "--no-progress", "--out", str(tmp_path / "gen")]) == 0
    ar = [r["tokens"] for r in sorted(records, key=lambda r: r["index"]) if r["method"] == "ar"]
    assert np.array_equal(np.load(tmp_path / "gen" / "tokens.npy"), np.array(ar))
    # What each run records of the text encoder, as before the family inputs were declared (so
    # folders written then still resume): generate keeps its file identity, bench's identity does not.
    generated = json.loads((tmp_path / "gen" / "stats.json").read_text())["settings"]
    assert "t5_path" in generated["files"] and generated["t5_path"] == str(t5.resolve())
    benched = json.loads((tmp_path / "bench" / "settings.json").read_text())["settings"]["models"]
    assert set(benched["files"]) == {"gpt_ckpt", "vq_ckpt"} and benched["t5_path"] == str(t5.resolve())

    for rank in ("0", "1"):  # two torchrun ranks, one after the other
        for name, value in (("RANK", rank), ("WORLD_SIZE", "2"), ("LOCAL_RANK", rank)):
            monkeypatch.setenv(name, value)
        assert main(["eval", "--images-per-class", "2", "--", *t2i, *prompts, "--no-progress", "--out",
                     str(tmp_path / "eval")]) == 0, capsys.readouterr().err
    shards = sorted((tmp_path / "eval").glob("shard-*"))
    seen = [image["prompt"] for shard in shards for image in json.loads((shard / "stats.json").read_text())["images"]]
    assert seen == [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[2]]


def test_train_drafter_on_a_t2i_checkpoint_with_prompts(t5, tiny_ckpts, tmp_path, capsys):
    """``train-drafter --gpt-ckpt T2I --t5-path DIR --prompts-file F`` trains on the model's own
    samples of the prompts (features through the decoding interface, with the caption mask); the
    drafter serves ``generate``, losslessly at temperature 0."""
    t2i = tiny_ckpts["t2i"]["args"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n{PROMPTS[2]}\n")
    drafter = tmp_path / "drafter"
    ckpt = tiny_ckpts["t2i"]
    train = ["--gpt-ckpt", ckpt["gpt"], "--gpt-model", ckpt["gpt_json"], "--image-size", "16", "--downsample", "4"]
    assert main(["train-drafter", *train, "--t5-path", str(t5), "--prompts-file", str(prompts), "--self-samples", "4",
                 "--batch-size", "2", "--steps", "2", "--out", str(drafter), "--no-progress"]) == 0, \
        capsys.readouterr().err
    base = ["generate", *t2i, "--prompt", PROMPTS[0], "--prompt", PROMPTS[2], "--t5-path", str(t5), "--temperature",
            "0", "--batch-size", "2", "--no-progress"]
    assert main(base + ["--method", "ar", "--out", str(tmp_path / "ar")]) == 0
    assert main(base + ["--method", "eagle2", "--drafter-ckpt", str(drafter), "--out", str(tmp_path / "e")]) == 0
    assert np.array_equal(np.load(tmp_path / "e" / "tokens.npy"), np.load(tmp_path / "ar" / "tokens.npy"))


def test_teacher_forced_t2i_features_are_the_decoding_ones(t5, tiny_ckpts):
    """With a caption mask, train-drafter's features come through the decoding interface: CFG on
    them picks each greedy token of a LlamaGen t2i model (masked captions, as decoding masks them)."""
    from relaxspec import methods
    from relaxspec.decoding import decode
    from relaxspec.models.llamagen.checkpoints import load_gpt
    from relaxspec.sampling import SamplingConfig
    from relaxspec.training.drafter import target_features

    ckpt = tiny_ckpts["t2i"]
    target = load_gpt(ckpt["gpt"], ckpt["gpt_json"], image_size=16, downsample=4)
    features, mask, _ = encode_prompts(PROMPTS, t5, max_length=target.config.cls_token_num)
    scale = 4.0
    tokens = decode(target, features, SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0), methods.resolve("ar"),
                    cond_mask=mask).tokens
    hidden, logits = target_features(target, tokens, features, null_rows=3, cond_mask=mask)
    guided = logits[3:] + scale * (logits[:3] - logits[3:])
    assert torch.equal(guided.argmax(-1), tokens)


def test_a_coco_captions_file_is_a_prompts_file_for_every_command(t5, tiny_ckpts, tmp_path, capsys):
    """``--prompts-file captions_val2017.json`` (MS-COCO's annotations) gives each image's first
    caption, images by id, wherever a prompts file is read (issue 29): generate's tokens equal
    those of the same captions given one per line."""
    coco = {"images": [{"id": 9}, {"id": 2}], "annotations": [
        {"image_id": 9, "id": 1, "caption": "the big blue dog ."}, {"image_id": 2, "id": 2, "caption": "a cat"},
        {"image_id": 9, "id": 3, "caption": "a second caption of image 9"}]}
    (tmp_path / "captions.json").write_text(json.dumps(coco))
    (tmp_path / "captions.txt").write_text("a cat\nthe big blue dog .\n")
    args = ["generate", *tiny_ckpts["t2i"]["args"], "--t5-path", str(t5), "--no-progress", "--batch-size", "2"]
    for name in ("json", "txt"):
        assert main([*args, "--prompts-file", str(tmp_path / f"captions.{name}"), "--out", str(tmp_path / name)]) == 0
    assert np.array_equal(np.load(tmp_path / "json" / "tokens.npy"), np.load(tmp_path / "txt" / "tokens.npy"))
    stats = json.loads((tmp_path / "json" / "stats.json").read_text())
    assert stats["settings"]["prompts"] == ["a cat", "the big blue dog ."]
