"""Emu3 through transformers (relaxspec.models.emu3): a tiny random Emu3ForConditionalGeneration
with its processor, saved with save_pretrained and loaded back the way users load theirs. Greedy AR
equals transformers' own image generation (its documented recipe: prefix-constrained visual
tokens, forced end-of-lines, a negative prompt for guidance) token for token; the first step's
processed distribution equals transformers' logits processors'; every lossless method equals
greedy AR, so the forced end-of-line companions survive trees and KV compaction."""

from __future__ import annotations

import pytest
import torch

from relaxspec import methods
from relaxspec.decoding import decode
from relaxspec.decoding.target import GuidedTarget
from relaxspec.models.base import ImageTokenizer, TargetModel
from relaxspec.sampling import SamplingConfig

transformers = pytest.importorskip("transformers", reason="Emu3 needs transformers (pip install -e '.[test]')")

from helpers.emu3 import CODES, GRID, NEGATIVE, PROMPTS, VOCAB, adapter, tiny_emu3, tiny_processor  # noqa: E402


@pytest.fixture(scope="module")
def emu3_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("emu3")
    tiny_processor().save_pretrained(folder)
    model = tiny_emu3()
    model.save_pretrained(folder)
    return folder, model


def transformers_greedy(model, processor, prompts, negative, image_size=GRID * 8):
    """transformers' documented Emu3 image generation, greedy: the image tokens (end-of-lines dropped)."""
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=prompts, padding=True, return_tensors="pt", return_for_image_generation=True,
                       image_area=image_size ** 2)
    height, width = (int(v) for v in inputs.pop("image_sizes")[0])
    tok = processor.tokenizer
    visual = model.vocabulary_mapping.image_tokens
    eol = VOCAB["<|extra_200|>"]

    def allowed(batch_id, input_ids):
        position = torch.nonzero(input_ids == tok.image_wrapper_token_id, as_tuple=True)[0][0]
        offset = input_ids.shape[0] - position
        if offset % (width + 1) == 0:
            return (eol,)
        if offset == (width + 1) * height + 1:
            return (tok.eof_token_id,)
        if offset == (width + 1) * height + 2:
            return (tok.eoi_token_id,)
        if offset == (width + 1) * height + 3:
            return (tok.eos_token_id,)
        if offset > (width + 1) * height + 3:
            return (tok.pad_token_id,)
        return visual

    extra = {}
    if negative:
        neg = processor(text=[negative] * len(prompts), return_tensors="pt")
        extra = dict(negative_prompt_ids=neg.input_ids, negative_prompt_attention_mask=neg.attention_mask)
    out = model.generate(**inputs, max_new_tokens=(width + 1) * height + 3, prefix_allowed_tokens_fn=allowed,
                         do_sample=False, **extra)
    sequence = out[:, inputs.input_ids.shape[1]:]
    rows = sequence[:, : height * (width + 1)].reshape(len(prompts), height, width + 1)
    assert (rows[:, :, -1] == eol).all()
    return model.vocabulary_mapping.convert_bpe2img(rows).reshape(len(prompts), -1).long()


@pytest.fixture(scope="module")
def emu3(emu3_folder):
    return adapter(emu3_folder[0])


def test_the_adapter_implements_the_protocols(emu3):
    target, tokenizer, cond = emu3
    assert isinstance(target, TargetModel) and isinstance(tokenizer, ImageTokenizer)
    assert (target.config.block_size, target.config.grid_size, target.config.vocab_size) == (16, 4, CODES)
    assert cond.shape[:2] == (3, 2) and (cond[:, 0, -1] == VOCAB["<|image token|>"]).all()
    pixels = tokenizer.decode(torch.zeros(1, 16, dtype=torch.long))
    assert pixels.shape == (1, 3, 8, 8) and float(pixels.abs().max()) <= 1.0


@pytest.mark.parametrize("rows", [[0], [1], [0, 1, 2]], ids=["p0", "p1", "batch3"])
@pytest.mark.parametrize("negative", [NEGATIVE, ""], ids=["negative", "no-negative"])
def test_greedy_ar_equals_transformers_image_generation(emu3_folder, rows, negative):
    folder, model = emu3_folder
    prompts = [PROMPTS[i] for i in rows]
    theirs = transformers_greedy(model, tiny_processor(), prompts, negative)
    target, _, cond = adapter(folder, prompts, negative)
    ours = decode(target, cond, SamplingConfig(cfg_scale=3.0, temperature=0.0, top_k=0), methods.resolve("ar"))
    assert torch.equal(ours.tokens, theirs)


