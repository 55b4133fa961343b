"""``relaxspec tune``'s search: the fastest setting for one model on this machine within a quality
budget, found in a wall-clock budget.

The phases, each kept in the output folder so that running the same command again continues:

1. **cost curve** (``costs.json``): target forwards over 1..64 tokens and drafter forwards, timed
   here (:func:`relaxspec.bench.cost.measure_forward_costs`);
2. **probe** (``probe.json``): per-(depth, rank) acceptance counts from decoding the tune images
   with a wide tree under the exact rule and (relaxed budgets) with deep trees under LANTERN at a
   mild and at a strong relaxation (:data:`relaxspec.tuning.candidates.PROBE_RULES`);
3. **trees** (``trees/``): per rule, the trees that commit the most tokens per second
   (:func:`relaxspec.tuning.candidates.candidate_trees`);
4. **successive halving** (``rounds/rN``): every candidate setting decodes the same new tune
   images as eager AR, alternated image by image (``relaxspec bench``'s runner); after each round
   the settings over budget are dropped and the slower half goes, so the finalists are measured
   on the most images. Compiled variants of the finalists (and compiled AR) join the last rounds;
5. **quality** (``--within-ar-quality``, ``quality/``): the relaxed finalists and AR decode fresh
   tune images, scored with the classifier against real images or, without them, against an
   independent AR sample of the same classes; a setting passes when its paired intervals against
   AR hold 0;
6. **held-out** (``heldout/``): the chosen setting and AR on images of classes (or prompts) the
   search never saw: the speed-up the preset reports.

Decisions (the survivors and size of each round, the choice) are written to ``state.json`` as
they are made, so a resumed run never re-decides differently; the time spent is kept there too
and counts against ``--minutes`` across resumptions. A ``state.json`` is checked where it is read
(:func:`relaxspec.tuning.state.state_problem`): one that this code did not write is refused with
one line, never half used. The speed-ups, MAL and TV reported are recomputed from the decodes'
records on every run (the closest setting's too, though the state keeps a copy), so a state saved
before tune's MAL meant bench's (tokens per target forward) resumes with today's numbers.

Budgets: ``--minutes`` is at most :data:`MAX_MINUTES` (a week). Once the forwards are timed, a
budget that cannot pay for the least search (the probe, every setting and AR once, the winner and
AR on :data:`MIN_INTERVAL_PAIRS` held-out images) is refused (exit 2) before any image is decoded:
nothing is decided and no preset written; the timed forwards are kept, so the same command with
more minutes goes on. A speed-up measured on fewer than :data:`MIN_INTERVAL_PAIRS` paired images
carries no interval (``None`` bounds and its pair count): a bootstrap over one pair is ``[x, x]``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from relaxspec.bench.config import BASELINE, MethodSpec
from relaxspec.bench.report import (MIN_INTERVAL_PAIRS, pairwise_speedups, quality_metrics, speedup_interval,
                                    tokens_per_forward, within_baseline_quality)
from relaxspec.bench.run import read_records, run_bench
from relaxspec.decoding.result import add_counts
from relaxspec.devices import machine_identity
from relaxspec.errors import RelaxspecError
from relaxspec.files import write_json
from relaxspec.runs.folder import settings_hash
from relaxspec.tuning.budget import choose, pareto, survivors, within
from relaxspec.tuning.candidates import (LEGACY_PROBE_TREE, PROBE_RULES, PROBE_TREES, Candidate, build_candidates,
                                         candidate_trees)
from relaxspec.tuning.config import (MAX_MINUTES, MAX_PLAN_IMAGES, MIN_QUALITY_IMAGES, TuneConfig, check_minutes,
                                     round_up)
from relaxspec.tuning.state import STATE_FILE, costs_problem, open_state, probes_problem, read_owned
from relaxspec.bench.cost import measure_forward_costs, ForwardCosts

#: Shares of the budget kept for the held-out measurement and for the quality test.
HELDOUT_SHARE, QUALITY_SHARE = 0.15, 0.2
#: Compiling a setting costs about this on a CPU (seconds, assumed before it is measured).
COMPILE_GUESS_S = {"cpu": 30.0, "cuda": 30.0}
#: A round's settings: at most this many finalists get a compiled variant.
COMPILED_FINALISTS = 2
MIN_PROBE_TESTS = 10
#: Successive halving stops after this many rounds.
MAX_ROUNDS = 8


class Tuner:
    """One tuning run of ``pipeline`` under ``sampling`` into ``out`` (see the module docstring);
    :meth:`run` returns the result dict that :mod:`relaxspec.tuning.report` writes up."""

    def __init__(self, pipeline, sampling, out, config: TuneConfig, *, overwrite: bool = False):
        check_minutes(config.minutes)
        if config.budget.kind == "quality" and config.classifier is None:
            raise RelaxspecError("--within-ar-quality needs a quality source: --classifier DIR (and --real-data NPZ)")
        if len(config.tune) < 1 or len(config.heldout) < 1:
            raise RelaxspecError("tuning needs at least one tune and one held-out class (or prompt)")
        self.pipeline, self.sampling, self.out, self.config = pipeline, sampling, Path(out), config
        self.device = pipeline.device
        self.budget_s = 60.0 * config.minutes
        self.settings = self._settings()
        digest = settings_hash(self.settings)
        self.state = open_state(self.out, self.settings, digest, overwrite)
        self.started = time.perf_counter()
        self.spent_before = float(self.state.get("spent_seconds", 0.0))

    # ------------------------------------------------------------------ state
    def _settings(self) -> dict:
        c = self.config
        return {"budget": c.budget.to_dict(), "model": self.pipeline.fingerprint(),
                "machine": machine_identity(self.device), "device": str(self.device), "sampling": self.sampling.to_dict(),
                "tune": [str(x) for x in c.tune], "heldout": [str(x) for x in c.heldout], "seed": c.seed,
                "threads": c.threads, "batch_size": c.batch_size, "compile": c.compile,
                "quality_source": c.quality_source, **c.extra_identity}

    def spent(self) -> float:
        return self.spent_before + time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - self.spent()

    def save(self) -> None:
        self.state["spent_seconds"] = self.spent()
        write_json(self.out / STATE_FILE, self.state)

    def say(self, text: str) -> None:
        if self.config.progress:
            print(f"tune [{self.spent() / 60:5.1f}/{self.config.minutes:g} min]: {text}", file=sys.stderr)

    # ------------------------------------------------------------------ images
    def images(self, pool: list, start: int, count: int):
        """The :class:`~relaxspec.conditions.Condition` of ``count`` images cycling through ``pool``
        (class ids or prompts) from ``start``."""
        picked = [pool[(start + i) % len(pool)] for i in range(count)]
        if self.pipeline.takes == "prompts":
            return self.pipeline.conditions(prompts=[str(p) for p in picked])
        return self.pipeline.conditions(classes=[int(c) for c in picked])

    def bench(self, folder: str, candidates: list[Candidate], images, seed: int, warmup: int) -> list[dict]:
        specs = [MethodSpec(label=BASELINE, options={"method": "ar"}, family=BASELINE)] + [c.spec() for c in candidates]
        return run_bench(self.pipeline, images, specs, self.sampling, self.out / folder, seed=seed, threads=self.config.threads, warmup=warmup,
                         batch_size=self.config.batch_size, progress=self.config.progress)

    # ------------------------------------------------------------------ phases
    def run(self) -> dict:
        try:
            costs = self.cost_curve()
            if not self.state["rounds"]:
                self.check_time(costs)
            trees = self.trees(costs) if self.pipeline.drafter is not None else {}
            self.candidates(trees)
            if not self.state.get("halving_done"):
                self.halving()
            if self.config.budget.kind == "quality":
                self.quality_test()
            rows = self.rows()
            chosen = self.choice(rows)
            heldout = self.heldout(chosen) if chosen is not None else None
            self.state["done"] = True
            return {"rows": rows, "chosen": chosen, "heldout": heldout, "trees": trees, "costs": costs,
                    "closest": self.closest(rows), "spent_seconds": self.spent(),
                    "candidates": {c.label: c for c in self.all_candidates()}}
        finally:
            self.save()

    def cost_curve(self) -> dict:
        path = self.out / "costs.json"
        if path.exists():
            return read_owned(self.out, "costs.json", costs_problem)

        self.say("timing the target and drafter forwards (the cost curve)")
        cond = mask = None
        if self.pipeline.takes == "prompts":
            first = self.images(self.config.tune, 0, 1)
            cond, mask = first.cond.to(self.device), None if first.mask is None else first.mask.to(self.device)
        with pinned_threads(self.config.threads):
            costs = measure_forward_costs(self.pipeline.target, self.pipeline.drafter, sampling=self.sampling,
                                          reps=7 if self.budget_s >= 300 else 3, warmup=1, cond=cond, cond_mask=mask)
        data = costs.to_dict()
        data["ar_image_seconds_estimate"] = costs.target_seconds(1) * self.pipeline.image_tokens
        write_json(path, data)
        self.save()
        return data

    def least_seconds(self, costs: dict) -> float:
        """The least search, from the timed forwards: the probe (when still to do), every setting
        and AR on one image (the settings without trees: the trees only add more), the winner and AR
        on :data:`MIN_INTERVAL_PAIRS` held-out images, and (quality budget) the quality test of one
        finalist against AR and its reference. A floor: a decode is taken as one AR image."""
        image = float(costs["ar_image_seconds_estimate"])
        has_drafter = self.pipeline.drafter is not None
        path = self.out / "probe.json"
        done = read_owned(self.out, "probe.json", probes_problem) if path.exists() else {}
        probes = 2 * len(self.rules_to_probe(done)) if has_drafter else 0
        settings = len(build_candidates(self.config.budget, {}, has_drafter))
        decodes = probes + settings + 1 + 2 * MIN_INTERVAL_PAIRS
        if self.config.budget.kind == "quality":
            decodes += 3 * MIN_QUALITY_IMAGES
        return decodes * image

    def check_time(self, costs: dict) -> None:
        """Refuse, before any image is decoded, a budget that cannot pay for the least search."""
        least, left = self.least_seconds(costs), self.left()
        if left >= least:
            return
        needed = (self.spent() + least) / 60
        minutes = round_up(needed * 1.2)  # a little more: the floor is an estimate
        if minutes > MAX_MINUTES:
            raise RelaxspecError(f"the least search (the probe, every setting once against AR, the winner on "
                                 f"{MIN_INTERVAL_PAIRS} held-out images) needs about {least:.3g} s here, more than "
                                 f"--minutes allows ({MAX_MINUTES}, a week): nothing was decided and no tune.json "
                                 "written")
        raise RelaxspecError(
            f"--minutes {self.config.minutes:g} is too short to measure anything: the forwards were timed (an AR image "
            f"takes about {costs['ar_image_seconds_estimate']:.3g} s here), {max(left, 0):.3g} s are left, and the "
            f"least search (the probe, every setting once against AR, the winner on {MIN_INTERVAL_PAIRS} held-out images) "
            f"needs about {least:.3g} s; nothing was decided and no tune.json written: give --minutes >= {minutes:g} "
            "(the same command goes on from the timed forwards)")

    def probe_rules(self) -> list[str]:
        """The acceptance rules whose rates the probe measures (:data:`PROBE_RULES`): the relaxed
        ones only when the budget allows relaxed settings."""
        return [rule for rule in PROBE_RULES if rule == "exact" or self.config.budget.relaxed_allowed]

    def rules_to_probe(self, probes: dict) -> list[str]:
        """The rules still to probe: none once the candidates are decided (their trees are chosen;
        a rule probed later would change nothing), else those without a probe with today's tree
        (:data:`PROBE_TREES`; a probe that recorded none was made with ``probe6x6``, every
        probe's tree before the trees were per rule)."""
        if "candidates" in self.state:
            return []
        return [rule for rule in self.probe_rules()
                if rule not in probes or probes[rule].get("tree", LEGACY_PROBE_TREE) != PROBE_TREES[rule]]

    def trees(self, costs: dict) -> dict:
        path = self.out / "probe.json"
        probes = read_owned(self.out, "probe.json", probes_problem) if path.exists() else {}
        rules = self.probe_rules()
        count = max(2, min(12, int(self.budget_s / 150)))
        folder = self.out / "trees"
        for rule in self.rules_to_probe(probes):
            for stale in folder.glob(f"{rule}-*.json"):  # trees of an earlier probe of this rule
                stale.unlink()
            fields = dict(PROBE_RULES[rule])
            method = fields.pop("method")
            shown = ", ".join(f"{k} {v}" for k, v in fields.items())
            self.say(f"probing acceptance per (depth, rank) with the {PROBE_TREES[rule]} tree, {rule} rule "
                     f"({method}{', ' + shown if shown else ''}), {count} images")
            prepared = self.pipeline.prepare(self.pipeline.method(method, {"draft": "static", "tree": PROBE_TREES[rule],
                                                                             **fields}), self.sampling)
            tests = accepts = None
            with pinned_threads(self.config.threads):
                for start in range(0, count, max(1, self.config.batch_size)):
                    n = min(max(1, self.config.batch_size), count - start)
                    condition = self.images(self.config.tune, start, n)
                    generator = torch.Generator(device=self.device).manual_seed(self.config.seed * 1000003 + 77 + start)
                    result = self.pipeline.generate(condition, prepared, generator=generator)
                    tests, accepts = add_counts(tests, result.rank_tests.double().cpu()), \
                        add_counts(accepts, result.rank_accepts.double().cpu())
            probes[rule] = {"tests": tests.tolist(), "accepts": accepts.tolist(), "images": count,
                            "tree": PROBE_TREES[rule]}
            write_json(path, probes)
            self.save()
        table = ForwardCosts({int(k): v for k, v in costs["target_seconds"].items()},
                             {int(k): v for k, v in costs["drafter_seconds"].items()})
        folder.mkdir(exist_ok=True)
        found = {}
        for rule in (rule for rule in rules if rule in probes):  # a run decided before a rule was probed has none
            tests = torch.tensor(probes[rule]["tests"], dtype=torch.float64)
            accepts = torch.tensor(probes[rule]["accepts"], dtype=torch.float64)
            rates = torch.where(tests >= MIN_PROBE_TESTS, accepts / tests.clamp(min=1), torch.zeros_like(tests))
            found[rule] = []
            for name, spec, facts in candidate_trees(rates, table.step_seconds, table.target_seconds(1)):
                tree_path = folder / f"{rule}-{name}.json"
                if not tree_path.exists():
                    tree_path.write_text(json.dumps({"paths": [list(p) for p in spec.paths], **facts}) + "\n")
                found[rule].append({"name": f"{rule}-{name}", "path": str(tree_path.resolve()), **facts})
        return found

    def candidates(self, trees: dict) -> list[Candidate]:
        if "candidates" not in self.state:
            found = build_candidates(self.config.budget, trees, self.pipeline.drafter is not None)
            self.state["candidates"] = [c.to_dict() for c in found]
            self.save()
        return [Candidate.from_dict(c) for c in self.state["candidates"]]

    def all_candidates(self) -> list[Candidate]:
        extra = [Candidate.from_dict(c) for c in self.state.get("compiled", [])]
        return [Candidate.from_dict(c) for c in self.state["candidates"]] + extra

    # ------------------------------------------------------------------ halving
    def _reserve(self) -> float:
        share = HELDOUT_SHARE + (QUALITY_SHARE if self.config.budget.kind == "quality" else 0.0)
        return share * self.budget_s

    def _seconds_per_image(self, rows: dict[str, dict], label: str) -> float:
        row = rows.get(label)
        if row and row.get("seconds"):
            return row["seconds"]
        ar = rows.get(BASELINE, {}).get("seconds")
        if ar:
            return ar
        costs = read_owned(self.out, "costs.json", costs_problem)
        return costs["ar_image_seconds_estimate"] * 1.5

    def halving(self) -> None:
        by_label = {c.label: c for c in self.all_candidates()}
        rounds = self.state["rounds"]
        used = sum(r["images"] for r in rounds)
        while True:
            if rounds and not rounds[-1].get("complete"):
                current = rounds[-1]
            else:
                current = self._next_round(used)
                if current is None:
                    self.state["halving_done"] = True  # decided once: a resumed run goes on from here
                    self.save()
                    break
                rounds.append(current)
                by_label = {c.label: c for c in self.all_candidates()}
                self.save()
            index = len(rounds)
            self.say(f"round {index}: {len(current['labels'])} settings x {current['images']} images, paired with AR")
            chosen = [by_label[label] for label in current["labels"]]
            self.bench(f"rounds/r{index}", chosen, self.images(self.config.tune, current["start"], current["images"]),
                       current["seed"], warmup=_warmup(chosen))
            current["complete"] = True
            used = current["start"] + current["images"]
            self.save()

    def _next_round(self, used: int) -> dict | None:
        """The next round's settings and image count, or ``None`` when the search is over (one
        setting left, or no time for a round that measures more images than the last)."""
        rounds = self.state["rounds"]
        if len(rounds) >= MAX_ROUNDS:
            return None
        variants: list[Candidate] = []
        if not rounds:
            labels = self.state_labels()
        else:
            labels = self.finalists()
            variants = self._compiled_variants(labels)
            if len(labels) + len(variants) <= 1:
                return None
            labels = labels + [v.label for v in variants]
        rows = {r["label"]: r for r in self.rows()}
        per_image = sum(self._seconds_per_image(rows, l) for l in labels) + self._seconds_per_image(rows, BASELINE)
        measured = {l for r in rounds for l in r["labels"]}
        compiling = sum(1 for l in labels if l.endswith("+compile") and l not in measured)
        fixed = compiling * COMPILE_GUESS_S.get(self.device.type, 30.0)
        left = self.left() - self._reserve() - fixed
        rounds_left = max(1, math.ceil(math.log2(max(len(labels), 2))))
        planned = int(left / max(per_image * rounds_left, 1e-9))  # this round's share of what is left
        now = int(left / max(per_image, 1e-9))  # the most this round can take
        if not rounds:
            images = max(1, min(planned, 8))  # every setting is measured at least once
        else:
            floor = rounds[-1]["images"]
            if now < floor:
                return None  # no time for a round on as many images as the last: the estimates so far decide
            images = min(max(planned, floor), now, 4 * floor, 256)
            if set(labels) == set(rounds[-1]["labels"]) and images <= floor:
                return None  # the same settings on as few images again: the later phases need the time more
        if rounds and variants:  # they are tried from now on
            self.state["compiled"] = [v.to_dict() for v in variants]
            self.state["compiled_added"] = True
        return {"labels": labels, "images": images, "start": used, "seed": self.config.seed * 7919 + 101 + len(rounds),
                "complete": False}

    def finalists(self) -> list[str]:
        """The survivors of the last complete round (:func:`relaxspec.tuning.budget.survivors`:
        the faster half within budget, plus the speed / TV front while quality is unknown)."""
        rounds = [r for r in self.state["rounds"] if r.get("complete")]
        if not rounds:
            return []
        rows = {r["label"]: r for r in self.rows(rounds_only=True)}
        previous = rounds[-1]["labels"]
        return survivors([rows[l] for l in previous if l in rows], self.config.budget, math.ceil(len(previous) / 2))

    def state_labels(self) -> list[str]:
        return [c["label"] for c in self.state["candidates"]]

    def _compiled_variants(self, labels: list[str]) -> list[Candidate]:
        """Compiled variants of the fastest finalists (and compiled AR): they join, once, when few
        settings are left (compiling costs a fixed price per setting)."""
        if not self.config.compile or self.state.get("compiled_added") or len(labels) > 2 * COMPILED_FINALISTS:
            return []
        base = {c.label: c for c in self.all_candidates()}
        variants = [base[l].compiled() for l in labels[:COMPILED_FINALISTS] if not base[l].fields.get("compile")]
        return variants + [Candidate("ar+compile", "ar", {"compile": True})]

    # ------------------------------------------------------------------ measurements
    def _folders(self, rounds_only: bool = False) -> list[Path]:
        folders = [self.out / f"rounds/r{i + 1}" for i, r in enumerate(self.state["rounds"])]
        if not rounds_only and (self.out / "quality").exists():
            folders.append(self.out / "quality")
        return folders

    def rows(self, rounds_only: bool = False) -> list[dict]:
        """One row per tried setting over every tune image it decoded (rounds and the quality
        test, each paired with AR in its own folder): median paired speed-up with a bootstrap
        interval (``None`` bounds under :data:`MIN_INTERVAL_PAIRS` pairs), mean TV per token, seconds
        per image, MAL (bench's: tokens / target forwards over all its images), and the quality
        verdict."""
        ratios: dict[str, list] = {}
        decoded: dict[str, list[dict]] = {}
        for folder in self._folders(rounds_only):
            records = read_records(folder)
            for label in dict.fromkeys(r["method"] for r in records):
                decoded.setdefault(label, []).extend(r for r in records if r["method"] == label)
                if label != BASELINE:  # paired within a folder: image indices restart in each
                    ratios.setdefault(label, []).extend(pairwise_speedups(records, label).tolist())
        candidates = {c.label: c for c in self.all_candidates()}
        quality = self.state.get("quality", {})
        rows = []
        for label, mine in decoded.items():
            cand = candidates.get(label)
            relaxed = cand.relaxed if cand is not None else False
            certified = cand is None or cand.certified
            r = np.asarray(ratios.get(label, []), dtype=np.float64)
            speed = speedup_interval(r)
            tv = [x["tv_per_token"] for x in mine if x.get("tv_per_token") is not None]
            family = (cand.method + ("++" if "lam" in cand.fields else "")) if cand else "ar"
            row = {"label": label, "method": cand.method if cand else "ar", "family": family, "relaxed": relaxed,
                   "tree": cand.tree if cand else None, "speedup": speed[0], "speedup_lo": speed[1],
                   "speedup_hi": speed[2], "pairs": int(len(r)),
                   "seconds": float(np.mean([x["seconds"] for x in mine])),
                   "mal": tokens_per_forward(mine, self.pipeline.image_tokens),
                   # an uncertified record (rows in parallel) leaves the TV unknown
                   "tv_per_token": ((float(np.mean(tv)) if tv and certified else None) if relaxed else 0.0),
                   "compile": bool(cand.fields.get("compile")) if cand else False}
            if label in quality and not rounds_only:
                row["quality_ok"] = quality[label]["ok"]
                row["quality"] = quality[label]["metrics"]
            rows.append(row)
        return rows

    # ------------------------------------------------------------------ quality
    def quality_test(self) -> None:
        if "quality" in self.state and self.state.get("quality_complete"):
            return
        rows = [r for r in self.rows() if r["label"] != BASELINE]
        last = set(self.finalists())
        pending = [r for r in rows if r["relaxed"] and within(r, self.config.budget) is None and r["label"] in last]
        exact_best = max((r["speedup"] for r in rows if not r["relaxed"] and r["speedup"] is not None), default=1.0)
        finalists = sorted([r for r in pareto(pending) if r["speedup"] > exact_best], key=lambda r: -r["speedup"])[:4]
        if "quality_plan" not in self.state:
            per_image = sum(r["seconds"] for r in finalists) + 2 * self._seconds_per_image(
                {r["label"]: r for r in self.rows()}, BASELINE)
            images = int(max(self.left() - HELDOUT_SHARE * self.budget_s, 0) / max(per_image, 1e-9))
            used = sum(r["images"] for r in self.state["rounds"])
            self.state["quality_plan"] = {"labels": [r["label"] for r in finalists],
                                          "images": max(MIN_QUALITY_IMAGES, min(images, MAX_PLAN_IMAGES)),
                                          "start": used, "seed": self.config.seed * 7919 + 31}
            self.save()
        plan = self.state["quality_plan"]
        if not plan["labels"]:
            self.state["quality"], self.state["quality_complete"] = {}, True
            return
        by_label = {c.label: c for c in self.all_candidates()}
        self.say(f"quality: {len(plan['labels'])} relaxed finalists x {plan['images']} images, against AR")
        images = self.images(self.config.tune, plan["start"], plan["images"])
        finalists = [by_label[l] for l in plan["labels"]]
        records = self.bench("quality", finalists, images, plan["seed"], warmup=_warmup(finalists))
        self.state["quality"] = self.judge(records, plan["labels"], images, "quality-reference", plan["seed"] + 1)
        self.state["quality_complete"] = True
        self.save()

    def judge(self, records: list[dict], labels: list[str], images, reference_folder: str, reference_seed: int) -> dict:
        """Per label: its quality metrics against the reference and whether its paired intervals
        against AR hold 0 (:func:`relaxspec.bench.report.within_baseline_quality`)."""
        if self.pipeline.takes != "classes":
            raise RelaxspecError("the quality budget scores class-conditional images (a classifier); for a prompt "
                                 "model use --lossless or --max-tv-per-token")
        fake = {}
        indices = {}
        for label in [BASELINE] + labels:
            mine = sorted((r for r in records if r["method"] == label), key=lambda r: r["index"])
            tokens = torch.tensor([r["tokens"] for r in mine])
            fake[label] = (self.pipeline.pixels(tokens), np.array([r["class"] for r in mine]))
            indices[label] = [r["index"] for r in mine]
        if self.config.real_images is not None:  # the command checked there are two or more of each set
            classes = sorted({int(record["class"]) for record in images.records})
            reference = self.config.real_images[np.isin(self.config.real_labels, classes)]
        else:
            self.say("quality reference: an independent AR sample of the same classes")
            ref = run_bench(self.pipeline, images, [MethodSpec(label=BASELINE, options={"method": "ar"}, family=BASELINE)],
                            self.sampling, self.out / reference_folder, seed=reference_seed, threads=self.config.threads,
                            warmup=0, batch_size=self.config.batch_size, progress=self.config.progress)
            ref = sorted(ref, key=lambda r: r["index"])
            reference = self.pipeline.pixels(torch.tensor([r["tokens"] for r in ref]))
        metrics = quality_metrics(fake, self.config.classifier, reference, indices=indices, n_boot=200)
        return {label: {"ok": bool(within_baseline_quality({"quality": metrics[label]})), "metrics": metrics[label]}
                for label in labels} | {BASELINE: {"ok": True, "metrics": metrics[BASELINE]}}

    # ------------------------------------------------------------------ the choice
    def choice(self, rows: list[dict]) -> dict | None:
        if "chosen" in self.state:
            label = self.state["chosen"]
            if label is None:
                return None
            row = next((r for r in rows if r["label"] == label), None)
            if row is None:  # a known setting, but none of its decodes is in the folder: not this run's
                raise RelaxspecError(f"--out {self.out}: {STATE_FILE} is not a tune state this relaxspec wrote "
                                     f"(chosen {label!r} has no measurements here); remove it or pass --overwrite")
            return row
        pool = [r for r in rows if r["label"] != BASELINE]
        chosen, closest = choose(pool, self.config.budget)
        self.state["chosen"] = chosen["label"] if chosen else None
        self.state["closest"] = closest
        self.save()
        return chosen

    def closest(self, rows: list[dict]) -> dict | None:
        """The setting nearest to qualifying when none did (decided once, kept by label), with its
        numbers as measured now: the copy in a state saved before tune's MAL meant bench's (tokens
        / target forwards) holds a mean of per-image MALs."""
        kept = self.state.get("closest")
        if kept is None:
            return None
        return next((row for row in rows if row["label"] == kept["label"]), kept)

    def heldout(self, chosen: dict) -> dict:
        by_label = {c.label: c for c in self.all_candidates()}
        if "heldout_plan" not in self.state:
            rows = {r["label"]: r for r in self.rows()}
            per_image = rows[chosen["label"]]["seconds"] + self._seconds_per_image(rows, BASELINE)
            if self.config.budget.kind == "quality":
                per_image += self._seconds_per_image(rows, BASELINE)
            images = int(max(self.left(), 0) / max(per_image, 1e-9))
            self.state["heldout_plan"] = {"images": max(MIN_INTERVAL_PAIRS, min(images, MAX_PLAN_IMAGES)),
                                          "seed": self.config.seed * 7919 + 57}
            self.save()
        plan = self.state["heldout_plan"]
        self.say(f"held-out: {chosen['label']} and AR on {plan['images']} images of classes or prompts the search "
                 "never saw")
        images = self.images(self.config.heldout, 0, plan["images"])
        records = self.bench("heldout", [by_label[chosen["label"]]], images, plan["seed"], warmup=1)
        ratios = pairwise_speedups(records, chosen["label"])
        mine = [r for r in records if r["method"] == chosen["label"]]
        tv = [r["tv_per_token"] for r in mine if r.get("tv_per_token") is not None]
        result = {"images": len(mine), "speedup": speedup_interval(ratios, n_boot=500), "pairs": int(len(ratios)),
                  "seconds": float(np.mean([r["seconds"] for r in mine])),
                  "ar_seconds": float(np.mean([r["seconds"] for r in records if r["method"] == BASELINE])),
                  "mal": tokens_per_forward(mine, self.pipeline.image_tokens),
                  # None: unknown (rows in parallel: the tuning rows say so), as for the search's rows
                  "tv_per_token": (0.0 if not chosen["relaxed"] else
                                   float(np.mean(tv)) if tv and chosen.get("tv_per_token") is not None else None)}
        if self.config.budget.kind == "quality" and chosen["relaxed"]:
            if "heldout_quality" not in self.state:
                self.state["heldout_quality"] = self.judge(records, [chosen["label"]], images, "heldout-reference",
                                                           plan["seed"] + 1)[chosen["label"]]
                self.save()
            result["quality"] = self.state["heldout_quality"]
        budget = self.config.budget
        if budget.kind == "tv" and chosen["relaxed"]:
            result["within_budget"] = result["tv_per_token"] is not None and result["tv_per_token"] <= budget.max_tv_per_token
        elif budget.kind == "quality" and chosen["relaxed"]:
            result["within_budget"] = bool(result["quality"]["ok"])
        else:
            result["within_budget"] = True
        return result


def _warmup(candidates: list[Candidate]) -> int:
    """One unrecorded decode per setting first when any compiles (compilation stays out of the
    timings, also in a round resumed in a new process); none otherwise."""
    return 1 if any(c.fields.get("compile") for c in candidates) else 0


@contextmanager
def pinned_threads(threads: int | None):
    """Pin torch's CPU threads for a block (``None`` leaves them); restored afterwards."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


__all__ = ["Tuner", "pinned_threads"]