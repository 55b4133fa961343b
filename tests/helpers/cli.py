"""Running the command line inside a test: a command that must succeed, one that must be refused."""

from __future__ import annotations

from relaxspec.cli import main


def run(argv, capsys) -> str:
    """Run ``relaxspec ARGV`` (any path-like arguments as text); it must exit 0. Returns stderr."""
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def outcome(argv, capsys) -> tuple[int, str, str]:
    """Run ``relaxspec ARGV``: its exit code, stdout and stderr."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def generate_args(ckpts, out, *extra) -> list:
    """``relaxspec generate`` on the tiny files ``ckpts`` (a ``tiny_ckpts`` entry) into ``out``."""
    return ["generate", *ckpts["args"], "--out", out, "--no-progress", *extra]


def assert_one_line_error(code, stdout, err, expected):
    """What :func:`outcome` returned is exit code 2 and one ``relaxspec: error:`` line naming ``expected``."""
    assert code == 2, (stdout, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("relaxspec: error: ") and "Traceback" not in err
    assert expected in lines[0], lines[0]


def refused(argv, capsys) -> str:
    """Run ``relaxspec ARGV``; it must exit 2 with one stderr line, which is returned."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def install_family(site, distribution: str, entries: str):
    """Make ``site`` (a folder) a distribution's install on ``sys.path`` whose ``entry_points.txt``
    registers ``entries`` (``name = module:Class`` lines) as relaxspec families, as ``pip install``
    of a package that declares them in ``[project.entry-points."relaxspec.families"]`` does.
    Returns the folder to take off ``sys.path`` afterwards."""
    import sys

    info = site / f"{distribution.replace('-', '_')}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[relaxspec.families]\n{entries}\n")
    sys.path.insert(0, str(site))
    return site
