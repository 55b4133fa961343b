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
