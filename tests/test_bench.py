"""``relaxspec bench`` and ``relaxspec eval`` on tiny random models: method specs and sweeps, the
interleaved resumable loop, pairwise speed-ups, acceptance heat maps, the tables, the offline
quality numbers, sharded generation and the error messages."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pytest
import torch

from relaxspec.bench import run as bench_run
from relaxspec.cli import bench as cli_bench
from relaxspec.cli.bench import add_bench_parser
from relaxspec.bench.config import DEFAULT_METHODS, expand_methods, parse_methods
from relaxspec.cli.eval import add_eval_parser
from relaxspec.runs.shards import shard_range
from relaxspec.bench.report import (
    acceptance_map,
    accepted_flags,
    markdown_table,
    pareto_front,
    summarize,
    write_report,
)
from relaxspec.api import pipeline_of
from relaxspec.bench.run import PreparedMethod, read_records, run_bench
from relaxspec.cli.options import Parser, UsageError
from relaxspec.decoding import decode
from relaxspec.errors import RelaxspecError
from relaxspec.sampling import SamplingConfig

SAMPLING = SamplingConfig(cfg_scale=4.0, temperature=1.0, top_k=0, top_p=1.0)
#: Two images (classes 1 and 2) with ar, sd-chain, sjd and a two-point LANTERN sweep.
BENCH_METHODS = dict(names=["ar", "sd-chain", "sjd"], sweeps=["lantern:delta=0.1,0.4"])
LABELS = ["ar", "sd-chain", "sjd", "lantern[delta=0.1]", "lantern[delta=0.4]"]


@pytest.fixture(autouse=True)
def neighbour_cache(monkeypatch, tmp_path_factory):
    """LANTERN's neighbour tables go to a temporary cache, not ~/.cache."""
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "neighbour-cache"))


@pytest.fixture(scope="module")
def models(tiny_c2i_models):
    """The tiny official-layout target and VQ, and a random drafter saved and loaded as users do."""
    return tiny_c2i_models


def bench_on(models, classes, specs, out, *, drafter: bool = True, **kwargs):
    """run_bench on the tiny models as a LlamaGen c2i pipeline, for ``classes``."""
    pipeline = pipeline_of((models["target"], models["vq"], models["drafter"] if drafter else None))
    return run_bench(pipeline, pipeline.conditions(classes=classes), specs, SAMPLING, out, **kwargs)


@pytest.fixture(scope="module")
def bench_dir(models, tmp_path_factory):
    """One finished benchmark (2 images x 5 methods) shared by the report tests."""
    out = tmp_path_factory.mktemp("bench")
    specs = expand_methods(BENCH_METHODS["names"], BENCH_METHODS["sweeps"])
    for spec in specs:  # as bench --profile does: the report's time split is measured in profile mode
        spec.options.setdefault("profile", True)
    bench_on(models, [1, 2], specs, out, warmup=0, progress=False)
    return out


def parser():
    root = Parser(prog="relaxspec")
    commands = root.add_subparsers(dest="command")
    add_bench_parser(commands)
    add_eval_parser(commands)
    return root


