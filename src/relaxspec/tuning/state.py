"""The tune folder's own files: ``state.json`` (every decision of a run, kept as it is made, so
that the same command resumes) opened by :func:`open_state`, and each saved file checked where
it is read (:func:`state_problem`, :func:`costs_problem`, :func:`probes_problem`): one that this
code did not write is refused with one line, never half used."""

from __future__ import annotations

import math
from pathlib import Path

from relaxspec import methods
from relaxspec.bench.config import BASELINE
from relaxspec.errors import RelaxspecError, shown
from relaxspec.files import read_json, write_json
from relaxspec.runs.folder import RunKind, open_run, run_meta
from relaxspec.tuning.candidates import PROBE_RULES
from relaxspec.tuning.config import MAX_PLAN_IMAGES

STATE_FILE = "state.json"
#: Everything a tuning run writes in its folder (removed by --overwrite).
OWNED = ("costs.json", "probe.json", "trees", "rounds", "quality", "quality-reference", "heldout", "heldout-reference",
         STATE_FILE, "tune.json", "report.md", "settings.csv", "frontier.png")


def open_state(out: Path, settings: dict, digest: str, overwrite: bool) -> dict:
    """The ``state.json`` in ``out`` of the run whose ``settings`` hash to ``digest``: the saved
    one when it is that run's, else a fresh one (with ``overwrite``, after removing every file of
    :data:`OWNED`): :func:`relaxspec.runs.folder.open_run`, which refuses a folder of another run,
    a damaged state (:func:`state_problem`) or leftovers without a state in one line unless
    ``overwrite``."""
    state = open_run(out, TUNE_RUN, settings, overwrite=overwrite, digest=digest)
    if state is not None:
        return state
    state = run_meta(settings, digest, spent_seconds=0.0, rounds=[])
    write_json(out / STATE_FILE, state)
    return state


def read_owned(out: Path, name: str, problem) -> dict:
    """One of the run's own files in ``out``, checked by ``problem(data) -> str | None``: a
    hand-edited or damaged one is refused in one line, as a damaged state is."""
    try:
        data = read_json(out / name)
    except RelaxspecError as err:
        why = str(err).split(": ", 1)[-1]
    else:
        why = problem(data)
        if why is None:
            return data
    raise RelaxspecError(f"--out {out}: {name} is not one this relaxspec wrote ({why}); remove it or pass "
                         "--overwrite")


# ---------------------------------------------------------------------------- the files, checked

def _number_table(table) -> bool:
    """``{"1": 0.01, "4": 0.012, ...}``: forward sizes -> seconds."""
    if not isinstance(table, dict) or not table:
        return False
    try:
        return all(int(size) >= 1 and isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
                   for size, value in table.items())
    except ValueError:
        return False


def costs_problem(costs) -> str | None:
    """What is wrong with a ``costs.json`` (``None``: nothing)."""
    if not isinstance(costs, dict):
        return "not a JSON object"
    if not _number_table(costs.get("target_seconds")):
        return "target_seconds is not a table of forward sizes to seconds"
    if not isinstance(costs.get("drafter_seconds"), dict) or \
            costs["drafter_seconds"] and not _number_table(costs["drafter_seconds"]):
        return "drafter_seconds is not a table of forward sizes to seconds"
    estimate = costs.get("ar_image_seconds_estimate")
    if isinstance(estimate, bool) or not isinstance(estimate, (int, float)) or not estimate > 0:
        return "ar_image_seconds_estimate is not a positive number"
    return None


def probes_problem(probes) -> str | None:
    """What is wrong with a ``probe.json`` (``None``: nothing)."""
    if not isinstance(probes, dict):
        return "not a JSON object"
    for rule, probe in probes.items():
        if rule not in PROBE_RULES or not isinstance(probe, dict):
            return f"{shown(rule)} is not a probe of an acceptance rule"
        for key in ("tests", "accepts"):
            table = probe.get(key)
            if not isinstance(table, list) or not table or not all(
                    isinstance(row, list) and len(row) == len(table[0]) and row and
                    all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in row)
                    for row in table):
                return f"{rule}.{key} is not a table of counts"
        if len(probe["tests"]) != len(probe["accepts"]) or len(probe["tests"][0]) != len(probe["accepts"][0]):
            return f"{rule}: tests and accepts differ in shape"
        if not isinstance(probe.get("tree", ""), str):
            return f"{rule}.tree is not a tree name"
    return None


