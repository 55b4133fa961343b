"""benchmarks/gpu.py's run record: a GPU lease has one try, so what a run measured must survive a
budget that runs out, an item that fails and a command stopped at its time limit."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_script", ROOT / "benchmarks" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_record_is_written_after_every_item_and_keeps_going(tmp_path, capsys) -> None:
    gpu = load_script()
    path = tmp_path / "gpu.json"
    report = gpu.Report(path, budget=60.0, head={"device": "cpu"})
    assert json.loads(path.read_text()) == {"device": "cpu"}
    assert report.item(("xl", "ar_ms"), lambda: 1.5) == 1.5
    assert json.loads(path.read_text())["xl"] == {"ar_ms": 1.5}  # on disk before the next item starts
    assert "- xl / ar_ms: 1.5" in path.with_suffix(".md").read_text()  # and as markdown beside it

    def broken():
        raise RuntimeError("CUDA error: out of memory")

    report.item(("xl", "engine", "sd-chain"), broken)
    assert report.item(("xl", "engine", "too long"), lambda: 1 / 0, need=3600.0) is None  # never started
    record = json.loads(path.read_text())
    assert record["xl"]["engine"]["sd-chain"] == {"error": "RuntimeError: CUDA error: out of memory"}
    assert "budget left" in record["xl"]["engine"]["too long"]["skipped"]
    assert record["xl"]["ar_ms"] == 1.5
    assert "skipped xl/engine/too long" in capsys.readouterr().out
    assert "- xl / engine / sd-chain / error: RuntimeError" in path.with_suffix(".md").read_text()


def test_the_heldout_part_keeps_what_it_measured(tmp_path, monkeypatch) -> None:
    """The held-out bench on the device: a run cut at its time is reported from its finished images
    (``--report-only``), and a run that fails (one method's graph on a new torch, say) is run again
    without sjd-pac, so the other methods' numbers still come back. Every call is the README's
    held-out command, compiled, against compiled AR."""
    import subprocess

    gpu = load_script()
    calls = []

    def run(command, check, timeout):
        calls.append(command)
        out = Path(command[command.index("--out") + 1])
        methods = command[command.index("--methods") + 1]
        if "--report-only" not in command:
            if behaviour == "slow":
                raise subprocess.TimeoutExpired(command, timeout)
            if behaviour == "broken" and "sjd-pac" in methods.split(","):
                raise subprocess.CalledProcessError(1, command)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({"methods": methods}))

    monkeypatch.setattr(gpu.subprocess, "run", run)
    behaviour = "slow"
    summary = gpu.heldout_bench("cuda", tmp_path / "slow", 100, 30.0)
    assert summary["methods"] == gpu.HELDOUT_METHODS and "--report-only" in calls[-1] and len(calls) == 2
    for command in calls:
        assert {"--compile", "--baseline", "ar-compiled", "--classes", gpu.HELDOUT_CLASSES} <= set(command)
        assert command[command.index("--num-images") + 1] == "100"
    assert gpu.HELDOUT_CLASSES.split(",")[:3] == ["1", "5", "9"] and len(gpu.HELDOUT_CLASSES.split(",")) == 25
    behaviour, calls[:] = "broken", []
    summary = gpu.heldout_bench("cuda", tmp_path / "broken", 100, 30.0)
    assert "error" in summary and "sjd-pac" not in summary["without_sjd_pac"]["methods"].split(",")
    assert summary["without_sjd_pac"]["methods"] == "ar-compiled,sd,sjd,scd,lantern" and len(calls) == 2
    assert (tmp_path / "broken-without-sjd-pac" / "summary.json").exists()
