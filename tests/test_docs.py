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
    said = []
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
        said.append(capsys.readouterr().out)
    images = tmp_path / "demo-ckpt-images"
    assert (images / "0000.png").is_file() and (images / "0001.png").is_file()
    # issue 54: the "try:" line make-test-checkpoints prints is the README's next command, word for word
    hint = [line for line in said[0].splitlines() if line.startswith("try: ")]
    assert hint == [f"try: {' '.join(commands[1].split())}"]


def test_the_hint_make_test_checkpoints_prints_runs_as_printed_after_the_readme_s_first_run(tmp_path, monkeypatch,
                                                                                           capsys):
    """Issue 45: the "try:" line of make-test-checkpoints ended with ``--out out``, the folder the
    README's first command had already filled with other settings, so it was refused as printed.
    Here ``out/`` holds another run, and the printed command runs as it is."""
    import shlex

    from relaxspec.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stats.json").write_text('{"settings": "another run"}')
    assert main(["make-test-checkpoints", "--preset", "tiny", "--out", "ckpt"]) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if line.startswith("try: relaxspec ")]
    assert len(hint) == 1
    assert main(shlex.split(hint[0][len("try: relaxspec "):]) + ["--no-progress"]) == 0, capsys.readouterr().err


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
    # a range any CUDA build since 2.6 satisfies (the oldest whose compile tests pass), as the README says
    assert torch_specs == ["torch>=2.6"] and "`torch>=2.6`" in gpu, torch_specs
    extras = [d for group in project["optional-dependencies"].values() for d in group]
    assert not any(d.replace(" ", "").startswith(("torch", "torchvision")) for d in extras)


