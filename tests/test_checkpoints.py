"""Checkpoint files: every official layout, strictness, refusal of unsafe pickles, our format."""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

from relaxspec.models.llamagen.checkpoints import describe, infer_gpt_fields, load_gpt, load_vq
from relaxspec.models.weights import read_state, save_model
from relaxspec.errors import RelaxspecError
from relaxspec.models.llamagen.gpt import rope_table_2d
from relaxspec.models.llamagen.vq import VQ_CONFIGS, VQModel

from helpers.gpt import gpt_b_expected_shapes


def logits_of(model, cond=None):
    cond = torch.tensor([1, 2]) if cond is None else cond
    tokens = torch.arange(2 * 6).view(2, 6) % model.config.vocab_size
    with torch.no_grad():
        return model.forward_train(cond, tokens)


def official_state(model) -> dict:
    """A state dict as upstream saves it: fresh tensors under the upstream names."""
    return {k: v.clone() for k, v in model.state_dict().items()}


LAYOUTS = {
    "model": lambda sd: {"model": sd},
    "module": lambda sd: {"module": sd},
    "state_dict": lambda sd: {"state_dict": sd},
    "raw": lambda sd: sd,
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_official_layout_loads_with_identical_logits(layout, tiny_gpt, tmp_path):
    expected = logits_of(tiny_gpt)
    state = official_state(tiny_gpt)
    # Derived buffers some official files carry are ignored.
    state["freqs_cis"] = rope_table_2d(4, 16, cls_token_num=1)
    state["layers.0.attention.kv_cache.k_cache"] = torch.zeros(1, 4, 17, 16)
    path = tmp_path / "ckpt.pt"
    torch.save(LAYOUTS[layout](state), path)
    assert read_state(path).layout == layout
    loaded = load_gpt(path, config=tiny_gpt.config)
    torch.testing.assert_close(logits_of(loaded), expected, atol=0, rtol=0)


@pytest.mark.slow
def test_gpt_b_official_files_both_layouts(tmp_path):
    """GPT-B as upstream ships it ({"model": sd}, fp32) and as a raw state dict with freqs_cis
    (XXL / 3B style), written from the REFERENCE key list with random weights: both load under
    --gpt-model GPT-B, hold exactly the file's tensors, and give identical logits."""
    gen = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=gen) * 0.02 + (1.0 if len(shape) == 1 else 0.0)
             for name, shape in gpt_b_expected_shapes("c2i").items()}
    wrapped, raw = tmp_path / "c2i_B_256.pt", tmp_path / "raw.pt"
    torch.save({"model": state}, wrapped)
    torch.save({**state, "freqs_cis": rope_table_2d(16, 64, cls_token_num=1)}, raw)
    first = load_gpt(wrapped, "GPT-B", image_size=256)
    for name in ("tok_embeddings.weight", "layers.11.feed_forward.w2.weight", "cls_embedding.embedding_table.weight"):
        assert torch.equal(first.state_dict()[name], state[name])
    cond, tokens = torch.tensor([207]), torch.randint(0, 16384, (1, 4), generator=gen)
    with torch.no_grad():
        expected = first.forward_train(cond, tokens)
        del first
        second = load_gpt(raw, "GPT-B", image_size=256)
        torch.testing.assert_close(second.forward_train(cond, tokens), expected, atol=0, rtol=0)
    assert second.config.num_classes == 1000 and second.config.block_size == 256
    # The raw file's freqs_cis pins the grid: asking for another resolution is refused.
    with pytest.raises(RelaxspecError, match="16x16"):
        load_gpt(raw, "GPT-B", image_size=384)


def test_t2i_official_layout(tiny_t2i, tmp_path):
    path = tmp_path / "t2i.pt"
    torch.save({"model": official_state(tiny_t2i)}, path)
    state = read_state(path).state_dict
    assert tuple(state["cls_embedding.uncond_embedding"].shape) == (6, 32)
    assert tuple(state["cls_embedding.cap_proj.fc1.weight"].shape) == (64, 32)
    assert tuple(state["cls_embedding.cap_proj.fc2.weight"].shape) == (64, 64)
    fields = infer_gpt_fields(state)
    assert fields["model_type"] == "t2i" and fields["cls_token_num"] == 6 and fields["caption_dim"] == 32
    captions = torch.randn(2, 6, 32)
    loaded = load_gpt(path, config=tiny_t2i.config)
    torch.testing.assert_close(logits_of(loaded, captions), logits_of(tiny_t2i, captions), atol=0, rtol=0)


