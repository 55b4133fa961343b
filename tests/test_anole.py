"""Anole (relaxspec.models.anole, relaxspec.pipelines.anole) on a tiny folder in the layout of
``leloy/Anole-7b-v0.1-hf`` (tests/helpers/anole.py): the language model, the VQ model with its
decoder and the tokenizer files in one transformers folder, the real 65,536-id vocabulary layout.

Greedy AR equals the official LANTERN generation's tokens (tests/data/anole/golden.json, made by
running LANTERN's own ``generate`` on this very folder: make_golden.py there says how and what was
patched), its prompt ids are the official ones, and its pixels the official decoder's; a batch of
left-padded prompts gives each prompt's tokens alone; every lossless method (exact SD with a
drafter of the family's layers, SJD, ...) equals greedy AR and the relaxed ones paint whole
images; the commands take the folder; bad folders are one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from relaxspec import methods
from relaxspec.decoding import decode
from relaxspec.errors import RelaxspecError
from relaxspec.models.base import ImageTokenizer, TargetModel
from relaxspec.sampling import SamplingConfig

pytest.importorskip("transformers", reason="Anole needs transformers (pip install -e '.[test]')")

from helpers import anole as af  # noqa: E402
from relaxspec.models import anole  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "anole"


@pytest.fixture(scope="module")
def golden():
    runs = json.loads((GOLDEN / "golden.json").read_text())
    with np.load(GOLDEN / "golden.npz") as arrays:
        runs["pixels"] = {key: arrays[key] for key in arrays.files}
    return runs


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return af.anole_folder(tmp_path_factory.mktemp("anole"))


@pytest.fixture(scope="module")
def opened(files):
    return anole.open_folder(files["model_path"], af.PROMPTS)


def greedy(scale: float = 3.0) -> SamplingConfig:
    return SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0, top_p=1.0)


# ---------------------------------------------------------------- the official generation
def test_the_folder_is_the_one_the_golden_data_were_made_from(files, golden):
    assert af.fingerprint(files["state"]) == golden["fingerprint"]
    assert golden["made_with"]["lantern"].startswith("jadohu/LANTERN ")


@pytest.mark.parametrize("run", ["prompt0", "prompt1", "prompt2", "prompt0_cfg1"])
def test_greedy_ar_is_the_official_generation(files, golden, run):
    """Each prompt alone, as generate_images.py runs it: the condition is the ids LANTERN's
    generate fed its first forward (the unconditional row's pads, id 1 there, are -1 here), and
    greedy AR's codes + 4 are the ids it generated."""
    official = golden["runs"][run]
    opened = anole.open_folder(files["model_path"], official["prompts"])
    cond, uncond = official["first_call"]["input_ids"]
    assert opened.cond[0, 0].tolist() == cond
    assert opened.cond[0, 1].tolist() == [-1 if token == af.PAD_ID else token for token in uncond]
    tokens = decode(opened.target, opened.cond, greedy(official["cfg"]), methods.resolve("ar")).tokens
    assert (tokens + af.FIRST_IMAGE_ID).tolist() == official["tokens"]


def test_the_official_positions(opened, golden):
    """LANTERN's positions: the prompt at 0..L-1 and image token i at L + i; the unconditional
    context's <s> and <racm3:break> at 0 and 1, image token i at 2 + i (its masked pads sit at 0
    there; relaxspec's are masked and never read). Here the prompt is left-padded to the batch's
    length, which the positions skip."""
    official = golden["runs"]["prompt2"]
    target, slots = opened.target, opened.cond.shape[2]
    cond, _ = opened.format(official["prompts"])
    target._pad = (torch.cat([cond, target.null_condition(cond)])[:, 0] < 0).sum(-1)  # what prefill sets
    ours = target._real_positions(torch.arange(slots + 1).expand(2, -1))
    first = official["first_call"]["position_ids"]
    length = len(first[0])
    assert ours[0, slots - length:slots].tolist() == first[0]
    assert ours[1, slots - 2:slots].tolist() == first[1][-2:]
    assert ours[:, slots].tolist() == [p[0] for p in official["second_call_positions"]]


def test_pixels_are_the_official_decoders(opened, golden):
    """The codes decoded by the folder's own VQ decoder (model.vqmodel.*) and converted with the
    official truncation equal what LANTERN's VQGAN (read from Meta's files) painted, within one
    level of rounding, at the stored pixels."""
    stride = golden["pixel_stride"]
    for run in ("prompt0", "prompt1", "prompt2"):
        tokens = torch.tensor(golden["runs"][run]["tokens"]) - af.FIRST_IMAGE_ID
        pixels = anole.to_uint8(opened.tokenizer.decode(tokens)).numpy()[0]
        assert list(pixels.shape) == golden["runs"][run]["image_shape"]
        theirs = golden["pixels"][f"pixels_{run}"]
        assert np.abs(pixels[::stride, ::stride].astype(int) - theirs).max() <= 1, run


def test_a_left_padded_batch_gives_each_prompts_tokens(opened, golden):
    """Three prompts of different lengths in one batch: padding is masked and positions skip it,
    so each row is its prompt's official tokens (LANTERN's generate takes one prompt at a time)."""
    tokens = decode(opened.target, opened.cond, greedy(), methods.resolve("ar")).tokens
    official = [golden["runs"][f"prompt{i}"]["tokens"][0] for i in range(3)]
    assert (tokens + af.FIRST_IMAGE_ID).tolist() == official


# ---------------------------------------------------------------- the adapter
def test_the_adapter_implements_the_protocols(files, opened):
    from relaxspec.pipelines.open import folder_pipeline_class, model_module

    target, tokenizer = opened.target, opened.tokenizer
    assert isinstance(target, TargetModel) and isinstance(tokenizer, ImageTokenizer)
    assert model_module(files["model_path"]) is anole and folder_pipeline_class(files["model_path"]).family == "Anole"
    assert (target.config.block_size, target.config.grid_size, target.config.vocab_size) == (64, 8, af.CODES)
    assert (tokenizer.config.codebook_size, tokenizer.config.downsample_factor) == (af.CODES, 16)
    assert torch.equal(target.code_ids, torch.arange(af.CODES) + af.FIRST_IMAGE_ID)  # the official 4..8195
    assert target.hf.model.vqmodel is None  # the language model runs without the VQ model
    assert torch.equal(tokenizer.raw_codebook, files["state"]["model.vqmodel.quantize.embedding.weight"])
    assert opened.image_size == af.IMAGE_SIZE and opened.record == {"prompts": af.PROMPTS,
                                                                    "prompt_tokens": opened.cond.shape[2]}
    assert anole.sampling_defaults(files["model_path"]) == {"cfg_scale": 3.0, "temperature": 0.7, "top_k": 0,
                                                            "top_p": 0.9}


@pytest.mark.slow  # whole commands on the tiny models (the full suite runs it)
def test_every_method(opened, tmp_path, monkeypatch):
    """Drafter-free methods and exact SD (chain, static tree, EAGLE-2's dynamic tree) and LANTERN at
    delta 0 with a random drafter of Chameleon's own layer give greedy AR's tokens; the relaxed
    methods, sampled, paint whole images on the family's codebook."""
    from relaxspec.drafting.eagle import EagleDrafter

    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path))
    target, cond, tokenizer = opened.target, opened.cond[:1], opened.tokenizer
    ar = decode(target, cond, greedy(), methods.resolve("ar")).tokens
    torch.manual_seed(1)
    drafter = EagleDrafter.for_target(target)
    assert drafter.config.family == "chameleon"
    lossless = [("sjd", {"window": 4}), ("scd", {"window": 3}), ("gsd", {"window": 6, "group_p_gap": 0.0}),
                ("sjd-pac", {"window": 16}),
                ("sd", {"draft": "chain", "depth": 3}), ("sd-static", {"tree": "eagle25"}), ("eagle2", {}),
                ("lantern", {"draft": "chain", "delta": 0.0, "k": 8})]
    for name, given in lossless:
        result = decode(target, cond, greedy(), methods.resolve(name, given), drafter=drafter, vq=tokenizer)
        assert torch.equal(result.tokens, ar), name
    sampling = SamplingConfig(cfg_scale=3.0, temperature=0.7, top_p=0.9)
    relaxed = [("gsd", {"window": 4}), ("lantern", {"draft": "chain", "k": 8, "delta": 0.3}),
               ("lantern++", {"tree": "chain4", "k": 8}), ("cool", {"draft": "chain"})]
    for name, given in relaxed:
        sampled = decode(target, cond, sampling, methods.resolve(name, given), drafter=drafter, vq=tokenizer,
                         generator=torch.Generator().manual_seed(0))
        assert [sum(a) for a in sampled.accept_lengths] == [64], name


