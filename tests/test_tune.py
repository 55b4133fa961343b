"""``relaxspec tune``: the search.

* the budget logic on its own: over many random rows, a setting over budget never survives a
  round and is never chosen; with nothing within budget beating AR, nothing is chosen and the
  closest setting is named;
* the command on the tiny LlamaGen-format files (with a drafter): its phases, outputs, the budget
  held, and resumption; budgets too short to measure, and honest intervals.

The tune state, preset files and other models are in ``test_tune_presets.py``.

Timings on a shared CPU are noise, so most tests replace each decode's seconds by a fixed cost
model (``cost_model``, :mod:`helpers.tuning`: a target forward costs 1 ms, a drafter forward
``drafter_ms``): the search's decisions are then a pure function of the decodes, and the
assertions exact.
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

from helpers.tuning import cost_model, llamagen, neighbour_cache, steady_costs, tune  # noqa: F401 - fixtures


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
    """The subject is the folder's refusal, not the timing: the forwards' costs are fixed
    (``steady_costs``), so a 3-second budget is never "too short to measure anything", however
    busy the machine (issue 54: it was, on a busy one)."""
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
