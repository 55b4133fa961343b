"""Counts a user gives, checked against what they cost before any work (issue 54, item 2): image
counts past one run's bound, self-samples and drafter sizes past the memory free, each one line
and exit 2; and what runs within them does not grow its writes with the run (tests/test_cli.py:
``test_a_batch_writes_its_own_rows_and_records_not_the_whole_run_again``). Each case was minutes
of growing memory and no word before (3-8 GB at a minute, or an 8 TB allocation)."""

from __future__ import annotations

import pytest

from relaxspec import devices
from relaxspec.cli import main
from relaxspec.inputs import MAX_IMAGES, check_image_count


def refused(argv, message, capsys) -> str:
    """``relaxspec ARGV`` exits 2 with ``message`` on one line of stderr and no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_the_image_bound_is_said_and_the_bound_itself_passes():
    assert check_image_count(MAX_IMAGES, "--num-images") == MAX_IMAGES
    with pytest.raises(Exception, match=r"--num-images is 1,000,001 images: one run makes at most 1,000,000"):
        check_image_count(MAX_IMAGES + 1, "--num-images")


@pytest.mark.parametrize("argv, message", [
    (["eval", "--images-per-class", "1000000000", "--", "--no-progress"],
     "--images-per-class 1000000000 x 8 classes is 8,000,000,000 images: one run makes at most 1,000,000"),
    (["eval", "--images-per-class", "1000000", "--", "--classes", "heart,1", "--no-progress"],
     "--images-per-class 1000000 x 2 classes is 2,000,000 images"),
    (["bench", "--images-per-class", "1000000000", "--no-plots", "--no-progress"],
     "--images-per-class 1000000000 x 99 classes is 99,000,000,000 images"),
    (["bench", "--num-images", "1000000000", "--no-plots", "--no-progress"],
     "--num-images 1000000000 is 1,000,000,000 images"),
])
def test_image_counts_past_a_run_are_one_line_before_any_image(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    argv = argv[:1] + ["--out", str(out)] + argv[1:] if argv[0] == "bench" else argv + ["--out", str(out)]
    refused(argv, message, capsys)
    assert not list(out.rglob("*.png")) and not list(out.rglob("records.jsonl"))


def test_self_samples_and_drafter_layers_past_the_free_memory_are_one_line(tiny_ckpts, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(devices, "free_memory", lambda device="cpu": 10 ** 9)  # 1 GB free, whatever this machine has
    base = ["train-drafter", *tiny_ckpts["c2i"]["args"], "--steps", "0", "--device", "cpu", "--no-progress"]
    refused(base + ["--self-samples", "1000000000000", "--out", str(tmp_path / "a")],
            "--self-samples 1,000,000,000,000 (16 tokens each, held twice) needs about 256.0 TB and this machine has "
            "1.0 GB free", capsys)
    refused(base + ["--self-samples", "2", "--n-layer", "1000000", "--out", str(tmp_path / "b")],
            "--n-layer 1,000,000 (a drafter of", capsys)
    assert not list(tmp_path.rglob("self_samples*"))
    # within the memory, the same run trains
    assert main(base + ["--self-samples", "2", "--n-layer", "2", "--batch-size", "2", "--out", str(tmp_path / "c")]) == 0


def test_check_fits_says_both_sizes_and_lets_what_fits_pass(monkeypatch):
    assert devices.free_memory("cpu") > 0  # MemAvailable of /proc/meminfo (Linux, as CI)
    monkeypatch.setattr(devices, "free_memory", lambda device="cpu": 10 ** 9)
    devices.check_fits("x", 10 ** 9, "cpu")
    with pytest.raises(devices.RelaxspecError, match=r"^x needs about 2\.0 TB and this machine has 1\.0 GB free$"):
        devices.check_fits("x", 2 * 10 ** 12, "cpu")


def test_an_image_run_past_its_disk_is_one_line_before_any_image(tmp_path, capsys, monkeypatch):
    """The PNGs an image run will write (half their raw pixels each, and a kilobyte) are checked
    against the free space of --out's disk before the first decode; what an earlier run of the
    same command finished is not counted again."""
    import collections

    from relaxspec.runs import images

    usage = collections.namedtuple("usage", "total used free")
    free = {"bytes": 1000}
    monkeypatch.setattr(images.shutil, "disk_usage", lambda path: usage(10 ** 12, 0, free["bytes"]))
    argv = ["generate", "--classes", "heart,1,2", "--out", str(tmp_path / "out"), "--no-progress"]
    refused(argv, f"--out {tmp_path / 'out'}: 3 more images of 32 px need about 7.7 KB and its disk has 1.0 KB free",
            capsys)
    assert not list((tmp_path / "out").glob("*.png"))
    free["bytes"] = 3 * (32 * 32 * 3 // 2 + 1024)  # exactly what three need
    assert main(argv) == 0, capsys.readouterr().err