def run_cli(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    return args.handler(args)


# ------------------------------------------------------------------------------------------
# Method specs and sweeps
# ------------------------------------------------------------------------------------------


def test_sweeps_expand_into_labelled_variants():
    specs = expand_methods(None, ["lantern:delta=0.05,0.1,0.2,0.4", "lantern++:lam=2,5,10", "cool:cool_delta=1.1,2,4"])
    labels = [s.label for s in specs]
    assert labels[:4] == ["ar", "sd-chain", "sd-static", "eagle2"]
    assert [s.label for s in specs if s.family == "lantern"] == [f"lantern[delta={d}]" for d in ("0.05", "0.1", "0.2", "0.4")]
    assert [s.method_options().lam for s in specs if s.family == "lantern++"] == [2.0, 5.0, 10.0]
    assert [s.method_options().cool_delta for s in specs if s.family == "cool"] == [1.1, 2.0, 4.0]
    assert "lantern" not in labels and "lantern++" not in labels  # replaced by their variants
    options = {s.label: s.method_options() for s in specs}
    assert options["lantern[delta=0.2]"].draft == "dynamic" and options["lantern[delta=0.2]"].k == 1000
    assert options["lantern++[lam=10]"].draft == "static" and options["lantern++[lam=10]"].k == 10
    # The baseline is always there, first when not listed; a swept name missing from --methods is appended;
    # sweeps of one name multiply; a lam sweep on LANTERN replaces its additive budget.
    product = expand_methods(parse_methods("sjd"), ["lantern:lam=2,5", "lantern:k=5,50"])
    assert [s.label for s in product] == ["ar", "sjd", "lantern[lam=2,k=5]", "lantern[lam=2,k=50]",
                                          "lantern[lam=5,k=5]", "lantern[lam=5,k=50]"]
    assert product[2].method_options().delta is None and product[2].method_options().lam == 2.0
    assert parse_methods(None) == list(DEFAULT_METHODS) and parse_methods("sd-dynamic,ar") == ["eagle2", "ar"]


@pytest.mark.parametrize("methods, sweeps, message", [
    ("ar,foo", [], "unknown method 'foo'"),
    ("ar,sjd,ar", [], "more than once"),
    (" , ", [], "--methods is empty"),
    (None, ["lantern"], "expected NAME:FIELD=V1,V2"),
    (None, ["lantern:delta="], "no values"),
    (None, ["lantern:delta=0.1,0.1"], "repeated"),
    (None, ["lantern:delta=abc"], "float expected"),
    (None, ["lantern:depth=2.5"], "int expected"),
    (None, ["lantern:colour=1"], "unknown field 'colour'"),
    (None, ["lantern:method=sd"], "not its method"),
    (None, ["ar:temperature=0,1"], "baseline"),
    (None, ["lantern:delta=0.1", "lantern:delta=0.2"], "swept twice"),
    (None, ["lantern:delta=1.5"], "lantern[delta=1.5]: --delta is an additive TV budget"),
    (None, ["lantern:k=5", "lantern:delta=2"], "additive TV budget"),
    (None, ["lantern++:delta=0.1"], "lantern++[delta=0.1]: --method lantern++ is the multiplicative rule"),
    (None, ["lantern++:lam=0.5"], "multiplicative bound >= 1"),
    (None, ["sjd:window=0"], "window must be >= 1"),
    (None, ["sjd:top_p=0"], "top-p must lie in (0, 1]"),
])
def test_bad_methods_and_sweeps_are_one_line_errors(methods, sweeps, message):
    with pytest.raises(RelaxspecError) as err:
        expand_methods(parse_methods(methods), sweeps)
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------


def test_bench_records_every_image_and_method_in_rotating_order(bench_dir):
    records = read_records(bench_dir)
    assert sorted((r["index"], r["method"]) for r in records) == sorted((i, m) for i in (0, 1) for m in LABELS)
    for r in records:
        assert len(r["tokens"]) == 16 and sum(r["accept_lengths"]) == 16
        assert r["class"] == [1, 2][r["index"]] and r["seed"] == r["index"]  # seed 0: 0 * 1000003 + image
        assert r["seconds"] > 0 and r["wall_seconds"] >= r["seconds"] * 0.5 and 0 <= r["drafter_seconds"] <= r["seconds"]
        assert r["target_forwards"] == len(r["accept_lengths"]) and r["mal"] == pytest.approx(16 / r["target_forwards"])
    by = {(r["index"], r["method"]): r for r in records}
    # Each image starts with a different method: image 1's order is image 0's rotated by one.
    assert [m for m in LABELS if by[(0, m)]["order"] == 0] == ["ar"]
    assert [m for m in LABELS if by[(1, m)]["order"] == 0] == ["sd-chain"]
    assert by[(1, "ar")]["order"] == len(LABELS) - 1
    # AR is AR; exact methods certify zero TV, LANTERN does not.
    assert all(by[(i, "ar")]["target_forwards"] == 16 and by[(i, "ar")]["drafter_forwards"] == 0 for i in (0, 1))
    assert all(by[(i, m)]["tv_sum"] == 0 for i in (0, 1) for m in ("ar", "sd-chain", "sjd"))
    assert any(by[(i, "lantern[delta=0.4]")]["tv_sum"] > 0 for i in (0, 1))
    assert by[(0, "sd-chain")]["drafter_forwards"] > 0
    settings = json.loads((bench_dir / "settings.json").read_text())
    assert [m["label"] for m in settings["settings"]["methods"]] == LABELS


def test_bench_resumes_and_never_mixes_settings(models, tmp_path, monkeypatch):
    calls = []
    real_decode = bench_run.decode_method

    def counting(method, *args):
        calls.append(method.spec.label)
        return real_decode(method, *args)

    monkeypatch.setattr(bench_run, "decode_method", counting)
    specs = expand_methods(["ar", "sjd", "scd"])
    bench = lambda **kw: bench_on(models, [1, 2, 3], specs, tmp_path, drafter=False, progress=False, **kw)
    bench(warmup=1)
    assert len(calls) == 3 + 9  # one warm-up decode per method, then 3 images x 3 methods
    path = tmp_path / "records.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 9

    calls.clear()
    assert len(bench(warmup=1)) == 9 and calls == []  # all done: nothing decoded, not even warm-up

    # An interrupted run: the last two records are missing and a third was torn mid-write.
    path.write_text("\n".join(lines[:6]) + "\n" + lines[6][:40])
    calls.clear()
    records = bench(warmup=0)
    assert len(calls) == 3 and len(records) == 9
    assert sorted((r["index"], r["method"]) for r in read_records(tmp_path)) == sorted(
        (i, m) for i in range(3) for m in ("ar", "sjd", "scd"))

    with pytest.raises(RelaxspecError, match="different settings.*seed"):
        bench(warmup=0, seed=1)
    calls.clear()
    assert len(bench(warmup=0, seed=1, overwrite=True)) == 9 and len(calls) == 9
    assert {r["seed"] for r in read_records(tmp_path)} == {1_000_003, 1_000_004, 1_000_005}


def test_prebuilt_sources_and_rules_decode_exactly_like_decode(models):
    """The bench builds each method's draft source and rule once; reusing them across images
    gives the tokens :func:`relaxspec.decoding.decode` gives with the same generator."""
    cond = torch.tensor([3])
    pipeline = pipeline_of((models["target"], models["vq"], models["drafter"]))
    condition = pipeline.conditions(classes=[3])
    for spec in expand_methods(["sd-static", "lantern++", "cool", "sjd", "scd"]):
        method = PreparedMethod.build(spec, SAMPLING, pipeline)
        for seed in (0, 1):
            mine = bench_run.decode_method(method, pipeline, condition, torch.Generator().manual_seed(seed))
            theirs = decode(models["target"], cond, SAMPLING, spec.method_options(), drafter=models["drafter"],
                            vq=models["vq"], generator=torch.Generator().manual_seed(seed))
            assert torch.equal(mine.tokens, theirs.tokens), spec.label
            assert mine.accept_lengths == theirs.accept_lengths


def test_throughput_mode_records_each_image_of_a_batch(models, tmp_path):
    threads = torch.get_num_threads()
    specs = expand_methods(["ar", "sjd"])
    records = bench_on(models, [1, 2, 3], specs, tmp_path, drafter=False, batch_size=2, warmup=0, threads=1,
                       progress=False)
    assert torch.get_num_threads() == threads  # the pinned thread count is restored
    assert len(records) == 6 and {r["batch_size"] for r in records} == {1, 2}
    by = {(r["index"], r["method"]): r for r in records}
    assert by[(0, "ar")]["seconds"] == by[(1, "ar")]["seconds"]  # shares of one batch
    assert by[(0, "sjd")]["seed"] == by[(1, "sjd")]["seed"] == 0 and by[(2, "sjd")]["seed"] == 1


def test_bench_input_errors(models, tmp_path):
    with pytest.raises(RelaxspecError, match="needs a trained drafter"):
        bench_on(models, [1], expand_methods(["sd-chain"]), tmp_path / "a", drafter=False, progress=False)
    with pytest.raises(RelaxspecError, match="class id 10 is out of range"):
        bench_on(models, [1, 10], expand_methods(["ar"]), tmp_path / "b", progress=False)
    with pytest.raises(RelaxspecError, match="no images to benchmark"):
        run_bench(pipeline_of((models["target"], models["vq"], None)), [1], expand_methods(["ar"]), SAMPLING,
                  tmp_path / "b", progress=False)  # class ids are given as a pipeline's Condition
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "records.jsonl").write_text("{}\n")
    with pytest.raises(RelaxspecError, match="holds records.jsonl but no settings.json"):
        bench_on(models, [1], expand_methods(["ar"]), tmp_path / "c", progress=False)


