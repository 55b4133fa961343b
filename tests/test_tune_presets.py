"""``relaxspec tune``: its state and preset files, and models other than LlamaGen files.

* the state file, checked: a malformed or hand-edited ``state.json`` (or probe) is named in one
  line, and the preset kept;
* the preset file: refusal of presets made for another model, drafter or machine kind, and a
  preset with a tree travelling with its folder;
* the command on a Janus ``--model-path`` folder and the embedded model, compiled finalists, and
  a quality budget with a classifier.

The search itself is in ``test_tune.py``; the shared fixtures (the fixed ``cost_model``, the tiny
``llamagen`` files) in :mod:`helpers.tuning`.
"""

from __future__ import annotations

import json

import pytest
import torch

import relaxspec.compiling
from relaxspec.cli import main
from relaxspec.errors import RelaxspecError

from helpers.tuning import cost_model, llamagen, neighbour_cache, steady_costs  # noqa: F401 - fixtures
from helpers.tuning import model_clock


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
    refused([*args, "--preset", "/dev/null"], "is a device, not a file")  # issue 54: it said "no such file"
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
    assert {c["method"] for c in state["candidates"]} == {"sjd", "scd", "sjd-pac"}
    assert not (out / "probe.json").exists()  # no drafter: nothing to probe
    if code == 0:  # the preset holds for other prompts: the folder's target is the same model
        assert json.loads((out / "tune.json").read_text())["method"]["method"] in ("sjd", "scd", "sjd-pac")
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
    # The search's clock is the cost model's plus 30 ms a decode: its rounds ([(9, 8), (5, 32), (6, 32)]:
    # settings x images) are decided by counts, not by how busy the machine is (on the wall's clock
    # a loaded machine left no time for the third round, where the compiled finalists join)
    model_clock(monkeypatch, cost_model, per_decode=0.03)
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
    cost_model["slower"] = {"sd": 20.0, "sjd": 20.0, "scd": 20.0, "sjd-pac": 20.0}
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
