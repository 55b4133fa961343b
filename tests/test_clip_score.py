"""CLIP score (``relaxspec eval --clip-path``) on a tiny random CLIP folder built here, and COCO
captions read as prompts: the score is torchmetrics' (each image against its own prompt, through
transformers' CLIPModel), eval writes it with its interval, and every bad input is one line before
anything is generated."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaxspec.cli import main
from relaxspec.errors import RelaxspecError

transformers = pytest.importorskip("transformers", reason="CLIP scores need transformers (pip install -e '.[test]')")

from helpers.clip import write_clip  # noqa: E402
from helpers.t5 import make_t5  # noqa: E402

from relaxspec.evaluation.clip import clip_score, clip_scores, load_clip  # noqa: E402
from relaxspec.files import read_captions_json  # noqa: E402

#: Words of helpers/t5.py's T5 vocabulary, so the t2i model encodes them too.
PROMPTS = ["a red cat", "the big blue dog", "a small green heart", "a cat on a dog"]


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory) -> Path:
    return write_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    """PNGs of several sizes (resize and centre crop both act), smooth enough to differ in CLIP."""
    from relaxspec.files import write_png

    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    files = []
    for n, (h, w) in enumerate([(16, 16), (40, 24), (32, 48), (16, 16), (24, 24)]):
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        files.append(folder / f"{n}.png")
        write_png(files[-1], pixels)
    return files


def reference_scores(folder: Path, files: list[Path], prompts: list[str], definition: str = "torchmetrics") -> np.ndarray:
    """Each image against its prompt, straight through transformers: the processor, the tokenizer
    truncating to 77 tokens, get_image_features / get_text_features; then torchmetrics' 100 *
    max(cos, 0), or official LANTERN's raw cos against 'A photo depicts ' + prompt."""
    from PIL import Image
    from transformers import AutoTokenizer, CLIPModel

    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor
    model = CLIPModel.from_pretrained(folder, use_safetensors=True).eval()
    tokenizer, processor = AutoTokenizer.from_pretrained(folder), ImageProcessor.from_pretrained(folder)

    def projected(out):
        return out if isinstance(out, torch.Tensor) else out.pooler_output

    scores = []
    with torch.no_grad():
        for file, prompt in zip(files, prompts, strict=True):
            pixels = processor(images=Image.open(file).convert("RGB"), return_tensors="pt")["pixel_values"]
            text = ("A photo depicts " + prompt) if definition == "lantern" else prompt
            tokens = tokenizer([text], truncation=True, max_length=77, return_tensors="pt")
            image = projected(model.get_image_features(pixel_values=pixels))
            text = projected(model.get_text_features(**tokens))
            cosine = torch.nn.functional.cosine_similarity(image, text).item()
            scores.append(cosine if definition == "lantern" else 100 * max(cosine, 0.0))
    return np.array(scores)


# ------------------------------------------------------------------------------- the score itself
def test_clip_score_is_transformers_clip_on_each_image_and_its_prompt(clip_folder, images):
    """(a) Per image and mean, to 1e-4 on the 0-100 scale (1e-6 on the cosine: float32 sums differ
    with the batch's padding), including a prompt past 77 tokens (truncated, end-of-text
    kept) and batches that split the images."""
    long_prompt = " ".join(["red cat"] * 60)  # 120 words: past the 77-token context
    prompts = [PROMPTS[0], PROMPTS[1], long_prompt, PROMPTS[0], PROMPTS[3]]
    clip = load_clip(clip_folder)
    assert clip.max_length == 77
    assert len(clip.tokenizer(long_prompt)["input_ids"]) > 77
    ours = clip_scores(clip, images, prompts, batch_size=2, definition="torchmetrics")
    want = reference_scores(clip_folder, images, prompts)
    np.testing.assert_allclose(ours, want, rtol=0, atol=1e-4)
    assert (ours > 0).all()
    entry = clip_score(images, prompts, clip_folder, n_boot=200, definition="torchmetrics")
    assert entry["value"] == pytest.approx(want.mean(), abs=1e-4)
    assert entry["lo"] <= entry["value"] <= entry["hi"] and entry["images"] == 5
    assert entry["model"] == str(clip_folder.resolve())
    with torch.no_grad():
        clip.model.text_projection.weight.neg_()  # every cosine negative: each score is 0, never below
    assert (clip_scores(clip, images, prompts, definition="torchmetrics") == 0).all()


