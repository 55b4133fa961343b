"""Every Python block in README.md and docs/API.md runs as written, top to bottom, one shared
namespace per page (later blocks use earlier blocks' names), in an empty folder, against the
embedded model. A page that loses all its blocks fails too (the test would otherwise pass
vacuously)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/API.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(page: str) -> list[str]:
    return BLOCK.findall((ROOT / page).read_text())


@pytest.mark.slow  # runs every Python block of the docs against the embedded model
@pytest.mark.parametrize("page", PAGES)
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no Python blocks"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for number, code in enumerate(blocks, 1):
        try:
            exec(compile(code, f"{page} python block {number}", "exec"), namespace)
        except Exception as err:  # name the block, then fail with the original traceback
            raise AssertionError(f"{page}: python block {number} failed: {type(err).__name__}: {err}") from err


def test_only_python_blocks_are_marked_python():
    """A signature listing or shell session marked ``python`` would fail above; here the other
    direction: no page outside the tested ones claims runnable Python it does not test."""
    untested = [str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
                if str(p.relative_to(ROOT)) not in PAGES and python_blocks(str(p.relative_to(ROOT)))]
    assert not untested, f"python blocks that no test runs: {untested} (add the page to PAGES, or mark the block text)"


SHELL = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def documented_commands(page: Path) -> list[str]:
    """The ``relaxspec ...`` command lines of a page's bash blocks, continuations joined."""
    commands = []
    for block in SHELL.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip().startswith("relaxspec "):
                commands.append(line.split("#")[0].strip())
    return commands


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "models").glob("*.md")), ids=lambda p: p.name)
def test_model_pages_commands_parse(page):
    """The model pages' commands need real checkpoints, so they cannot run here; every one must
    still be a command relaxspec's parser accepts (a renamed or removed flag fails)."""
    import shlex

    from relaxspec.cli import build_parser

    commands = documented_commands(page)
    assert commands, f"{page.name} documents no relaxspec command"
    parser = build_parser()
    for command in commands:
        parser.parse_args(shlex.split(command)[1:])