# ------------------------------------------------------------------------------------------
# The report
# ------------------------------------------------------------------------------------------


def synthetic(method: str, index: int, ms: float, accept_lengths=(1,) * 16, tv: float = 0.0) -> dict:
    return {"index": index, "method": method, "family": method, "class": 0, "seconds": ms / 1000,
            "wall_seconds": ms / 1000, "drafter_seconds": 0.0, "target_forwards": len(accept_lengths),
            "drafter_forwards": 0, "mal": 16 / len(accept_lengths), "tv_sum": tv,
            "accept_lengths": list(accept_lengths), "tokens": [0] * 16}


def test_a_speedup_from_fewer_than_five_pairs_has_no_interval():
    """bench and tune share one rule (bench.report.speedup_interval): under five image pairs a
    bootstrap is no interval (from one pair it was [x, x]), so bench reports the median alone."""
    few = [synthetic("ar", i, 10.0) for i in range(4)] + [synthetic("fast", i, 5.0 + i) for i in range(4)]
    rows = {r["label"]: r for r in summarize(few, n_boot=50)}
    assert rows["fast"]["speedup"] == pytest.approx(float(np.median([10 / 5, 10 / 6, 10 / 7, 10 / 8])))
    assert rows["fast"]["speedup_lo"] is None and rows["fast"]["speedup_hi"] is None and rows["fast"]["speedup_pairs"] == 4


