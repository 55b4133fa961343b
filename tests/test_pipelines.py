"""The pipeline contract (diffusers' scheduler-mixin idea): every pipeline ``open_pipeline``
returns, whatever its family, opens from the paths a user has, turns classes or prompts into a
``Condition`` checked once, decodes with any method, and paints pixels -- the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import helpers
from relaxspec import methods
from relaxspec.conditions import Condition, class_ids
from relaxspec.decoding import decode
from relaxspec.errors import RelaxspecError
from relaxspec.pipelines import ImagePipeline, open_pipeline
from relaxspec.sampling import SamplingConfig

KINDS = ["embedded", "llamagen-c2i", "llamagen-t2i", "janus", "emu3", "lumina", "anole"]


@pytest.fixture(scope="module")
def opened(tmp_path_factory, tiny_ckpts):
    """``kind -> (pipeline, what its conditions take)``, each opened once through the front door."""
    root = tmp_path_factory.mktemp("pipelines")
    cache: dict = {}

    def get(kind: str):
        if kind in cache:
            return cache[kind]
        if kind == "embedded":
            pipeline, given = open_pipeline(), {"classes": "heart,time"}
        elif kind == "llamagen-c2i":
            ckpt = tiny_ckpts["c2i"]
            pipeline = open_pipeline(gpt_ckpt=ckpt["gpt"], gpt_model=ckpt["gpt_json"], vq_ckpt=ckpt["vq"],
                                     vq_model=ckpt["vq_json"], image_size=16)
            given = {"classes": [1, 2]}
        elif kind == "llamagen-t2i":
            ckpt = tiny_ckpts["t2i"]
            t5 = helpers.make_t5(root / "t5", d_model=ckpt["config"]["caption_dim"])
            pipeline = open_pipeline(gpt_ckpt=ckpt["gpt"], gpt_model=ckpt["gpt_json"], vq_ckpt=ckpt["vq"],
                                     vq_model=ckpt["vq_json"], image_size=16, t5_path=t5)
            given = {"prompts": ["a red cat", "green"]}
        elif kind == "janus":
            folder = root / "janus"
            helpers.janus_folder_at(folder)
            pipeline, given = open_pipeline(model_path=folder, prompt_length=32), {"prompts": ["a red fox", "a cat"]}
        elif kind == "emu3":
            folder = helpers.emu3_folder_at(root / "emu3")
            pipeline = open_pipeline(model_path=folder, prompts=["a red fox", "a lighthouse"], image_size=32)
            given = {"prompts": ["a red fox", "a lighthouse"]}
        elif kind == "anole":
            from helpers import anole as anole_fixtures

            files = anole_fixtures.anole_folder(root / "anole")
            pipeline, given = open_pipeline(model_path=files["model_path"]), {"prompts": ["a red fox", "a lighthouse"]}
        else:
            from helpers import lumina as lumina_fixtures

            files = lumina_fixtures.lumina_folders(root / "lumina")
            pipeline = open_pipeline(model_path=files["model_path"], tokenizer_path=files["tokenizer_path"],
                                     prompts=["a red fox"], image_size=lumina_fixtures.IMAGE_SIZE)
            given = {"prompts": ["a red fox", "a lighthouse"]}
        cache[kind] = pipeline, given
        return cache[kind]

    return get


@pytest.fixture(params=KINDS)
def pipe(request, opened):
    return opened(request.param)


def test_a_pipeline_says_what_it_is(pipe):
    pipeline, given = pipe
    assert isinstance(pipeline, ImagePipeline) and pipeline.family
    assert pipeline.takes == ("classes" if "classes" in given else "prompts")
    assert pipeline.image_size == pipeline.grid * pipeline.tokenizer.config.downsample_factor
    assert pipeline.image_tokens == pipeline.grid ** 2 and pipeline.family in pipeline.describe()
    assert pipeline.identity  # what a run records about the model


def test_conditions_carry_the_tensors_and_what_each_image_records(pipe):
    pipeline, given = pipe
    condition = pipeline.conditions(**given)
    assert isinstance(condition, Condition) and len(condition) == 2
    key = "class" if "classes" in given else "prompt"
    assert [set(r) for r in condition.records] == [{key}, {key}]
    one = condition.select([1])
    assert len(one) == 1 and one.records == condition.records[1:]
    assert torch.equal(one.cond, condition.cond[1:])


def test_the_wrong_kind_of_condition_is_one_line(pipe):
    pipeline, given = pipe
    wrong = {"prompts": ["a cat"]} if "classes" in given else {"classes": "1"}
    with pytest.raises(RelaxspecError) as err:
        pipeline.conditions(**wrong)
    assert "\n" not in str(err.value)


def test_sampling_defaults_and_overrides(pipe):
    pipeline, _ = pipe
    defaults = pipeline.sampling()
    assert isinstance(defaults, SamplingConfig)
    assert pipeline.sampling(cfg_scale=1.5, top_k=None).cfg_scale == 1.5
    assert pipeline.sampling(top_k=None).top_k == defaults.top_k  # None keeps the default
    given = SamplingConfig(temperature=0.0)
    assert pipeline.sampling(given) is given


def test_methods_are_checked_against_the_pipeline(pipe):
    pipeline, _ = pipe
    assert pipeline.method("sjd", {"window": 4}).window == 4
    if pipeline.drafter is None:
        with pytest.raises(RelaxspecError, match="drafts with an EAGLE drafter"):
            pipeline.method("sd")
    with pytest.raises(RelaxspecError, match="not both"):
        pipeline.method(methods.resolve("ar"), {"compile": True})


def test_greedy_ar_is_the_engines_and_lossless_methods_equal_it(pipe):
    """The pipeline's decode is the engine's, for any method: greedy AR through it equals
    ``relaxspec.decoding.decode`` on the same tensors, and SJD (lossless) equals greedy AR."""
    pipeline, given = pipe
    condition = pipeline.conditions(**given)
    sampling = pipeline.sampling(temperature=0.0)
    ours = pipeline.generate(condition, pipeline.method("ar"), sampling).tokens
    theirs = decode(pipeline.target, condition.cond.to(pipeline.device), sampling, methods.resolve("ar"),
                    cond_mask=None if condition.mask is None else condition.mask.to(pipeline.device)).tokens
    assert torch.equal(ours, theirs)
    assert ours.shape == (2, pipeline.image_tokens) and int(ours.min()) >= 0
    assert int(ours.max()) < pipeline.target.config.vocab_size
    jacobi = pipeline.generate(condition, pipeline.method("sjd", {"window": 3}), sampling).tokens
    assert torch.equal(jacobi, ours)


def test_pixels_and_images(pipe):
    pipeline, given = pipe
    condition = pipeline.conditions(**given)
    tokens = pipeline.generate(condition, pipeline.method("ar"), generator=torch.Generator().manual_seed(0)).tokens
    pixels = pipeline.pixels(tokens)
    side = pipeline.image_size
    assert pixels.dtype == np.uint8 and pixels.shape == (2, side, side, 3)
    images = pipeline.images(tokens, upscale=2)
    assert [im.size for im in images] == [(2 * side, 2 * side)] * 2
    assert np.array_equal(np.asarray(images[0])[::2, ::2], pixels[0])


def test_the_front_door_refuses_what_does_not_go_together(tmp_path):
    cases = [
        (dict(vq_ckpt="vq.pt"), "--vq-ckpt goes with --gpt-ckpt (LlamaGen); this model is the embedded model"),
        (dict(tokenizer_path="tok"), "--tokenizer-path goes with --model-path"),
        (dict(negative_prompt="blurry"), "--negative-prompt goes with --model-path"),
        (dict(model_path=tmp_path, gpt_ckpt="gpt.pt"), "--model-path is a whole model"),
        (dict(model_path=tmp_path), "not a transformers model folder"),
        (dict(precision="fp8"), "precision must be one of fp32, bf16, fp16"),
        (dict(image_size=0), "image size must be a whole number >= 1"),
        (dict(t5_path="t5"), "--t5-path goes with --gpt-ckpt (LlamaGen); this model is the embedded model"),
    ]
    for kwargs, message in cases:
        with pytest.raises(RelaxspecError) as err:
            open_pipeline(**kwargs)
        assert message in str(err.value) and "\n" not in str(err.value), kwargs


def test_one_class_check():
    names = ["heart", "sky & weather", "time"]
    assert class_ids("heart, 2", 3, names) == [0, 2]
    assert class_ids("Sky_&_Weather", 3, names) == [1]
    assert class_ids([2, "1"], 3) == [2, 1]
    for classes, message in [("3", "class id 3 is out of range: this model has classes 0..2"),
                             ("heat", "unknown class 'heat'; did you mean heart?"),
                             ("cat", "give class ids"), (" , ", "no classes given"), ("-1", "out of range")]:
        with pytest.raises(RelaxspecError, match=message.replace("?", r"\?")):
            class_ids(classes, 3, names if classes in ("heat",) else None)


def test_every_command_decodes_through_the_pipeline_and_checks_a_method_once(tmp_path, monkeypatch, capsys):
    """One decode path: generate (three batches), eval's shard and bench (two methods, a warm-up)
    decode through ``ImagePipeline.generate`` with what ``prepare`` checked and built once per
    method and run; no command calls the engine past the pipeline."""
    from relaxspec.cli import main
    from relaxspec.methods.base import Method
    from relaxspec.pipelines.base import PreparedDecode

    checks, builds, decodes = [], [], []
    real_check, real_prepare, real_generate = Method.check_fits, ImagePipeline.prepare, ImagePipeline.generate

    def check(self, options, context):
        checks.append(options.method)
        return real_check(self, options, context)

    def prepare(self, options=None, sampling=None):
        builds.append(options.method)
        return real_prepare(self, options, sampling)

    def generate(self, condition, options=None, sampling=None, **kwargs):
        decodes.append(isinstance(options, PreparedDecode))
        return real_generate(self, condition, options, sampling, **kwargs)

    monkeypatch.setattr(Method, "check_fits", check)
    monkeypatch.setattr(ImagePipeline, "prepare", prepare)
    monkeypatch.setattr(ImagePipeline, "generate", generate)
    quiet = ["--no-progress", "--classes", "heart,time,animal-mammal"]
    assert main(["generate", "--method", "sjd", *quiet, "--out", str(tmp_path / "g")]) == 0, capsys.readouterr().err
    assert (checks, builds, decodes) == (["sjd"], ["sjd"], [True, True, True])
    checks.clear(), builds.clear(), decodes.clear()
    assert main(["eval", "--", "--method", "scd", *quiet, "--out", str(tmp_path / "e")]) == 0, capsys.readouterr().err
    assert (checks, builds, decodes) == (["scd"], ["scd"], [True, True, True])
    checks.clear(), builds.clear(), decodes.clear()
    assert main(["bench", "--methods", "sjd", "--classes", "1,2", "--warmup", "1", "--no-plots", "--no-progress",
                 "--out", str(tmp_path / "b")]) == 0, capsys.readouterr().err
    assert sorted(checks) == sorted(builds) == ["ar", "sjd"] and decodes == [True] * 6  # 2 warm-ups, 2 x 2 images