def test_greedy_paths_differ_between_prompts(emu3_folder):
    _, model = emu3_folder
    tokens = transformers_greedy(model, tiny_processor(), PROMPTS, NEGATIVE)
    assert len({tuple(row) for row in tokens.tolist()}) == 3


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8)])
def test_the_first_step_law_equals_transformers_processors(emu3_folder, emu3, temperature, top_k, top_p):
    """transformers' processors as generate orders them (unbatched CFG on the negative prompt, the
    prefix constraint, temperature, top-k, top-p) on its first step, restricted to the visual
    tokens in code order, against the adapter's processed law."""
    from transformers import (LogitsProcessorList, PrefixConstrainedLogitsProcessor, TemperatureLogitsWarper,
                              TopKLogitsWarper, TopPLogitsWarper, UnbatchedClassifierFreeGuidanceLogitsProcessor)

    _, model = emu3_folder
    target, _, cond = emu3
    processor, scale = tiny_processor(), 3.0
    processor.tokenizer.padding_side = "left"
    inputs = processor(text=PROMPTS, padding=True, return_tensors="pt", return_for_image_generation=True,
                       image_area=(GRID * 8) ** 2)
    neg = processor(text=[NEGATIVE] * 3, return_tensors="pt")
    visual = model.vocabulary_mapping.image_tokens
    positions = (inputs.attention_mask.cumsum(-1) - 1).clamp(min=0)  # generate's left-padding positions
    with torch.no_grad():
        scores = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                       position_ids=positions).logits[:, -1]
        processors = LogitsProcessorList(
            [UnbatchedClassifierFreeGuidanceLogitsProcessor(scale, model, unconditional_ids=neg.input_ids,
                                                            unconditional_attention_mask=neg.attention_mask),
             PrefixConstrainedLogitsProcessor(lambda batch_id, ids: visual, num_beams=1),
             TemperatureLogitsWarper(temperature)]
            + ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else []))
        expected = torch.softmax(processors(inputs.input_ids, scores), dim=-1)[:, target.visual_ids]
    guided = GuidedTarget(target, cond, SamplingConfig(cfg_scale=scale, temperature=temperature, top_k=top_k,
                                                       top_p=top_p))
    probs, _ = guided.prefill()
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-4)