def test_speedup_is_the_median_of_per_image_ratios():
    halves = [synthetic("ar", i, 10.0) for i in range(5)] + [synthetic("fast", i, 5.0, (1, 5, 5, 5)) for i in range(5)]
    rows = {r["label"]: r for r in summarize(halves, n_boot=50)}
    assert rows["fast"]["speedup"] == pytest.approx(2.0)
    assert rows["fast"]["speedup_lo"] == pytest.approx(2.0) and rows["fast"]["speedup_hi"] == pytest.approx(2.0)
    assert rows["ar"]["speedup"] == pytest.approx(1.0) and rows["ar"]["mal"] == 1.0
    assert rows["fast"]["mal"] == pytest.approx(4.0) and rows["fast"]["target_forwards_per_image"] == 4
    assert rows["fast"]["latency_median_s"] == pytest.approx(0.005)
    # Pairwise, not a ratio of medians: AR 10 / 30 ms vs 5 / 10 ms -> ratios 2 and 3 -> 2.5 (not 20 / 7.5).
    # An image the baseline never decoded has no pair.
    paired = [synthetic("ar", 0, 10.0), synthetic("ar", 1, 30.0), synthetic("m", 0, 5.0), synthetic("m", 1, 10.0),
              synthetic("m", 2, 1.0)]
    row = summarize(paired, n_boot=0)[1]
    assert row["speedup"] == pytest.approx(2.5) and row["speedup_pairs"] == 2 and row["images"] == 3
    assert row["latency_median_s"] == pytest.approx(0.005) and row["latency_q75_s"] == pytest.approx(0.0075)
    # No baseline, no speed-up.
    assert summarize([synthetic("m", 0, 5.0)], n_boot=0)[0]["speedup"] is None


def test_acceptance_flags_and_heat_map():
    # prefill token, then steps committing 3 (2 drafts + bonus), 1, 4, 2, 5 tokens
    flags = accepted_flags([1, 3, 1, 4, 2, 5], 16)
    assert flags.tolist() == [False, True, True, False, False, True, True, True, False, True, False,
                              True, True, True, True, False]
    assert accepted_flags([1, 3], 16) is None  # lengths that do not add up to the image are ignored
    records = [synthetic("m", 0, 1.0, (1, 3, 1, 4, 2, 5)), synthetic("m", 1, 1.0)]
    heat = acceptance_map(records, 16)
    assert heat.shape == (4, 4) and heat[0, 1] == 0.5 and heat[0, 0] == 0.0 and heat.max() == 0.5
    assert acceptance_map(records, 15) is None and acceptance_map([synthetic("m", 0, 1.0, (1,) * 15)], 15).shape == (1, 15)


def test_pareto_front():
    points = [{"label": "a", "speedup": 1.0, "fid": 1.0}, {"label": "b", "speedup": 2.0, "fid": 2.0},
              {"label": "c", "speedup": 1.5, "fid": 3.0}, {"label": "d", "speedup": None, "fid": 0.0}]
    assert pareto_front(points, "fid") == ["a", "b"]
    assert pareto_front(points, "fid", lower_is_better=False) == ["b", "c"]


