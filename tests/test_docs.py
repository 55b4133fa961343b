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
#: ``expression  # 'what it gives ... more of it'``: a quoted result on a line of its own.
SHOWN = re.compile(r"^(?P<expr>[^#=\s][^#=]*?)\s+#\s+'(?P<text>[^']+)'\s*$", re.M)


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
        for shown in SHOWN.finditer(code):  # a result the page quotes is the result (issue 33: a stale one)
            value = str(eval(shown.group("expr"), namespace))
            at = 0
            for fragment in shown.group("text").split("..."):
                found = value.find(fragment.strip(), at)
                assert found >= 0, f"{page}: {shown.group('expr')} gives {value!r}, not {shown.group('text')!r}"
                at = found + len(fragment.strip())


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


def test_the_readme_test_checkpoints_block_runs_as_written(tmp_path, monkeypatch, capsys):
    """Issue 33: the README named ``make-test-checkpoints --out demo-ckpt`` without the
    ``--gpt-model`` / ``--vq-model`` the next command needs (the sizes have no name). The block
    that shows the pair runs here as written, in an empty folder."""
    import shlex

    from relaxspec.cli import main

    blocks = [block for block in SHELL.findall((ROOT / "README.md").read_text())
              if "make-test-checkpoints --out demo-ckpt" in block]
    assert len(blocks) == 1, "README.md: the make-test-checkpoints block is gone"
    commands = [line for line in blocks[0].replace("\\\n", " ").splitlines() if line.startswith("relaxspec ")]
    assert len(commands) == 2 and "generate" in commands[1]
    monkeypatch.chdir(tmp_path)
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
    assert (tmp_path / "demo-out" / "0000.png").is_file() and (tmp_path / "demo-out" / "0001.png").is_file()


def test_gpu_users_keep_their_torch():
    """Issue 33: the README's ``pip install torch==2.13.0`` would replace a GPU machine's CUDA torch.
    The README says how to install there (``pip install -e .`` alone), and that holds: the project
    asks for a torch range, never one build, so pip keeps an installed torch."""
    import tomllib

    readme = (ROOT / "README.md").read_text()
    start = readme.index("**On a GPU machine, keep your torch.**")
    gpu = readme[start:readme.index("\n\n", start)]
    assert "pip install -e ." in gpu and "--device cuda" in gpu and "--precision bf16" in gpu
    assert "benchmarks/gpu.sh" in gpu and "torch==" not in gpu.replace("`pip install torch==2.13.0` would", "")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_specs = [d for d in project["dependencies"] if d.replace(" ", "").startswith("torch")]
    assert torch_specs == ["torch>=2.4"], torch_specs  # a range any CUDA build since 2.4 satisfies
    extras = [d for group in project["optional-dependencies"].values() for d in group]
    assert not any(d.replace(" ", "").startswith(("torch", "torchvision")) for d in extras)