def state_problem(state) -> str | None:
    """What makes ``state`` (a parsed ``state.json``) other than a state
    :class:`~relaxspec.tuning.search.Tuner` writes, in a few words, or ``None``: its keys, their
    types and ranges, every setting it names (a label of its candidates or compiled variants, each
    a method the registry resolves) and the rows it keeps. :func:`open_state` asks this before a resumed run uses any of it."""
    if not isinstance(state, dict):
        return "not a JSON object"
    if not isinstance(state.get("settings_hash"), str):
        return "no settings_hash"
    if not isinstance(state.get("settings"), dict):
        return "no settings"
    if not _is_number(state.get("spent_seconds"), finite=True) or state["spent_seconds"] < 0:
        return "spent_seconds is not a number >= 0"
    for flag in ("halving_done", "compiled_added", "quality_complete", "done"):
        if flag in state and not isinstance(state[flag], bool):
            return f"{flag} is not true or false"
    labels = set()
    for key in ("candidates", "compiled"):
        if key not in state:
            continue
        if not isinstance(state[key], list):
            return f"{key} is not a list"
        for item in state[key]:
            problem = _candidate_problem(item)
            if problem is not None:
                return f"{key}: {problem}"
            labels.add(item["label"])
    rounds = state.get("rounds")
    if not isinstance(rounds, list):
        return "rounds is not a list"
    for number, plan in enumerate(rounds, 1):
        problem = _plan_problem(plan, labels, ("labels", "images", "start", "seed"))
        if problem is None and not isinstance(plan.get("complete"), bool):
            problem = "complete is not true or false"
        if problem is not None:
            return f"round {number}: {problem}"
    if "chosen" in state and state["chosen"] is not None and state["chosen"] not in labels:
        return f"chosen {state['chosen']!r} is no setting it tried"
    if state.get("closest") is not None:
        problem = _row_problem(state["closest"])
        if problem is not None:
            return f"closest: {problem}"
    for key, fields in (("quality_plan", ("labels", "images", "start", "seed")), ("heldout_plan", ("images", "seed"))):
        if key in state:
            problem = _plan_problem(state[key], labels, fields, empty_labels=True)
            if problem is not None:
                return f"{key}: {problem}"
    if "quality" in state:
        if not isinstance(state["quality"], dict):
            return "quality is not an object"
        for label, verdict in state["quality"].items():
            problem = (f"names {label!r}, no setting it tried" if label != BASELINE and label not in labels
                       else _verdict_problem(verdict))
            if problem is not None:
                return f"quality: {problem}"
    if "heldout_quality" in state:
        problem = _verdict_problem(state["heldout_quality"])
        if problem is not None:
            return f"heldout_quality: {problem}"
    return None


def _is_number(value, finite: bool = False) -> bool:
    """A real number (JSON's NaN too, as a measurement may be, unless ``finite``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (math.isfinite(value) or not finite)


def _is_whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _candidate_problem(item) -> str | None:
    if not isinstance(item, dict) or not isinstance(item.get("label"), str) or not isinstance(item.get("method"), str) \
            or not isinstance(item.get("fields"), dict) or not isinstance(item.get("tree"), (str, type(None))):
        return "a setting without label, method, fields and tree"
    try:
        methods.resolve(item["method"], item["fields"])
    except (RelaxspecError, TypeError, ValueError) as err:
        return f"{item['label']!r}: {err}"
    return None


def _plan_problem(plan, labels: set, fields: tuple, empty_labels: bool = False) -> str | None:
    """A round's or a phase's plan: ``labels`` (settings it tried), ``images`` (1 ..
    :data:`MAX_PLAN_IMAGES`), ``start`` (>= 0), ``seed`` (whole numbers)."""
    if not isinstance(plan, dict):
        return "not an object"
    if "labels" in fields:
        names = plan.get("labels")
        if not isinstance(names, list) or not (names or empty_labels) or not all(isinstance(n, str) for n in names):
            return "labels is not a list of settings"
        unknown = [n for n in names if n not in labels]
        if unknown:
            return f"{unknown[0]!r} is no setting it tried"
    if "images" in fields and not (_is_whole(plan.get("images"), 1) and plan["images"] <= MAX_PLAN_IMAGES):
        return f"images is not a whole number in [1, {MAX_PLAN_IMAGES}]"
    if "start" in fields and not _is_whole(plan.get("start"), 0):
        return "start is not a whole number >= 0"
    if "seed" in fields and not (isinstance(plan.get("seed"), int) and not isinstance(plan["seed"], bool)):
        return "seed is not a whole number"
    return None


def _row_problem(row) -> str | None:
    """A measured row as :meth:`~relaxspec.tuning.search.Tuner.rows` makes it (the fields the reports read)."""
    if not isinstance(row, dict) or not isinstance(row.get("label"), str):
        return "not a row with a label"
    for key in ("speedup", "speedup_lo", "speedup_hi", "tv_per_token"):
        if row.get(key) is not None and not _is_number(row[key]):
            return f"{key} is not a number"
    if row.get("pairs") is not None and not _is_whole(row["pairs"], 0):
        return "pairs is not a whole number"
    for key in ("relaxed", "quality_ok"):
        if row.get(key) is not None and not isinstance(row[key], bool):
            return f"{key} is not true or false"
    return None


def _verdict_problem(verdict) -> str | None:
    """A quality verdict: ``ok`` and its ``metrics`` (the intervals the report prints)."""
    if not isinstance(verdict, dict) or not isinstance(verdict.get("ok"), bool) or \
            not isinstance(verdict.get("metrics"), dict):
        return "a verdict without ok and metrics"
    for key, value in verdict["metrics"].items():
        if key.endswith("_diff_vs_ar") or key in ("class_accuracy", "fid_like", "precision", "recall"):
            if value is not None and not (isinstance(value, list) and len(value) == 3
                                          and all(v is None or _is_number(v) for v in value)):
                return f"{key} is not [value, lo, hi]"
    return None


#: A tuning run's folder: ``state.json`` holds its settings and every decision, beside what it writes.
TUNE_RUN = RunKind("a tuning run", STATE_FILE, "a tune state",
                   owned=tuple(name for name in OWNED if name != STATE_FILE), problem=state_problem)


__all__ = ["OWNED", "STATE_FILE", "TUNE_RUN", "costs_problem", "open_state", "probes_problem", "read_owned", "state_problem"]
