"""LANTERN's neighbour tables as users hold them (issue 29, item 4): official LANTERN writes
``vq_distances/top_{V-1}_indices.npy`` (uint16 ``[V, V - 1]``) from ``torch.cdist`` of the raw
codebook, self excluded, ``topk`` nearest first. Ours is computed with exact distances and ties
broken by code id. The two hold the same codes for the first neighbours but can order near ties
differently deeper in the list, and LANTERN's prefix rule reads the order; so ``--neighbours FILE``
takes the file itself, checked, and a decode with it is the decode with that very table."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import relaxspec
from relaxspec.acceptance import LanternRule, neighbour_table
from relaxspec.acceptance.neighbours import load_neighbour_file
from relaxspec.cli import main
from relaxspec.decoding import decode
from relaxspec.errors import RelaxspecError
from relaxspec.pipelines import open_pipeline


def official_style_table(codebook: torch.Tensor) -> np.ndarray:
    """The table as LANTERN's codebook script computes it (its method in our words): Euclidean
    ``cdist`` of the raw codebook, the diagonal set to infinity, ``topk`` of the V - 1 smallest,
    saved as uint16."""
    distances = torch.cdist(codebook, codebook, p=2)
    distances.fill_diagonal_(float("inf"))
    _, nearest = torch.topk(distances, codebook.shape[0] - 1, dim=-1, largest=False)
    return nearest.to(torch.uint16).numpy()


@pytest.fixture(scope="module")
def codebook() -> torch.Tensor:
    from relaxspec.pipelines import open_pipeline

    return open_pipeline(with_drafter=False).tokenizer.raw_codebook.detach().float().cpu()


@pytest.fixture(scope="module")
def official_file(codebook, tmp_path_factory):
    path = tmp_path_factory.mktemp("vq_distances") / f"top_{codebook.shape[0] - 1}_indices.npy"
    np.save(path, official_style_table(codebook))
    return path


def test_the_official_table_holds_our_nearest_codes(codebook, official_file):
    """On the embedded codebook the official way and ours agree row for row on the first 64
    neighbours (the embedded presets' k); the file reads back as that table."""
    ours = neighbour_table(codebook, 64, "raw")
    theirs = load_neighbour_file(official_file, codebook.shape[0], 64)
    assert theirs.dtype == torch.int64 and theirs.shape == (codebook.shape[0], 64)
    assert torch.equal(theirs, ours)
    # The whole list: the same codes in every row (the order of near ties may differ).
    full = load_neighbour_file(official_file, codebook.shape[0], codebook.shape[0] - 1)
    assert torch.equal(full.sort(1).values, neighbour_table(codebook, codebook.shape[0] - 1, "raw").sort(1).values)


@pytest.mark.slow  # whole commands on the tiny models (the full suite runs it)
def test_a_decode_with_the_file_is_the_decode_with_that_table(official_file, tmp_path):
    """The file is the table the rule reads: a file equal to ours decodes exactly as the computed
    table does (sampled, same seed), and a table in another order decodes as a rule built on that
    order does, not as the computed one."""
    sampling = {"temperature": 1.0}
    computed = relaxspec.generate("heart,time", "lantern", seed=3, sampling=sampling)
    with_file = relaxspec.generate("heart,time", "lantern", seed=3, sampling=sampling, neighbours=str(official_file))
    assert torch.equal(computed.result.tokens, with_file.result.tokens)
    assert torch.equal(computed.result.target_forwards, with_file.result.target_forwards)
    # The same codes, the first 64 of each row in reverse: LANTERN's prefix rule now credits other
    # neighbours first. What the file says is what the rule reads.
    table = np.load(official_file)
    reordered = table.copy()
    reordered[:, :64] = table[:, :64][:, ::-1]
    other = tmp_path / "reordered.npy"
    np.save(other, reordered)
    with_other = relaxspec.generate("heart,time", "lantern", seed=3, sampling=sampling, neighbours=str(other))
    pipeline = open_pipeline()
    options = pipeline.method("lantern")
    rule = LanternRule(torch.from_numpy(reordered[:, :64].astype(np.int64)), 64, delta=options.delta)
    condition = pipeline.conditions(classes="heart,time")
    by_hand = decode(pipeline.target, condition.cond, pipeline.sampling(sampling), options,
                     vq=pipeline.tokenizer, drafter=pipeline.drafter, rule=rule,
                     generator=torch.Generator().manual_seed(relaxspec.sampling.batch_seed(3, 0)))
    assert torch.equal(with_other.result.tokens, by_hand.tokens)
    assert not torch.equal(with_other.result.tokens, computed.result.tokens)


def fifo(path) -> str:
    os.mkfifo(path)
    return str(path)


def bad_file(tmp_path, name, array, **kwargs) -> str:
    path = tmp_path / name
    np.save(path, array, **kwargs)
    return str(path)


def text_file(path) -> str:
    path.write_text("0 1 2\n1 0 2\n")
    return str(path)


def test_bad_neighbour_files_are_one_line(codebook, tmp_path, capsys):
    vocab = codebook.shape[0]
    good = np.stack([np.roll(np.arange(vocab), -i - 1)[: vocab - 1] for i in range(vocab)]).astype(np.uint16)
    cases = [
        (str(tmp_path / "missing.npy"), "no such file"),
        (bad_file(tmp_path, "rows.npy", good[:10]), f"a table for 10 codes; this model's codebook has {vocab}"),
        (bad_file(tmp_path, "narrow.npy", good[:, :8]), "8 neighbours per code, fewer than k = 64"),
        (bad_file(tmp_path, "floats.npy", good.astype(np.float32)), "expected a 2-D integer array"),
        (bad_file(tmp_path, "flat.npy", good[0]), "expected a 2-D integer array"),
        (bad_file(tmp_path, "self.npy", np.tile(np.arange(vocab)[:, None], (1, 64))), "code 0 lists itself"),
        (bad_file(tmp_path, "twice.npy", np.tile(good[:, :1], (1, 64))), "code 0 lists a neighbour twice"),
        (bad_file(tmp_path, "range.npy", good.astype(np.int64) + vocab), f"code ids must lie in [0, {vocab - 1}]"),
        # A pickled object array: refused by the reader, never unpickled.
        (bad_file(tmp_path, "pickle.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True),
         "not a NumPy table of code ids: it holds Python objects (a pickle), never loaded"),
        # Issue 45: plain text was called "pickled (object) data", with numpy's advice to unpickle it;
        # a folder that exists was "no such file".
        (text_file(tmp_path / "nb.txt"), "not a .npy file (no NumPy header)"),
        (str(tmp_path), "is a folder, not a file"),
        # Issue 54: a FIFO, /dev/zero and /dev/null were "no such file".
        (fifo(tmp_path / "nb.pipe"), "is a named pipe (FIFO), not a file"),
        ("/dev/zero", "is a device, not a file"),
        ("/dev/null", "is a device, not a file"),
    ]
    for path, message in cases:
        argv = ["generate", "--classes", "heart", "--method", "lantern", "--neighbours", path, "--out",
                str(tmp_path / "out"), "--no-progress"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (path, err)
        assert not (tmp_path / "out" / "0000.png").exists()
    with pytest.raises(RelaxspecError, match="--geometry is not used by"):
        relaxspec.generate("heart", "lantern", neighbours=str(tmp_path / "rows.npy"), geometry="normalised")
    with pytest.raises(RelaxspecError, match="--neighbours is not used by --method sd"):
        relaxspec.generate("heart", "sd", neighbours=str(tmp_path / "rows.npy"))


def test_generate_records_the_file_it_read(official_file, tmp_path, capsys):
    import json

    out = tmp_path / "out"
    assert main(["generate", "--classes", "heart", "--method", "lantern", "--neighbours", str(official_file), "--out",
                 str(out), "--no-progress"]) == 0
    method = json.loads((out / "stats.json").read_text())["settings"]["method"]
    assert method["neighbours"] == str(official_file) and "geometry" not in method
    assert f"neighbours={official_file}" in capsys.readouterr().err