def test_the_default_clip_score_is_official_lanterns(clip_folder, images):
    """LANTERN and LANTERN++ report official LANTERN's eval_fid_clip: the raw cosine (no factor 100,
    no clamp) of each image with 'A photo depicts ' + its prompt. That is the default; it is not
    torchmetrics' number."""
    prompts = [PROMPTS[i % 4] for i in range(5)]
    clip = load_clip(clip_folder)
    ours = clip_scores(clip, images, prompts)
    np.testing.assert_allclose(ours, reference_scores(clip_folder, images, prompts, "lantern"), rtol=0, atol=1e-6)
    assert not np.allclose(ours * 100, clip_scores(clip, images, prompts, definition="torchmetrics"), atol=1e-3)
    entry = clip_score(images, prompts, clip_folder, n_boot=50)
    assert entry["definition"] == "lantern" and "A photo depicts" in entry["formula"]
    with pytest.raises(RelaxspecError, match="definition must be one of lantern, torchmetrics"):
        clip_scores(clip, images, prompts, definition="hessel")


def test_each_image_is_scored_against_its_own_prompt(clip_folder, images):
    """(b) The pairing is per image: a shuffled prompt list changes the scores, and every score is
    the one of that image alone with that prompt."""
    clip = load_clip(clip_folder)
    prompts = [PROMPTS[i % 4] for i in range(5)]
    shuffled = [prompts[i] for i in (1, 2, 3, 4, 0)]
    paired, other = clip_scores(clip, images, prompts), clip_scores(clip, images, shuffled)
    assert not np.allclose(paired, other)
    for i in range(5):
        assert clip_scores(clip, images[i:i + 1], shuffled[i:i + 1])[0] == pytest.approx(other[i], abs=1e-4)
    with pytest.raises(RelaxspecError, match="5 images but 4 prompts"):
        clip_scores(clip, images, prompts[:4])


# ------------------------------------------------------------------------------ COCO captions
COCO = {"info": {}, "images": [{"id": 30}, {"id": 4}, {"id": 12}],
        "annotations": [{"image_id": 30, "id": 1, "caption": "a red cat"},
                        {"image_id": 4, "id": 2, "caption": "the big blue dog"},
                        {"image_id": 30, "id": 3, "caption": "a cat on a dog"},
                        {"image_id": 12, "id": 4, "caption": "a small green heart"},
                        {"image_id": 4, "id": 5, "caption": "a dog"}]}


def test_coco_captions_are_read_one_per_image_in_id_order(tmp_path):
    """(e) The first caption of each image in file order, images by id; LANTERN's plain list and
    an object of captions as written; anything else one line."""
    path = tmp_path / "captions_val2017.json"
    path.write_text(json.dumps(COCO))
    assert read_captions_json(path) == ["the big blue dog", "a small green heart", "a red cat"]
    listed = tmp_path / "captions_val2017_longest.json"
    listed.write_text(json.dumps(["a red cat", "a dog"]))
    assert read_captions_json(listed) == ["a red cat", "a dog"]
    keyed = tmp_path / "keyed.json"
    keyed.write_text(json.dumps({"9": "a dog", "1": "a cat"}))
    assert read_captions_json(keyed) == ["a dog", "a cat"]
    for bad, message in ((42, "not a captions file"), ({"annotations": [{"image_id": 1}]}, "annotation 0 has no"),
                         ({"annotations": []}, "'annotations' is not a non-empty list"), ([1, 2], "entry 0 is not text"),
                         (["a cat", " "], "entry 1 is empty"), ([], "no captions"),
                         ({"annotations": [{"image_id": 1, "caption": "a"}, {"image_id": "2", "caption": "b"}]},
                          "mix integers and strings")):
        path.write_text(json.dumps(bad))
        with pytest.raises(RelaxspecError, match=message):
            read_captions_json(path)
    path.write_text("{not json")
    with pytest.raises(RelaxspecError, match="not JSON"):
        read_captions_json(path)


# ------------------------------------------------------------------------------ relaxspec eval
@pytest.fixture(scope="module")
def t5(tmp_path_factory, tiny_ckpts) -> Path:
    return make_t5(tmp_path_factory.mktemp("t5"), d_model=tiny_ckpts["t2i"]["config"]["caption_dim"])