@pytest.mark.parametrize("problem", ["missing", "unexpected", "shape"])
def test_strict_loading_names_the_offending_key(problem, tiny_gpt, tmp_path):
    state = official_state(tiny_gpt)
    if problem == "missing":
        del state["layers.1.ffn_norm.weight"]
        key = "layers.1.ffn_norm.weight"
    elif problem == "unexpected":
        state["layers.0.attention.bias"] = torch.zeros(3)
        key = "layers.0.attention.bias"
    else:
        state["layers.0.attention.wo.weight"] = torch.zeros(64, 32)
        key = "layers.0.attention.wo.weight"
    path = tmp_path / "bad.pt"
    torch.save({"model": state}, path)
    with pytest.raises(RelaxspecError, match=problem if problem != "shape" else "shape mismatch") as err:
        load_gpt(path, config=tiny_gpt.config)
    assert key in str(err.value)


def test_wrong_named_size_and_missing_name(tiny_gpt, tmp_path):
    path = tmp_path / "tiny.pt"
    torch.save({"model": official_state(tiny_gpt)}, path)
    with pytest.raises(RelaxspecError, match="not GPT-B"):
        load_gpt(path, "GPT-B")
    with pytest.raises(RelaxspecError, match="needs --gpt-model"):
        load_gpt(path)
    with pytest.raises(RelaxspecError, match="unknown GPT model"):
        load_gpt(path, "GPT-Q")