def test_speculative_steps_sync_once(opened):
    """The adapter's position and mask arithmetic adds no host sync: none per AR step, at most
    the engine's one per Jacobi step, and no host->device copy."""
    from relaxspec.bench.counting import StepCounter

    for name, given, budget in (("ar", {}, 0), ("sjd", {"window": 4}, 1)):
        with StepCounter(opened.target.hf.model.layers[0]) as counter:
            decode(opened.target, opened.cond[:1], SamplingConfig(cfg_scale=3.0), methods.resolve(name, given),
                   generator=torch.Generator().manual_seed(0))
        assert len(counter.steps) >= 2
        assert all(w.syncs <= budget and w.host_copies == 0 for w in counter.steps), name


# ---------------------------------------------------------------- commands
@pytest.mark.slow  # whole commands on the tiny models (the full suite runs it)
def test_generate_bench_and_train_drafter_take_the_folder(files, tmp_path, capsys):
    """``generate`` (no --tokenizer-path) writes the official pixels of its codes; ``bench`` runs
    drafter-free methods; ``train-drafter --model-path`` writes a drafter that exact SD decodes
    greedy AR's tokens with."""
    from PIL import Image

    from relaxspec.cli import main

    model = ["--model-path", str(files["model_path"])]
    prompts = ["--prompt", af.PROMPTS[0], "--prompt", af.PROMPTS[2]]
    code = main(["generate", *model, *prompts, "--temperature", "0", "--method", "ar", "--batch-size", "2",
                 "--no-progress", "--out", str(tmp_path / "ar")])
    assert code == 0, capsys.readouterr().err
    tokens = np.load(tmp_path / "ar" / "tokens.npy")
    settings = json.loads((tmp_path / "ar" / "stats.json").read_text())["settings"]
    assert settings["model_type"] == "chameleon" and settings["sampling"]["top_p"] == 0.9
    opened = anole.open_folder(files["model_path"], [af.PROMPTS[2]])
    pixels = anole.to_uint8(opened.tokenizer.decode(torch.from_numpy(tokens))).numpy()[1]
    assert np.array_equal(np.asarray(Image.open(tmp_path / "ar" / "0001.png")), pixels)

    code = main(["bench", *model, "--prompt", af.PROMPTS[0], "--num-images", "2", "--methods", "ar,sjd",
                 "--no-plots", "--no-progress", "--warmup", "0", "--out", str(tmp_path / "bench")])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert {row["label"] for row in summary["methods"]} == {"ar", "sjd"}

    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(af.PROMPTS) + "\n")
    drafter = tmp_path / "drafter"
    code = main(["train-drafter", *model, "--prompts-file", str(prompts_file), "--self-samples", "2", "--steps", "2",
                 "--batch-size", "2", "--no-progress", "--out", str(drafter)])
    assert code == 0, capsys.readouterr().err
    code = main(["generate", *model, *prompts, "--temperature", "0", "--method", "sd", "--drafter-ckpt",
                 str(drafter), "--batch-size", "2", "--no-progress", "--out", str(tmp_path / "sd")])
    assert code == 0, capsys.readouterr().err
    assert np.array_equal(np.load(tmp_path / "sd" / "tokens.npy"), tokens)