def test_eval_scores_coco_prompts_with_clip(clip_folder, t5, tiny_ckpts, tmp_path, capsys):
    """(c) eval on a tiny LlamaGen t2i with COCO captions as prompts (first 2 images by id, 2
    images each): eval.json's clip entry is the score of every image against its own caption, the
    summary line shows it with its interval, and --scores-only recomputes it."""
    coco = tmp_path / "captions_val2017.json"
    coco.write_text(json.dumps(COCO))
    out = tmp_path / "eval"
    generate = [*tiny_ckpts["t2i"]["args"], "--prompts-file", str(coco), "--t5-path", str(t5), "--no-progress",
                "--out", str(out)]
    argv = ["eval", "--images-per-class", "2", "--num-prompts", "2", "--clip-path", str(clip_folder), "--clip-score",
            "torchmetrics", "--", *generate]
    assert main(argv) == 0, capsys.readouterr().err
    line = capsys.readouterr().out.strip().splitlines()[-1]
    stats = json.loads((out / "shard-00-of-01" / "stats.json").read_text())
    prompts = [image["prompt"] for image in stats["images"]]
    assert prompts == ["the big blue dog"] * 2 + ["a small green heart"] * 2
    clip = json.loads((out / "eval.json").read_text())["clip"]
    files = [out / "shard-00-of-01" / image["file"] for image in stats["images"]]
    want = reference_scores(clip_folder, files, prompts)
    assert clip["value"] == pytest.approx(want.mean(), abs=1e-4) and clip["images"] == 4
    assert clip["lo"] <= clip["value"] <= clip["hi"] and clip["model"] == str(clip_folder.resolve())
    assert f"CLIP score (torchmetrics) {clip['value']:.2f} [{clip['lo']:.2f}, {clip['hi']:.2f}]" in line
    assert main(["eval", "--scores-only", *argv[1:]]) == 0, capsys.readouterr().err
    assert json.loads((out / "eval.json").read_text())["clip"]["value"] == pytest.approx(clip["value"], abs=1e-9)


def _folder_with(tmp_path: Path, clip_folder: Path, name: str, drop=(), config=None, pickled=False) -> Path:
    """A copy of the CLIP folder without ``drop``, with another config or pickled weights only."""
    import shutil

    folder = tmp_path / name
    shutil.copytree(clip_folder, folder)
    for item in drop:
        (folder / item).unlink(missing_ok=True)
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if pickled:
        for weights in folder.glob("*.safetensors"):
            weights.unlink()
        (folder / "pytorch_model.bin").write_bytes(b"never read")
    return folder


def test_bad_clip_inputs_are_one_line_before_anything_is_generated(clip_folder, t5, tiny_ckpts, tmp_path, capsys):
    """(d) Not a folder, no config.json, a non-CLIP config, pickled weights only, no tokenizer, a
    class-conditional run, caption features, a malformed COCO file: exit 2, one line, no shard."""
    t2i = [*tiny_ckpts["t2i"]["args"], "--prompt", PROMPTS[0], "--t5-path", str(t5), "--no-progress"]
    c2i = [*tiny_ckpts["c2i"]["args"], "--classes", "1", "--no-progress"]
    features = tmp_path / "captions.npy"
    np.save(features, np.zeros((1, 6, 32), dtype=np.float32))
    t2i_features = [*tiny_ckpts["t2i"]["args"], "--caption-features", str(features), "--no-progress"]
    malformed = tmp_path / "captions.json"
    malformed.write_text(json.dumps({"annotations": [{"id": 1, "caption": "a cat"}]}))
    cases = [
        (tmp_path / "nowhere", t2i, "not a folder"),
        (_folder_with(tmp_path, clip_folder, "noconfig", drop=["config.json"]), t2i, "no config.json"),
        (_folder_with(tmp_path, clip_folder, "t5config", config={"model_type": "t5"}), t2i,
         "model_type is 't5', not 'clip'"),
        (_folder_with(tmp_path, clip_folder, "pickled", pickled=True), t2i, "holds only pytorch_model.bin"),
        (_folder_with(tmp_path, clip_folder, "notokenizer", drop=["tokenizer.json", "vocab.json", "merges.txt"]), t2i,
         "no tokenizer"),
        (clip_folder, c2i, "--clip-path scores each image against its prompt: this run has none"),
        (clip_folder, t2i_features, "this run has none"),
        (clip_folder, [*tiny_ckpts["t2i"]["args"], "--prompts-file", str(malformed), "--t5-path", str(t5)],
         "annotation 0 has no 'image_id' and 'caption'"),
    ]
    for n, (folder, generate, message) in enumerate(cases):
        out = tmp_path / f"out{n}"
        assert main(["eval", "--clip-path", str(folder), "--", *generate, "--out", str(out)]) == 2, message
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
        assert not out.exists(), message  # refused before any shard was written


