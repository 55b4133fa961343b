"""Janus through transformers (relaxspec.models.janus): a tiny random JanusForConditionalGeneration
saved with save_pretrained and loaded back the way users load theirs; greedy AR equals
transformers' own image generation token for token (CFG, left-padded batches); the first step's
processed distribution equals transformers' logits processors'; every lossless method equals
greedy AR on it."""

from __future__ import annotations

import pytest
import torch

from relaxspec import methods
from relaxspec.decoding import decode
from relaxspec.decoding.target import GuidedTarget
from relaxspec.models.base import ImageTokenizer, TargetModel
from relaxspec.sampling import SamplingConfig

transformers = pytest.importorskip("transformers", reason="Janus needs transformers (pip install -e '.[test]')")

from helpers.janus import BOI, BOS, PAD, PROMPTS, WORDS, janus_folder_at, tiny_janus  # noqa: E402
@pytest.fixture(scope="module")
def janus(tmp_path_factory):
    from relaxspec.models.janus import load_janus

    folder = tmp_path_factory.mktemp("janus")
    tiny_janus().save_pretrained(folder)
    target, tokenizer = load_janus(folder, prompt_length=7)
    assert target.boi == BOI  # read from generation_config.json
    # transformers 5's loader drops generation_kwargs, which its own image generate reads.
    target.hf.generation_config.generation_kwargs = {"boi_token_id": BOI}
    return target, tokenizer


def transformers_greedy(target, ids, scale):
    mask = (ids != PAD).long()
    return target.hf.generate(ids, attention_mask=mask, generation_mode="image", do_sample=False,
                              guidance_scale=scale)


def test_the_adapter_implements_the_protocols(janus):
    target, tokenizer = janus
    assert isinstance(target, TargetModel) and isinstance(tokenizer, ImageTokenizer)
    assert (target.config.block_size, target.config.grid_size, target.config.vocab_size) == (16, 4, 48)
    pixels = tokenizer.decode(torch.zeros(1, 16, dtype=torch.long))
    assert pixels.shape == (1, 3, 8, 8) and float(pixels.abs().max()) <= 1.0


@pytest.mark.parametrize("rows", [[0], [1], [2], [0, 1, 2]], ids=["p0", "p1", "p2", "batch3"])
@pytest.mark.parametrize("scale", [5.0, 2.0])
def test_greedy_ar_equals_transformers_image_generation(janus, rows, scale):
    target, _ = janus
    ids = PROMPTS[rows]
    theirs = transformers_greedy(target, ids, scale)
    ours = decode(target, ids, SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0), methods.resolve("ar"),
                  cond_mask=ids != PAD)
    assert torch.equal(ours.tokens, theirs)


def test_greedy_paths_differ_between_prompts(janus):
    target, _ = janus
    tokens = transformers_greedy(target, PROMPTS, 5.0)
    assert len({tuple(row) for row in tokens.tolist()}) == 3


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8)])
def test_the_first_step_law_equals_transformers_processors(janus, temperature, top_k, top_p):
    from transformers import (ClassifierFreeGuidanceLogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper)

    target, _ = janus
    ids, scale = PROMPTS, 4.0
    mask = (ids != PAD).long()
    # transformers' image mode, step 0: the doubled batch, the language model, the generation head.
    doubled = ids.repeat(2, 1)
    keep = (doubled[3:] == BOS) | (doubled[3:] == BOI)
    doubled[3:] = torch.where(keep, doubled[3:], torch.full_like(doubled[3:], PAD))
    with torch.no_grad():
        hidden = target.hf.model.language_model(inputs_embeds=target.hf.get_input_embeddings()(doubled),
                                                attention_mask=mask.repeat(2, 1)).last_hidden_state[:, -1]
        scores = target.hf.model.generation_head(hidden)
    processors = LogitsProcessorList([ClassifierFreeGuidanceLogitsProcessor(scale), TemperatureLogitsWarper(temperature)]
                                     + ([TopKLogitsWarper(top_k)] if top_k else [])
                                     + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
    expected = torch.softmax(processors(ids, scores), dim=-1)  # as generate calls them: the conditional ids
    guided = GuidedTarget(target, ids, SamplingConfig(cfg_scale=scale, temperature=temperature, top_k=top_k, top_p=top_p),
                          cond_mask=ids != PAD)
    probs, _ = guided.prefill()
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)


def test_a_folder_without_safetensors_is_refused(tmp_path):
    from relaxspec.errors import RelaxspecError
    from relaxspec.models.janus import load_janus

    (tmp_path / "config.json").write_text('{"model_type": "janus"}')
    with pytest.raises(RelaxspecError, match="no .safetensors weights"):
        load_janus(tmp_path, prompt_length=4)


