"""The architecture (pyproject.toml's import-linter contracts), checked with import-linter:
commands above the library, each library layer importing only the layers below it, no import
circles in any package, no argument parsing in the library.

Each contract is also shown to fail: a copy of the package with one planted violation must
break exactly the contract it violates (a contract that cannot fail proves nothing)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "relaxspec"
LAYERS = "Layers: the commands above the library"
CIRCLES = "No import circles"
ARGPARSE = "Argument parsing belongs to the commands"


def lint(src: Path) -> tuple[int, str]:
    """``lint-imports`` on the package under ``src`` with the repo's contracts; no cache files."""
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
               "sys.exit(lint_imports_command())", "--config", str(ROOT / "pyproject.toml"), "--no-cache", "--no-logo"]
    proc = subprocess.run(command, cwd=src, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})
    return proc.returncode, proc.stdout + proc.stderr


def verdicts(output: str) -> dict[str, bool]:
    """Contract name prefix -> kept, from lint-imports' report."""
    lines = " ".join(output.split())
    found = {}
    for name in (LAYERS, CIRCLES, ARGPARSE):
        at = lines.find(name)
        assert at >= 0, f"contract {name!r} not reported:\n{output}"
        rest = lines[at:]
        kept, broken = rest.find("KEPT"), rest.find("BROKEN")
        found[name] = broken < 0 or 0 <= kept < broken
    return found


def test_the_tree_keeps_every_contract():
    code, output = lint(ROOT / "src")
    assert code == 0, output
    assert verdicts(output) == {LAYERS: True, CIRCLES: True, ARGPARSE: True}


@pytest.mark.parametrize("module, line, broken", [
    # the engine reaching up into the command line, which imports the engine (a circle) and
    # brings argparse along
    ("decoding/raster.py", "import relaxspec.cli.generate", {LAYERS, CIRCLES, ARGPARSE}),
    # the decoding driver reaching up into the methods that build its plans (which import decoding)
    ("decoding/driver.py", "import relaxspec.methods", {LAYERS, CIRCLES}),
    # a model importing a method: a lower layer reaching up
    ("models/llamagen/gpt.py", "import relaxspec.acceptance.exact", {LAYERS}),
    # two modules of one package importing each other (the step parts import verify)
    ("decoding/verify.py", "import relaxspec.decoding.steps", {CIRCLES}),
    # argparse in a training recipe
    ("training/common.py", "import argparse", {ARGPARSE}),
])
def test_a_planted_violation_breaks_its_contract(tmp_path, module, line, broken):
    copy = tmp_path / "src" / "relaxspec"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"))
    target = copy / module
    target.write_text(target.read_text() + f"\n{line}  # planted by tests/test_layers.py\n")
    if CIRCLES in broken:  # the other direction is already there
        assert "from relaxspec.decoding.verify import" in (copy / "decoding" / "steps.py").read_text()
    code, output = lint(tmp_path / "src")
    assert code != 0, output
    assert {name for name, kept in verdicts(output).items() if not kept} == broken, output


# ---------------------------------------------------------------- private names and file sizes
MAX_LINES = 600


def private_uses(package: Path) -> list[str]:
    """Every use of another module's private (one-underscore) name: ``from relaxspec.x import _y``
    and ``module._y`` on a relaxspec module imported by name."""
    import ast

    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("relaxspec"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(package)}:{node.lineno} imports {alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules.update((a.asname or a.name.split(".")[0]) for a in node.names if a.name.startswith("relaxspec"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                found.append(f"{path.relative_to(package)}:{node.lineno} uses {node.value.id}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_name(tmp_path):
    assert private_uses(PACKAGE) == []
    planted = tmp_path / "relaxspec"
    (planted / "a").mkdir(parents=True)
    (planted / "a" / "b.py").write_text("from relaxspec.c import _hidden\nimport relaxspec.d as d\nd._other()\n")
    assert private_uses(planted) == ["a/b.py:1 imports _hidden", "a/b.py:3 uses d._other"]


def test_every_source_file_is_under_the_size_bound():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n >= MAX_LINES} == {}


#: The longest function the decoding wing may have (issue 52: its step was one 145-line function).
MAX_DECODING_FUNCTION = 60


def long_functions(package: Path, bound: int) -> dict[str, int]:
    """``module:function -> lines`` of every function (methods included) longer than ``bound``."""
    import ast

    found = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= bound:
                found[f"{path.relative_to(package)}:{node.name}"] = node.end_lineno - node.lineno + 1
    return found


def test_no_decoding_function_is_longer_than_the_bound(tmp_path):
    assert long_functions(PACKAGE / "decoding", MAX_DECODING_FUNCTION) == {}
    (tmp_path / "long.py").write_text("def step():\n" + "    x = 1\n" * MAX_DECODING_FUNCTION)
    assert long_functions(tmp_path, MAX_DECODING_FUNCTION) == {"long.py:step": MAX_DECODING_FUNCTION + 1}