class Payload:
    """Unpickling this would run a shell command (if a loader were unsafe)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Custom:
    pass


@pytest.mark.parametrize("content", ["namespace", "custom", "code"])
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_unsafe_pickles_are_refused(content, tiny_gpt, tmp_path):
    marker = tmp_path / "executed"
    state = official_state(tiny_gpt)
    extra = {"namespace": argparse.Namespace(lr=1e-4), "custom": Custom(), "code": Payload(marker)}[content]
    path = tmp_path / "training_state.pt"
    torch.save({"model": state, "args": extra}, path)
    with pytest.raises(RelaxspecError, match="refusing"):
        load_gpt(path, config=tiny_gpt.config)
    legacy = tmp_path / "legacy.pt"  # an old-style (non-zip) pickle takes another code path
    with open(legacy, "wb") as handle:
        pickle.dump({"model": {}, "args": extra}, handle)
    with pytest.raises(RelaxspecError, match="refusing|not a"):
        read_state(legacy)
    assert not marker.exists()


def test_files_that_are_not_checkpoints(tmp_path, tiny_gpt):
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint\n")
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    no_weights = tmp_path / "list.pt"
    torch.save([1, 2, 3], no_weights)
    for path, message in ((text, "not a"), (empty, "empty"), (no_weights, "no state dict"),
                          (tmp_path / "missing.pt", "no such file"), (tmp_path, "config.json")):
        with pytest.raises(RelaxspecError, match=message):
            load_gpt(path, config=tiny_gpt.config)
    vq_file = tmp_path / "vq.pt"
    torch.save({"model": {"quantize.embedding.weight": torch.zeros(4, 2)}}, vq_file)
    with pytest.raises(RelaxspecError, match="not a LlamaGen GPT"):
        load_gpt(vq_file, "GPT-B")
    with pytest.raises(RelaxspecError, match="not a LlamaGen VQ"):
        load_vq(_saved(tmp_path, tiny_gpt), "VQ-16")


def _saved(tmp_path, model):
    path = tmp_path / "gpt.pt"
    torch.save({"model": official_state(model)}, path)
    return path


def test_own_format_round_trip(tiny_gpt, tiny_vq, tmp_path):
    gpt_dir = save_model(tiny_gpt, tmp_path / "gpt")
    assert sorted(p.name for p in gpt_dir.iterdir()) == ["config.json", "model.safetensors"]
    loaded = load_gpt(gpt_dir)  # no model name needed: the folder carries its config
    assert loaded.config == tiny_gpt.config
    torch.testing.assert_close(logits_of(loaded), logits_of(tiny_gpt), atol=0, rtol=0)
    with pytest.raises(RelaxspecError, match="not a multiple"):
        load_gpt(gpt_dir, image_size=18, downsample=4)
    with pytest.raises(RelaxspecError, match="token grid"):
        load_gpt(gpt_dir, image_size=32, downsample=4)
    assert load_gpt(gpt_dir, precision="bf16").output.weight.dtype == torch.bfloat16

    vq_dir = save_model(tiny_vq, tmp_path / "vq")
    vq = load_vq(vq_dir)
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(vq.decode(tokens), tiny_vq.decode(tokens), atol=0, rtol=0)
    with pytest.raises(RelaxspecError, match="not a GPT"):
        load_gpt(vq_dir)

    single = tmp_path / "weights.safetensors"  # a bare safetensors file: official names, no config
    save_file({k: v.contiguous() for k, v in tiny_gpt.state_dict().items()}, str(single))
    assert read_state(single).layout == "safetensors"
    torch.testing.assert_close(logits_of(load_gpt(single, config=tiny_gpt.config)), logits_of(tiny_gpt), atol=0, rtol=0)


@pytest.mark.slow
def test_vq16_official_layout_loads(tmp_path):
    torch.manual_seed(0)
    source = VQModel(VQ_CONFIGS["VQ-16"]).eval()
    path = tmp_path / "vq_ds16_c2i.pt"
    torch.save({"model": official_state(source)}, path)
    loaded = load_vq(path, "VQ-16")
    tokens = torch.randint(0, 16384, (1, 2, 2))
    with torch.no_grad():
        torch.testing.assert_close(loaded.decode(tokens), source.decode(tokens), atol=0, rtol=0)
    with pytest.raises(RelaxspecError, match="unknown VQ model"):
        load_vq(path, "VQ-3")
    # An unnamed size needs its config (GroupNorm groups are not in the weights).
    small = dataclasses.replace(VQ_CONFIGS["VQ-16"], ch=32, z_channels=32, norm_groups=8)
    other = tmp_path / "small.pt"
    torch.save({"model": official_state(VQModel(small))}, other)
    with pytest.raises(RelaxspecError, match="shape mismatches"):
        load_vq(other, "VQ-16")
    assert load_vq(other, config=small).config == small


def test_describe(tiny_gpt, tiny_vq, tmp_path):
    path = _saved(tmp_path, tiny_gpt)
    info = describe(path)
    assert info["layout"] == "model" and info["kind"] == "gpt" and info["looks_like"] is None
    assert info["parameters"] == tiny_gpt.num_parameters()
    assert info["config"]["dim"] == 64 and info["config"]["n_layer"] == 2 and info["config"]["num_classes"] == 10
    vq_path = tmp_path / "vq.pt"
    torch.save({"model": official_state(tiny_vq)}, vq_path)
    assert describe(vq_path)["config"] == {"codebook_size": 64, "codebook_embed_dim": 8}


def test_class_names_survive_a_save(tiny_gpt, tmp_path):
    named = tmp_path / "named"
    save_model(tiny_gpt, named)
    assert load_gpt(named).class_names is None  # an unnamed model stays unnamed
    tiny_gpt.class_names = [f"class-{i}" for i in range(tiny_gpt.config.num_classes)]
    try:
        save_model(tiny_gpt, named)
        assert load_gpt(named).class_names == tiny_gpt.class_names
    finally:
        tiny_gpt.class_names = None


@pytest.mark.parametrize("content, says", [
    (b"hello, these are my notes\n", "it is a text file (starting 'hello, these are my notes')"),
    ("h\u00e9llo w\u00f6rld ".encode() * 100, "it is a text file"),
    (bytes([0x33, 0x9D, 0x4F, 0x58]) + bytes(range(256)), "its bytes (starting 33 9d 4f 58) are no known format"),
])
def test_a_file_that_is_no_checkpoint_is_named_for_what_it_is(content, says, tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(content)
    with pytest.raises(RelaxspecError) as err:
        read_state(path)
    message = str(err.value)
    assert says in message and "not a PyTorch file" in message
    assert "refusing" not in message and "safely" not in message  # nothing unsafe about it


def test_safetensors_are_recognised_by_their_bytes(tiny_gpt, tmp_path):
    folder = save_model(tiny_gpt, tmp_path / "gpt")
    renamed = tmp_path / "weights.bin"
    renamed.write_bytes((folder / "model.safetensors").read_bytes())
    loaded = read_state(renamed)
    assert loaded.layout == "safetensors" and set(loaded.state_dict) == set(tiny_gpt.state_dict())
