"""Shared fixtures: tiny LlamaGen-shaped models (CPU, milliseconds per forward) and tiny
official-layout checkpoint files written by ``relaxspec make-test-checkpoints``."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch

from relaxspec.models.llamagen.gpt import GPTConfig, Transformer
from relaxspec.models.llamagen.vq import VQConfig, VQModel


try:  # transformers' progress bars are process-wide state that relaxspec turns off when it first loads
    # a folder; off from the start, no test's captured output depends on which tests ran before it on
    # its worker (a test that writes a folder with save_pretrained would otherwise print a bar or not)
    from transformers.utils import logging as _hf_logging

    _hf_logging.disable_progress_bar()
except ImportError:
    pass


#: 64-d, 2 layers, 4 heads (head dim 16), 64 codes, 10 classes, 4x4 token grid.
TINY_GPT = dict(dim=64, n_layer=2, n_head=4, vocab_size=64, num_classes=10, block_size=16)
#: t2i variant: 6 caption tokens of 32 features.
TINY_T2I = dict(TINY_GPT, model_type="t2i", cls_token_num=6, caption_dim=32)
#: ch_mult (1, 2, 2): downsampling 4, so a 16 px image is the GPT's 4x4 grid; 64 codes.
TINY_VQ = dict(codebook_size=64, codebook_embed_dim=8, z_channels=16, ch=32, ch_mult=(1, 2, 2), num_res_blocks=1,
               norm_groups=8)


def scramble_(model: Transformer, seed: int = 0) -> Transformer:
    """Give a GPT weights with O(1) activations and well-separated logits.

    Upstream's std-0.02 initialisation makes next-token distributions nearly uniform, where an
    argmax can hinge on rounding; fan-in-scaled weights make every comparison in the tests robust.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if param.dim() == 1:  # RMSNorm gains
                param.copy_(1 + 0.1 * noise)
            elif "embedding" in name:  # token / class tables
                param.copy_(noise)
            else:  # Linear [out, in]
                param.copy_(noise / param.shape[1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("uncond_embedding"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen))
    return model



@contextlib.contextmanager
def interrupted_at(monkeypatch, step: int):
    """A recipe run inside this block is interrupted (KeyboardInterrupt, asserted) when it asks
    for the learning rate of ``step``, as a Ctrl-C between checkpoints would."""
    from relaxspec.training import common

    real = common.warmup_cosine

    def crash(at, *args):
        if at == step:
            raise KeyboardInterrupt
        return real(at, *args)

    monkeypatch.setattr(common, "warmup_cosine", crash)
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        monkeypatch.setattr(common, "warmup_cosine", real)


@pytest.fixture(autouse=True)
def one_thread():
    """The test models are tiny: a forward is dominated by thread hand-offs, and with more than
    one intra-op thread on a busy 2-core machine one millisecond becomes a hundred. Every test
    starts on one thread, whatever the previous one set (recipes and the CLI set --threads)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)

@pytest.fixture
def fixed_forward_costs(monkeypatch):
    """``relaxspec tune``'s timed forwards replaced by fixed ones (a tenth of a millisecond each),
    so that whether a short --minutes can pay for the least search does not depend on how busy the
    machine is (issue 54: on a busy one, a test's three-second budget was "too short to measure
    anything"). The search's own clock stays real: the tests assert nothing that it decides."""
    from relaxspec.bench.cost import ForwardCosts
    from relaxspec.tuning import search

    fixed = ForwardCosts(target={1: 1e-4, 64: 1e-4}, drafter={1: 1e-4, 16: 1e-4})
    monkeypatch.setattr(search, "measure_forward_costs", lambda *args, **kwargs: fixed)
    return fixed


@pytest.fixture
def make_gpt():
    """Factory: ``make_gpt(**overrides)`` -> an eval-mode tiny GPT with scrambled weights."""

    def build(seed: int = 0, **overrides) -> Transformer:
        fields = dict(TINY_GPT)
        if overrides.get("model_type") == "t2i":
            fields = dict(TINY_T2I)
        fields.update(overrides)
        torch.manual_seed(seed)
        return scramble_(Transformer(GPTConfig(**fields)), seed).eval()

    return build


@pytest.fixture
def tiny_gpt(make_gpt) -> Transformer:
    return make_gpt()


@pytest.fixture
def tiny_t2i(make_gpt) -> Transformer:
    return make_gpt(model_type="t2i")


@pytest.fixture
def tiny_vq() -> VQModel:
    torch.manual_seed(0)
    return VQModel(VQConfig(**TINY_VQ)).eval()


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory) -> dict:
    """Official-layout random-weight files from ``relaxspec make-test-checkpoints --preset tiny``:
    ``{"c2i": {...}, "t2i": {...}}`` each with gpt / gpt_json / vq / vq_json paths (as str) and
    the CLI arguments that load them (``args``)."""
    from relaxspec.cli import main

    files = {}
    for model_type in ("c2i", "t2i"):
        folder = tmp_path_factory.mktemp(f"ckpt-{model_type}")
        assert main(["make-test-checkpoints", "--preset", "tiny", "--model-type", model_type, "--out", str(folder)]) == 0
        entry = {name: str(folder / name) for name in ("gpt.pt", "gpt.json", "vq.pt", "vq.json")}
        entry = {"gpt": entry["gpt.pt"], "gpt_json": entry["gpt.json"], "vq": entry["vq.pt"], "vq_json": entry["vq.json"],
                 "folder": folder, "config": json.loads(Path(entry["gpt.json"]).read_text())}
        entry["args"] = ["--gpt-ckpt", entry["gpt"], "--gpt-model", entry["gpt_json"], "--vq-ckpt", entry["vq"],
                         "--vq-model", entry["vq_json"], "--image-size", "16"]
        files[model_type] = entry
    return files


@pytest.fixture(scope="session")
def tiny_c2i_models(tiny_ckpts, tmp_path_factory) -> dict:
    """The tiny official-layout c2i target and VQ (``tiny_ckpts``), and a random drafter saved and
    loaded as users do: ``target``, ``vq``, ``drafter``, ``drafter_dir``, ``files`` and the CLI
    ``args`` of the files (without the drafter)."""
    from relaxspec.drafting.eagle import EagleDrafter, load_drafter
    from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq
    from relaxspec.models.weights import save_model

    files = tiny_ckpts["c2i"]
    vq = load_vq(files["vq"], files["vq_json"])
    target = load_gpt(files["gpt"], files["gpt_json"], image_size=16, downsample=vq.config.downsample_factor)
    torch.manual_seed(0)
    folder = save_model(EagleDrafter.for_target(target), tmp_path_factory.mktemp("drafter") / "drafter", kind="drafter")
    return {"target": target, "vq": vq, "drafter": load_drafter(folder, target), "drafter_dir": str(folder),
            "files": files, "args": files["args"]}


@pytest.fixture
def refused(capsys):
    """``refused(argv, message)``: ``relaxspec ARGV`` exits 2 with ``message`` on one stderr line."""
    from relaxspec.cli import main

    def check(argv: list[str], message: str) -> None:
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err

    return check


@pytest.fixture
def lossless_cli(capsys):
    """``lossless_cli(argv, expected, out)``: ``relaxspec ARGV --method M --out OUT/M`` writes the
    tokens ``expected`` for AR and the drafter-free lossless methods (SJD, GSD with a group of one)."""
    import numpy as np

    from relaxspec.cli import main

    def check(argv: list[str], expected, out) -> None:
        for method in (["--method", "ar"], ["--method", "sjd", "--window", "4"],
                       ["--method", "gsd", "--window", "4", "--group-p-gap", "0"]):
            folder = out / method[1]
            assert main(argv + method + ["--out", str(folder)]) == 0, capsys.readouterr().err
            assert np.array_equal(np.load(folder / "tokens.npy"), np.asarray(expected)), method

    return check