@pytest.fixture(scope="module")
def janus_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("janus-cli")
    return folder, janus_folder_at(folder)


def test_generate_with_a_janus_folder_equals_transformers(janus_folder, tmp_path, lossless_cli):
    """``relaxspec generate --model-path DIR --prompt ...`` formats prompts as transformers' Janus
    recipe does and, greedy, gives its image tokens; lossless methods give the same tokens."""
    import json

    from transformers import AutoProcessor

    folder, model = janus_folder
    prompts = ["a red fox", "the blue cat under the rain"]
    processor = AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                           add_generation_prompt=True) for p in prompts]
    inputs = processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")
    assert inputs.input_ids[0, -1] == WORDS.index("<begin_of_image>") and inputs.input_ids[1, 0] == WORDS.index("<bos>")
    theirs = model.generate(**inputs, generation_mode="image", do_sample=False)  # its default CFG, 5
    base = ["generate", "--model-path", str(folder), "--prompt", prompts[0], "--prompt", prompts[1], "--temperature",
            "0", "--batch-size", "2", "--no-progress"]
    lossless_cli(base, theirs.numpy(), tmp_path)
    stats = json.loads((tmp_path / "ar" / "stats.json").read_text())
    assert stats["settings"]["model_type"] == "janus" and stats["settings"]["sampling"]["cfg_scale"] == 5.0
    assert [image["prompt"] for image in stats["images"]] == prompts and (tmp_path / "ar" / "0001.png").is_file()


@pytest.mark.parametrize("extra, message", [
    ([], "this Janus model takes text prompts"),
    (["--classes", "1"], "this Janus model takes text prompts"),
    (["--prompt", "  "], "prompt 1 is empty"),
    (["--prompt", "a fox", "--gpt-ckpt", "x.pt"], "--model-path is a whole model"),
    (["--prompt", "a fox", "--image-size", "64"], "image size is fixed by its config (8)"),
    (["--prompt", "a fox", "--negative-prompt", "blurry"], "--negative-prompt goes with --model-path (Emu3); this model is Janus"),
    (["--prompt", "a red fox " * 120], "exceed the model's context (256 positions)"),
])
def test_janus_folder_errors_are_one_line(janus_folder, tmp_path, refused, extra, message):
    folder, _ = janus_folder
    refused(["generate", "--model-path", str(folder), "--out", str(tmp_path / "o"), *extra], message)


def test_an_unsupported_model_folder_is_one_line(tmp_path, capsys):
    from relaxspec.cli import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llava"}')
    assert main(["generate", "--model-path", str(tmp_path / "m"), "--prompt", "a fox", "--out", str(tmp_path / "o")]) == 2
    assert ("model type 'llava' is not supported (janus (Janus), emu3 (Emu3), chameleon (Anole or Lumina-mGPT) are)"
            in capsys.readouterr().err)


def test_a_missing_or_weightless_model_folder_is_one_line(tmp_path, refused):
    refused(["generate", "--model-path", str(tmp_path / "nowhere"), "--prompt", "a fox", "--out", str(tmp_path / "o")],
            "not a transformers model folder (no config.json)")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text('{"model_type": "emu3"}')
    refused(["generate", "--model-path", str(tmp_path / "empty"), "--prompt", "a fox", "--out", str(tmp_path / "o")],
            "no usable processor")


def test_info_recognises_a_janus_folder(janus_folder, capsys):
    from relaxspec.cli import main

    folder, _ = janus_folder
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "model_type:            janus" in out and "--model-path DIR --prompt" in out


