"""``relaxspec tune`` and preset files.

* the budget logic on its own: over many random rows, a setting over budget never survives a
  round and is never chosen; with nothing within budget beating AR, nothing is chosen and the
  closest setting is named;
* the command on the tiny LlamaGen-format files (with a drafter), a Janus ``--model-path`` folder
  and the embedded model: its phases, outputs, the budget held, and resumption;
* the preset file: round trip through ``generate``, ``bench`` and ``relaxspec.generate``, greedy
  decoding with a lossless preset equal to greedy AR, and refusal of presets made for another
  model, drafter or machine kind.

Timings on a shared CPU are noise, so most tests replace each decode's seconds by a fixed cost
model (``cost_model``: a target forward costs 1 ms, a drafter forward ``drafter_ms``): the
search's decisions are then a pure function of the decodes, and the assertions exact.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

import relaxspec.compiling
from relaxspec.cli import main
from relaxspec.errors import RelaxspecError
from relaxspec.tuning.budget import Budget, choose, pareto, survivors, within


@pytest.fixture(autouse=True)
def neighbour_cache(monkeypatch, tmp_path_factory):
    """LANTERN's neighbour tables go to a temporary cache, not ~/.cache."""
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "neighbour-cache"))


@pytest.fixture
def cost_model(monkeypatch):
    """Replace every benchmarked decode's seconds by ``1 ms x target forwards + drafter_ms x
    drafter forwards``; returns a dict whose ``drafter_ms``, ``ar_factor`` (AR's
    seconds are multiplied by it) and ``slower`` (method name -> factor) a test may change, and which counts the decodes recorded."""
    from relaxspec.bench import run

    real = run.result_records
    model = {"drafter_ms": 0.1, "ar_factor": 1.0, "slower": {}, "decodes": 0}

    def fake(result, wall, method, *args, **kwargs):
        records = real(result, wall, method, *args, **kwargs)
        model["decodes"] += 1
        for r in records:
            r["seconds"] = 1e-3 * r["target_forwards"] + 1e-3 * model["drafter_ms"] * r["drafter_forwards"]
            if method.label == "ar":
                r["seconds"] *= model["ar_factor"]
            r["seconds"] *= model["slower"].get(method.label.split("[")[0], 1.0)
        return records

    monkeypatch.setattr(run, "result_records", fake)
    return model


@pytest.fixture(scope="module")
def llamagen(tiny_c2i_models):
    """The tiny official-layout c2i files and a drafter trained for nothing (random weights)."""
    models = tiny_c2i_models
    return {"args": models["args"] + ["--drafter-ckpt", models["drafter_dir"]], "files": models["files"],
            "drafter": models["drafter_dir"]}