def test_jacobi_accepts_runs_across_row_ends(emu3):
    """Greedy SJD equals AR while accepting runs that cross a row end: the forced end-of-line
    companions hold inside multi-token steps. (Every method on both families:
    tests/test_hf_structure.py.)"""
    target, _, cond = emu3
    greedy = SamplingConfig(cfg_scale=3.0, temperature=0.0, top_k=0)
    ar = decode(target, cond, greedy, methods.resolve("ar")).tokens
    result = decode(target, cond, greedy, methods.resolve("sjd", {"window": 6}))
    assert torch.equal(result.tokens, ar)
    accepted = result.accept_lengths
    starts = [torch.tensor([0] + steps[:-1]).cumsum(0) for steps in accepted]
    crossing = sum(int(((s // GRID) != ((s + torch.tensor(a) - 1) // GRID)).sum()) for s, a in zip(starts, accepted))
    assert crossing > 0  # steps that accept a run across a row end, through its forced end-of-line


def test_generate_with_an_emu3_folder_equals_transformers(emu3_folder, tmp_path, capsys, lossless_cli):
    """``relaxspec generate --model-path DIR --prompt ...`` formats prompts (and transformers'
    example negative prompt, the default) as transformers' recipe does and, greedy, gives its image
    tokens; drafter-free lossless methods give the same tokens."""
    import json

    from relaxspec.cli import main
    from relaxspec.models.emu3 import NEGATIVE_PROMPT

    folder, model = emu3_folder
    prompts = PROMPTS[:2]
    theirs = transformers_greedy(model, tiny_processor(), prompts, NEGATIVE_PROMPT)
    base = ["generate", "--model-path", str(folder), "--prompt", prompts[0], "--prompt", prompts[1], "--image-size",
            "32", "--temperature", "0", "--batch-size", "2", "--no-progress"]
    lossless_cli(base, theirs.numpy(), tmp_path)
    stats = json.loads((tmp_path / "ar" / "stats.json").read_text())
    settings = stats["settings"]
    assert settings["model_type"] == "emu3" and settings["sampling"]["cfg_scale"] == 3.0
    assert settings["negative_prompt"] == NEGATIVE_PROMPT and settings["image_size"] == 8  # 4 tokens x 2 px (tiny VQ)
    assert settings["sampling"]["top_k"] == 2048  # Emu3's recipe: the tiny folder's generation config sets none
    assert [image["prompt"] for image in stats["images"]] == prompts and (tmp_path / "ar" / "0001.png").is_file()
    capsys.readouterr()
    assert main(["info", str(folder)]) == 0  # info names the folder a --model-path target
    out = capsys.readouterr().out
    assert "model_type:            emu3" in out and "an Emu3 target" in out


@pytest.mark.parametrize("extra, message", [
    ([], "this Emu3 model takes text prompts"),
    (["--prompt", "a fox", "--image-size", "30"], "give a multiple of 8"),
    (["--prompt", "a fox", "--image-size", "64"], "the model's context is 96"),
    (["--prompt", ""], "prompt 1 is empty"),
    (["--prompt", "a fox", "--t5-path", "t5"], "--t5-path goes with --gpt-ckpt (LlamaGen); this model is Emu3"),
])
def test_emu3_folder_errors_are_one_line(emu3_folder, tmp_path, refused, extra, message):
    folder, _ = emu3_folder
    refused(["generate", "--model-path", str(folder), "--out", str(tmp_path / "o"), *extra], message)


def test_a_negative_prompt_needs_a_model_folder(tmp_path, refused):
    refused(["generate", "--negative-prompt", "blurry", "--out", str(tmp_path / "o")],
            "--negative-prompt goes with --model-path")


def test_conditions_that_are_not_formatted_are_refused(emu3):
    from relaxspec.errors import RelaxspecError

    target, _, cond = emu3
    greedy = SamplingConfig(cfg_scale=3.0, temperature=0.0)
    with pytest.raises(RelaxspecError, match=r"\[B, 2, S\]"):
        decode(target, cond[:, 0], greedy, methods.resolve("ar"))
    right_padded = torch.cat([cond[:, :, 1:], torch.full_like(cond[:, :, :1], -1)], -1)
    with pytest.raises(RelaxspecError, match="left-padded"):
        decode(target, right_padded, greedy, methods.resolve("ar"))
    longer = torch.nn.functional.pad(cond, (2, 0), value=-1)  # another prompt set's length
    with pytest.raises(RelaxspecError, match="this target was made for"):
        decode(target, longer, greedy, methods.resolve("ar"))


def test_the_api_generates_from_an_emu3_folder(emu3_folder):
    """``relaxspec.generate(model_path=DIR, prompts=..., negative_prompt=...)`` gives transformers'
    greedy tokens (as ``generate --model-path`` does), with AR and with SCD."""
    import relaxspec

    folder, model = emu3_folder
    theirs = transformers_greedy(model, tiny_processor(), PROMPTS[:2], NEGATIVE)
    for method, fields in (("ar", {}), ("scd", {"window": 4})):
        made = relaxspec.generate(prompts=PROMPTS[:2], model_path=str(folder), method=method, image_size=32,
                                  negative_prompt=NEGATIVE, sampling={"temperature": 0.0}, **fields)
        assert torch.equal(made.result.tokens, theirs), method
    assert made.images[1].size == (8, 8)


def test_teacher_forced_features_are_the_decoding_ones(emu3):
    """train-drafter's pass over whole images (through the decoding interface, end-of-lines
    included) reproduces greedy decoding: CFG on its logits picks each greedy token."""
    from relaxspec.training.drafter import target_features

    target, _, cond = emu3
    scale = 3.0
    tokens = decode(target, cond, SamplingConfig(cfg_scale=scale, temperature=0.0, top_k=0), methods.resolve("ar")).tokens
    hidden, logits = target_features(target, tokens, cond, null_rows=3)
    guided = scale * logits[:3] + (1 - scale) * logits[3:]
    assert hidden.shape == (6, 16, 32) and torch.equal(guided.argmax(-1), tokens)


@pytest.mark.slow
def test_train_drafter_on_an_emu3_folder_then_generate(emu3_folder, tmp_path, capsys):
    """``train-drafter --model-path DIR --prompts-file F`` trains on the model's own samples; the
    drafter it writes serves ``generate --drafter-ckpt``, losslessly at temperature 0."""
    import json

    import numpy as np

    from relaxspec.cli import main

    folder, _ = emu3_folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\nthe blue cat under the rain\n")
    drafter = tmp_path / "drafter"
    assert main(["train-drafter", "--model-path", str(folder), "--prompts-file", str(prompts), "--image-size", "32",
                 "--self-samples", "4", "--steps", "3", "--batch-size", "2", "--out", str(drafter),
                 "--no-progress"]) == 0, capsys.readouterr().err
    state = json.loads((drafter / "config.json").read_text())
    assert state["kind"] == "drafter"
    base = ["generate", "--model-path", str(folder), "--prompt", "a red fox", "--prompt", "a lighthouse",
            "--image-size", "32", "--temperature", "0", "--batch-size", "2", "--no-progress"]
    assert main(base + ["--method", "ar", "--out", str(tmp_path / "ar")]) == 0
    for method in ("eagle2", "sd"):
        out = tmp_path / method
        assert main(base + ["--method", method, "--drafter-ckpt", str(drafter), "--out", str(out)]) == 0, \
            capsys.readouterr().err
        assert np.array_equal(np.load(out / "tokens.npy"), np.load(tmp_path / "ar" / "tokens.npy")), method
    sampled = [arg for arg in base if arg not in ("--temperature", "0")]
    assert main(sampled + ["--method", "lantern", "--drafter-ckpt", str(drafter), "--out", str(tmp_path / "lantern")]) \
        == 0, capsys.readouterr().err  # relaxed, so sampled: it runs and writes its images
    assert (tmp_path / "lantern" / "0001.png").is_file()
    import relaxspec

    made = relaxspec.generate(prompts=["a red fox", "a lighthouse"], model_path=str(folder), method="eagle2",
                              drafter_ckpt=str(drafter), image_size=32, sampling={"temperature": 0.0})
    assert np.array_equal(made.result.tokens.numpy(), np.load(tmp_path / "ar" / "tokens.npy"))


def test_bench_takes_prompts(emu3_folder, tmp_path, capsys):
    """``relaxspec bench --model-path DIR --prompt ...``: every method on the same prompt images;
    lossless ones commit AR's tokens, the report names the prompts, and the run resumes."""
    import json

    from relaxspec.bench.run import read_records
    from relaxspec.cli import main

    folder, _ = emu3_folder
    out = tmp_path / "bench"
    args = ["bench", "--model-path", str(folder), "--prompt", "a red fox", "--prompt", "a lighthouse", "--num-images",
            "3", "--image-size", "32", "--methods", "ar,sjd,gsd", "--sweep", "gsd:group_p_gap=0", "--temperature",
            "0", "--warmup", "0", "--no-plots", "--no-progress", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    records = read_records(out)
    assert [r["prompt"] for r in records if r["method"] == "ar"] == ["a red fox", "a lighthouse", "a red fox"]
    tokens = {(r["index"], r["method"]): r["tokens"] for r in records}
    assert all(tokens[i, "sjd"] == tokens[i, "ar"] == tokens[i, "gsd[group_p_gap=0]"] for i in range(3))
    settings = json.loads((out / "settings.json").read_text())["settings"]
    assert settings["prompts"] == ["a red fox", "a lighthouse", "a red fox"] and settings["models"]["model_type"] == "emu3"
    assert "3 images (2 prompts)" in (out / "summary.md").read_text()
    assert main(args) == 0  # resumed: nothing left to decode
    assert len(read_records(out)) == len(records)
    capsys.readouterr()
    assert main(args[:-2] + ["--classes", "1", "--out", str(tmp_path / "x")]) == 2
    assert "give --classes or prompts, not both" in capsys.readouterr().err


def test_interrupted_self_samples_resume_and_prompts_stay_fixed(emu3_folder, tmp_path, monkeypatch, refused):
    """train-drafter --model-path saves its self-samples batch by batch: a run interrupted while
    sampling keeps the finished batches and, started again, samples only the rest (the same
    tokens as an uninterrupted run). A resume with other prompts is refused."""
    import numpy as np

    from relaxspec.cli import main
    from relaxspec.training.drafter import data as ar_module  # where the sampler looks generate_ar up
    from relaxspec.training.drafter import SELF_SAMPLES

    folder, _ = emu3_folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox\nthe blue cat under the rain\na lighthouse\n")
    args = ["train-drafter", "--model-path", str(folder), "--prompts-file", str(prompts), "--image-size", "32",
            "--self-samples", "6", "--batch-size", "2", "--steps", "1", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "whole")]) == 0
    whole = np.load(tmp_path / "whole" / SELF_SAMPLES)["tokens"]

    real, calls = ar_module.generate_ar, []

    def crash_on_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ar_module, "generate_ar", crash_on_third)
    assert main(args + ["--out", str(tmp_path / "cut")]) != 0  # Ctrl-C while sampling the third batch
    assert sorted(p.name for p in (tmp_path / "cut").glob("self_samples.parts-*/*")) == [
        "batch-000000.npy", "batch-000001.npy"]  # the two finished batches are kept
    calls.clear()
    monkeypatch.setattr(ar_module, "generate_ar", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert main(args + ["--out", str(tmp_path / "cut")]) == 0
    assert len(calls) == 1  # only the unfinished batch
    assert np.array_equal(np.load(tmp_path / "cut" / SELF_SAMPLES)["tokens"], whole)

    prompts.write_text("a dog\n")
    refused(args + ["--out", str(tmp_path / "whole"), "--resume", "--steps", "2"], "prompts_sha256")