def test_broken_janus_folders_are_one_line(janus_folder, tmp_path, capsys):
    """Review findings: a truncated safetensors file, a processor without its chat template, a
    config.json that is not an object; each is one line, exit 2."""
    import shutil

    from relaxspec.cli import main

    folder, _ = janus_folder
    cases = {}
    truncated = tmp_path / "truncated"
    shutil.copytree(folder, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    cases[truncated] = "not a loadable Janus folder"
    no_template = tmp_path / "no-template"
    shutil.copytree(folder, no_template)
    for path in no_template.glob("chat_template*"):
        path.unlink()
    cases[no_template] = "no chat template"
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1]")
    cases[listed] = "not a model config"
    for path, message in cases.items():
        assert main(["generate", "--model-path", str(path), "--prompt", "a red fox", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (path.name, err)


def test_a_prompts_file_with_a_byte_order_mark(janus_folder, tmp_path):
    import json

    from relaxspec.cli import main

    folder, _ = janus_folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\xef\xbb\xbfa red fox\n")
    assert main(["generate", "--model-path", str(folder), "--prompts-file", str(prompts), "--temperature", "0",
                 "--no-progress", "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "stats.json").read_text())["settings"]["prompts"] == ["a red fox"]


def test_right_padded_prompts_are_refused(janus):
    from relaxspec.errors import RelaxspecError

    target, _ = janus
    ids = torch.tensor([[BOS, 10, 11, BOI, PAD, PAD, PAD]])
    with pytest.raises(RelaxspecError, match="left-padded"):
        decode(target, ids, SamplingConfig(cfg_scale=5.0, temperature=0.0), methods.resolve("ar"), cond_mask=ids != PAD)
    ids = torch.tensor([[PAD, BOS, 10, 11, 12, 13, 14, BOI]])  # 8 tokens for a 7-token target
    with pytest.raises(RelaxspecError, match="7 condition tokens"):
        decode(target, ids, SamplingConfig(cfg_scale=5.0, temperature=0.0), methods.resolve("ar"), cond_mask=ids != PAD)


def test_the_api_points_janus_users_to_model_path(janus):
    import relaxspec
    from relaxspec.errors import RelaxspecError

    target, tokenizer = janus
    with pytest.raises(RelaxspecError, match="model_path"):
        relaxspec.generate(prompts=["a fox"], t5_path="x", model=(target, tokenizer, None), method="ar")


def test_the_api_generates_from_a_janus_folder(janus_folder):
    """``relaxspec.generate(model_path=DIR, prompts=...)``: the command's tokens, as images."""
    import relaxspec

    folder, model = janus_folder
    ar = relaxspec.generate(prompts=["a red fox", "the blue cat"], model_path=str(folder), method="ar",
                            sampling={"temperature": 0.0})
    sjd = relaxspec.generate(prompts=["a red fox", "the blue cat"], model_path=str(folder), method="sjd", window=4,
                             sampling={"temperature": 0.0})
    assert torch.equal(ar.result.tokens, sjd.result.tokens) and ar.images[0].size == (8, 8)


def test_teacher_forced_features_are_the_decoding_ones(janus):
    """train-drafter's pass over whole images (through the decoding interface, with the prompts'
    padding mask) reproduces greedy decoding: CFG on its logits picks each greedy token."""
    from relaxspec.training.drafter import target_features

    target, _ = janus
    ids, scale = PROMPTS, 5.0
    tokens = decode(target, ids, SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0), methods.resolve("ar"),
                    cond_mask=ids != PAD).tokens
    hidden, logits = target_features(target, tokens, ids, null_rows=3, cond_mask=ids != PAD)
    guided = scale * logits[:3] + (1 - scale) * logits[3:]
    assert hidden.shape == (6, 16, 32) and torch.equal(guided.argmax(-1), tokens)


def test_train_drafter_on_a_janus_folder_then_generate(janus_folder, tmp_path, capsys, refused):
    """``train-drafter --model-path DIR --prompts-file F``, then ``generate --drafter-ckpt``:
    lossless at temperature 0; bad combinations are one line."""
    import numpy as np

    from relaxspec.cli import main

    folder, _ = janus_folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\nthe blue cat under the rain\nthe dog\n")
    drafter = tmp_path / "drafter"
    assert main(["train-drafter", "--model-path", str(folder), "--prompts-file", str(prompts), "--self-samples", "3",
                 "--steps", "2", "--batch-size", "3", "--out", str(drafter), "--no-progress"]) == 0, \
        capsys.readouterr().err
    base = ["generate", "--model-path", str(folder), "--prompt", "a red fox", "--prompt", "the cat", "--temperature",
            "0", "--batch-size", "2", "--no-progress"]
    assert main(base + ["--method", "ar", "--out", str(tmp_path / "ar")]) == 0
    assert main(base + ["--method", "eagle2", "--drafter-ckpt", str(drafter), "--out", str(tmp_path / "e")]) == 0
    assert np.array_equal(np.load(tmp_path / "e" / "tokens.npy"), np.load(tmp_path / "ar" / "tokens.npy"))
    args = ["train-drafter", "--model-path", str(folder), "--self-samples", "2", "--out", str(tmp_path / "x")]
    refused(args + ["--prompts-file", str(prompts), "--data", "x.npy"], "trains on its own samples of prompts")
    refused(args, "--model-path needs --prompts-file")
