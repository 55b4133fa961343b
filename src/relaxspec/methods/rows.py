"""Rows in parallel at their papers' settings (:mod:`relaxspec.decoding.rows`): ZipAR (arXiv
2412.04062) opens a row once the row above has a lead of tokens and drafts nothing; PJD (Parallel
Jacobi Decoding, arXiv 2606.05703) gives every open row its own Jacobi window, verified as its code
verifies them (``pjd``) or every row exactly (``pjd-exact``).
Any other method drafting with a Jacobi window takes ``--rows`` too. Neither is the model's law
(:data:`relaxspec.methods.grid.ROWS_SEEN`: what a token sees)."""

from __future__ import annotations

from relaxspec.drafting.base import NoDrafts
from relaxspec.drafting.jacobi import JacobiSource
from relaxspec.errors import RelaxspecError
from relaxspec.methods.base import JACOBI, Method, Preset, Setting

PJD_ACCEPTANCE = Setting(
    "pjd_acceptance", str, "official",
    "PJD: 'official' as its code (a row below the top one commits its accepted drafts only, the next token left as "
    "the next step's first draft; an old draft kept where p_new/q_old > 0.5) or 'exact' (every row as the top one)",
    choices=("official", "exact"))

#: Every row may be open (ZipAR's schedule: as many as the lead allows); the engine takes the grid's.
ALL_ROWS = 4096


class ZipAR(Method):
    name = "zipar"
    summary = "rows in parallel, no drafts: a row opens once the row above has a lead of tokens (ZipAR)"
    drafts = ()
    rows_only = True
    presets = {"zipar": Preset({"rows": ALL_ROWS}, "ZipAR: every row opens once the row above has a third of its "
                                                   "tokens (ZipAR's 8 of 24), no drafts", bench=False)}

    def resolve(self, options) -> None:
        if options.rows < 2:
            raise RelaxspecError("--method zipar paints rows in parallel: --rows must be at least 2")

    def source(self, options, context):
        return NoDrafts()


class PJD(Method):
    """PJD's settings are the official code's and the paper's (github.com/boyaliao/PJD): a Jacobi
    window of 7 drafts per open row (its sampler's ``window_size = 8`` counts the root; until
    2026-11-27 the preset had 8 drafts), every row that has a lead open (no
    cap), and a lead of about a fifth of the row (the paper's c = 6 on LlamaGen's 32 columns at
    512 px; c = 11, and the code's 8, on Lumina-mGPT's 48)."""

    name = "pjd"
    summary = "parallel Jacobi decoding: every open row with its own Jacobi window (PJD)"
    drafts = (JACOBI,)
    settings = (PJD_ACCEPTANCE,)
    presets = {"pjd": Preset({"rows": ALL_ROWS, "window": 7}, "PJD: every row opens once the row above has a fifth of "
                                                              "its tokens (PJD's 6 of 32), each with a Jacobi window "
                                                              "of 7 drafts and its root (PJD's window_size 8) "
                                                              "verified with PJD's code's acceptance", bench=False),
               "pjd-exact": Preset({"rows": ALL_ROWS, "window": 7, "pjd_acceptance": "exact"},
                                   "PJD's schedule and window, every open row verified exactly as the top one (a bonus "
                                   "or residual token each step): faster than PJD's code's acceptance here "
                                   "(docs/BENCHMARKS.md)", bench=False)}

    def default_row_lead(self, grid: int) -> int:
        return max(1, round(grid / 5))

    def prefix_below(self, options) -> bool:
        return options.pjd_acceptance == "official"

    def source(self, options, context):
        return JacobiSource(options.window, keep_likelier=options.pjd_acceptance == "official")

    def resolve(self, options) -> None:
        super().resolve(options)
        if options.rows < 2:
            raise RelaxspecError("--method pjd paints rows in parallel: --rows must be at least 2 (one row is --method "
                                 "sjd)")


METHODS = (ZipAR(), PJD())

__all__ = ["ALL_ROWS", "METHODS", "PJD", "ZipAR"]