def test_the_demo_opens_the_folder(files, tmp_path):
    import threading

    from relaxspec.cli import build_parser
    from relaxspec.cli.demo import load_demo_model
    from relaxspec.demo.app import race_handler

    model = load_demo_model(build_parser().parse_args(["demo", "--model-path", str(files["model_path"]),
                                                       "--prompt", af.PROMPTS[0]]))
    assert model.pipeline.family == "Anole"
    updates = list(race_handler(model, tmp_path, [], threading.Lock(), af.PROMPTS[1], "sjd", None, 0, None))
    assert updates[-1][-1].startswith("done: sjd"), updates[-1][-1]


# ---------------------------------------------------------------- bad folders
def _copy(files, tmp_path, name: str) -> Path:
    import shutil

    return Path(shutil.copytree(files["model_path"], tmp_path / name))


def test_bad_folders_are_one_line(files, tmp_path, refused):
    def generate(folder, *extra, message):
        refused(["generate", "--model-path", str(folder), "--prompt", "a fox", *extra, "--out", str(tmp_path / "o")],
                message)

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llava"}')
    generate(other, message="chameleon (Anole or Lumina-mGPT)")

    no_tokenizer = _copy(files, tmp_path, "no-tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    generate(no_tokenizer, message="no tokenizer.json")

    # Without the VQ decoder the folder is Lumina-mGPT's (as transformers' own converter writes
    # Chameleon): the message says what either needs.
    no_decoder = _copy(files, tmp_path, "no-decoder")
    index = json.loads((no_decoder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(anole.DECODER_PREFIX)}
    (no_decoder / "model.safetensors.index.json").write_text(json.dumps(index))
    generate(no_decoder, message="when its weights hold the VQ decoder, model.vqmodel.decoder.*")
    with pytest.raises(RelaxspecError, match="no VQ decoder weights"):
        anole.load_vq(_strip_decoder(files, tmp_path), anole.read_anole_config(files["model_path"])[1])

    generate(files["model_path"], "--image-size", "512", message="an Anole image is 128 pixels")
    generate(files["model_path"], "--tokenizer-path", str(tmp_path), message="--tokenizer-path goes with --model-path (Lumina-mGPT); this model is Anole")
    generate(files["model_path"], "--negative-prompt", "blurry", message="--negative-prompt goes with --model-path (Emu3); this model is Anole")

    shuffled = _copy(files, tmp_path, "shuffled")
    config = json.loads((shuffled / "config.json").read_text())
    config["vocabulary_map"]["IMGIMGAZ"], config["vocabulary_map"]["IMGIMGBZ"] = 5, 4
    (shuffled / "config.json").write_text(json.dumps(config))
    generate(shuffled, message="not those of config.json's vocabulary_map")

    vq = _copy(files, tmp_path, "vq")
    config = json.loads((vq / "config.json").read_text())
    config["vq_config"]["latent_channels"] = 16
    (vq / "config.json").write_text(json.dumps(config))
    generate(vq, message="config.json's vq_config makes it (64, 16, 3, 3)")


def _strip_decoder(files, tmp_path) -> Path:
    """A copy whose safetensors hold no decoder tensors at all."""
    from safetensors.torch import save_file

    folder = tmp_path / "stripped"
    folder.mkdir()
    (folder / "config.json").write_text((files["model_path"] / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in files["state"].items() if not k.startswith(anole.DECODER_PREFIX)},
              str(folder / "model.safetensors"))
    return folder


def test_a_folder_as_save_pretrained_writes_it_reads_transformers_defaults(files, golden, tmp_path):
    """(issue 43) ``save_pretrained`` leaves out every ``vq_config`` field equal to transformers'
    default (the tiny folder's 8192 codes among them; the real Anole-7b's are all defaults):
    relaxspec fills them in as transformers does, and the folder decodes the official tokens."""
    from transformers.models.chameleon.configuration_chameleon import ChameleonVQVAEConfig

    defaults = ChameleonVQVAEConfig().to_dict()
    assert {key: defaults[key] for key in anole.VQ_DEFAULTS} == anole.VQ_DEFAULTS
    folder = _copy(files, tmp_path, "saved")
    config = json.loads((folder / "config.json").read_text())
    config["vq_config"] = {k: v for k, v in config["vq_config"].items() if k not in defaults or defaults[k] != v}
    assert "num_embeddings" not in config["vq_config"] and "resolution" in config["vq_config"]
    (folder / "config.json").write_text(json.dumps(config))
    assert anole.read_anole_config(folder)[1] == anole.read_anole_config(files["model_path"])[1]
    official = golden["runs"]["prompt0"]
    opened = anole.open_folder(folder, official["prompts"])
    tokens = decode(opened.target, opened.cond, greedy(official["cfg"]), methods.resolve("ar")).tokens
    assert (tokens + af.FIRST_IMAGE_ID).tolist() == official["tokens"]
    del config["vq_config"]  # none at all: every field transformers' default (a 512-pixel, 8192-code VQ)
    assert anole.vq_config(config, folder).n_embed == 8192 and anole.vq_config(config, folder).resolution == 512