def test_report_tables_and_plot_data(bench_dir, monkeypatch):
    from relaxspec.bench.report import plots

    monkeypatch.setattr(plots, "plots_available", lambda: False)
    result = write_report(bench_dir, n_boot=20)
    names = {p.name for p in result["files"]}
    assert names == {"summary.json", "summary.csv", "summary.md", "plot_data.json"}
    assert any("matplotlib is not installed" in n for n in result["notes"])
    assert any("quality not measured" in n for n in result["notes"])
    table = [line for line in (bench_dir / "summary.md").read_text().splitlines() if line.startswith("| `")]
    assert [line.split("`")[1] for line in table] == LABELS  # one row per method, in run order
    csv_rows = (bench_dir / "summary.csv").read_text().splitlines()
    assert len(csv_rows) == 1 + len(LABELS) and csv_rows[0].startswith("label,family,sweep")
    summary = json.loads((bench_dir / "summary.json").read_text())
    rows = {r["label"]: r for r in summary["methods"]}
    assert rows["ar"]["speedup"] == 1.0 and rows["ar"]["mal"] == 1.0 and rows["ar"]["drafter_share"] == 0
    # the time split: AR spends nothing in a drafter; the three shares add up to the decode time
    assert rows["ar"]["drafter_forward_share"] == 0 and rows["sjd"]["drafter_forward_share"] == 0
    for row in rows.values():
        assert 0 < row["target_share"] < 1 and 0 <= row["overhead_share"] < 1
        assert row["target_share"] + row["drafter_forward_share"] + row["overhead_share"] == pytest.approx(1.0)
    assert rows["sd-chain"]["drafter_forward_share"] > 0
    assert rows["lantern[delta=0.4]"]["sweep"] == {"delta": 0.4} and rows["lantern[delta=0.4]"]["family"] == "lantern"
    assert rows["sd-chain"]["speedup_pairs"] == 2 and rows["sd-chain"]["tv_sum_mean"] == 0
    assert rows["sd-chain"]["tv_certified"] == 0
    data = json.loads((bench_dir / "plot_data.json").read_text())
    assert set(data["accept_heatmap"]) == set(LABELS)
    assert np.asarray(data["accept_heatmap"]["sjd"]).shape == (4, 4)
    assert np.asarray(data["accept_heatmap"]["ar"]).max() == 0
    assert sum(data["accept_length_hist"]["ar"].values()) == 2 * 15
    assert [p["label"] for p in data["pareto"]["points"] if p["family"] == "lantern"] == LABELS[3:]


def test_report_quality_with_a_classifier(bench_dir, models, tmp_path):
    pytest.importorskip("scipy")
    from relaxspec.evaluation.classifier import ClassifierConfig, ImageClassifier

    torch.manual_seed(0)
    classifier = ImageClassifier(ClassifierConfig(num_classes=10, image_size=16, channels=(8,), feature_dim=8)).eval()
    rng = np.random.default_rng(0)
    real = tmp_path / "val.npz"
    np.savez(real, images=rng.integers(0, 256, (30, 16, 16, 3), dtype=np.uint8), labels=np.arange(30) % 10)
    result = write_report(bench_dir, vq=models["vq"], classifier=classifier, real_data=real, n_boot=10, plots=False)
    rows = {r["label"]: r for r in result["rows"]}
    for label in LABELS:
        quality = rows[label]["quality"]
        assert quality["n_fake"] == 2 and quality["n_real"] == 6  # real images of the benchmarked classes 1, 2
        value, lo, hi = quality["class_accuracy"]
        assert 0 <= lo <= value <= hi <= 1
        assert quality["fid_like"][0] >= 0
        by_class = {int(c): v for c, v in quality["class_accuracy_by_class"].items()}
        assert sorted(by_class) == [1, 2] and sum(n for _, n in by_class.values()) == 2
        assert sum(h for h, _ in by_class.values()) == round(value * 2)  # the per-class hits add up
    assert "class_accuracy_diff_vs_ar" in rows["sjd"]["quality"] and "class_accuracy_diff_vs_ar" not in rows["ar"]["quality"]
    assert len(list((bench_dir / "images" / "lantern_delta=0.4").glob("*.png"))) == 2
    digest = json.loads((bench_dir / "settings.json").read_text())["settings_hash"]
    assert (bench_dir / "images" / "SETTINGS_HASH").read_text().strip() == digest
    table = (bench_dir / "summary.md").read_text()
    assert "FID-like" in table and "NOT comparable to Inception FID" in table
    assert table.count("| `") == len(LABELS) + len(LABELS) - 1  # main table + the differences to AR


def test_plots_when_matplotlib_is_installed(bench_dir):
    pytest.importorskip("matplotlib")
    result = write_report(bench_dir, n_boot=0)
    assert {"pareto.png", "mal_hist.png", "accept_heatmap.png"} <= {p.name for p in result["files"]}


def test_markdown_table_marks_missing_methods():
    rows = summarize([synthetic("ar", 0, 10.0)], ["ar", "never-ran"], num_tokens=16, n_boot=0)
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 4 and lines[3].startswith("| never-ran | 0 |")