def tune(args: list[str], out, capsys, expect: int = 0) -> str:
    capsys.readouterr()
    code = main(["tune", *args, "--out", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert code == expect, captured.err
    return captured.out + captured.err


# ---------------------------------------------------------------------------- the budget logic


def _random_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        relaxed = rng.random() < 0.6
        row = {"label": f"s{i}", "relaxed": relaxed, "speedup": rng.uniform(0.5, 3.0),
               "tv_per_token": rng.uniform(0, 0.3) if relaxed else 0.0}
        if relaxed and rng.random() < 0.7:
            row["quality_ok"] = rng.random() < 0.5
        rows.append(row)
    return rows


@pytest.mark.parametrize("budget", [Budget("lossless"), Budget("tv", 0.1), Budget("tv", 0.0), Budget("quality")])
def test_a_setting_over_budget_never_survives_and_is_never_chosen(budget):
    rng = random.Random(0)
    chose = 0
    for _ in range(300):
        rows = _random_rows(rng, rng.randint(1, 12))
        kept = survivors(rows, budget, keep=max(1, len(rows) // 2))
        assert all(within(r, budget) is not False for r in rows if r["label"] in kept)
        chosen, closest = choose(rows, budget)
        if chosen is not None:
            chose += 1
            assert closest is None and within(chosen, budget) is True and chosen["speedup"] > 1.0
            assert all(r["speedup"] <= chosen["speedup"] for r in rows if within(r, budget) is True)
        else:
            assert not any(within(r, budget) is True and r["speedup"] > 1.0 for r in rows)
            assert closest is not None
    assert chose > 50  # the property was exercised on both sides


def test_budget_rules_by_hand():
    exact = {"label": "sd", "relaxed": False, "speedup": 1.3, "tv_per_token": 0.0}
    loose = {"label": "lantern-0.5", "relaxed": True, "speedup": 2.5, "tv_per_token": 0.3}
    tight = {"label": "lantern-0.1", "relaxed": True, "speedup": 1.8, "tv_per_token": 0.05}
    rows = [exact, loose, tight]
    assert choose(rows, Budget("lossless"))[0] is exact
    assert choose(rows, Budget("tv", 0.1))[0] is tight
    assert choose(rows, Budget("tv", 0.5))[0] is loose
    # quality not measured: a relaxed setting is not chosen; it survives a round while unjudged
    assert choose(rows, Budget("quality"))[0] is exact
    assert survivors(rows, Budget("quality"), keep=1) == ["lantern-0.5", "lantern-0.1"]
    tight["quality_ok"], loose["quality_ok"] = True, False
    assert choose(rows, Budget("quality"))[0] is tight
    assert survivors(rows, Budget("quality"), keep=3) == ["lantern-0.1", "sd"]
    # nothing within budget beats AR: no choice, and the closest named
    slow = {"label": "sd", "relaxed": False, "speedup": 0.9, "tv_per_token": 0.0}
    assert choose([slow, loose, tight], Budget("tv", 0.01)) == (None, tight)
    assert choose([slow], Budget("lossless")) == (None, slow)
    with pytest.raises(RelaxspecError, match="max-tv-per-token must be a number in"):
        Budget("tv", -0.1)


def test_rows_in_parallel_never_crowd_certified_settings_off_the_front():
    """A rows setting's TV is unknown (its record covers the acceptance only), not zero: the
    fastest ZipAR must not dominate every LANTERN setting, or only it reaches the quality test
    (and, failing it, tune falls back to compiled AR, as a run with the packed weights did)."""
    zipar = {"label": "zipar[row_lead=1]", "relaxed": True, "speedup": 4.3, "tv_per_token": None}
    strong = {"label": "lantern-0.7", "relaxed": True, "speedup": 3.6, "tv_per_token": 0.40}
    mild = {"label": "lantern-0.5", "relaxed": True, "speedup": 2.2, "tv_per_token": 0.38}
    slow = {"label": "lantern-0.7-slow", "relaxed": True, "speedup": 2.0, "tv_per_token": 0.41}
    assert [r["label"] for r in pareto([zipar, strong, mild, slow])] == ["zipar[row_lead=1]", "lantern-0.7",
                                                                        "lantern-0.5"]
    assert survivors([zipar, strong, mild, slow], Budget("quality"), keep=1) == ["zipar[row_lead=1]", "lantern-0.7",
                                                                                "lantern-0.5"]
    # an unknown TV dominates nothing, and is dominated by anything at least as fast
    assert pareto([dict(zipar, speedup=2.0), strong]) == [strong]


def test_rows_in_parallel_are_knobs_of_a_quality_budget_only():
    """ZipAR's lead and PJD's window are tried when quality decides (their law is not the model's
    and no TV record certifies it), never under a lossless or TV budget."""
    from relaxspec.tuning.candidates import build_candidates

    quality = build_candidates(Budget("quality"), {}, has_drafter=False)
    rows = [c for c in quality if c.method in ("zipar", "pjd")]
    assert sorted(c.label for c in rows) == ["pjd[window=2,row_lead=2]", "pjd[window=4,row_lead=2]",
                                             "zipar[row_lead=1]", "zipar[row_lead=2]", "zipar[row_lead=3]"]
    assert all(c.relaxed for c in rows) and not any(c.relaxed for c in quality if c.method in ("sjd", "scd"))
    for budget in (Budget("lossless"), Budget("tv", 0.5)):
        assert not [c for c in build_candidates(budget, {}, has_drafter=False) if c.method in ("zipar", "pjd")]
    # with a drafter, LANTERN's best tree drafts for every open row too, under a quality budget alone
    trees = {"relaxed": [{"name": "chain3", "path": "chain"}], "exact": []}
    drafted = [c for c in build_candidates(Budget("quality"), trees, has_drafter=True) if c.fields.get("rows", 1) > 1
               and c.method == "lantern"]
    assert sorted(c.fields["row_lead"] for c in drafted) == [2, 3] and all(c.relaxed for c in drafted)
    for budget in (Budget("lossless"), Budget("tv", 0.5)):
        assert not [c for c in build_candidates(budget, trees, has_drafter=True) if c.fields.get("rows", 1) > 1]


def test_a_strong_relaxation_drafts_on_the_trees_of_its_own_probe():
    """LANTERN's ``delta`` 0.5 and 0.7 race on the trees built from the strong probe's rates, the
    milder deltas on the mild probe's; a run without a strong probe gives every delta the mild trees."""
    from relaxspec.tuning.candidates import PROBE_RULES, build_candidates

    assert PROBE_RULES["strong"]["delta"] > PROBE_RULES["relaxed"]["delta"]
    trees = {"exact": [], "relaxed": [{"name": "relaxed-chain6", "path": "chain6.json"}],
             "strong": [{"name": "strong-chain9", "path": "chain9.json"}]}
    lantern = [c for c in build_candidates(Budget("tv", 0.5), trees, has_drafter=True)
               if c.method == "lantern" and "delta" in c.fields]
    deltas = {tree: sorted(c.fields["delta"] for c in lantern if c.tree == tree)
              for tree in ("relaxed-chain6", "strong-chain9")}
    assert deltas == {"relaxed-chain6": [0.1, 0.2, 0.3, 0.3, 0.3], "strong-chain9": [0.5, 0.7]}
    del trees["strong"]
    mild = [c for c in build_candidates(Budget("tv", 0.5), trees, has_drafter=True)
            if c.method == "lantern" and "delta" in c.fields]
    assert sorted({c.fields["delta"] for c in mild}) == [0.1, 0.2, 0.3, 0.5, 0.7]
    assert {c.tree for c in mild} == {"relaxed-chain6"}


def test_a_resumed_run_probes_only_what_its_probe_file_lacks():
    """A probe.json written before the trees were per rule (no tree recorded: ``probe6x6``) keeps
    its exact probe and measures the relaxed rules again with their deep trees; once the
    candidates are decided nothing more is probed (their trees are chosen)."""
    from types import SimpleNamespace

    from relaxspec.tuning.candidates import PROBE_RULES
    from relaxspec.tuning.search import Tuner

    old = {"exact": {"tests": [[1]], "accepts": [[1]], "images": 2},
           "relaxed": {"tests": [[1]], "accepts": [[1]], "images": 2}}
    tuner = SimpleNamespace(state={}, probe_rules=lambda: list(PROBE_RULES))
    assert Tuner.rules_to_probe(tuner, old) == ["relaxed", "strong"]
    fresh = {rule: {**old["exact"], "tree": tree} for rule, tree in
             (("exact", "probe6x6"), ("relaxed", "probe10x4"), ("strong", "probe10x4"))}
    assert Tuner.rules_to_probe(tuner, fresh) == []
    tuner.state["candidates"] = []
    assert Tuner.rules_to_probe(tuner, old) == []


def test_trees_go_as_deep_as_the_probe_measured():
    """Rates measured ten levels deep, nearly all accepted (a strong relaxation on a cheap drafter),
    give chains deeper than eight, the old cap; a six-level probe still bounds its chains at six."""
    from relaxspec.bench.cost import ForwardCosts
    from relaxspec.tuning.candidates import candidate_trees

    costs = ForwardCosts({1: 0.010, 16: 0.012, 64: 0.050}, {1: 0.0001, 16: 0.0002})  # a GPU-like, flat curve
    deep = torch.full((10, 4), 0.02)
    deep[:, 0] = 0.97
    depths = [spec.depth for _, spec, _ in candidate_trees(deep, costs.step_seconds, costs.target_seconds(1))]
    assert max(depths) == 10
    shallow = [spec.depth for _, spec, _ in candidate_trees(deep[:6], costs.step_seconds, costs.target_seconds(1))]
    assert max(shallow) == 6


# ---------------------------------------------------------------------------- the command


@pytest.mark.slow
def test_tune_lossless_on_llamagen_files_and_the_preset_round_trips(llamagen, cost_model, tmp_path, capsys):
    """The phases leave their files; every setting tried is exact; the preset names a tree beside
    it; generate / bench / relaxspec.generate take it, and greedy decoding with it equals greedy AR."""
    out = tmp_path / "tune"
    text = tune([*llamagen["args"], "--lossless", "--minutes", "0.1", "--no-compile"], out, capsys)
    assert "chosen:" in text
    for name in ("costs.json", "probe.json", "state.json", "settings.csv", "report.md", "tune.json"):
        assert (out / name).is_file(), name
    state = json.loads((out / "state.json").read_text())
    rounds = state["rounds"]
    assert rounds and all(r["complete"] for r in rounds)
    assert [len(r["labels"]) for r in rounds] == sorted((len(r["labels"]) for r in rounds), reverse=True)
    assert all(b["images"] >= a["images"] for a, b in zip(rounds, rounds[1:]))  # finalists see more images
    tried = [c["method"] for c in state["candidates"]] + [label for r in rounds for label in r["labels"]]
    assert not any(m.startswith(("lantern", "cool", "gsd")) for m in tried)
    preset = json.loads((out / "tune.json").read_text())
    assert preset["kind"] == "relaxspec-preset" and preset["budget"]["kind"] == "lossless"
    assert preset["method"]["method"] in ("sd", "sjd", "scd")
    heldout = preset["measured"]["heldout"]
    assert heldout["images"] >= 4 and heldout["speedup"][1] <= heldout["speedup"][0] <= heldout["speedup"][2]
    if str(preset["method"].get("draft", "")).endswith(".json"):
        assert not preset["method"]["draft"].startswith("/") and (out / preset["method"]["draft"]).is_file()
    report = (out / "report.md").read_text()
    assert "Chosen" in report and "held out" in report

    # greedy: the preset's tokens equal AR's
    greedy = ["--temperature", "0", "--classes", "1,5", "--no-progress"]
    assert main(["generate", *llamagen["args"], "--preset", str(out / "tune.json"), *greedy,
                 "--out", str(tmp_path / "g-preset")]) == 0
    assert main(["generate", *llamagen["files"]["args"], "--method", "ar", *greedy, "--out", str(tmp_path / "g-ar")]) == 0
    assert np.array_equal(np.load(tmp_path / "g-preset" / "tokens.npy"), np.load(tmp_path / "g-ar" / "tokens.npy"))
    stats = json.loads((tmp_path / "g-preset" / "stats.json").read_text())
    assert stats["settings"]["method"]["method"] == preset["method"]["method"]

    # bench runs it as "tuned" beside AR
    capsys.readouterr()
    assert main(["bench", *llamagen["args"], "--preset", str(out / "tune.json"), "--num-images", "2", "--no-plots",
                 "--no-progress", "--out", str(tmp_path / "bench")]) == 0
    assert "| `tuned` |" in capsys.readouterr().out

    # the Python API: the preset's tokens are those of its method and settings spelled out
    import relaxspec
    from relaxspec.models.llamagen.checkpoints import load_gpt, load_vq
    from relaxspec.drafting.eagle import load_drafter
    from relaxspec.pipelines.presets import read_preset

    files = llamagen["files"]
    vq = load_vq(files["vq"], files["vq_json"])
    target = load_gpt(files["gpt"], files["gpt_json"], image_size=16, downsample=vq.config.downsample_factor)
    model = (target, vq, load_drafter(llamagen["drafter"], target))
    fields = dict(read_preset(out / "tune.json")["method"])
    by_preset = relaxspec.generate([1, 2], model=model, preset=str(out / "tune.json"), seed=3)
    spelled = relaxspec.generate([1, 2], fields.pop("method"), model=model, seed=3, **fields)
    assert torch.equal(by_preset.result.tokens, spelled.result.tokens)
    with pytest.raises(RelaxspecError, match="give preset or method"):
        relaxspec.generate([1], "ar", model=model, preset=str(out / "tune.json"))


@pytest.mark.slow
def test_a_tv_budget_is_held_and_every_setting_is_plotted(llamagen, cost_model, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "tune"
    code = main(["tune", *llamagen["args"], "--max-tv-per-token", "0.05", "--minutes", "0.15", "--no-compile",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err  # SJD's window beats AR under the cost model: a preset exists
    state = json.loads((out / "state.json").read_text())
    labels = [c["label"] for c in state["candidates"]]
    assert any(l.startswith("lantern") for l in labels) and any(l.startswith("cool") for l in labels)
    assert any(l.startswith("gsd") for l in labels) and (out / "trees").is_dir()
    assert (out / "frontier.png").stat().st_size > 1000
    import csv

    rows = list(csv.DictReader((out / "settings.csv").open()))
    assert len(rows) >= len(state["rounds"][0]["labels"])
    preset = json.loads((out / "tune.json").read_text())
    chosen = next(r for r in rows if r["label"] == state["chosen"])
    assert chosen["tv_per_token"] != "" and float(chosen["tv_per_token"]) <= 0.05
    assert preset["measured"]["tune"]["label"] == state["chosen"]
    over = [r for r in rows if r["tv_per_token"] and float(r["tv_per_token"]) > 0.05]
    assert over and all(float(r["speedup"]) > 0 for r in over)  # the budget mattered: settings over it were measured
    fastest = max((r for r in rows if r["label"] != "ar"), key=lambda r: float(r["speedup"]))
    if fastest in over:
        assert fastest["label"] != state["chosen"]


def test_nothing_within_budget_beats_ar_names_the_closest(llamagen, cost_model, tmp_path, capsys):
    """With AR's forwards 100x cheaper than anyone else's, no exact setting beats AR: exit 1, the
    closest named, and no preset file."""
    cost_model["ar_factor"] = 0.01
    out = tmp_path / "tune"
    text = tune([*llamagen["args"], "--lossless", "--minutes", "0.1", "--no-compile", "--classes", "0,2",
                 "--heldout-classes", "1"], out, capsys, expect=1)
    assert "no setting within the budget (lossless (exact methods only)) beats eager AR" in text
    assert "the fastest within it is" in text
    assert not (out / "tune.json").exists() and "No preset" in (out / "report.md").read_text()


@pytest.mark.slow
def test_an_interrupted_tune_resumes_without_redoing_decodes(llamagen, cost_model, tmp_path, capsys, monkeypatch):
    from relaxspec.bench import run

    args = [*llamagen["args"], "--lossless", "--minutes", "0.1", "--no-compile", "--classes", "0,2,3",
            "--heldout-classes", "1,5"]
    out = tmp_path / "tune"
    real = run.timed_decode
    calls = {"n": 0}

    def crash(*a, **k):
        calls["n"] += 1
        if calls["n"] == 25:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(run, "timed_decode", crash)
    assert main(["tune", *args, "--out", str(out), "--no-progress"]) == 130  # Ctrl-C
    first = json.loads((out / "state.json").read_text())
    assert first["spent_seconds"] > 0 and not first.get("done")
    recorded = cost_model["decodes"]
    monkeypatch.setattr(run, "timed_decode", real)
    assert main(["tune", *args, "--out", str(out), "--no-progress"]) in (0, 1)
    second = json.loads((out / "state.json").read_text())
    assert second["done"] and second["spent_seconds"] >= first["spent_seconds"]
    for before, after in zip(first["rounds"], second["rounds"]):  # the decisions made before the crash stand
        assert {k: before[k] for k in ("labels", "images", "start", "seed")} == \
            {k: after[k] for k in ("labels", "images", "start", "seed")}
    # the same command again: finished, nothing decoded
    before = cost_model["decodes"]
    main(["tune", *args, "--out", str(out), "--no-progress"])
    assert cost_model["decodes"] == before and recorded > 0


def test_another_budget_in_the_same_folder_is_refused(llamagen, cost_model, tmp_path, capsys, refused):
    out = tmp_path / "tune"
    args = [*llamagen["args"], "--minutes", "0.05", "--no-compile", "--classes", "0,2", "--heldout-classes", "1"]
    main(["tune", *args, "--lossless", "--out", str(out), "--no-progress"])
    refused(["tune", *args, "--max-tv-per-token", "0.1", "--out", str(out)], "holds a tuning run with different settings "
                                                                            "(changed: budget")
    (out / "state.json").write_text("{")
    refused(["tune", *args, "--lossless", "--out", str(out)], "state.json is not a tune state this relaxspec wrote "
                                                              "(not JSON); remove it or pass --overwrite")
    (out / "state.json").unlink()
    refused(["tune", *args, "--lossless", "--out", str(out)], "but no state.json; choose another folder or pass --overwrite")
    # --overwrite starts afresh: nothing of the old run is left
    assert main(["tune", *args, "--max-tv-per-token", "0.1", "--out", str(out), "--no-progress", "--overwrite"]) in (0, 1)
    assert json.loads((out / "state.json").read_text())["settings"]["budget"]["kind"] == "tv"


# ---------------------------------------------------------------------------- short budgets, intervals


def test_a_budget_too_short_to_measure_anything_writes_no_preset(llamagen, tmp_path, refused, capsys):
    """--minutes 1e-9: once the forwards are timed, one line says the least search does not fit and
    how many minutes would; nothing is decoded or decided and no tune.json is written; the state
    keeps the timed forwards for the same command with more minutes."""
    out = tmp_path / "tune"
    args = ["tune", *llamagen["args"], "--lossless", "--no-compile", "--classes", "0,2", "--heldout-classes", "1",
            "--out", str(out), "--no-progress"]
    refused([*args, "--minutes", "1e-9"], "--minutes 1e-09 is too short to measure anything")
    capsys.readouterr()
    assert main([*args, "--minutes", "1e-9"]) == 2
    line = capsys.readouterr().err
    assert "nothing was decided and no tune.json written: give --minutes >= " in line
    assert float(line.split("give --minutes >= ")[1].split()[0]) > 1e-9
    assert not (out / "tune.json").exists() and not (out / "probe.json").exists() and (out / "costs.json").is_file()
    state = json.loads((out / "state.json").read_text())
    assert state["rounds"] == [] and "chosen" not in state and "candidates" not in state


def test_a_speedup_from_fewer_than_five_pairs_has_no_interval():
    from relaxspec.tuning.report import describe_heldout, describe_row, interval_note
    from relaxspec.bench.report import MIN_INTERVAL_PAIRS, speedup_interval

    assert MIN_INTERVAL_PAIRS == 5
    assert speedup_interval([1.07]) == [1.07, None, None]
    assert speedup_interval([1.0, 1.1, 1.2, 1.3])[1:] == [None, None]
    assert speedup_interval([]) == [None, None, None]
    value, lo, hi = speedup_interval([1.0, 1.1, 1.2, 1.3, 1.4])
    assert lo <= value <= hi and lo < hi
    row = {"label": "sd", "relaxed": False, "speedup": 1.07, "speedup_lo": None, "speedup_hi": None, "pairs": 1}
    assert describe_row(row) == "sd: 1.07x (n/a: only 1 pair) eager AR"
    assert describe_row({**row, "speedup_lo": 1.0, "speedup_hi": 1.2, "pairs": 9}) == "sd: 1.07x [1.00, 1.20] eager AR"
    heldout = {"images": 5, "pairs": 5, "speedup": [1.1, 1.0, 1.2]}
    assert describe_heldout(heldout) == "1.10x [1.00, 1.20]"
    assert describe_heldout({**heldout, "pairs": 4, "speedup": [1.1, None, None]}) == "1.10x (n/a: only 4 pairs)"
    assert interval_note({"chosen": {**row, "pairs": 9}, "heldout": heldout}, 2.0) is None  # enough pairs: no note
    assert interval_note({"chosen": row, "heldout": heldout}, 2.0) == (
        "the budget allowed sd 1 tune image pair (chosen at 1.07x): no interval (one needs 5 pairs); give --minutes "
        ">= 10 for one")


def test_too_few_pairs_give_an_honest_preset_every_reader_takes(llamagen, tmp_path, monkeypatch):
    """One tune and one held-out image pair (what a short budget leaves): the rows, the held-out
    measurement, tune.json and report.md carry the median and the pair count, no interval; the
    preset readers take it, and one line says what the budget allowed."""
    from relaxspec.pipelines import open_pipeline
    from relaxspec.pipelines.presets import read_preset, with_preset
    from relaxspec.tuning import Budget, TuneConfig, Tuner, search
    from relaxspec.tuning.report import interval_note, write_results

    files = llamagen["files"]
    pipeline = open_pipeline(gpt_ckpt=files["gpt"], gpt_model=files["gpt_json"], vq_ckpt=files["vq"],
                             vq_model=files["vq_json"], image_size=16)
    config = TuneConfig(budget=Budget("lossless"), minutes=0.5, tune=[0, 2], heldout=[1], progress=False)
    tuner = Tuner(pipeline, pipeline.sampling(), tmp_path / "tune", config)
    label = "sjd[window=8]"
    tuner.state.update(candidates=[{"label": label, "method": "sjd", "fields": {"window": 8}, "tree": None}],
                       rounds=[{"labels": [label], "images": 1, "start": 0, "seed": 1, "complete": True}],
                       halving_done=True, heldout_plan={"images": 1, "seed": 2})

    def records(ar_seconds: float) -> list[dict]:
        return [{"method": method, "index": 0, "class": 1, "seconds": seconds, "mal": 1.5, "target_forwards": 2,
                 "tv_per_token": None} for method, seconds in (("ar", ar_seconds), (label, 1.0))]

    monkeypatch.setattr(search, "read_records", lambda folder: records(1.07))
    monkeypatch.setattr(tuner, "bench", lambda *args, **kwargs: records(1.2))
    rows = tuner.rows()
    chosen = tuner.choice(rows)
    assert chosen["label"] == label and chosen["pairs"] == 1 and chosen["speedup"] == pytest.approx(1.07)
    assert chosen["speedup_lo"] is None and chosen["speedup_hi"] is None  # was [1.07, 1.07]
    heldout = tuner.heldout(chosen)
    assert heldout["pairs"] == 1 and heldout["speedup"][0] == pytest.approx(1.2)
    assert heldout["speedup"][1:] == [None, None]  # was [1.2, 1.2]
    result = {"rows": rows, "chosen": chosen, "heldout": heldout, "spent_seconds": 30.0,
              "candidates": {c.label: c for c in tuner.all_candidates()}}
    write_results(tuner.out, result, tuner)
    measured = json.loads((tuner.out / "tune.json").read_text())["measured"]
    assert measured["heldout"]["speedup"][1:] == [None, None] and measured["heldout"]["pairs"] == 1
    assert measured["tune"]["speedup_lo"] is None and measured["tune"]["pairs"] == 1
    method = read_preset(tuner.out / "tune.json")["method"]
    assert method["method"] == "sjd" and method["window"] == 8
    assert with_preset(pipeline, str(tuner.out / "tune.json")).default_method == "sjd"
    note = interval_note(result, config.minutes)
    assert note == ("the budget allowed sjd[window=8] 1 tune image pair (chosen at 1.07x) and 1 held-out image pair "
                    "(speed-up 1.20x measured): no interval (one needs 5 pairs); give --minutes >= 2.5 for one")
    report = (tuner.out / "report.md").read_text()
    assert "**1.20x (n/a: only 1 pair) eager AR**" in report and note in report and "[1.07, 1.07]" not in report


def test_tune_reports_bench_mal_tokens_per_target_forward(llamagen, tmp_path, monkeypatch):
    """MAL means one thing in bench and tune: image tokens committed per target forward over all
    images (total tokens / total forwards). Two images decoded in 2 and 8 forwards make 2n / 10,
    not the mean of the per-image MALs (n / 2 + n / 8) / 2 that tune once reported; a state saved
    then still resumes, the closest setting's numbers recomputed from the records."""
    from relaxspec.bench.report import summarize
    from relaxspec.pipelines import open_pipeline
    from relaxspec.tuning import Budget, TuneConfig, Tuner, search

    files = llamagen["files"]
    pipeline = open_pipeline(gpt_ckpt=files["gpt"], gpt_model=files["gpt_json"], vq_ckpt=files["vq"],
                             vq_model=files["vq_json"], image_size=16)
    n = pipeline.image_tokens
    config = TuneConfig(budget=Budget("lossless"), minutes=0.5, tune=[0, 2], heldout=[1], progress=False)
    tuner = Tuner(pipeline, pipeline.sampling(), tmp_path / "tune", config)
    label = "sjd[window=8]"
    old_closest = {"label": label, "relaxed": False, "speedup": 0.9, "pairs": 2, "mal": (n / 2 + n / 8) / 2}
    tuner.state.update(candidates=[{"label": label, "method": "sjd", "fields": {"window": 8}, "tree": None}],
                       rounds=[{"labels": [label], "images": 2, "start": 0, "seed": 1, "complete": True}],
                       halving_done=True, heldout_plan={"images": 2, "seed": 2}, chosen=None, closest=old_closest)

    def record(method: str, index: int, forwards: int) -> dict:
        return {"method": method, "index": index, "class": 1, "seconds": forwards / 100, "wall_seconds": forwards / 100,
                "drafter_seconds": 0.0, "target_forwards": forwards, "drafter_forwards": 0, "mal": n / forwards,
                "tv_sum": 0.0, "tv_per_token": None, "accept_lengths": [1] * forwards, "tokens": [0] * n}

    records = [record("ar", 0, n), record("ar", 1, n), record(label, 0, 2), record(label, 1, 8)]
    monkeypatch.setattr(search, "read_records", lambda folder: records)
    monkeypatch.setattr(tuner, "bench", lambda *args, **kwargs: records)
    bench_mal = {row["label"]: row["mal"] for row in summarize(records, num_tokens=n, n_boot=0)}
    assert bench_mal[label] == pytest.approx(2 * n / 10) and bench_mal["ar"] == 1.0
    rows = {row["label"]: row for row in tuner.rows()}
    assert {key: rows[key]["mal"] for key in rows} == pytest.approx(bench_mal)
    assert rows[label]["mal"] != pytest.approx((n / 2 + n / 8) / 2)  # the old per-image mean
    assert tuner.heldout(rows[label])["mal"] == pytest.approx(bench_mal[label])
    assert tuner.closest(list(rows.values()))["mal"] == pytest.approx(bench_mal[label])
    assert "mal_image_mean" not in rows[label]


# ---------------------------------------------------------------------------- state.json, checked


def _valid_state() -> dict:
    label = "sjd[window=8]"
    return {"settings_hash": "0123456789abcdef", "settings": {"seed": 0}, "spent_seconds": 12.5,
            "candidates": [{"label": label, "method": "sjd", "fields": {"window": 8}, "tree": None}],
            "compiled": [{"label": f"{label}+compile", "method": "sjd", "fields": {"window": 8, "compile": True},
                          "tree": None}],
            "compiled_added": True,
            "rounds": [{"labels": [label], "images": 2, "start": 0, "seed": 101, "complete": True},
                       {"labels": [label, f"{label}+compile"], "images": 4, "start": 2, "seed": 102, "complete": True}],
            "halving_done": True,
            "quality_plan": {"labels": [label], "images": 16, "start": 6, "seed": 31},
            "quality": {label: {"ok": True, "metrics": {"class_accuracy_diff_vs_ar": [0.0, -0.1, 0.1]}},
                        "ar": {"ok": True, "metrics": {"class_accuracy": [0.5, 0.4, 0.6], "n_fake": 16}}},
            "quality_complete": True, "chosen": label, "closest": None,
            "heldout_plan": {"images": 5, "seed": 57},
            "heldout_quality": {"ok": True, "metrics": {"fid_like_diff_vs_ar": [0.1, None, None]}}, "done": True}


def _set(path: str, value):
    """A change to a state: ``value`` at ``path`` (keys and list indices joined by dots), or the key
    removed when ``value`` is ``...``."""
    def change(state: dict) -> dict:
        *parents, last = path.split(".")
        node = state
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if value is ...:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return state
    return change


@pytest.mark.parametrize("change, problem", [
    (lambda state: [state], "not a JSON object"),
    (_set("settings_hash", ...), "no settings_hash"),
    (_set("settings", "x"), "no settings"),
    (_set("rounds", ...), "rounds is not a list"),  # was a KeyError
    (_set("rounds", "r1"), "rounds is not a list"),
    (_set("spent_seconds", "abc"), "spent_seconds is not a number >= 0"),  # was a ValueError
    (_set("spent_seconds", -1), "spent_seconds is not a number >= 0"),
    (_set("spent_seconds", float("nan")), "spent_seconds is not a number >= 0"),
    (_set("halving_done", "yes"), "halving_done is not true or false"),
    (_set("rounds.0", "r1"), "round 1: not an object"),
    (_set("rounds.0.labels", ["sd[tree=x]"]), "round 1: 'sd[tree=x]' is no setting it tried"),
    (_set("rounds.0.labels", []), "round 1: labels is not a list of settings"),
    (_set("rounds.1.images", "4"), "round 2: images is not a whole number in [1, 400]"),  # was a TypeError
    (_set("rounds.1.images", 0), "round 2: images is not a whole number in [1, 400]"),
    (_set("rounds.1.images", True), "round 2: images is not a whole number in [1, 400]"),
    (_set("rounds.1.start", -1), "round 2: start is not a whole number >= 0"),
    (_set("rounds.0.seed", 1.5), "round 1: seed is not a whole number"),
    (_set("rounds.0.complete", ...), "round 1: complete is not true or false"),
    (_set("candidates", {}), "candidates is not a list"),
    (_set("candidates", ...), "round 1: 'sjd[window=8]' is no setting it tried"),
    (_set("candidates.0.fields", None), "candidates: a setting without label, method, fields and tree"),
    (_set("candidates.0.method", "nope"), "candidates: 'sjd[window=8]': unknown method 'nope'"),
    (_set("candidates.0.fields", {"window": "eight"}), "candidates: 'sjd[window=8]': window must be an int"),
    (_set("compiled.0.label", 3), "compiled: a setting without label"),
    (_set("chosen", "bogus"), "chosen 'bogus' is no setting it tried"),
    (_set("chosen", 3), "chosen 3 is no setting it tried"),
    (_set("closest", {"label": "x", "speedup": "fast"}), "closest: speedup is not a number"),
    (_set("closest", [1]), "closest: not a row with a label"),
    (_set("quality_plan.labels", ["nope"]), "quality_plan: 'nope' is no setting it tried"),
    (_set("quality_plan.images", 10 ** 9), "quality_plan: images is not a whole number in [1, 400]"),
    (_set("quality", []), "quality is not an object"),
    (_set("quality.nope", {"ok": True, "metrics": {}}), "quality: names 'nope', no setting it tried"),
    (_set("quality.sjd[window=8].ok", "yes"), "quality: a verdict without ok and metrics"),
    (_set("quality.ar.metrics.class_accuracy", 0.5), "quality: class_accuracy is not [value, lo, hi]"),
    (_set("heldout_plan.seed", "s"), "heldout_plan: seed is not a whole number"),
    (_set("heldout_plan", None), "heldout_plan: not an object"),
    (_set("heldout_quality", []), "heldout_quality: a verdict without ok and metrics"),
])
def test_a_malformed_state_is_named(change, problem):
    from relaxspec.tuning.state import state_problem

    assert state_problem(_valid_state()) is None
    assert state_problem({**_valid_state(), "chosen": None, "closest": {"label": "sd", "speedup": 0.9, "pairs": 3,
                                                                        "relaxed": False}}) is None
    found = state_problem(change(_valid_state()))
    assert found is not None and found.startswith(problem), found


def test_a_hand_edited_state_is_refused_in_one_line_and_the_preset_kept(llamagen, tmp_path, refused):
    """A state.json of this run's settings, edited by hand: one line naming what is wrong, exit 2, and
    tune.json untouched (a bogus ``chosen`` once read as "no setting beats AR" and deleted it)."""
    out = tmp_path / "tune"
    args = ["tune", *llamagen["args"], "--lossless", "--no-compile", "--classes", "0,2", "--heldout-classes", "1",
            "--out", str(out), "--no-progress"]
    refused([*args, "--minutes", "1e-9"], "too short to measure anything")  # a state of these settings, nothing decoded
    label = "sjd[window=8]"
    state = {**json.loads((out / "state.json").read_text()),
             "candidates": [{"label": label, "method": "sjd", "fields": {"window": 8}, "tree": None}],
             "rounds": [{"labels": [label], "images": 1, "start": 0, "seed": 1, "complete": True}], "halving_done": True}
    (out / "tune.json").write_text("an earlier preset")
    for change, problem in ((_set("chosen", "bogus"), "chosen 'bogus' is no setting it tried"),
                            (_set("rounds", ...), "rounds is not a list"),
                            (_set("rounds.0.images", "1"), "round 1: images is not a whole number in [1, 400]"),
                            (_set("spent_seconds", "abc"), "spent_seconds is not a number >= 0")):
        (out / "state.json").write_text(json.dumps(change(json.loads(json.dumps(state)))))
        refused([*args, "--minutes", "1"], f"--out {out}: state.json is not a tune state this relaxspec wrote "
                                           f"({problem}); remove it or pass --overwrite")
        assert (out / "tune.json").read_text() == "an earlier preset"
    # a setting it tried, but no decode of it in the folder: refused too, the preset kept
    (out / "state.json").write_text(json.dumps({**state, "chosen": label}))
    refused([*args, "--minutes", "1"], f"(chosen '{label}' has no measurements here); remove it or pass --overwrite")
    assert (out / "tune.json").read_text() == "an earlier preset"
    # The run's other files, damaged or edited: one line too (was a KeyError / RecursionError)
    (out / "state.json").write_text(json.dumps(state))
    costs = json.loads((out / "costs.json").read_text())
    for damaged, problem in (({**costs, "target_seconds": {"x": 1}}, "target_seconds is not a table of forward sizes to seconds"),
                             ({k: v for k, v in costs.items() if k != "ar_image_seconds_estimate"},
                              "ar_image_seconds_estimate is not a positive number")):
        (out / "costs.json").write_text(json.dumps(damaged))
        refused([*args, "--minutes", "1"], f"costs.json is not one this relaxspec wrote ({problem}); remove it or "
                                           "pass --overwrite")
    (out / "costs.json").write_text("[" * 100_000)
    refused([*args, "--minutes", "1"], "costs.json is not one this relaxspec wrote (not JSON this reader takes")
    assert (out / "tune.json").read_text() == "an earlier preset"


def test_a_damaged_probe_is_named():
    from relaxspec.tuning.state import probes_problem

    good = {"exact": {"tests": [[4, 2], [1, 0]], "accepts": [[3, 1], [0, 0]], "images": 2}}
    assert probes_problem(good) is None
    assert probes_problem([]) == "not a JSON object"
    assert probes_problem({"magic": good["exact"]}) == "'magic' is not a probe of an acceptance rule"
    assert probes_problem({"exact": {**good["exact"], "tests": [[1], [1, 2]]}}) == "exact.tests is not a table of counts"
    assert probes_problem({"exact": {**good["exact"], "accepts": [[1, 1]]}}) == "exact: tests and accepts differ in shape"


@pytest.mark.parametrize("extra, message", [
    (["--lossless", "--max-tv-per-token", "0.1"], "not allowed with argument"),
    (["--lossless", "--within-ar-quality"], "not allowed with argument"),
    (["--lossless", "--minutes", "0"], "--minutes must be > 0 and at most 10080 (a week), got 0"),
    (["--lossless", "--minutes", "-3"], "--minutes must be > 0 and at most 10080 (a week), got -3"),
    (["--lossless", "--minutes", "inf"], "--minutes must be > 0 and at most 10080 (a week), got inf"),
    (["--lossless", "--minutes", "nan"], "--minutes must be > 0 and at most 10080 (a week), got nan"),
    (["--lossless", "--minutes", "1e308"], "--minutes must be > 0 and at most 10080 (a week), got 1e+308"),
    (["--lossless", "--minutes", "10081"], "--minutes must be > 0 and at most 10080 (a week), got 10081"),
    (["--within-ar-quality"], "--within-ar-quality needs --classifier DIR"),
    (["--max-tv-per-token", "2"], "--max-tv-per-token must be a number in [0, 1]"),
    ([], "choose a budget: --lossless, --max-tv-per-token X or --within-ar-quality"),
    (["--lossless", "--classifier", "C"], "--classifier / --real-data go with --within-ar-quality"),
    (["--lossless", "--classes", "1,2", "--heldout-classes", "2"], "share class 2"),
    (["--lossless", "--threads", "0"], "threads must be a whole number >= 1"),
])
def test_bad_tune_inputs_are_one_line(llamagen, tmp_path, refused, extra, message):
    refused(["tune", *llamagen["args"], *extra, "--out", str(tmp_path / "t")], message)


def test_tune_without_out_for_a_users_model_is_refused(llamagen, refused):
    refused(["tune", *llamagen["args"], "--lossless"], "--out DIR is required")


def test_the_class_split(llamagen):
    """Default: c % 4 == 1 held out; --heldout-classes alone: the rest is tuned on; disjoint always."""
    import argparse

    from relaxspec.cli.tune import split_classes
    from relaxspec.pipelines import open_pipeline

    files = llamagen["files"]
    pipeline = open_pipeline(gpt_ckpt=files["gpt"], gpt_model=files["gpt_json"], vq_ckpt=files["vq"],
                             vq_model=files["vq_json"], image_size=16)

    def split(classes=None, heldout=None):
        return split_classes(argparse.Namespace(classes=classes, heldout_classes=heldout, prompt=None,
                                                prompts_file=None), pipeline)

    assert split() == ([0, 2, 3, 4, 6, 7, 8], [1, 5, 9])
    assert split(heldout="2,3") == ([0, 1, 4, 5, 6, 7, 8, 9], [2, 3])
    assert split(classes="0,1") == ([0, 1], [5, 9])


# ---------------------------------------------------------------------------- presets refused


def _preset_from(out, **changes) -> str:
    data = json.loads((out / "tune.json").read_text())
    for key, value in changes.items():
        data[key] = {**data[key], **value}
    path = out / f"edited-{len(changes)}-{'-'.join(changes)}.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture(scope="module")
def made(llamagen, tmp_path_factory):
    """A lossless preset of the tiny files (real timings: whatever it picks)."""
    out = tmp_path_factory.mktemp("made")
    from relaxspec.pipelines import open_pipeline
    from relaxspec.pipelines.presets import preset_record
    from relaxspec import methods

    files = llamagen["files"]
    pipeline = open_pipeline(gpt_ckpt=files["gpt"], gpt_model=files["gpt_json"], vq_ckpt=files["vq"],
                             vq_model=files["vq_json"], image_size=16, drafter_ckpt=llamagen["drafter"])
    options = methods.resolve("sd", {"draft": "chain", "depth": 2})
    record = preset_record(options, pipeline.sampling(), pipeline=pipeline, threads=1, batch_size=1,
                           measured={}, budget={"kind": "lossless"}, command="test", tree_root=out)
    (out / "tune.json").write_text(json.dumps(record))
    return out


def test_presets_for_another_model_drafter_precision_or_machine_are_refused(llamagen, made, tmp_path, refused):
    args = ["generate", *llamagen["args"], "--classes", "1", "--out", str(tmp_path / "g")]
    assert main([*args, "--preset", str(made / "tune.json"), "--no-progress"]) == 0
    refused([*args, "--preset", _preset_from(made, machine={"name": "Some Other CPU"})],
            "was tuned on another kind of machine (cpu: Some Other CPU)")
    refused([*args, "--preset", _preset_from(made, model={"target": "0123456789abcdef"})],
            "was tuned for another model")
    refused([*args, "--preset", _preset_from(made, model={"drafter": "0123456789abcdef"})],
            "was tuned with another drafter")
    refused([*args, "--preset", _preset_from(made, model={"dtype": "bfloat16"})],
            "was tuned with the weights in bfloat16")
    refused([*args, "--preset", str(made / "nope.json")], "no such file")
    refused([*args, "--preset", str(made)], "is a folder, not a file")  # issue 45: it said "no such file"
    (tmp_path / "x.json").write_text(json.dumps({"kind": "something"}))
    refused([*args, "--preset", str(tmp_path / "x.json")], "not a relaxspec preset file")
    refused([*args, "--preset", str(made / "tune.json"), "--method", "ar"], "--preset names the method")
    import relaxspec

    with pytest.raises(RelaxspecError, match="was tuned for another model"):
        relaxspec.generate([1], preset=str(made / "tune.json"))  # the embedded model
    # the embedded model is another model
    refused(["generate", "--preset", str(made / "tune.json"), "--out", str(tmp_path / "e")], "was tuned for another model")
    refused(["bench", "--preset", str(made / "tune.json"), "--out", str(tmp_path / "b")], "was tuned for another model")


def test_a_preset_with_a_tree_travels_with_its_folder(llamagen, tmp_path):
    """A copied folder keeps working: the tree is named relative to the preset; a missing tree is
    refused with one line."""
    import shutil

    from relaxspec.pipelines.presets import read_preset

    folder = tmp_path / "a"
    (folder / "trees").mkdir(parents=True)
    (folder / "trees" / "t.json").write_text(json.dumps({"paths": [[0], [0, 0]]}))
    (folder / "tune.json").write_text(json.dumps({"kind": "relaxspec-preset", "version": 1,
                                                  "method": {"method": "sd", "draft": "trees/t.json"}}))
    moved = tmp_path / "b"
    shutil.copytree(folder, moved)
    shutil.rmtree(folder)
    assert read_preset(moved / "tune.json")["method"]["draft"] == str((moved / "trees" / "t.json").resolve())
    (moved / "trees" / "t.json").unlink()
    with pytest.raises(RelaxspecError, match="its tree trees/t.json is missing"):
        read_preset(moved / "tune.json")


# ---------------------------------------------------------------------------- other models


@pytest.mark.slow
def test_tune_a_janus_folder_on_prompts(cost_model, tmp_path, capsys):
    """A ``--model-path`` folder without a drafter: the drafter-free methods, tuned on the even
    prompts and measured on the odd ones."""
    pytest.importorskip("transformers")
    from helpers.janus import janus_folder_at

    folder = tmp_path / "janus"
    janus_folder_at(folder)
    prompts = tmp_path / "prompts.txt"
    texts = ["a red fox", "a blue cat", "the dog under the rain", "a lighthouse"]
    prompts.write_text("\n".join(texts) + "\n")
    out = tmp_path / "tune"
    code = main(["tune", "--model-path", str(folder), "--prompts-file", str(prompts), "--lossless", "--minutes", "0.1",
                 "--no-compile", "--out", str(out), "--no-progress"])
    assert code in (0, 1), capsys.readouterr().err
    state = json.loads((out / "state.json").read_text())
    assert state["settings"]["tune"] == texts[0::2] and state["settings"]["heldout"] == texts[1::2]
    assert {c["method"] for c in state["candidates"]} == {"sjd", "scd"}
    assert not (out / "probe.json").exists()  # no drafter: nothing to probe
    if code == 0:  # the preset holds for other prompts: the folder's target is the same model
        assert json.loads((out / "tune.json").read_text())["method"]["method"] in ("sjd", "scd")
        assert main(["generate", "--model-path", str(folder), "--prompt", "a red dog", "--preset", str(out / "tune.json"),
                     "--out", str(tmp_path / "g"), "--no-progress"]) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_tune_the_embedded_model_quickly(cost_model, tmp_path, capsys, monkeypatch):
    """The embedded model, lossless, on two classes: the probe and trees come from its drafter, and
    the preset works with generate. Six seconds cannot pay for its least search (about 20 s on one
    CPU core); the floor is tested on the tiny files, so it is lifted here to keep the test short."""
    from relaxspec.tuning import search

    monkeypatch.setattr(search.Tuner, "least_seconds", lambda self, costs: 0.0)
    out = tmp_path / "tune"
    code = main(["tune", "--lossless", "--minutes", "0.1", "--classes", "0,2", "--heldout-classes", "1",
                 "--out", str(out), "--no-progress"])
    assert code in (0, 1), capsys.readouterr().err
    if code == 0:
        assert main(["generate", "--preset", str(out / "tune.json"), "--classes", "1", "--out", str(tmp_path / "g"),
                     "--no-progress"]) == 0
    state = json.loads((out / "state.json").read_text())
    assert json.loads((out / "probe.json").read_text())["exact"]["images"] >= 2
    assert any(c["method"] == "sd" and c["fields"].get("draft", "").endswith(".json") for c in state["candidates"])


@pytest.mark.slow
def test_compiled_finalists_and_compiled_ar_join_the_last_rounds(llamagen, cost_model, tmp_path, capsys, monkeypatch):
    from relaxspec.tuning import search

    monkeypatch.setattr(search, "COMPILE_GUESS_S", {"cpu": 1.0})  # a tiny model compiles in seconds
    # (and with aot_eager in a few: which compiler compiles is not what the rounds are about)
    monkeypatch.setattr(relaxspec.compiling, "BACKEND", "aot_eager")
    out = tmp_path / "tune"
    code = main(["tune", *llamagen["args"], "--lossless", "--minutes", "0.3", "--classes", "0,2",
                 "--heldout-classes", "1", "--out", str(out), "--no-progress"])
    assert code in (0, 1), capsys.readouterr().err
    state = json.loads((out / "state.json").read_text())
    rounds = state["rounds"]
    assert len(rounds) >= 2 and len(rounds[1]["labels"]) < len(rounds[0]["labels"]) + 3  # halved, then + compiled
    assert rounds[1]["images"] >= rounds[0]["images"]
    assert state.get("compiled_added") and any(c["label"] == "ar+compile" for c in state["compiled"])
    compiled = [c["label"] for c in state["compiled"]]
    measured = [r for r in state["rounds"] if set(compiled) <= set(r["labels"])]
    assert measured and search._warmup([search.Candidate.from_dict(c) for c in state["compiled"]]) == 1
    import csv

    rows = {r["label"]: r for r in csv.DictReader((out / "settings.csv").open())}
    assert all(rows[label]["compile"] == "True" for label in compiled)


@pytest.mark.slow
def test_quality_budget_with_a_classifier(llamagen, cost_model, tmp_path, capsys):
    """``--within-ar-quality`` with a (random) classifier and no real images: the reference is an
    independent AR sample; a relaxed setting is chosen only if its quality test passed. The exact
    methods are made 20x slower, so relaxed finalists reach the test."""
    pytest.importorskip("scipy")
    cost_model["slower"] = {"sd": 20.0, "sjd": 20.0, "scd": 20.0}
    from relaxspec.evaluation.classifier import ClassifierConfig, ImageClassifier, save_classifier

    torch.manual_seed(0)
    classifier = ImageClassifier(ClassifierConfig(num_classes=10, image_size=16, channels=(8,), feature_dim=8)).eval()
    folder = save_classifier(classifier, tmp_path / "classifier")
    out = tmp_path / "tune"
    code = main(["tune", *llamagen["args"], "--within-ar-quality", "--classifier", str(folder), "--minutes", "0.15",
                 "--no-compile", "--out", str(out), "--no-progress"])
    assert code in (0, 1), capsys.readouterr().err
    state = json.loads((out / "state.json").read_text())
    assert state.get("quality_complete")
    judged = state["quality"]
    assert state["quality_plan"]["labels"], "no relaxed finalist reached the quality test"
    assert (out / "quality-reference").is_dir() and set(state["quality_plan"]["labels"]) <= set(judged)
    assert all(isinstance(judged[l]["ok"], bool) and "class_accuracy_diff_vs_ar" in judged[l]["metrics"]
               for l in state["quality_plan"]["labels"])
    assert "Quality test (" in (out / "report.md").read_text()
    if state["chosen"]:
        chosen = next(c for c in state["candidates"] if c["label"] == state["chosen"])
        if chosen["method"] in ("lantern", "cool", "gsd", "zipar", "pjd"):
            assert judged[state["chosen"]]["ok"] is True