def test_the_per_method_table_reads_finished_eval_folders(tmp_path, capsys):
    """``relaxspec eval --table OUT ...``: a row per method with its intervals, as the papers' tables
    list FID and CLIP score per method; a folder without eval.json is one line."""
    runs = {"ar": {"method": "ar"}, "lantern": {"method": "lantern", "k": 1000, "delta": 0.1}}
    for name, method in runs.items():
        shard = tmp_path / name / "shard-00-of-01"
        shard.mkdir(parents=True)
        (shard / "stats.json").write_text(json.dumps({"settings": {"method": method}, "images": []}))
        clip = {"value": 31.25 if name == "ar" else 30.5, "lo": 30.0, "hi": 32.5, "images": 4}
        (tmp_path / name / "eval.json").write_text(json.dumps({"images": 4, "fid": {"value": 12.345}, "clip": clip}))
    assert main(["eval", "--table", str(tmp_path / "ar"), str(tmp_path / "lantern")]) == 0
    out = capsys.readouterr().out
    assert "| `method=ar` | 4 | 12.35 | 31.25 [30.00, 32.50] | – |" in out
    assert "| `method=lantern k=1000 delta=0.1` | 4 | 12.35 | 30.50 [30.00, 32.50] | – |" in out
    assert (tmp_path / "eval-table.md").read_text() == out
    assert main(["eval", "--table", str(tmp_path / "nowhere")]) == 2
    assert "no eval.json" in capsys.readouterr().err


def test_eval_res_crops_and_resizes_as_lanterns_evaluation(clip_folder, images, tmp_path, monkeypatch):
    """``--eval-res PX``: the centre square of the long edge, LANCZOS to PX, for FID (handed to
    clean-fid as its custom transform, both sets) and for CLIP (before the processor)."""
    import sys
    import types

    from PIL import Image

    from relaxspec.cli.eval import clean_fid, crop_resize

    wide = np.zeros((20, 40, 3), dtype=np.uint8)
    wide[:, 10:30] = 255  # the centre square is white, the sides black
    out = crop_resize(16)(wide)
    assert out.shape == (16, 16, 3) and out.min() == 255
    # CLIP: scoring with the transform is scoring the transformed images
    clip = load_clip(clip_folder)
    prompts = [PROMPTS[i % 4] for i in range(5)]
    squeezed = []
    for n, path in enumerate(images):
        target = tmp_path / f"{n}.png"
        Image.fromarray(crop_resize(24)(np.asarray(Image.open(path).convert("RGB")))).save(target)
        squeezed.append(target)
    np.testing.assert_allclose(clip_scores(clip, images, prompts, transform=crop_resize(24)),
                               clip_scores(clip, squeezed, prompts), rtol=0, atol=1e-6)
    # FID: clean-fid is handed the same transform for both sets (a recording stand-in here)
    seen = []
    fid_module = types.SimpleNamespace(
        get_files_features=lambda files, model, **kw: seen.append(kw) or np.zeros((len(files), 2)),
        get_folder_features=lambda folder, model, **kw: seen.append(kw) or np.ones((3, 2)),
        fid_from_feats=lambda a, b: 1.0)
    package = types.ModuleType("cleanfid")
    package.fid, package.features = fid_module, types.SimpleNamespace(build_feature_extractor=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "cleanfid", package)
    monkeypatch.setitem(sys.modules, "cleanfid.fid", fid_module)
    monkeypatch.setitem(sys.modules, "cleanfid.features", package.features)
    assert clean_fid([Path(p) for p in images], str(tmp_path), progress=False, eval_res=16) == 1.0
    assert len(seen) == 2 and all(kw["custom_image_tranform"](wide).shape == (16, 16, 3) for kw in seen)