# ------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------


def test_bench_command(models, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["bench", *models["args"], "--classes", "1,2", "--methods", "ar,sjd", "--warmup", "0", "--out", str(out),
            "--no-progress", "--no-plots"]
    assert run_cli(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("| `") == 2 and "summary.md" in printed
    assert len(read_records(out)) == 4
    assert run_cli(argv + ["--report-only"]) == 0
    assert "skipped" not in capsys.readouterr().out
    # Issue 45: a damaged or cut-off line was dropped without a word; the report says so
    records = (out / "records.jsonl").read_text().splitlines()
    (out / "records.jsonl").write_text("\n".join([*records[:-1], records[-1][: len(records[-1]) // 2], "{]"]) + "\n")
    assert run_cli(argv + ["--report-only"]) == 0
    printed = capsys.readouterr().out
    assert "note: 2 lines of records.jsonl skipped: not a complete record" in printed
    assert "2 lines of records.jsonl skipped" in (out / "summary.md").read_text()
    assert run_cli(["bench", "--list-methods"]) == 0 and "lantern++" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--classes", "no-such-class", "--methods", "ar", "--out", "X"], "unknown class 'no-such-class'"),
    (["MODELS", "--methods", "ar,sd-chain", "--out", "X"], "sd-chain draft with an EAGLE drafter"),
    (["MODELS", "--classes", "1,12", "--methods", "ar", "--out", "X"], "class id 12 is out of range"),
    (["MODELS", "--methods", "ar", "--threads", "0", "--out", "X"], "--threads must be a whole number >= 1"),
    (["MODELS", "--methods", "ar", "--threads", "100000", "--out", "X"], "and at most"),
    (["MODELS", "--classifier", "C", "--out", "X"], "both --classifier and --real-data"),
    (["MODELS", "--methods", "ar", "--sweep", "lantern:delta=2", "--out", "X"], "additive TV budget"),
    (["MODELS", "--methods", "ar"], "--out DIR is required"),
    (["MODELS", "--methods", "ar", "--sweep", "sjd:tree=eagle25", "--out", "X"], "--tree is not used by --method sjd"),
])
def test_bench_command_errors(models, tmp_path, extra, message):
    argv = ["bench"]
    for item in extra:
        argv += models["args"] if item == "MODELS" else [str(tmp_path / item) if item in ("X", "C") else item]
    with pytest.raises(RelaxspecError, match=message.replace("(", r"\(").replace("[", r"\[")):
        run_cli(argv)


def test_quality_inputs_are_checked_before_any_decoding(models, tmp_path, monkeypatch):
    from relaxspec import embedded

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoding started before the quality inputs were checked")

    monkeypatch.setattr(cli_bench, "run_bench", no_decoding)  # what the command calls
    junk, other = tmp_path / "junk.npz", tmp_path / "other.npz"
    junk.write_bytes(b"not an array file")
    np.savez(other, images=np.zeros((2, 16, 16, 3), np.uint8), labels=np.array([7, 8]))
    argv = ["bench", *models["args"], "--classes", "1,2", "--methods", "ar", "--out", str(tmp_path / "b"),
            "--classifier", str(embedded.path("classifier"))]
    with pytest.raises(RelaxspecError, match="not a .npy / .npz array file"):
        run_cli(argv + ["--real-data", str(junk)])
    with pytest.raises(RelaxspecError, match="no real images of the benchmarked classes"):
        run_cli(argv + ["--real-data", str(other)])


def test_bench_command_usage_errors():
    with pytest.raises(UsageError, match="not allowed with argument"):
        run_cli(["bench", "--images-per-class", "2", "--num-images", "3", "--out", "X"])
    with pytest.raises(UsageError, match="invalid int value"):
        run_cli(["bench", "--threads", "two", "--out", "X"])


def test_eval_refuses_upscaled_images(models, tmp_path):
    generate = [*models["args"], "--classes", "1", "--upscale", "2", "--out", str(tmp_path / "eval")]
    with pytest.raises(RelaxspecError, match="--upscale has no place in relaxspec eval"):
        run_cli(["eval", "--", *generate])
    assert not (tmp_path / "eval").exists()


def test_eval_generates_sharded_and_resumable(models, tmp_path, monkeypatch, capsys):
    out = tmp_path / "eval"
    generate = [*models["args"], "--classes", "1,2", "--threads", "1", "--no-progress", "--out", str(out)]
    assert [list(shard_range(5, r, 2)) for r in (0, 1)] == [[0, 1], [2, 3, 4]]
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert run_cli(["eval", "--images-per-class", "2", "--", *generate]) == 0
    shards = [json.loads((out / f"shard-0{r}-of-02" / "stats.json").read_text()) for r in (0, 1)]
    assert [[im["class"] for im in s["images"]] for s in shards] == [[1, 1], [2, 2]]
    assert [s["settings"]["seed"] for s in shards] == [0, 1] and all(s["complete"] for s in shards)
    # Run again: both shards are complete, nothing is generated.
    assert run_cli(["eval", "--images-per-class", "2", "--", *generate]) == 0
    assert "0 generated now" in capsys.readouterr().out
    # Another world size in the same folder is refused.
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RelaxspecError, match="one folder per sharding"):
        run_cli(["eval", "--", *generate])
    monkeypatch.setenv("WORLD_SIZE", "2")

    # FID through clean-fid: without it, one clear line; with it, its features and distance are used.
    monkeypatch.setitem(sys.modules, "cleanfid", None)
    with pytest.raises(RelaxspecError, match="needs clean-fid"):
        run_cli(["eval", "--scores-only", "--fid-ref", str(tmp_path), "--", *generate])
    seen = {}
    fid_module = types.SimpleNamespace(
        get_files_features=lambda files, model, **kw: seen.setdefault("files", files) and np.zeros((len(files), 2)),
        get_folder_features=lambda folder, model, **kw: np.ones((3, 2)),
        fid_from_feats=lambda a, b: 12.5)
    features_module = types.SimpleNamespace(build_feature_extractor=lambda mode, device, use_dataparallel: "model")
    package = types.ModuleType("cleanfid")
    package.fid, package.features = fid_module, features_module
    monkeypatch.setitem(sys.modules, "cleanfid", package)
    monkeypatch.setitem(sys.modules, "cleanfid.fid", fid_module)
    monkeypatch.setitem(sys.modules, "cleanfid.features", features_module)
    assert run_cli(["eval", "--scores-only", "--fid-ref", str(tmp_path), "--", *generate]) == 0
    scores = json.loads((out / "eval.json").read_text())
    assert scores["fid"]["value"] == 12.5 and scores["images"] == 4
    assert len(seen["files"]) == 4 and not any(f.endswith("grid.png") for f in seen["files"])
    with pytest.raises(RelaxspecError, match="after '--'"):
        run_cli(["eval", "--images-per-class", "2"])


def test_models_and_sampling_default_to_the_embedded_model_or_upstream(tiny_ckpts):
    """One opener for every command: no model flags is the embedded model with its documented
    sampling; a user's official checkpoint gets upstream's; given flags always win."""
    from relaxspec import embedded
    from relaxspec.cli import build_parser
    from relaxspec.cli.options import open_from_args

    args = build_parser().parse_args(["bench", "--out", "x"])
    pipeline = open_from_args(args)
    assert pipeline.identity["gpt_ckpt"] == str(embedded.path("gpt").resolve())
    want = embedded.defaults()["sampling"]
    assert pipeline.sampling().to_dict() == {**pipeline.sampling().to_dict(), **want}
    args = build_parser().parse_args(["bench", "--out", "x", *tiny_ckpts["c2i"]["args"]])
    sampling = open_from_args(args).sampling(cfg_scale=2.0, top_k=None)
    assert (sampling.cfg_scale, sampling.temperature, sampling.top_k, sampling.top_p) == (2.0, 1.0, 2000, 1.0)


def test_verdict_names_the_fastest_method_within_ar_quality():
    from relaxspec.bench.report import verdict

    def row(label, speedup, acc=None, fid=None):
        quality = None if acc is None else {"class_accuracy_diff_vs_ar": acc, "fid_like_diff_vs_ar": fid}
        return {"label": label, "speedup": speedup, "speedup_lo": speedup - 0.1, "speedup_hi": speedup + 0.1,
                "quality": quality}

    timed = [row("ar", 1.0), row("sd", 1.2), row("lantern", 2.0), row("cool", 1.7)]
    assert verdict(timed) == "verdict: fastest is lantern, 2.00x ar [1.90, 2.10] (quality not measured)"
    judged = [row("ar", 1.0, [0, 0, 0], [0, 0, 0]), row("sd", 1.2, [0.0, -0.1, 0.1], [0.1, -1, 1]),
              row("lantern", 2.0, [-0.2, -0.3, -0.1], [5, 1, 9]),  # measurably worse on both
              row("cool", 1.7, [-0.05, -0.2, 0.1], [1, -2, 3])]
    assert verdict(judged) == "verdict: fastest within ar's quality is cool, 1.70x ar [1.60, 1.80]"
    judged[3]["quality"]["fid_like_diff_vs_ar"] = [3, 1, 5]  # FID-like measurably worse
    judged[1]["quality"]["class_accuracy_diff_vs_ar"] = [-0.2, -0.3, -0.05]
    assert verdict(judged) == "verdict: no method keeps quality within ar's intervals; fastest overall is lantern"
    one_image = [row("ar", 1.0), {**row("sd", 1.3), "speedup_lo": None, "speedup_hi": None}]
    assert verdict(one_image) == "verdict: fastest is sd, 1.30x ar (quality not measured)"
    slow = [row("ar", 1.0), row("sjd", 0.8)]
    assert verdict(slow) == "verdict: no method is faster than ar (the fastest, sjd, is 0.80x ar [0.70, 0.90])"
    judged[2]["quality"] = None  # only cool (now slower than ar) within quality
    judged[3]["quality"] = {"class_accuracy_diff_vs_ar": [0, -0.1, 0.1], "fid_like_diff_vs_ar": [0, None, None]}
    judged[3]["speedup"] = 0.9
    assert verdict(judged) == ("verdict: no method within ar's quality is faster than ar (the fastest overall is "
                               "lantern, 2.00x ar [1.90, 2.10])")


def test_gsd_is_benchmarked_like_decode(models):
    """GSD's rule reads the target's token embeddings: the bench hands it the target."""
    cond = torch.tensor([3])
    [_, spec] = expand_methods(["gsd"], ["gsd:window=4"])
    pipeline = pipeline_of((models["target"], models["vq"], None))
    method = PreparedMethod.build(spec, SAMPLING, pipeline)
    mine = bench_run.decode_method(method, pipeline, pipeline.conditions(classes=[3]), torch.Generator().manual_seed(0))
    theirs = decode(models["target"], cond, SAMPLING, spec.method_options(), vq=models["vq"],
                    generator=torch.Generator().manual_seed(0))
    assert torch.equal(mine.tokens, theirs.tokens) and mine.accept_lengths == theirs.accept_lengths


def test_bench_shards_over_processes_and_merges_what_one_process_writes(models, tmp_path, monkeypatch, capsys):
    """torchrun's RANK / WORLD_SIZE split the batches; each rank times its own; the last to finish
    merges the shards into the records one process writes (same seeds, tokens, order), each
    record naming the rank and device that timed it, and the report says so."""
    common = [*models["args"], "--classes", "1,2,3", "--methods", "ar,sjd", "--batch-size", "1", "--warmup", "0",
              "--threads", "1", "--no-plots", "--no-progress"]
    assert run_cli(["bench", *common, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    sharded = tmp_path / "two"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert run_cli(["bench", *common, "--out", str(sharded)]) == 0
    assert "the rank that finishes last merges" in capsys.readouterr().err
    assert not (sharded / "records.jsonl").exists()
    monkeypatch.setenv("RANK", "1")
    assert run_cli(["bench", *common, "--out", str(sharded)]) == 0
    assert "timed by 2 processes" in capsys.readouterr().out  # the report's note

    def tokens(folder):
        return {(r["index"], r["method"]): (r["tokens"], r["seed"], r["order"]) for r in read_records(folder)}

    assert tokens(sharded) == tokens(tmp_path / "one") and len(tokens(sharded)) == 6
    merged = read_records(sharded)
    assert {(r["index"], r["rank"]) for r in merged} == {(0, 0), (1, 1), (2, 1)}  # batches 0 | 1, 2
    assert all(r["device"].startswith("cpu: ") for r in merged)
    assert json.loads((sharded / "settings.json").read_text())["settings_hash"] == \
        json.loads((tmp_path / "one" / "settings.json").read_text())["settings_hash"]
    assert "timed by 2 processes" in json.dumps(json.loads((sharded / "summary.json").read_text()))
    # A finished rank started again decodes nothing and merges again.
    assert run_cli(["bench", *common, "--out", str(sharded)]) == 0
    assert len(read_records(sharded / "shard-01-of-02")) == 4
    # --report-only in one process merges finished shards first.
    (sharded / "records.jsonl").unlink()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert run_cli(["bench", *common, "--out", str(sharded), "--report-only"]) == 0
    assert tokens(sharded) == tokens(tmp_path / "one")
