"""What the ``relaxspec tune`` tests share: the neighbour-table cache off ``~/.cache``, the fixed
cost model that makes the search's decisions exact, the tiny LlamaGen files with a drafter, and
running the command."""

from __future__ import annotations

import pytest

from relaxspec.cli import main


@pytest.fixture(autouse=True)
def neighbour_cache(monkeypatch, tmp_path_factory):
    """LANTERN's neighbour tables go to a temporary cache, not ~/.cache."""
    monkeypatch.setenv("RELAXSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "neighbour-cache"))


@pytest.fixture(autouse=True)
def steady_costs(fixed_forward_costs):
    """Every tune test runs on fixed forward costs (``fixed_forward_costs`` in conftest.py)."""
    return fixed_forward_costs


@pytest.fixture
def cost_model(monkeypatch):
    """Replace every benchmarked decode's seconds by ``1 ms x target forwards + drafter_ms x
    drafter forwards``; returns a dict whose ``drafter_ms``, ``ar_factor`` (AR's
    seconds are multiplied by it) and ``slower`` (method name -> factor) a test may change, and which counts the
    decodes recorded and sums their seconds (``seconds``: a clock a test may give the search, :func:`model_clock`)."""
    from relaxspec.bench import run

    real = run.result_records
    model = {"drafter_ms": 0.1, "ar_factor": 1.0, "slower": {}, "decodes": 0, "seconds": 0.0}

    def fake(result, wall, method, *args, **kwargs):
        records = real(result, wall, method, *args, **kwargs)
        model["decodes"] += 1
        for r in records:
            r["seconds"] = 1e-3 * r["target_forwards"] + 1e-3 * model["drafter_ms"] * r["drafter_forwards"]
            if method.label == "ar":
                r["seconds"] *= model["ar_factor"]
            r["seconds"] *= model["slower"].get(method.label.split("[")[0], 1.0)
            model["seconds"] += r["seconds"]
        return records

    monkeypatch.setattr(run, "result_records", fake)
    return model


def model_clock(monkeypatch, cost_model: dict, per_decode: float = 0.0) -> None:
    """The search's clock reads the cost model's seconds (plus ``per_decode`` for every decode
    recorded) instead of the wall's: what it has spent, and so how many rounds of how many images
    it plans, no longer depends on how busy the machine is."""
    from types import SimpleNamespace

    from relaxspec.tuning import search

    clock = SimpleNamespace(perf_counter=lambda: cost_model["seconds"] + per_decode * cost_model["decodes"])
    monkeypatch.setattr(search, "time", clock)


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
