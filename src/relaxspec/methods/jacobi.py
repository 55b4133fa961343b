"""The drafter-free Jacobi baselines: speculative Jacobi decoding (SJD, arXiv 2410.01699) and
its maximally coupled variant (SCD-style, arXiv 2510.24211). Both are exact."""

from __future__ import annotations

from relaxspec.methods.base import JACOBI, Method, Preset, draft_source


class SJD(Method):
    name = "sjd"
    summary = "speculative Jacobi decoding: a window of future tokens, no drafter"
    drafts = (JACOBI,)
    presets = {"sjd": Preset({"window": 16}, "speculative Jacobi decoding, window 16, no drafter")}


class SCD(Method):
    name = "scd"
    summary = "SJD with maximally coupled redraws (SCD-style), no drafter"
    drafts = (JACOBI,)
    presets = {"scd": Preset({"window": 16}, "SJD with maximally coupled redraws (SCD-style), window 16, no drafter")}

    def source(self, options, context):
        return draft_source(self, options, context.drafter, context.sampling, coupled=True)


METHODS = (SJD(), SCD())