@pytest.mark.slow  # whole commands on the tiny models (the full suite runs it)
def test_the_lantern_page_runs_on_tiny_replicas(tmp_path, monkeypatch, capsys, tiny_ckpts):
    """Issue 29: every command of docs/models/lantern.md runs on tiny replicas of the files it
    names (official LANTERN's layouts: tests/data/lantern), with 2 captions instead of 1,000 or
    5,000 and the CPU instead of CUDA; clean-fid (it needs torchvision) is stood in for."""
    import shlex
    import sys
    import types

    import numpy as np
    import torch

    pytest.importorskip("transformers")
    from helpers.clip import write_clip
    from helpers.t5 import make_t5
    from relaxspec.cli import main

    data = ROOT / "tests" / "data" / "lantern"
    vq = tiny_ckpts["t2i"]
    t5 = make_t5(tmp_path / "t5", d_model=16)
    codebook = torch.load(vq["vq"], weights_only=True)["model"]["quantize.embedding.weight"].float()
    distances = torch.cdist(codebook, codebook)
    distances.fill_diagonal_(float("inf"))
    np.save(tmp_path / "table.npy", distances.topk(63, largest=False).indices.to(torch.uint16).numpy())
    (tmp_path / "captions.json").write_text('["a red cat", "the big blue dog", "a small green heart"]')
    (tmp_path / "coco").mkdir()
    (tmp_path / "clip").mkdir()
    files = {"LlamaGen-T2I": data / "llamagen-t2i", "LlamaGen-T2I-2": data / "llamagen-t2i",
             "llamagen_drafter": data / "llamagen-t2i-drafter", "flan-t5-xl": t5,
             "top_16383_indices.npy": tmp_path / "table.npy", "captions_val2017_longest.json": tmp_path / "captions.json",
             "coco-val2017": tmp_path / "coco", "clip-vit-base-patch32": write_clip(tmp_path / "clip")}
    sizes = {"--num-images": "2", "--num-prompts": "2", "--device": "cpu", "--precision": "fp32", "--batch-size": "2"}
    fid = types.SimpleNamespace(get_files_features=lambda files, model, **kw: np.zeros((len(files), 2)),
                                get_folder_features=lambda folder, model, **kw: np.ones((3, 2)),
                                fid_from_feats=lambda a, b: 7.5)
    package = types.ModuleType("cleanfid")
    package.fid, package.features = fid, types.SimpleNamespace(build_feature_extractor=lambda *a, **k: None)
    for name, module in (("cleanfid", package), ("cleanfid.fid", fid), ("cleanfid.features", package.features)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.chdir(tmp_path)
    commands = documented_commands(ROOT / "docs" / "models" / "lantern.md")
    assert len(commands) == 5
    for command in commands:
        argv = shlex.split(command)[1:]
        argv = [str(files.get(word, word)) if not word.startswith("--sweep") else word for word in argv]
        argv = [f"{word.split('=')[0]}={files[word.split('=')[1]]}" if "=" in word and word.split("=")[1] in files
                else word for word in argv]
        for flag, value in sizes.items():
            if flag in argv:
                argv[argv.index(flag) + 1] = value
        if "--vq-ckpt" in argv:
            at = argv.index("--vq-ckpt")
            argv[at + 1:at + 2] = [vq["vq"], "--vq-model", vq["vq_json"]]
        argv += ["--no-progress"] if argv[0] in ("bench",) else []
        assert main(argv) == 0, (command, capsys.readouterr().err)
    out = capsys.readouterr().out
    assert "| `eval-ar`" in out and "| `eval-lantern`" in out and "7.50" in out  # the table of the two evals
    assert (tmp_path / "bench-lantern" / "summary.md").is_file() and (tmp_path / "bench-lanternpp" / "summary.md").is_file()


@pytest.mark.slow  # a whole document: four commands and a short drafter training on the tiny folder
def test_the_anole_page_runs_on_a_tiny_replica(tmp_path, monkeypatch, capsys):
    """Issue 29: the commands of docs/models/anole.md run on a tiny Anole folder in the published
    layout and a tiny drafter in official LANTERN's (tests/helpers/anole.py), with 2 samples
    instead of thousands (one bench image), a few training steps and the CPU; the demo line, which serves a page
    until stopped, is covered by tests/test_anole.py's race."""
    import shlex

    import numpy as np

    pytest.importorskip("transformers")
    from helpers import anole
    from relaxspec.cli import main

    folder = anole.anole_folder(tmp_path)["model_path"]
    (tmp_path / "prompts.txt").write_text("\n".join(anole.PROMPTS) + "\n")
    np.save(tmp_path / "table.npy", anole.neighbour_table(64).astype(np.uint16))
    files = {"Anole-7b-v0.1-hf": folder, "prompts.txt": tmp_path / "prompts.txt",
             "anole_drafter": anole.write_drafter_folder(tmp_path / "anole_drafter"),
             "top_8191_indices.npy": tmp_path / "table.npy"}
    sizes = {"--self-samples": "2", "--num-images": "1", "--device": "cpu", "--precision": "fp32", "--k": "64",
             "--patience": "1"}
    monkeypatch.chdir(tmp_path)
    commands = [c for c in documented_commands(ROOT / "docs" / "models" / "anole.md") if not c.startswith("relaxspec demo")]
    assert len(commands) == 5
    for command in commands:
        argv = [str(files.get(word, word)) for word in shlex.split(command)[1:]]
        for flag, value in sizes.items():
            if flag in argv:
                argv[argv.index(flag) + 1] = value
        if argv[0] == "train-drafter":
            argv = [word for word in argv if word != "--bf16"] + ["--steps", "2", "--batch-size", "2"]
        assert main([*argv, "--no-progress"]) == 0, (command, capsys.readouterr().err)
    for out in ("anole-sjd", "anole-lantern", "anole-lantern-official"):
        assert (tmp_path / out / "0000.png").is_file(), out
    assert (tmp_path / "bench-anole" / "summary.md").is_file() and (tmp_path / "anole-drafter" / "best").is_dir()


def test_the_readme_torchrun_commands_parse():
    """The README's multi-process commands need GPUs and real models: torchrun's own parser must
    accept what comes before ``-m relaxspec`` (a module torchrun can start: ``python -m
    relaxspec``), and relaxspec's what comes after (the written-out ones)."""
    import shlex

    from torch.distributed.run import get_args_parser

    from relaxspec.cli import build_parser

    lines = [line.split("#")[0].strip() for block in SHELL.findall((ROOT / "README.md").read_text())
             for line in block.replace("\\\n", " ").splitlines() if line.strip().startswith("torchrun ")]
    assert len(lines) >= 2, "README.md: the torchrun commands are gone"
    full = 0
    for line in lines:
        words = shlex.split(line)
        cut = words.index("-m")
        assert words[cut + 1] == "relaxspec", line
        launcher = get_args_parser().parse_args([*words[1 : cut + 1], "relaxspec"])
        assert launcher.module and launcher.training_script == "relaxspec"
        if "..." not in words:
            build_parser().parse_args(words[cut + 2 :])
            full += 1
    assert full >= 1
    assert (ROOT / "src" / "relaxspec" / "__main__.py").is_file()


#: README commands a fresh clone cannot run, each with the reason (the tests fail when the README
#: gains a command that is neither run nor here, or loses one that is).
NOT_RUN_HERE = {
    "relaxspec demo": "serves a page until stopped (tests/test_demo.py runs it in a browser)",
    "c2i_B_256.pt": "upstream's GPT-B checkpoint, a file the user brings",
    "--gpt-ckpt PATH": "a placeholder for the user's checkpoint",
    "generate ...": "an elided command (the tree recipe's options)",
    "data/emoji/val.npz": "the validation images, built with npm (the embedded model card)",
    "LlamaGen-T2I": "upstream's t2i checkpoint and MS-COCO, files the user brings",
}
#: Commands the ordered run leaves to the order check alone: minutes each, on purpose.
CHECKED_NOT_RUN = {
    "relaxspec tune": "its least search takes minutes whatever the budget (tests/test_tune*.py run it on tiny models)",
    "--preset tune-relaxed/tune.json": "reads what the tune before it writes",
    "--compile": "a compile of the embedded model's graphs, half a minute to a minute each on 2 cores "
                 "(tests/test_fast_engine.py and test_compiling.py compile them)",
    "build-tree": "reads the elided probe run's record",
}


def readme_commands() -> list[str]:
    """Every ``relaxspec ...`` command of the README's bash blocks, in order (those after ``&&``
    included), continuations joined and comments cut."""
    commands = []
    for block in SHELL.findall((ROOT / "README.md").read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#")[0].split("&&"):
                if part.strip().startswith("relaxspec "):
                    commands.append(" ".join(part.split()))
    return commands


def test_the_readme_commands_fit_together_in_order():
    """Issue 54: followed literally, the README's --compile example was refused: it wrote to the
    folder its first command had filled. In the README's order, every command parses; none writes
    a folder an earlier command wrote (but a --report-only of it); and every file it reads is in the
    clone, under a folder an earlier command writes, or a file the user brings (NOT_RUN_HERE)."""
    import shlex

    from relaxspec.cli import build_parser

    parser, written, brought = build_parser(), {}, set()
    for command in readme_commands():
        words = shlex.split(command.replace("$(seq -s, 1 4 97)", "1,5,9"))[1:]
        if "..." in words:  # an elided command: what it writes still counts
            words = [word for word in words if word != "..."]
        args = parser.parse_args(words)
        out = getattr(args, "out", None)
        user_files = next((key for key in NOT_RUN_HERE if key in command), None)
        if user_files is not None:
            brought.add(user_files)
        if out is not None and out in written and not getattr(args, "report_only", False):
            raise AssertionError(f"README: {command!r} writes --out {out}, which {written[out]!r} wrote before")
        for word in words:
            if word == out or word.startswith("-") or not ("/" in word or word.endswith((".pt", ".json", ".npz"))):
                continue
            earlier = any(word == folder or word.startswith(folder.rstrip("/") + "/") for folder in written)
            assert earlier or (ROOT / word).exists() or user_files is not None, \
                f"README: {command!r} reads {word}, which no earlier command writes and a clone does not hold"
        if out is not None:
            written.setdefault(out, command)
    assert brought == set(NOT_RUN_HERE), set(NOT_RUN_HERE) - brought  # a reason no command needs any more


@pytest.mark.slow  # the README's quick commands one after another: about half a minute
def test_the_readme_commands_run_in_order_in_a_fresh_folder(tmp_path, monkeypatch, capsys):
    """The README's commands that run in seconds on a fresh clone run as printed, in the README's
    order, in one empty folder (the package's own files found as in a clone): generate,
    make-test-checkpoints and the generate it suggests, bench (of one image instead of its
    default). The others are NOT_RUN_HERE or CHECKED_NOT_RUN, by reason, and the order test above
    checks them."""
    import shlex

    from relaxspec.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").symlink_to(ROOT / "src")
    ran, skipped = [], set()
    for command in readme_commands():
        reason = next((key for key in {**NOT_RUN_HERE, **CHECKED_NOT_RUN} if key in command), None)
        if reason is not None:
            skipped.add(reason)
            continue
        argv = shlex.split(command)[1:] + (["--num-images", "1"] if command.startswith("relaxspec bench") else [])
        assert main(argv) == 0, (command, capsys.readouterr().err)
        ran.append(argv[0])
    assert skipped == set(NOT_RUN_HERE) | set(CHECKED_NOT_RUN), (set(NOT_RUN_HERE) | set(CHECKED_NOT_RUN)) - skipped
    assert ran == ["generate", "make-test-checkpoints", "generate", "bench"], ran
    assert (tmp_path / "out" / "grid.png").is_file() and (tmp_path / "demo-ckpt-images" / "0001.png").is_file()
    assert (tmp_path / "bench-embedded" / "summary.md").is_file()  # bench's folder for the embedded model
